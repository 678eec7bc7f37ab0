"""Timelines, repair and retention at restore (issue 15 items 3, 6, 7): 3 ranks on 3 'nodes', real holders, gloo.

- Timelines: after a restore to v the ranks' copies of newer versions (the abandoned branch) are fenced off,
  and a version whose copies come from two branches is never combined, even when every rank holds it.
  The interleaving is built exactly: ranks 0 and 1 sealed version 4 in branch A and rank 2 died before
  sealing it; the restore to 3 starts branch B; rank 2 seals its version 4 of branch B (other bytes, as a
  non-deterministic GPU replay gives) and ranks 0 and 1 die between their optimizer step and their seal.
- Repair: one member's newest copy fails its checksums (not scrubbed): it is rebuilt from parity like a
  lost member and the newest version is restored, instead of an older one or a refusal.
- Retention: the restored version is committed again on every rank, so the next snapshots cannot evict it
  before a newer version commits everywhere.
- Before the first commit: a node lost while the first version was sealed on the other ranks only leaves
  nothing restorable and nothing that was ever protected: the job starts fresh and says why. Once a version
  was committed, the same loss is refused as before.
"""
import logging

from shardsafe.parity.exchange import ParityExchange, gather_places, plan_parity
from shardsafe.holder.client import HolderClient
from shardsafe.holder.paths import HolderPaths
from shardsafe.snapshot.restore import Collectives, RestoreError, restore_from_holder
from shardsafe.snapshot.pipeline import GlooAgreement, LocalAgreement, SnapshotPipeline

from ._fork_ranks import run_ranks
from ._shards import WORLD, Shard, flip


def _seal(client, rank, world, version, shard, *, timeline, everyone=True, ex=None):
    """Seal ``shard`` as ``version``: with every rank (gloo vote + parity, committed) or on this rank alone."""
    pipe = SnapshotPipeline(client, rank=rank, world_size=world, node=f"n{rank}",
                            agreement=GlooAgreement() if everyone else LocalAgreement(), parity=ex if everyone else None)
    pipe.timeline = timeline
    pipe.submit(version, shard.capture())
    assert pipe.flush(timeout=30), pipe.history[-1].error
    pipe.close()


def _timelines(rank, world, root, fence_fails):
    import torch.distributed as dist
    client = HolderClient(HolderPaths(root, "pjob", f"n{rank}"), timeout_s=10).connect()
    coll = Collectives(None, world)
    for v in (1, 2, 3):
        _seal(client, rank, world, v, Shard(rank, v), timeline=11)
    if rank in (0, 1):   # branch A's version 4 on ranks 0 and 1; rank 2 died before sealing it
        _seal(client, rank, world, 4, Shard(rank, 4), timeline=11, everyone=False)
    dist.barrier()
    live = Shard(rank, 0)
    first = restore_from_holder(live, client, rank=rank, coll=coll)
    out = {"first": first.version, "first_equal": live.equals(Shard(rank, 3)), "timeline": first.timeline,
           "after_fence": client.sealed_versions(rank)}
    if fence_fails and rank in (0, 1):
        # as if this rank's fence had not reached its holder: branch A's version 4 is back
        _seal(client, rank, world, 4, Shard(rank, 4), timeline=11, everyone=False)
    if rank == 2:   # branch B's version 4: other bytes; ranks 0 and 1 die before their seal
        _seal(client, rank, world, 4, Shard(rank, 104), timeline=first.timeline, everyone=False)
    dist.barrier()
    live = Shard(rank, 0)
    second = restore_from_holder(live, client, rank=rank, coll=coll)
    out.update(second=second.version, second_equal=live.equals(Shard(rank, 3)), second_timeline=second.timeline)
    return out


def test_restore_fences_the_abandoned_branch(holders):
    out = run_ranks(WORLD, _timelines, holders, False, timeout_s=120, pg_timeout_s=10)
    assert [o["first"] for o in out] == [3, 3, 3] and all(o["first_equal"] for o in out), out
    assert len({o["timeline"] for o in out}) == 1 and out[0]["timeline"] not in (0, 11)   # one new branch id
    assert all(4 not in o["after_fence"] and 3 in o["after_fence"] for o in out), out      # branch A's 4 dropped
    assert [o["second"] for o in out] == [3, 3, 3] and all(o["second_equal"] for o in out), out
    assert out[0]["second_timeline"] != out[0]["timeline"]


def test_copies_of_two_timelines_are_never_combined(holders, caplog):
    """Every rank holds version 4, but ranks 0-1 hold branch A's and rank 2 branch B's: refused, 3 restored."""
    out = run_ranks(WORLD, _timelines, holders, True, timeout_s=120, pg_timeout_s=10)
    assert [o["second"] for o in out] == [3, 3, 3] and all(o["second_equal"] for o in out), out


def _repair(rank, world, root, corrupt):
    import torch.distributed as dist
    client = HolderClient(HolderPaths(root, "pjob", f"n{rank}"), timeout_s=10).connect()
    places = gather_places(rank, world, f"n{rank}", rank)
    ex = ParityExchange(plan_parity(places, group_size=0, parity_shards=1), rank, timeout_s=10)
    for v in (1, 2):
        _seal(client, rank, world, v, Shard(rank, v), timeline=5, ex=ex)
    dist.barrier()
    if rank in corrupt:   # bit rot in the newest copy; no scrub ran
        flip(client, rank, 2, "data", 4321)
    dist.barrier()
    live = Shard(rank, 0)
    try:
        res = restore_from_holder(live, client, rank=rank, coll=Collectives(None, world), exchange=ex,
                                  nodes=[p.node for p in places])
    except RestoreError as e:
        return {"error": str(e)}
    held = client.list(rank)[str(rank)]
    return {"version": res.version, "tier": res.tier, "equal": live.equals(Shard(rank, res.version)),
            "repaired": res.repaired_ranks, "rebuilt": res.rebuilt_bytes,
            "committed": [s["version"] for s in held["data"] if s["committed"]]}


def test_a_corrupt_copy_is_repaired_from_parity(holders):
    out = run_ranks(WORLD, _repair, holders, [1], timeout_s=120, pg_timeout_s=10)
    assert [o["version"] for o in out] == [2, 2, 2] and all(o["equal"] for o in out), out
    assert [o["tier"] for o in out] == ["parity"] * 3 and all(o["repaired"] == [1] for o in out), out
    assert out[1]["rebuilt"] > 0 and out[0]["rebuilt"] == 0
    assert all(2 in o["committed"] for o in out), out    # the restored version is kept (committed) everywhere


def test_more_corrupt_copies_than_parity_fall_back_to_the_older_version(holders):
    out = run_ranks(WORLD, _repair, holders, [0, 2], timeout_s=120, pg_timeout_s=10)
    assert [o["version"] for o in out] == [1, 1, 1] and all(o["equal"] for o in out), out


def _keep(rank, world, root):
    """Versions 1 and 2 sealed everywhere but committed nowhere (every rank died between the vote and its
    commit). After the restore to 2, rank 0 alone seals versions 3 and 4 (the others fail before theirs):
    without re-committing 2 at the restore, rank 0's holder evicts it for 4 and no version is common."""
    import torch.distributed as dist
    client = HolderClient(HolderPaths(root, "pjob", f"n{rank}"), timeout_s=10).connect()
    coll = Collectives(None, world)
    for v in (1, 2):
        _seal_uncommitted(client, rank, v, Shard(rank, v), timeline=7)
    dist.barrier()
    live = Shard(rank, 0)
    first = restore_from_holder(live, client, rank=rank, coll=coll)
    committed = [s["version"] for s in client.list(rank)[str(rank)]["data"] if s["committed"]]
    if rank == 0:
        for v in (3, 4):
            _seal_uncommitted(client, rank, v, Shard(rank, v), timeline=first.timeline)
    dist.barrier()
    live = Shard(rank, 0)
    try:
        second = restore_from_holder(live, client, rank=rank, coll=coll).version
    except RestoreError as e:
        second = str(e)
    return {"first": first.version, "committed": committed, "second": second, "equal": live.equals(Shard(rank, 2))}


def _seal_uncommitted(client, rank, version, shard, *, timeline, world=WORLD):
    pipe = SnapshotPipeline(client, rank=rank, world_size=world, node=f"n{rank}", agreement=_Never())
    pipe.timeline = timeline
    pipe.submit(version, shard.capture())
    pipe.flush(timeout=30)
    pipe.close()
    assert not pipe.history[-1].committed and not pipe.history[-1].error.startswith("agreement failed")


class _Never:
    def vote(self, version, ok, causes=0, standing=0):
        return False, causes, standing


def test_the_restored_version_is_kept_until_a_newer_one_commits(holders):
    out = run_ranks(WORLD, _keep, holders, timeout_s=120, pg_timeout_s=10)
    assert [o["first"] for o in out] == [2, 2, 2] and all(2 in o["committed"] for o in out), out
    assert [o["second"] for o in out] == [2, 2, 2] and all(o["equal"] for o in out), out


def _first_commit(rank, world, root, committed_first):
    """Version 2 sealed on ranks 0 and 1 only, then node n2 lost with its holder's memory; parity off.
    ``committed_first``: version 1 had been committed everywhere before."""
    import torch.distributed as dist
    client = HolderClient(HolderPaths(root, "pjob", f"n{rank}"), timeout_s=10).connect()
    if committed_first:
        _seal(client, rank, world, 1, Shard(rank, 1), timeline=9)
    if rank in (0, 1):
        _seal_uncommitted(client, rank, 2, Shard(rank, 2), timeline=9, world=world)
    dist.barrier()
    if rank == 2:
        client.drop(rank=rank)   # the node is lost: its copies are gone
    dist.barrier()
    live = Shard(rank, 0)
    try:
        res = restore_from_holder(live, client, rank=rank, coll=Collectives(None, world),
                                  nodes=[f"n{r}" for r in range(world)])
    except RestoreError as e:
        return {"error": str(e)}
    return {"version": res.version, "message": res.message, "notes": res.notes,
            "untouched": live.equals(Shard(rank, 0))}


def test_a_node_lost_before_the_first_commit_starts_fresh_and_says_why(holders, caplog):
    out = run_ranks(WORLD, _first_commit, holders, False, timeout_s=120, pg_timeout_s=10)
    assert [o.get("version") for o in out] == [-1, -1, -1], out
    assert all(o["untouched"] and o["notes"] == {"never_committed": [2]} for o in out), out
    assert all("no version of this job was ever committed" in o["message"] and "ranks [2]" in o["message"]
               and "nodes ['n2']" in o["message"] for o in out), out


def test_a_node_lost_after_a_commit_is_still_refused(holders):
    out = run_ranks(WORLD, _first_commit, holders, True, timeout_s=120, pg_timeout_s=10)
    assert all("cannot restore from memory" in o.get("error", "") and "ranks [2]" in o["error"] for o in out), out
