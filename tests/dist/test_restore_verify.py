"""Restore verification (snapshot/restore.py): a corrupted segment anywhere in a payload -- the first, a middle
or the last one, of a rank's data or of a parity share a rebuild would read -- is found before any byte of that
version is applied, and no rank applies it: every rank restores the older version instead; also when every rank
opened and verified its newest slot early, as a restarted trainer does (holder/early_open.py), after the
corruption. 3 ranks on 3 'nodes', real holders, gloo; payloads of four 4 MiB-chunked segments (two of the fp32
master, one of the bf16 moment, one of the step)."""
import pytest

from shardsafe.holder.client import HolderClient
from shardsafe.holder.early_open import EarlyOpen
from shardsafe.holder.paths import HolderPaths
from shardsafe.parity.exchange import ParityExchange, gather_places, plan_parity
from shardsafe.payload.manifest import CHUNK_BYTES
from shardsafe.snapshot.pipeline import GlooAgreement, SnapshotPipeline
from shardsafe.snapshot.restore import Collectives, restore_from_holder

from ._fork_ranks import run_ranks
from ._shards import WORLD, Shard, flip

N = 1_500_000   # fp32 master 6 MB (2 segments), bf16 moment 3 MB (1), step (1)


class Recording(Shard):
    """A live shard that records every version ``apply`` is handed (by its step tensor)."""

    def __init__(self, rank: int):
        super().__init__(rank, 0, n=N)
        self.applied: list[int] = []

    def apply(self, tensors, meta):
        self.applied.append(int(tensors["step"].item()))
        super().apply(tensors, meta)


def _offset(client, rank: int, kind: str, where: str) -> int:
    """A byte of version 2's first, a middle or the last checksummed segment of this rank's data or parity."""
    man, mm = client.open(rank=rank, version=2, kind=kind)
    mm.close()
    if kind == "parity":   # one xxh3 per parity share of chunk_size bytes
        n = man["chunk_size"] * len(man["xxh3"])
        return {"first": 17, "middle": n // 2, "last": n - 1}[where]
    first, last = man["entries"][0], man["entries"][-1]
    assert first["nbytes"] > CHUNK_BYTES + 12345 and len(man["entries"]) == 3   # the master spans two segments
    return {"first": first["offset"] + 17, "middle": first["offset"] + CHUNK_BYTES + 12345,
            "last": last["offset"] + last["nbytes"] - 1}[where]


def _corrupt_then_restore(rank, world, root, kind, where, early_open=False):
    import torch.distributed as dist
    client = HolderClient(HolderPaths(root, "pjob", f"n{rank}"), timeout_s=10).connect()
    places = gather_places(rank, world, f"n{rank}", rank)
    ex = ParityExchange(plan_parity(places, group_size=0, parity_shards=1), rank, timeout_s=10) \
        if kind == "parity" else None
    for v in (1, 2):
        pipe = SnapshotPipeline(client, rank=rank, world_size=world, node=f"n{rank}", agreement=GlooAgreement(),
                                parity=ex)
        pipe.timeline = 9
        pipe.submit(v, Shard(rank, v, n=N).capture())
        assert pipe.flush(timeout=60), pipe.history[-1].error
        pipe.close()
    dist.barrier()
    if kind == "data" and rank == 1:      # bit rot in rank 1's own copy of version 2 (no parity to repair it)
        flip(client, rank, 2, "data", _offset(client, rank, "data", where))
    if kind == "parity":
        if rank == 1:                     # node 1's copy of version 2 is gone: a rebuild from parity is needed
            client.drop(rank=rank, version=2, kind="data")
        if rank == 0:                     # ... and a parity share it would read is corrupt
            flip(client, rank, 2, "parity", _offset(client, rank, "parity", where))
    dist.barrier()
    early = EarlyOpen(HolderPaths(root, "pjob", f"n{rank}"), rank).start() if early_open else None
    if early is not None:
        assert early.wait(60), "early open unfinished"
    live = Recording(rank)
    res = restore_from_holder(live, client, rank=rank, coll=Collectives(None, world), exchange=ex,
                              nodes=[p.node for p in places], early=early)
    return {"version": res.version, "applied": live.applied, "equal": live.equals(Shard(rank, res.version, n=N)),
            "early": {k: v for k, v in (res.notes or {}).items() if k in ("early_open", "early_verify")},
            "early_problems": early.problems if early is not None else None}


@pytest.mark.parametrize("early_open", [False, True], ids=["restore-verifies", "early-open"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("kind", ["data", "parity"])
def test_a_corrupt_segment_is_never_applied_on_any_rank(holders, kind, where, early_open):
    out = run_ranks(WORLD, _corrupt_then_restore, holders, kind, where, early_open, timeout_s=180, pg_timeout_s=20)
    assert [o["version"] for o in out] == [1, 1, 1], out
    assert all(o["applied"] == [1] for o in out), out   # version 2 reached no rank's apply, not even the intact ones
    assert all(o["equal"] for o in out), out
    if early_open and kind == "data":
        # Rank 1's early verification found the flipped segment (so the restore verified again and refused it);
        # the other ranks' early verification of their intact version 2 held, and version 2 was still refused.
        assert len(out[1]["early_problems"]) == 1 and out[0]["early_problems"] == out[2]["early_problems"] == [], out
        assert out[1]["early"]["early_verify"].startswith("missed: the early verification found 1"), out
        assert all(out[r]["early"]["early_open"].startswith("missed: opened version 2") for r in (0, 2)), out
