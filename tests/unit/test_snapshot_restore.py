"""Snapshot pipeline and restore on one rank against a real holder: layout, checksums, corruption."""
import random

import numpy as np
import pytest
import torch

from shardsafe.payload import manifest as mf
from shardsafe.holder.client import HolderClient
from shardsafe.snapshot.restore import Collectives, RestoreError, restore_from_holder
from shardsafe.snapshot.pipeline import LocalAgreement, PipelineHooks, SnapshotPipeline
from shardsafe.snapshot.state import RankState, StateAdapter, apply_rng, capture_rng


class ToyAdapter(StateAdapter):
    """A rank state with odd sizes, several dtypes, a 0-d tensor and RNG."""


    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.t = {
            "master": torch.randn(1_000_003, generator=g),
            "exp_avg": torch.randn(1_000_003, generator=g),
            "lp": torch.randn(777, generator=g).to(torch.bfloat16),
            "step": torch.tensor(float(seed)),
            "counts": torch.arange(13, dtype=torch.int64),
        }
        self.meta = {"iteration": seed, "betas": (0.9, 0.95), "groups": [{"lr": 1e-3}]}

    def capture(self) -> RankState:
        rng = capture_rng()
        return RankState({**self.t, **rng.tensors}, {**self.meta, **rng.meta})

    def apply(self, tensors, meta):
        for k, v in self.t.items():
            v.copy_(tensors[k])
        apply_rng(tensors, meta)
        self.meta = {k: meta[k] for k in ("iteration", "betas", "groups")}


@pytest.fixture
def client(holder_factory):
    """A client of one holder, job "job", node n0."""
    (h,) = holder_factory(1, job="job", budget_gb=0.2)
    return HolderClient(h.paths, timeout_s=10).connect()


def snap(client, adapter, version):
    pipe = SnapshotPipeline(client, rank=0, world_size=1, node="n0", agreement=LocalAgreement())
    pipe.submit(version, adapter.capture())
    pipe.wait_copied()
    assert pipe.flush(timeout=30)
    pipe.close()
    return pipe.history[-1]


def test_round_trip_bit_exact_including_rng(client):
    src = ToyAdapter(1)
    random.seed(7); np.random.seed(7); torch.manual_seed(7)
    st = snap(client, src, 10)
    assert st.committed and not st.error
    expect = (random.random(), np.random.rand(), torch.rand(3))
    dst = ToyAdapter(2)
    random.seed(99); np.random.seed(99); torch.manual_seed(99)
    res = restore_from_holder(dst, client, rank=0, coll=Collectives())
    assert (res.version, res.tier) == (10, "memory")
    for k in src.t:
        assert torch.equal(src.t[k], dst.t[k]), k
    assert dst.meta == {"iteration": 1, "betas": (0.9, 0.95), "groups": [{"lr": 1e-3}]}
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])


def test_corrupted_byte_is_detected_and_older_version_restored(client):
    a = ToyAdapter(1)
    snap(client, a, 1)
    b = ToyAdapter(2)
    snap(client, b, 2)
    # Flip one byte of version 2 in shared memory, behind the holder's back.
    man, ro = client.open(rank=0, version=2)
    ro.close()
    entry = next(e for e in man["entries"] if e["name"] == "exp_avg")
    bad = None
    for m in list(client._maps.values()):   # the pipeline cached writable mappings of both slots; find the one holding v2
        buf = memoryview(m)
        if mf.verify(man, buf) == []:
            off = entry["offset"] + 5_000_000 % entry["nbytes"]
            m[off] = m[off] ^ 0x01
            bad = mf.verify(man, buf)
            buf.release()
            break
        buf.release()
    assert bad and "exp_avg segment" in bad[0]
    dst = ToyAdapter(3)
    res = restore_from_holder(dst, client, rank=0, coll=Collectives())
    assert res.version == 1, res.message           # the corrupt newest version was never loaded
    assert all(torch.equal(a.t[k], dst.t[k]) for k in a.t)


def test_layout_mismatch_is_refused(client):
    snap(client, ToyAdapter(1), 3)
    other = ToyAdapter(2)
    other.t["master"] = torch.zeros(10)
    with pytest.raises(RestoreError, match="nothing was loaded"):
        restore_from_holder(other, client, rank=0, coll=Collectives())
    assert torch.equal(other.t["master"], torch.zeros(10))


def test_no_holder_means_fresh_start_and_skipped_snapshots():
    ad = ToyAdapter(1)
    res = restore_from_holder(ad, None, rank=0, coll=Collectives())
    assert res.version == -1 and res.message == "no snapshot in memory for this job: starting fresh"
    events = []
    pipe = SnapshotPipeline(None, rank=0, world_size=1, node="n0", agreement=LocalAgreement(),
                            hooks=PipelineHooks(on_event=lambda kind, **f: events.append((kind, f))))
    pipe.submit(1, ad.capture())
    assert not pipe.flush(timeout=10)
    pipe.close()
    assert pipe.history[-1].error and events[0][0] == "snapshot_skipped"


def test_meta_json_round_trip_rejects_objects():
    m = {"a": (1, 2.5, None), "b": [{"c": (3,)}], 4: "int key"}
    assert mf.from_jsonable(mf.to_jsonable(m)) == m
    with pytest.raises(mf.ManifestError):
        mf.to_jsonable({"f": object()})


def test_stall_counter_is_the_sum_of_the_reported_stalls(client):
    """`stall_total_s` (what training loops subtract from an iteration's TOR seconds) accumulates exactly
    the blocking time the snapshot events report: captures, waits for the copy, waits for an earlier job."""
    events = []
    pipe = SnapshotPipeline(client, rank=0, world_size=1, node="n0", agreement=LocalAgreement(),
                            hooks=PipelineHooks(on_event=lambda kind, **f: events.append((kind, f))))
    src = ToyAdapter(3)
    before = []
    for v in (1, 2, 3):
        before.append(pipe.stall_total_s)
        pipe.submit(v, src.capture())   # v=2, 3: may wait for the previous job (its stall)
        if v != 2:
            pipe.wait_copied()
    assert pipe.flush(timeout=30)
    pipe.close()
    stalls = [f["stall_s"] for kind, f in events if kind == "snapshot"]
    assert len(stalls) == 3 and all(s > 0 for s in stalls)
    assert before[0] == 0.0 and before[1] > 0.0 and before[2] > before[1]
    assert pipe.stall_total_s == pytest.approx(sum(stalls), rel=0, abs=1e-9)


@pytest.mark.parametrize("fused", [True, False], ids=["copy+hash fused", "copy then hash threads"])
def test_cpu_copy_fused_or_not_seals_the_same_manifest_and_restores_bit_exact(client, monkeypatch, fused):
    # Both CPU copy paths of the pipeline (checksum.fused_available) give every segment of every entry the
    # digest of the bytes that landed; a tensor over several segments with an odd tail included.
    from shardsafe.payload import checksum
    if not fused:
        monkeypatch.setattr(checksum, "fused_available", lambda: False)
    assert checksum.fused_available() is fused
    src = ToyAdapter(3)
    src.t["master"] = torch.randn((9 << 20) // 4 + 5, generator=torch.Generator().manual_seed(5))
    st = snap(client, src, 4)
    assert st.committed and not st.error
    man, ro = client.open(rank=0, version=4)
    try:
        raw = memoryview(ro)
        for e in man["entries"]:
            assert e["xxh3"] == [mf.hash_bytes(raw[a:b]) for a, b in mf.chunk_ranges(e)], e["name"]
        assert len(next(e for e in man["entries"] if e["name"] == "master")["xxh3"]) == 3
        raw.release()
    finally:
        ro.close()
    dst = ToyAdapter(4)
    dst.t["master"] = torch.zeros_like(src.t["master"])
    assert restore_from_holder(dst, client, rank=0, coll=Collectives()).version == 4
    assert all(torch.equal(src.t[k], dst.t[k]) for k in src.t)


def test_peer_shards_are_read_from_the_holder_only_for_params_in_host_memory():
    # The DeepSpeed / Megatron adapters ask this before replacing the framework's param all-gather by casts
    # of the peers' shards from the node's memory: on a GPU the all-gather (NCCL) is the cheaper way. The
    # meta device stands in for a GPU tensor (no GPU here): what is checked is that a non-host tensor says no.
    from shardsafe.snapshot.restore import PeerPayloads
    assert PeerPayloads.pays_off([torch.zeros(2), torch.zeros(3, dtype=torch.bfloat16)])
    assert not PeerPayloads.pays_off([torch.zeros(2), torch.zeros(2, device="meta")])


class CountingCollectives(Collectives):
    """One rank's collectives, each call recorded: every collective of a restore is a ring's latency per restart
    at thousands of ranks."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def gather_ints(self, values):
        self.calls.append(f"gather_ints[{len(values)}]")
        return super().gather_ints(values)

    def all_true(self, flag):
        self.calls.append("all_true")
        return super().all_true(flag)


def test_a_restore_from_memory_is_two_collectives_and_a_fresh_start_one(client):
    """What every rank holds, the world size of its newest copy, whether its holder holds a committed copy, the
    new timeline's id and the node's two checks (shardsafe.snapshot.inventory) travel in one all-gather; the vote on a version carries the copies' digests (for the
    peer-payload path). A fresh start is the first all-gather alone."""
    coll = CountingCollectives()
    res = restore_from_holder(ToyAdapter(2), client, rank=0, coll=coll)
    assert res.version == -1 and coll.calls == ["gather_ints[13]"], coll.calls
    assert res.timeline > 0
    src = ToyAdapter(1)
    snap(client, src, 5)
    coll = CountingCollectives()
    dst = ToyAdapter(3)
    res = restore_from_holder(dst, client, rank=0, coll=coll)
    assert (res.version, res.tier) == (5, "memory") and all(torch.equal(src.t[k], dst.t[k]) for k in src.t)
    assert coll.calls == ["gather_ints[13]", "gather_ints[3]"], coll.calls
    assert res.timeline > 0 and res.timeline != restore_from_holder(ToyAdapter(3), client, rank=0,
                                                                      coll=Collectives()).timeline


def test_holdings_sent_with_the_places_are_what_the_restore_would_gather(client):
    """A runtime sends what its holder holds (and, on a node's lowest rank, the node's listing) in the places
    gather it runs anyway: read back, that is what the restore's own gather says, and placement's rule reads the
    same from a node's slot ranks as from its listing."""
    from shardsafe.parity.placement import inventory_of, settled, settled_ranks, slot_ranks
    from shardsafe.snapshot.inventory import gather_held, held_from_parts, held_part, node_checks, node_listing
    for v in (5, 6):
        snap(client, ToyAdapter(v), v)
    nodes = ["n0"]
    gathered = gather_held(client, 0, None, Collectives(), node_checks(
        client, rank=0, world_size=1, nodes=nodes, settled=lambda listing: settled(nodes, "n0", inventory_of(listing))))
    same, listing = node_listing(client, rank=0, world_size=1)
    parts = [held_part(client, 0, (same, slot_ranks(inventory_of(listing))))]
    sent = held_from_parts(parts, 0, nodes, parity=False, settled=lambda node, ranks: settled_ranks(nodes, node, ranks))
    assert gathered.data == sent.data == [[6, 5]] and gathered.mine_data == sent.mine_data == [5, 6]
    for field in ("parity", "world_seen", "committed", "same_size", "settled", "mine_parity"):
        assert getattr(gathered, field) == getattr(sent, field), field
    assert sent.timeline == parts[0]["t"] > 0
    # rank 1 runs on n1 now, and n0's holder keeps a slot of it: placement has something to move
    moved = [dict(parts[0], o=[0, 1]), {k: v for k, v in parts[0].items() if k not in ("s", "o")}]
    two = ["n0", "n1"]
    got = held_from_parts(moved, 1, two, parity=False, settled=lambda node, ranks: settled_ranks(two, node, ranks))
    inv = {**inventory_of(listing), (1, "data"): {6: {}}}
    assert got.settled is False and settled(two, "n0", inv) is False and got.mine_data == [5, 6]


def test_the_budget_check_rides_in_the_vote_on_the_verified_copy(client):
    """A restore from memory is one collective when what every rank holds came with the places: the vote on the
    verified copy carries the caller's ints (the runtime's budget check), computed from the manifest it verified."""
    from shardsafe.snapshot.inventory import held_from_parts, held_part
    src = ToyAdapter(1)
    snap(client, src, 5)
    held = held_from_parts([held_part(client, 0, (True, [0]))], 0, ["n0"], parity=False, settled=lambda n, r: True)
    seen = []

    def extra(manifest):
        seen.append(manifest and manifest["payload_nbytes"])
        return [7, len(seen)]

    coll, dst = CountingCollectives(), ToyAdapter(3)
    res = restore_from_holder(dst, client, rank=0, coll=coll, held=held, vote_extra=extra)
    assert (res.version, res.tier) == (5, "memory") and all(torch.equal(src.t[k], dst.t[k]) for k in src.t)
    assert coll.calls == ["gather_ints[5]"], coll.calls
    assert res.vote_rows == [[7, 1]] and seen == [mf.layout(src.capture().tensors)[1]]


def test_a_runtime_restart_judges_the_budget_from_the_restored_version(holder_factory, monkeypatch):
    """A holder with room for one version of the rank but not two: the start says the rank is NOT protected for its
    budget, and so does a restart that restores that version (its check now rides in the restore's vote)."""
    from shardsafe.config import ShardsafeConfig
    from shardsafe.protection import Cause
    from shardsafe.runtime import Runtime
    holders = holder_factory(1, job="bjob", budget_gb=0.012)
    monkeypatch.delenv("SHARDSAFE_RUN_DIR", raising=False)
    cfg = ShardsafeConfig(job_id="bjob", holder_dir=holders.root, node="n0", start_holder=False, interval=1,
                          timeout_s=10)
    verdicts = []
    for attempt in range(2):
        rt = Runtime(cfg, rank=0, world_size=1)
        try:
            state = ToyAdapter(attempt)
            res = rt.try_restore(state)
            verdicts.append((res.version, res.vote_rows is not None, set(rt.protection.causes()), rt.banner()))
            if attempt == 0:
                rt.after_step(1, state)
                assert rt.flush(30)
        finally:
            rt.close()
    assert verdicts[0][0] == -1 and verdicts[1][:2] == (1, True), verdicts
    assert all(Cause.BUDGET in v[2] and "NOT protected" in v[3] for v in verdicts), verdicts
