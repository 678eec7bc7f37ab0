"""A held copy that fails its checksums during a restore at another data-parallel size (snapshot/reshard_restore.py).

The pieces' messages of a re-partition are posted before the servers read their checksums (the bytes travel during
the verify), so an attempt that finds a corrupt copy ends every message on every rank before it tries again or
refuses, and nothing it received is applied. Real holders (one per simulated node), forked gloo ranks, the rank
state a ZeRO-2 partition of random bytes with DeepSpeed's layout metadata re-partitioned by DeepSpeed's resharder
(bench/shrink_restore.py's synthetic state, no engine).

* grow 3 -> 4 with parity (RS(2, 1) over n0..n2): source rank 1's copy of the newest version is corrupt: it is
  rebuilt from the survivors' parity like a lost one, and every rank's state equals the re-partition of the intact
  sources, computed here apart from the holders (``shardsafe.snapshot.reshard.reshard`` on the states themselves);
* shrink 4 -> 3 on two nodes, snapshots without parity: source rank 3's copy is corrupt and cannot be rebuilt: every
  rank refuses version 2 alike and restores version 1, equal to the re-partition of version 1's sources.
"""
import os
import sys

import pytest
import torch

from ._fork_ranks import run_ranks
from ._node_holders import NodeHolders
from ._shards import flip

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from bench.shrink_restore import JOB, _adapter_class, model_params  # noqa: E402

pytestmark = pytest.mark.slow
STATE = 3 << 20   # bytes of state per rank at D = 4: payloads of several checksum segments


def _runtime(rank, world, root, nodes, parity):
    from shardsafe.config import ShardsafeConfig
    from shardsafe.runtime import Runtime
    cfg = ShardsafeConfig(interval=1, holder_dir=root, node=nodes[rank], job_id=JOB, start_holder=False,
                          restore=False, parity_group_size=0 if parity else 1, timeout_s=30)
    return Runtime(cfg, rank=rank, world_size=world)


def _state(world, rank, version):
    """Source rank ``rank``'s state of ``version`` at ``world`` ranks (random bytes, the same in every process)."""
    shard = _adapter_class()(model_params(STATE, 4), world, rank, 12 // world, fill=True)
    shard.tensors["opt/master/0"].add_(version)
    return shard


def _snapshot(rank, world, root, nodes, corrupt, parity):
    """Versions 1 and 2 at ``world``; source rank ``corrupt``'s copy of version 2 gets one flipped byte."""
    import torch.distributed as dist
    rt = _runtime(rank, world, root, nodes, parity)
    for v in (1, 2):
        rt.pipeline.submit(v, _state(world, rank, v).capture())
        assert rt.pipeline.flush(), rt.pipeline.history[-1].error
    dist.barrier()
    if rank == corrupt:
        man, mm = rt.client.open(rank=rank, version=2)
        e = man["entries"][0]
        mm.close()
        flip(rt.client, rank, 2, "data", e["offset"] + e["nbytes"] // 2)
    dist.barrier()
    out = {"committed": rt.pipeline.last_committed}
    rt.close()
    return out


def _restore(rank, world, root, nodes, old_world):
    from adapters.deepspeed.reshard import DeepSpeedResharder
    from shardsafe.parity.recovery import MemberRecovery
    from shardsafe.snapshot.reshard import reshard
    from shardsafe.snapshot.reshard_restore import Resize
    from shardsafe.snapshot.restore import restore_from_holder
    rt = _runtime(rank, world, root, nodes, 1)
    live = _adapter_class()(model_params(STATE, 4), world, rank, 12 // world, fill=False)
    r = restore_from_holder(live, rt.client, rank=rank, coll=rt.coll, exchange=rt.exchange, nodes=rt.nodes,
                            resize=Resize(places=rt.places, recovery=MemberRecovery))
    want = reshard([_state(old_world, s, r.version).capture() for s in range(old_world)], world, DeepSpeedResharder(),
                   ranks=[rank]).ranks[0]
    rt.close()
    return {"version": r.version, "tier": r.tier, "lost": r.lost_ranks, "message": r.message,
            "equal": sorted(k for k, t in live.tensors.items() if torch.equal(_bits(t), _bits(want.tensors[k]))),
            "names": sorted(live.tensors)}


def _bits(t):   # random bytes are NaNs too: compared as bytes
    return t.reshape(-1).view(torch.uint8)


@pytest.fixture
def holders(tmp_path):
    h = NodeHolders(str(tmp_path), JOB, budget_gb=0.2)
    yield h
    h.stop()


def test_a_corrupt_copy_is_rebuilt_from_parity_when_the_job_grows(holders):
    holders.start("n0", "n1", "n2", "n3")
    old = ["n0", "n1", "n2"]
    snap = run_ranks(3, _snapshot, holders.root, old, 1, 1, timeout_s=120)
    assert all(s["committed"] == 2 for s in snap), snap
    out = run_ranks(4, _restore, holders.root, ["n0", "n1", "n2", "n3"], 3, timeout_s=120)
    for o in out:
        assert o.get("version") == 2 and o["tier"] == "parity" and o["lost"] == [1], out
        assert o["equal"] == o["names"], o   # every tensor the re-partition of the intact version 2


def test_a_corrupt_copy_without_parity_refuses_its_version_on_every_rank(holders):
    holders.start("n0", "n1")
    snap = run_ranks(4, _snapshot, holders.root, ["n0", "n0", "n1", "n1"], 3, 0, timeout_s=120)
    assert all(s["committed"] == 2 for s in snap), snap
    out = run_ranks(3, _restore, holders.root, ["n0", "n0", "n1"], 4, timeout_s=120)
    for o in out:   # version 2 refused alike everywhere: no rank applied any of it
        assert o["version"] == 1 and o["tier"] == "memory" and o["lost"] == [], out
        assert o["equal"] == o["names"], o
