"""Persistent tier (flush, retention, fallback, unwritable dir) and background scrubbing, one rank."""
import json
import os
import subprocess
import time

import pytest
import torch

from shardsafe.holder.client import HolderClient, stop_holder
from shardsafe.holder.paths import HolderPaths
from shardsafe.persist import PersistentStore
from shardsafe.snapshot.restore import Collectives, RestoreError, restore_from_holder
from shardsafe.snapshot.pipeline import LocalAgreement, PipelineHooks, SnapshotPipeline

from .test_snapshot_restore import ToyAdapter


@pytest.fixture
def holder(holder_factory, tmp_path):
    """start(node, budget_gb) -> a connected client; ``start.procs[node]`` is the holder process."""
    procs = {}

    def start(node="n0", budget_gb=0.2):
        (h,) = holder_factory([node], job="job", budget_gb=budget_gb, root=tmp_path / "h", run_dir=str(tmp_path))
        procs[node] = h.proc
        return HolderClient(h.paths, timeout_s=10).connect()

    start.procs = procs
    return start


def snapshots(client, versions, flush_dir=None, keep=2, seeds=None):
    def flush(v):
        client.flush(rank=0, version=v, dir=flush_dir, job_id="job", keep=keep)
    pipe = SnapshotPipeline(client, rank=0, world_size=1, node="n0", agreement=LocalAgreement(),
                            hooks=PipelineHooks(flush=flush if flush_dir else None))
    states = {}
    for v in versions:
        states[v] = ToyAdapter((seeds or {}).get(v, v))
        pipe.submit(v, states[v].capture())
        assert pipe.flush(timeout=30), pipe.history[-1].error
    pipe.close()
    return states


def wait_flushes(client, n, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = client.status()["flush"]
        if st["done"] + st["failed"] >= n:
            return st
        time.sleep(0.05)
    raise AssertionError(f"flushes not done: {client.status()['flush']}")


def test_flush_keep_and_restore_from_disk(holder, tmp_path):
    c = holder()
    disk = str(tmp_path / "persist")
    states = snapshots(c, [1, 2, 3], flush_dir=disk, keep=2)
    assert wait_flushes(c, 3)["done"] == 3
    store = PersistentStore(disk, "job")
    assert store.rank_versions(0) == [2, 3]                      # retention: newest 2
    assert oct(os.stat(store.paths(3, 0)[0]).st_mode & 0o777) == "0o600"
    assert not [f for f in os.listdir(store.version_dir(3)) if f.endswith(".tmp")]
    # A new node: empty holder, nothing in memory -> the persistent tier, bit-exact.
    fresh = holder("n1")
    live = ToyAdapter(99)
    res = restore_from_holder(live, fresh, rank=0, coll=Collectives(), persist=store)
    assert (res.version, res.tier) == (3, "persistent")
    assert all(torch.equal(live.t[k], states[3].t[k]) for k in live.t)
    # A flipped byte on disk: never loaded, the older version is used.
    with open(store.paths(3, 0)[0], "r+b") as f:
        f.seek(4_000_001)
        b = f.read(1)
        f.seek(4_000_001)
        f.write(bytes([b[0] ^ 1]))
    live = ToyAdapter(98)
    res = restore_from_holder(live, fresh, rank=0, coll=Collectives(), persist=store)
    assert (res.version, res.tier) == (2, "persistent")
    assert all(torch.equal(live.t[k], states[2].t[k]) for k in live.t)
    events = [json.loads(x) for x in open(tmp_path / "events.jsonl")]
    assert sum(1 for e in events if e["kind"] == "flush" and e.get("ok")) == 3


def test_unwritable_persist_dir_keeps_memory_tiers(holder, tmp_path):
    c = holder()
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    states = snapshots(c, [1, 2], flush_dir=str(blocker / "sub"))   # ENOTDIR: even root cannot write there
    st = wait_flushes(c, 2)
    assert st["failed"] == 2 and "persist_dir" in st["last_error"] and str(blocker) in st["last_error"]
    assert c.sealed_versions(0) == [1, 2]                           # memory tier unaffected
    live = ToyAdapter(50)
    assert restore_from_holder(live, c, rank=0, coll=Collectives()).version == 2
    assert all(torch.equal(live.t[k], states[2].t[k]) for k in live.t)


def test_scrub_marks_corrupt_and_restore_skips_it(holder):
    c = holder()
    states = snapshots(c, [1, 2])
    assert c.scrub() == {"ok": True, "checked": 2, "corrupt": []}
    slot = next(s["slot"] for s in c.list(0)["0"]["data"] if s["version"] == 2)
    c._maps[slot][123] ^= 0xFF                  # bit rot behind everyone's back
    found = c.scrub()
    assert [(b["rank"], b["version"]) for b in found["corrupt"]] == [(0, 2)]
    st = c.status()
    assert st["health"] == "corrupt" and st["corrupt"] == [{"rank": 0, "kind": "data", "version": 2}]
    assert c.sealed_versions(0) == [1]
    live = ToyAdapter(7)
    assert restore_from_holder(live, c, rank=0, coll=Collectives()).version == 1
    assert all(torch.equal(live.t[k], states[1].t[k]) for k in live.t)


def test_nothing_verifies_names_the_directories(holder, tmp_path):
    c = holder()
    snapshots(c, [1])
    other = ToyAdapter(1)
    other.t["master"] = torch.zeros(3)          # a different model: memory version refused
    with pytest.raises(RestoreError) as e:
        restore_from_holder(other, c, rank=0, coll=Collectives(), persist=PersistentStore(str(tmp_path / "p"), "job"))
    assert "nothing was loaded" in str(e.value) and str(tmp_path / "p") in str(e.value)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs: a real 'disk full' (ENOSPC) for the flush."""
    d = tmp_path / "tiny"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs to fill up (needs root/CAP_SYS_ADMIN): {r.stderr.strip()}")
    yield str(d)
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_disk_full_is_a_clear_error_and_memory_tiers_unaffected(holder, tiny_disk):
    c = holder()
    states = snapshots(c, [1, 2], flush_dir=tiny_disk)        # ~12 MB payloads into 1 MiB
    st = wait_flushes(c, 2)
    assert st["failed"] == 2 and "No space left on device" in st["last_error"] and tiny_disk in st["last_error"]
    assert "training and the memory tiers are unaffected" in st["last_error"]
    assert not [f for _, _, fs in os.walk(tiny_disk) for f in fs]   # no partial file left to look complete or eat space
    assert c.sealed_versions(0) == [1, 2]
    live = ToyAdapter(5)
    assert restore_from_holder(live, c, rank=0, coll=Collectives()).version == 2
    assert all(torch.equal(live.t[k], states[2].t[k]) for k in live.t)


def test_export_source_reads_committed_versions_from_holders_and_refuses_corrupt_ones(holder, tmp_path):
    """`shardsafe export holder://JOB`: the newest version committed on every rank, every checksum
    verified, tensors equal to what was snapshotted; a flipped byte in holder memory is refused."""
    from shardsafe.export.sources import ExportError, open_holders, open_source
    client = holder()
    states = snapshots(client, [3, 5])
    version, ranks = open_holders(str(tmp_path / "h"), "job")
    assert version == 5 and [r.rank for r in ranks] == [0]
    want = states[5].capture().tensors
    assert ranks[0].tensors.keys() == want.keys()
    assert all(torch.equal(ranks[0].tensors[k], want[k]) for k in want)
    assert open_source("holder://job", holder_dir=str(tmp_path / "h"), version=3)[0] == 3
    with pytest.raises(ExportError, match="not committed on every rank"):
        open_holders(str(tmp_path / "h"), "job", version=4)
    with pytest.raises(ExportError, match="no holder of job 'other'"):
        open_holders(str(tmp_path / "h"), "other")
    # Bit rot in v5 behind everyone's back (through the writer's mapping of the slot).
    slot = next(s["slot"] for s in client.list(0)["0"]["data"] if s["version"] == 5)
    man, mm = client.open(rank=0, version=5)
    mm.close()
    off = next(e for e in man["entries"] if e["nbytes"])["offset"]
    client._maps[slot][off] ^= 0xFF
    with pytest.raises(ExportError, match="rank 0 of version 5 .* fails its checksums"):
        open_holders(str(tmp_path / "h"), "job")
    client.close()


def test_peer_payloads_use_only_the_copy_its_owner_verified(holder):
    """The restore's peer-shard path reads a DP peer's payload from the node's holder only if it is the
    copy the peer verified (equal digest); a stale copy of the same version (an earlier timeline left
    on this node by an earlier placement of that rank) or a missing version makes every rank fall back."""
    from shardsafe.snapshot.restore import Collectives, PeerPayloads, manifest_digest
    c = holder()
    for rank in (0, 1):
        pipe = SnapshotPipeline(c, rank=rank, world_size=1, node="n0", agreement=LocalAgreement())
        pipe.submit(4, ToyAdapter(10 + rank).capture())
        assert pipe.flush(timeout=30), pipe.history[-1].error
        pipe.close()
    man1, mm = c.open(rank=1, version=4)
    mm.close()
    good = PeerPayloads(c, 4, Collectives(), digests=[0, manifest_digest(man1)])
    assert good.available([1])
    assert torch.equal(good.tensors(1)["master"], ToyAdapter(11).t["master"]) and good.meta(1)["iteration"] == 11
    good.close()
    stale = PeerPayloads(c, 4, Collectives(), digests=[0, manifest_digest(man1) ^ 1])
    assert not stale.available([1])
    stale.close()
    assert not PeerPayloads(c, 5, Collectives(), digests=[0, 0]).available([1])
    assert not PeerPayloads(c, 4, Collectives(), digests=[0, manifest_digest(man1)]).available([1], usable=False)


def _flushing(c, disk, *, keep=2, mbps=8.0, when=lambda v: True):
    """A one-rank pipeline whose committed versions ``when(v)`` the holder flushes at ``mbps`` MB/s
    (8 MB of ToyAdapter state at 8 MB/s: a flush takes about a second)."""
    return SnapshotPipeline(c, rank=0, world_size=1, node="n0", agreement=LocalAgreement(),
                            hooks=PipelineHooks(flush=lambda v: c.flush(rank=0, version=v, dir=disk, job_id="job",
                                                                        keep=keep, mbps=mbps) if when(v) else None))


def _restores_from_disk(disk, version, state):
    live = ToyAdapter(99)
    res = restore_from_holder(live, None, rank=0, coll=Collectives(), persist=PersistentStore(disk, "job"))
    assert (res.version, res.tier) == (version, "persistent")
    assert all(torch.equal(live.t[k], state.t[k]) for k in live.t)


def _held(client):
    slots = client.list(0)["0"]["data"]
    return sorted(s["version"] for s in slots if s["state"] != "free"), len(slots)


def test_shutdown_waits_for_queued_flushes(holder, tmp_path):
    """A holder told to stop while a flush is queued writes it first: the launcher's stop waits for it
    (beyond its grace) instead of killing the holder, which would lose the newest version on disk."""
    c, disk = holder(), str(tmp_path / "persist")
    pipe = _flushing(c, disk)
    state = ToyAdapter(5)
    pipe.submit(5, state.capture())
    assert pipe.flush(timeout=30), pipe.history[-1].error
    pipe.close()
    c.close()
    proc = holder.procs["n0"]
    t0 = time.perf_counter()
    stop_holder(c.paths, proc, grace_s=0.2)       # the flush outlasts the grace
    assert proc.returncode == 0, "the holder was killed instead of finishing its flush"
    assert time.perf_counter() - t0 > 0.2
    assert PersistentStore(disk, "job").rank_versions(0) == [5]
    _restores_from_disk(disk, 5, state)


def test_snapshots_go_on_while_a_flush_reads_an_older_version(holder, tmp_path):
    """A slow flush pins its version; the next snapshots take one extra slot (inside the budget)
    instead of being skipped, and once the flush is done the rank holds two versions again."""
    c, disk = holder(), str(tmp_path / "persist")
    pipe = _flushing(c, disk, keep=3, mbps=16, when=lambda v: v % 3 == 0)
    states = {}
    for v in range(1, 8):     # v3 and v6 take ~0.5 s each on disk; the others come right behind them
        states[v] = ToyAdapter(v)
        pipe.submit(v, states[v].capture())
        assert pipe.flush(timeout=30), (v, pipe.history[-1].error)
    pipe.close()
    assert [h.committed for h in pipe.history] == [True] * 7
    assert wait_flushes(c, 2)["done"] == 2
    assert _held(c) == ([6, 7], 3), c.list(0)   # the extra slot stays, free and pre-faulted
    man, mm = c.open(rank=0, version=7)
    mm.close()
    assert PersistentStore(disk, "job").rank_versions(0) == [3, 6]
    _restores_from_disk(disk, 6, states[6])


def test_no_budget_for_an_extra_slot_skips_snapshots_during_a_flush_and_says_why(holder, tmp_path):
    c = holder(budget_gb=0.02)                   # two 8 MiB slots
    pipe = _flushing(c, str(tmp_path / "persist"), when=lambda v: v == 1)
    for v in (1, 2, 3):
        pipe.submit(v, ToyAdapter(v).capture())
        pipe.flush(timeout=30)
    assert [h.committed for h in pipe.history] == [True, True, False]
    err = pipe.history[-1].error
    assert "being flushed" in err and "memory_budget_gb" in err and "persist_every" in err, err
    wait_flushes(c, 1)
    pipe.submit(4, ToyAdapter(4).capture())            # the flush is done: snapshots go on
    assert pipe.flush(timeout=30), pipe.history[-1].error
    pipe.close()
    assert _held(c) == ([2, 4], 2)


def test_drop_while_a_flush_reads_the_version(holder, tmp_path):
    """Dropping a version that is being flushed hides it at once and frees its memory when the flush
    is done (before: the drop closed the mapping under the flush's feet)."""
    c, disk = holder(), str(tmp_path / "persist")
    pipe = _flushing(c, disk)
    pipe.submit(1, ToyAdapter(1).capture())
    assert pipe.flush(timeout=30)
    pipe.close()
    c.drop(rank=0, version=1)
    assert c.sealed_versions(0) == [] and c.status()["used"] > 0   # hidden, bytes still being read
    assert wait_flushes(c, 1) == {**c.status()["flush"], "done": 1}
    assert c.status()["used"] == 0 and c.list(0) == {"0": {}}
    assert PersistentStore(disk, "job").rank_versions(0) == [1]
    _restores_from_disk(disk, 1, ToyAdapter(1))


def test_scrub_pins_one_slot_at_a_time(tmp_path, monkeypatch):
    """While the scrub hashes the newest version, the older one can already take the next snapshot:
    no extra slot (pinning every slot for the whole scrub made each snapshot in that window need one)."""
    import threading

    from shardsafe.payload import manifest as mf
    from shardsafe.holder.server import Holder
    h = Holder(HolderPaths(str(tmp_path / "h"), "job", "n0"), budget_bytes=64 << 20)
    slot_of = {}
    for v in (1, 2):
        slot_of[v] = h.acquire({"rank": 0, "version": v, "nbytes": 4096})[0]["slot"]
        h.seal({"rank": 0, "version": v, "manifest": {"v": v}})
        h.commit({"ranks": [0], "version": v})
    hashing, release = threading.Event(), threading.Event()

    def verify(man, buf):
        if man == {"v": 2}:
            hashing.set()
            release.wait(10)
        return []
    monkeypatch.setattr(mf, "verify_any", verify)
    t = threading.Thread(target=h.scrub)
    t.start()
    try:
        assert hashing.wait(10)
        got = h.acquire({"rank": 0, "version": 3, "nbytes": 4096})[0]["slot"]
        assert got == slot_of[1] and len(h.ranks[("", 0)].slots["data"]) == 2
    finally:
        release.set()
        t.join(10)
    assert h.scrub_stats["slots"] == 2
    for lst in h.ranks[("", 0)].slots.values():
        for s in lst:
            s.seg.close()


def _mapped_slots(rank):
    with open("/proc/self/maps") as f:
        return sorted({int(line.split(".data.")[1].split()[0]) for line in f if f"shardsafe.job.n0.r{rank}.data." in line})


def test_a_free_slot_is_given_back_when_another_rank_needs_the_budget(holder, tmp_path):
    """The slot kept after a flush is a cache: another request that needs its bytes gets them, and the
    trainer that had it mapped unmaps it at its next acquire (so the memory really goes)."""
    c = holder(budget_gb=0.03)                   # three slots of 8 MiB, not four
    pipe = _flushing(c, str(tmp_path / "persist"), when=lambda v: v == 1)
    for v in (1, 2, 3):          # v3 lands in a third slot while v1 is flushed
        pipe.submit(v, ToyAdapter(v).capture())
        assert pipe.flush(timeout=30), pipe.history[-1].error
    wait_flushes(c, 1)
    assert _held(c) == ([2, 3], 3) and len(_mapped_slots(0)) == 3
    other = HolderClient(c.paths, timeout_s=10).connect()
    other.acquire(rank=1, version=1, nbytes=8_000_000)    # needs the free slot's bytes
    assert _held(c) == ([2, 3], 2)
    pipe.submit(4, ToyAdapter(4).capture())
    assert pipe.flush(timeout=30), pipe.history[-1].error
    pipe.close()
    assert _held(c) == ([3, 4], 2) and len(_mapped_slots(0)) == 2
    other.close()


def test_flush_survives_another_holders_prune_removing_the_empty_version_dir(tmp_path, monkeypatch):
    """Rank 1's holder prunes an old version (its files, then the directory once empty) in the instant
    between rank 0's makedirs of that version and rank 0's first file: rank 0's flush still lands."""
    import shardsafe.persist as persist
    store = PersistentStore(str(tmp_path / "persist"), "job")
    real, raced = persist._write_file, []

    def racing_write(path, data, mbps, **kw):
        if not raced:
            raced.append(path)
            os.rmdir(os.path.dirname(path))   # what the other holder's prune does to an empty dir
        return real(path, data, mbps)

    monkeypatch.setattr(persist, "_write_file", racing_write)
    payload = bytes(range(256)) * 17
    store.write(version=4, rank=0, payload=memoryview(payload), manifest={"version": 4, "rank": 0})
    assert raced and store.rank_versions(0) == [4]
    with open(store.paths(4, 0)[0], "rb") as f:
        assert f.read() == payload


def test_only_refused_versions_on_disk_is_an_error_not_a_fresh_start(holder, tmp_path):
    """Issue 15 item 5: memory empty (a new node), the persistent tier holds versions of this job and none
    verifies: RestoreError naming the directory and why; the files stay as they were."""
    c = holder()
    disk = str(tmp_path / "persist")
    snapshots(c, [1, 2], flush_dir=disk, keep=2)
    assert wait_flushes(c, 2)["done"] == 2
    store = PersistentStore(disk, "job")
    for v in (1, 2):
        with open(store.paths(v, 0)[0], "r+b") as f:
            f.seek(1_000)
            b = f.read(1)
            f.seek(1_000)
            f.write(bytes([b[0] ^ 1]))
    before = {p: os.path.getsize(p) for v in (1, 2) for p in store.paths(v, 0)}
    with pytest.raises(RestoreError) as e:
        restore_from_holder(ToyAdapter(5), holder("n1"), rank=0, coll=Collectives(), persist=store)
    msg = str(e.value)
    assert disk in msg and "none is complete and verified" in msg and "checksum" in msg.lower(), msg
    assert {p: os.path.getsize(p) for p in before} == before and store.rank_versions(0) == [1, 2]


def test_snapshots_of_another_world_size_are_named_as_such(holder):
    c = holder()
    pipe = SnapshotPipeline(c, rank=0, world_size=4, node="n0", agreement=LocalAgreement())
    pipe.submit(1, ToyAdapter(1).capture())
    assert pipe.flush(timeout=30)
    pipe.close()
    with pytest.raises(RestoreError, match=r"world size \[4\], and this job runs at world size 1"):
        restore_from_holder(ToyAdapter(2), c, rank=0, coll=Collectives())
    assert c.sealed_versions(0) == [1]                 # nothing deleted


def _flush_files(store, version, rank, world_size=2, nbytes=64, torn=False):
    """One rank's flush of ``version`` as a holder writes it; ``torn``: the holder died halfway."""
    if torn:   # in a child that dies without any cleanup, as a SIGKILLed holder does
        pid = os.fork()
        if pid == 0:
            try:
                store.write(version=version, rank=rank, payload=memoryview(bytes(nbytes)), manifest={},
                            on_progress=lambda fraction: os._exit(7) if fraction >= 0.5 else None)
            finally:
                os._exit(1)
        assert os.waitpid(pid, 0)[1] >> 8 == 7, "the progress hook was never told half the payload was written"
        return
    store.write(version=version, rank=rank, payload=memoryview(bytes(nbytes)),
                manifest={"world_size": world_size})


def test_a_torn_flush_is_never_a_version_and_prune_keeps_the_newest_common_one(tmp_path):
    """A holder killed halfway through a flush leaves a .tmp of half the payload and no manifest: the version
    is not complete for that rank. Its peer flushing on must not prune the newest version every rank has
    (ranks prune on their own), and the torn leftovers go once newer versions are kept."""
    store = PersistentStore(str(tmp_path / "disk"), "job")
    for v in (2, 4):
        for r in (0, 1):
            _flush_files(store, v, r)
    _flush_files(store, 6, 0)
    _flush_files(store, 6, 1, torn=True)               # rank 1's holder died mid-write of version 6
    tmp = store.paths(6, 1)[0] + ".tmp"
    assert os.path.getsize(tmp) == 32 and not os.path.exists(store.paths(6, 1)[1])
    assert store.rank_versions(1) == [2, 4] and store.complete_versions(2) == [2, 4]
    # rank 0 flushes 8 and 10 (rank 1's new holder has nothing older than its next snapshot)
    for v in (8, 10):
        _flush_files(store, v, 0)
        store.prune(0, keep=2, world_size=2)
    assert store.rank_versions(0) == [4, 6, 8, 10], "4 is the newest version both ranks have: it must stay"
    # without the world size (an old holder's rule) rank 0 would have deleted it
    probe = PersistentStore(str(tmp_path / "probe"), "job")
    for v in (4, 6, 8):
        _flush_files(probe, v, 0)
    probe.prune(0, keep=2)
    assert probe.rank_versions(0) == [6, 8]
    # rank 1 flushes 10: now 10 is common, its torn 6 and old versions go, and so do rank 0's
    _flush_files(store, 10, 1)
    store.prune(1, keep=2, world_size=2)
    assert store.rank_versions(1) == [4, 10] and not os.path.exists(tmp)
    store.prune(0, keep=2, world_size=2)
    assert store.rank_versions(0) == [8, 10] and store.complete_versions(2) == [10]
    assert store.versions() == [4, 8, 10]
