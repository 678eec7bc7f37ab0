"""Rank placement across restarts, on real holders: ranks that run on another node than their
snapshots after a restart get them moved there (and parity rebuilds what a lost node took)."""
import pytest

from shardsafe.parity.exchange import ParityExchange, gather_places, plan_parity
from shardsafe.holder.client import HolderClient
from shardsafe.holder.paths import HolderPaths
from shardsafe.parity import placement
from shardsafe.parity.placement import migrate
from shardsafe.snapshot.restore import Collectives, restore_from_holder
from shardsafe.snapshot.pipeline import GlooAgreement, SnapshotPipeline

from ._fork_ranks import run_ranks
from ._shards import Shard

WORLD = 3


@pytest.fixture
def holders(holder_factory, request):
    """The root of WORLD + 1 holders of job mjob (n3: a replacement node, empty); budget: the param, 0.1 GB."""
    return holder_factory(WORLD + 1, job="mjob", budget_gb=getattr(request, "param", 0.1)).root


def _ranks_of(client):
    return sorted(int(r) for r, kinds in client.list().items() if kinds.get("data") or kinds.get("parity"))


def _scenario(rank, world, root, first, second, lose):
    """Snapshot v1, v2 with ranks on nodes ``first``; drop node ``lose``'s holder contents; restart
    with ranks on nodes ``second``: migrate, then restore."""
    import torch.distributed as dist
    node = f"n{first[rank]}"
    client = HolderClient(HolderPaths(root, "mjob", node), timeout_s=10).connect()
    ex = ParityExchange(plan_parity(gather_places(rank, world, node, rank), group_size=0, parity_shards=1), rank,
                        timeout_s=10)
    pipe = SnapshotPipeline(client, rank=rank, world_size=world, node=node, agreement=GlooAgreement(), parity=ex)
    for v in (1, 2):
        pipe.submit(v, Shard(rank, v).capture())
        assert pipe.flush(timeout=30), pipe.history[-1].error
    pipe.close()
    dist.barrier()
    if lose is not None and first[rank] == lose:   # the lost node's memory is gone with it
        client.drop(rank=rank, kind="data")
        client.drop(rank=rank, kind="parity")
    dist.barrier()
    client.close()
    # ---- the restart: torch elastic put the ranks on other nodes ----------------------------------------
    node = f"n{second[rank]}"
    client = HolderClient(HolderPaths(root, "mjob", node), timeout_s=10).connect()
    places = gather_places(rank, world, node, rank)
    ex = ParityExchange(plan_parity(places, group_size=0, parity_shards=1), rank, timeout_s=10)
    gathers = []   # the holders' listings exchanged (all-gathers of JSON) by this rank's migrate()
    real_gather = placement.gather_json
    placement.gather_json = lambda *a, **k: gathers.append(1) or real_gather(*a, **k)
    try:
        mig = migrate(client, rank=rank, world_size=world, node=node, rank_nodes=[p.node for p in places])
    finally:
        placement.gather_json = real_gather
    live = Shard(rank, 0)
    res = restore_from_holder(live, client, rank=rank, coll=Collectives(None, world), exchange=ex,
                              nodes=[p.node for p in places])
    dist.barrier()
    return {"ok": mig.ok, "moved": sorted({m.rank for m in mig.moves}), "bytes": mig.nbytes, "deferred": mig.deferred,
            "version": res.version, "tier": res.tier, "equal": live.equals(Shard(rank, res.version)),
            "holder_ranks": _ranks_of(client), "message": mig.message, "gathers": len(gathers)}


def test_swapped_ranks_are_moved_and_restored_from_memory(holders):
    out = run_ranks(WORLD, _scenario, holders, [0, 1, 2], [0, 2, 1], None, timeout_s=120, pg_timeout_s=10)
    assert all(o["ok"] for o in out) and out[0]["moved"] == [1, 2], out
    assert [o["version"] for o in out] == [2, 2, 2] and all(o["equal"] for o in out), out
    assert [o["tier"] for o in out] == ["memory"] * 3
    assert out[1]["bytes"] > 0 and out[2]["bytes"] > 0 and out[0]["bytes"] == 0
    # every holder now holds exactly the ranks that run on its node (stale copies dropped)
    assert [o["holder_ranks"] for o in out] == [[0], [1], [2]], out
    assert "rank 1: n1 -> n2" in out[0]["message"] and "rank 2: n2 -> n1" in out[0]["message"]
    assert [o["gathers"] for o in out] == [1, 1, 1]   # the vote said no: the listings were exchanged


def test_unchanged_placement_is_settled_by_one_vote_without_exchanging_listings(holders):
    """The common restart: every rank on its old node. No listing travels (at 8k ranks they are ~11 MB to every
    rank), nothing moves or is dropped, and the restore finds every rank's copy in its own holder."""
    out = run_ranks(WORLD, _scenario, holders, [0, 1, 2], [0, 1, 2], None, timeout_s=120, pg_timeout_s=10)
    assert all(o["ok"] for o in out) and all(o["moved"] == [] for o in out), out
    assert [o["gathers"] for o in out] == [0, 0, 0], out
    assert [o["version"] for o in out] == [2, 2, 2] and all(o["equal"] for o in out), out
    assert [o["tier"] for o in out] == ["memory"] * 3
    assert [o["holder_ranks"] for o in out] == [[0], [1], [2]], out
    assert out[0]["message"] == "placement: no slot to move"


def test_node_loss_with_shifted_ranks_moves_survivors_and_rebuilds_the_lost(holders):
    """Node n1 lost; torch elastic's next round is n0, n2, n3 (a fresh node sorts last): rank 1 now
    runs on n2 (which holds rank 2's snapshots), rank 2 on the empty n3."""
    out = run_ranks(WORLD, _scenario, holders, [0, 1, 2], [0, 2, 3], 1, timeout_s=120, pg_timeout_s=10)
    assert all(o["ok"] for o in out) and out[0]["moved"] == [2], out
    assert [o["version"] for o in out] == [2, 2, 2] and all(o["equal"] for o in out), out
    assert [o["tier"] for o in out] == ["parity"] * 3
    assert [o["holder_ranks"] for o in out] == [[0], [1], [2]], out
    assert [o["gathers"] for o in out] == [1, 1, 1]



@pytest.mark.parametrize("holders", [12 / 1024], indirect=True)
def test_swap_within_a_tight_budget_goes_through_process_memory(holders):
    """Each holder has room for its own rank's 2 data + 2 parity slots (8 MiB) and 4 MiB more: the incoming
    copies that do not fit wait in the receiver's memory until the stale ones are dropped."""
    out = run_ranks(WORLD, _scenario, holders, [0, 1, 2], [0, 2, 1], None, timeout_s=120, pg_timeout_s=10)
    assert all(o["ok"] for o in out) and out[0]["moved"] == [1, 2], out
    assert out[1]["deferred"] > 0 and out[2]["deferred"] > 0, out
    assert [o["version"] for o in out] == [2, 2, 2] and all(o["equal"] for o in out), out
    assert [o["tier"] for o in out] == ["memory"] * 3
    assert [o["holder_ranks"] for o in out] == [[0], [1], [2]], out
