"""A flipped byte in one member's held payload: found by the holder's scrub, never loaded, and the
member's payload rebuilt from its parity group (3 ranks on 3 'nodes', real holders, gloo)."""

from shardsafe.parity.exchange import ParityExchange, gather_places, plan_parity
from shardsafe.holder.client import HolderClient
from shardsafe.holder.paths import HolderPaths
from shardsafe.snapshot.restore import Collectives, restore_from_holder
from shardsafe.snapshot.pipeline import GlooAgreement, SnapshotPipeline

from ._fork_ranks import run_ranks
from ._shards import WORLD, Shard


def _scrub_then_restore(rank, world, root):
    import torch.distributed as dist
    client = HolderClient(HolderPaths(root, "pjob", f"n{rank}"), timeout_s=10).connect()
    places = gather_places(rank, world, f"n{rank}", rank)
    ex = ParityExchange(plan_parity(places, group_size=0, parity_shards=1), rank, timeout_s=10)
    pipe = SnapshotPipeline(client, rank=rank, world_size=world, node=f"n{rank}", agreement=GlooAgreement(), parity=ex)
    for v in (1, 2):
        pipe.submit(v, Shard(rank, v).capture())
        assert pipe.flush(timeout=30), pipe.history[-1].error
    pipe.close()
    found = []
    if rank == 1:
        slot = next(s["slot"] for s in client.list(1)["1"]["data"] if s["version"] == 2)
        client._maps[slot][777] ^= 0x10
        found = client.scrub()["corrupt"]
        assert client.status()["health"] == "corrupt"
    dist.barrier()
    live = Shard(rank, 0)
    res = restore_from_holder(live, client, rank=rank, coll=Collectives(None, world), exchange=ex,
                              nodes=[p.node for p in places])
    return {"found": [(b["rank"], b["version"]) for b in found], "version": res.version, "tier": res.tier,
            "equal": live.equals(Shard(rank, 2)), "rebuilt": res.rebuilt_bytes}


def test_scrub_finds_bit_rot_and_parity_repairs_it(holders):
    out = run_ranks(WORLD, _scrub_then_restore, holders, timeout_s=120, pg_timeout_s=10)
    assert out[1]["found"] == [[1, 2]]
    assert [o["version"] for o in out] == [2, 2, 2] and [o["tier"] for o in out] == ["parity"] * 3
    assert all(o["equal"] for o in out) and out[1]["rebuilt"] > 0
