"""Parity exchange and rebuild on real holders, 3 ranks on 3 'nodes', gloo: node loss, corruption, m+1."""
import pytest
import torch

from shardsafe.parity import repair as repair_mod
from shardsafe.parity.exchange import ParityExchange, gather_places, plan_parity
from shardsafe.holder.client import HolderClient
from shardsafe.holder.paths import HolderPaths
from shardsafe.snapshot.restore import Collectives, RestoreError, restore_from_holder
from shardsafe.snapshot.pipeline import GlooAgreement, SnapshotPipeline

from ._fork_ranks import run_ranks
from ._shards import WORLD, Shard, flip


def _scenario(rank, world, root, scenario, repair="chain"):
    import torch.distributed as dist
    client = HolderClient(HolderPaths(root, "pjob", f"n{rank}"), timeout_s=10).connect()
    places = gather_places(rank, world, f"n{rank}", rank)
    m = 2 if scenario == "two_m2" else 1
    ex = ParityExchange(plan_parity(places, group_size=0, parity_shards=m), rank, timeout_s=10, repair=repair)
    assert (ex.group.k, ex.group.m) == (3 - m, m)
    pipe = SnapshotPipeline(client, rank=rank, world_size=world, node=f"n{rank}", agreement=GlooAgreement(), parity=ex)
    # "uneven": payloads of 1.8, 2.4 and 3.0 MB, so rank 0's first data slot (2 MiB, sized before the
    # group's largest payload is known) is shorter than the group's padded payload.
    n = 300_007 + (100_000 * rank if scenario == "uneven" else 0)
    for v in (1, 2):
        pipe.submit(v, Shard(rank, v, n).capture())
        assert pipe.flush(timeout=30), pipe.history[-1].error
    pipe.close()
    pinfo = client.list(rank)[str(rank)]["parity"]
    cs = ex.group.chunk_size(ex.pmax_hint)
    assert all(s["nbytes"] == m * cs for s in pinfo)   # m/(n-m) of the padded payload
    dist.barrier()
    lost = {"one": [1], "parity_corrupt": [1], "data_corrupt": [1], "two": [1, 2], "uneven": [1],
            "sequential": [1], "two_m2": [1, 2]}[scenario]
    before = None
    if scenario in ("sequential", "two_m2") and rank in lost:   # what the lost rank's parity shares of version 2 were
        man, pmm = client.open(rank=rank, version=2, kind="parity")
        before = (bytes(pmm), man["xxh3"], man["codewords"])
        pmm.close()
    if scenario == "uneven":   # keep version 1 only: its rebuild reads rank 0's short slot
        client.drop(rank=rank, kind="data", version=2)
        client.drop(rank=rank, kind="parity", version=2)
    if rank in lost:   # the replacement node's holder is empty
        client.drop(rank=rank, kind="data")
        client.drop(rank=rank, kind="parity")
    if scenario == "parity_corrupt" and rank == 0:
        flip(client, 0, 2, "parity", 17)
    if scenario == "data_corrupt" and rank == 2:
        flip(client, 2, 2, "data", 1234)
    dist.barrier()
    live = Shard(rank, 0, n)
    coll = Collectives(None, world)
    try:
        res = restore_from_holder(live, client, rank=rank, coll=coll, exchange=ex, nodes=[p.node for p in places])
    except RestoreError as e:
        return {"error": str(e)}
    out = {"version": res.version, "tier": res.tier, "equal": live.equals(Shard(rank, res.version, n)),
           "rebuilt": res.rebuilt_bytes}
    if scenario not in ("sequential", "two_m2"):
        return out
    # The lost ranks came back from parity. Their slots of version 2 are committed, and their parity
    # shares were re-encoded: byte for byte what they held before the loss.
    held = client.list(rank)[str(rank)]
    out["committed"] = {k: [s["version"] for s in held[k] if s["committed"]] for k in ("data", "parity")}
    if rank in lost:
        man, pmm = client.open(rank=rank, version=2, kind="parity")
        out["parity_same"] = (bytes(pmm), man["xxh3"], man["codewords"]) == before
        pmm.close()
    if scenario == "two_m2":
        return out
    # Then rank 2's node is lost too, before any new snapshot: version 2 must still be rebuildable,
    # which needs the parity rank 1 holds for rank 2's chunks.
    dist.barrier()
    if rank == 2:
        client.drop(rank=rank, kind="data")
        client.drop(rank=rank, kind="parity")
    dist.barrier()
    live = Shard(rank, 0, n)
    try:
        res = restore_from_holder(live, client, rank=rank, coll=coll, exchange=ex, nodes=[p.node for p in places])
    except RestoreError as e:
        out["second"] = {"error": str(e)}
        return out
    out["second"] = {"version": res.version, "tier": res.tier, "equal": live.equals(Shard(rank, res.version, n)),
                     "rebuilt": res.rebuilt_bytes}
    return out


def test_one_node_lost_is_rebuilt_bit_exact(holders):
    out = run_ranks(WORLD, _scenario, holders, "one", timeout_s=120, pg_timeout_s=10)
    assert [o["version"] for o in out] == [2, 2, 2] and all(o["equal"] for o in out)
    assert [o["tier"] for o in out] == ["parity"] * 3
    assert out[1]["rebuilt"] > 0 and out[0]["rebuilt"] == 0


@pytest.mark.parametrize("repair,slice_kib,window", [("chain", None, None), ("chain", 64, None), ("chain", 16, 1),
                                                     ("gather", None, None)])
def test_rebuilt_member_protects_the_version_again(holders, monkeypatch, repair, slice_kib, window):
    """A rebuilt member also gets its parity shares back (equal to the lost ones) and commits them, so a second
    node lost before the next snapshot is still rebuilt (with m=1 it needs them). Both repairs: the partial
    products reduced along the survivors, and the k sources gathered on the rebuilder (the bench's baseline).
    With 64 KiB slices a chain carries every fragment of these chunks (about 150 KB) in 3 messages, the last
    one short, as it carries real payloads in 4 MiB slices; with 16 KiB slices and a window of 1 a survivor
    waits on each send and posts each receive one slice ahead."""
    if slice_kib:
        monkeypatch.setattr(repair_mod, "SLICE", slice_kib << 10)   # the forked ranks inherit it
    if window:
        monkeypatch.setattr(repair_mod, "WINDOW", window)
    out = run_ranks(WORLD, _scenario, holders, "sequential", repair, timeout_s=120, pg_timeout_s=10)
    assert [o["version"] for o in out] == [2, 2, 2] and all(o["equal"] for o in out), out
    assert out[1]["parity_same"] is True
    assert all(o["committed"] == {"data": [2], "parity": [2]} for o in out[1:2]), out
    second = [o["second"] for o in out]
    assert [s.get("version") for s in second] == [2, 2, 2], second
    assert [s["tier"] for s in second] == ["parity"] * 3 and all(s["equal"] for s in second)
    assert second[2]["rebuilt"] > 0 and second[1]["rebuilt"] == 0


@pytest.mark.parametrize("repair", ["chain", "gather"])
def test_two_lost_members_re_encode_their_parity_m2(holders, repair):
    """m=2, two members lost at once: each rebuilds its payload and gets its own two parity shares back."""
    out = run_ranks(WORLD, _scenario, holders, "two_m2", repair, timeout_s=120, pg_timeout_s=10)
    assert [o["version"] for o in out] == [2, 2, 2] and all(o["equal"] for o in out), out
    assert out[1]["parity_same"] is True and out[2]["parity_same"] is True
    assert all(o["committed"] == {"data": [2], "parity": [2]} for o in out[1:]), out


def test_uneven_payloads_are_protected_from_the_first_snapshot(holders):
    """Members' payloads differ (Megatron DistOpt shards do) and one member's first slot is shorter than
    the group's padded payload: that version is still committed with parity, and rebuilt bit-exact."""
    out = run_ranks(WORLD, _scenario, holders, "uneven", timeout_s=120, pg_timeout_s=10)
    assert [o["version"] for o in out] == [1, 1, 1] and all(o["equal"] for o in out), out
    assert [o["tier"] for o in out] == ["parity"] * 3 and out[1]["rebuilt"] > 0


@pytest.mark.parametrize("scenario", ["parity_corrupt", "data_corrupt"])
def test_corrupt_share_is_detected_and_never_restored(holders, scenario):
    """A flipped byte in a survivor's parity share or data: the newest version is refused; the
    previous one (its own, intact parity) is rebuilt and restored instead."""
    out = run_ranks(WORLD, _scenario, holders, scenario, timeout_s=120, pg_timeout_s=10)
    assert [o["version"] for o in out] == [1, 1, 1], out
    assert all(o["equal"] for o in out)


def test_more_losses_than_parity_is_a_clear_error(holders):
    out = run_ranks(WORLD, _scenario, holders, "two", timeout_s=120, pg_timeout_s=10)
    for o in out:
        msg = o["error"]
        assert "nodes ['n1', 'n2']" in msg and "parity_shards >= 2" in msg and "disk checkpoint" in msg, msg


# ---- the "device" transport (NCCL + CUDA kernels on a GPU) through its CPU test double ------------------

def _device_double(rank, world, root, m, device="cpu"):
    """Version 1 encoded by the host transport, version 2 (the same data) by the device transport's pipeline,
    in 64 KiB blocks so that many are in flight. Then node n1 is lost and version 2 is rebuilt from the
    device-made parity. ``device="cpu"``: the pipeline on CPU tensors over gloo, the test double used here;
    tests/gpu/test_device_transport_gpu.py runs the same on one GPU per rank with NCCL."""
    import torch.distributed as dist
    client = HolderClient(HolderPaths(root, "pjob", f"n{rank}"), timeout_s=10).connect()
    places = gather_places(rank, world, f"n{rank}", rank)
    plan = plan_parity(places, group_size=0, parity_shards=m)
    host = ParityExchange(plan, rank, timeout_s=10)
    dev = ParityExchange(plan, rank, timeout_s=10, transport="device", device=torch.device(device))
    dev.transport.block = 64 << 10
    n = 300_007 + 100_000 * (rank % 3)   # uneven payloads: padding and a short first slot on rank 0
    for version, ex in ((1, host), (2, dev)):
        pipe = SnapshotPipeline(client, rank=rank, world_size=world, node=f"n{rank}", agreement=GlooAgreement(),
                                parity=ex)
        pipe.submit(version, Shard(rank, 7, n).capture())
        assert pipe.flush(timeout=30), pipe.history[-1].error
        pipe.close()
    shares = {}
    for version in (1, 2):
        man, pmm = client.open(rank=rank, version=version, kind="parity")
        shares[version] = (bytes(pmm), man["xxh3"], man["codewords"], man["chunk_size"])
        pmm.close()
    dist.barrier()
    if rank == 1:   # the replacement node's holder is empty
        client.drop(rank=rank, kind="data")
        client.drop(rank=rank, kind="parity")
    dist.barrier()
    live = Shard(rank, 0, n)
    res = restore_from_holder(live, client, rank=rank, coll=Collectives(None, world), exchange=host,
                              nodes=[p.node for p in places])
    return {"same_parity": shares[1] == shares[2], "blocks": -(-shares[2][3] // (64 << 10)),
            "version": res.version, "tier": res.tier, "equal": live.equals(Shard(rank, 7, n)),
            "rebuilt": res.rebuilt_bytes}


@pytest.mark.parametrize("world, m", [(3, 1), (4, 2)])
def test_device_transport_double_makes_the_host_transports_parity(holder_factory, world, m):
    """With 4 members and m=2 a member sends two pieces of each block to the same peer, so the pairing of
    sends and receives by order (how NCCL matches them; gloo with one tag too) is exercised."""
    root = holder_factory(world, job="pjob", budget_gb=0.1).root
    out = run_ranks(world, _device_double, root, m, timeout_s=120, pg_timeout_s=10)
    assert all(o["same_parity"] for o in out), out   # byte for byte, checksums and codewords too
    assert all(o["blocks"] > 2 for o in out), out
    assert [o["version"] for o in out] == [2] * world and all(o["equal"] for o in out), out
    assert [o["tier"] for o in out] == ["parity"] * world and out[1]["rebuilt"] > 0


def _parity_slot_refused(rank, world, root):
    client = HolderClient(HolderPaths(root, "pjob", f"n{rank}"), timeout_s=10).connect()
    places = gather_places(rank, world, f"n{rank}", rank)
    ex = ParityExchange(plan_parity(places, group_size=0, parity_shards=1), rank, timeout_s=10)
    pipe = SnapshotPipeline(client, rank=rank, world_size=world, node=f"n{rank}", agreement=GlooAgreement(), parity=ex)
    pipe.submit(1, Shard(rank, 1).capture())
    pipe.flush(timeout=30)
    pipe.close()
    held = client.list(rank)[str(rank)]
    return {"committed": pipe.history[-1].committed, "error": pipe.history[-1].error,
            "sealed": [s["version"] for s in held["data"] if s["state"] == "sealed"],
            "committed_slots": [(k, s["version"]) for k in ("data", "parity") for s in held.get(k, []) if s["committed"]]}


def test_a_version_without_its_parity_is_not_committed_anywhere(holder_factory):
    """Node n2's holder has room for its data (a 2 MiB slot) but not for its parity share as well: the group
    votes no together, and the version is committed on no rank (data and parity slots alike), with the
    reason on every rank; the data stays sealed for a restore that needs no parity."""
    root = holder_factory(WORLD, job="pjob", budget_gb=[0.1, 0.1, 2.5 / 1024]).root
    out = run_ranks(WORLD, _parity_slot_refused, root, timeout_s=120, pg_timeout_s=10)
    assert [o["committed"] for o in out] == [False] * WORLD, out
    assert all(o["committed_slots"] == [] for o in out), out
    assert "parity slot" in out[2]["error"] and "budget" in out[2]["error"], out[2]
    assert all("could not store parity" in o["error"] for o in out[:2]), out
    assert [o["sealed"] for o in out] == [[1]] * WORLD, out
