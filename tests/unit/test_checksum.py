"""shardsafe/payload/checksum.py: xxh3 off the GIL gives python-xxhash's digests, for every split and buffer kind."""
import mmap

import numpy as np
import pytest
import xxhash

from shardsafe.payload import checksum
from shardsafe.payload import manifest as mf


def _ref(buf, a, b):
    return format(xxhash.xxh3_64_intdigest(memoryview(buf)[a:b]), "016x")


def test_the_native_path_is_found_in_the_installed_xxhash():
    # The wheel the venv installs exports XXH3_64bits; without it every checksum would run under the GIL.
    assert checksum.native_available(), xxhash.VERSION


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_hasher_matches_python_xxhash_over_odd_ranges(threads):
    rng = np.random.default_rng(7)
    buf = rng.integers(0, 256, size=(5 << 20) + 13, dtype=np.uint8).tobytes()
    ranges = [(0, 0), (0, 1), (1, 65), (3, (1 << 20) + 7), ((1 << 20) + 7, 5 << 20), ((5 << 20), (5 << 20) + 13)]
    ranges += [(a, a + 4099) for a in range(0, 4 << 20, 1 << 18)]
    h = checksum.Hasher(threads)
    try:
        assert h.hash_ranges(buf, ranges) == [_ref(buf, a, b) for a, b in ranges]
        assert h.submit(memoryview(buf), ranges).result() == [_ref(buf, a, b) for a, b in ranges]
        assert h.submit(buf, []).result() == []
    finally:
        h.close()
    assert checksum.digest(buf, 5, 9000) == _ref(buf, 5, 9000) == mf.hash_bytes(memoryview(buf)[5:9000])


def test_read_only_mapping_and_the_gil_fallback(monkeypatch):
    data = bytes(range(256)) * 4096
    m = mmap.mmap(-1, len(data))
    m.write(data)
    ro = memoryview(m).toreadonly()
    want = [_ref(data, a, a + 1000) for a in range(0, len(data) - 1000, 77777)]
    ranges = [(a, a + 1000) for a in range(0, len(data) - 1000, 77777)]
    assert checksum.Hasher(2).hash_ranges(ro, ranges) == want
    monkeypatch.setattr(checksum, "_xxh3", False)   # another xxhash build: one thread, python-xxhash
    h = checksum.Hasher(4)
    assert h.threads == 1 and h.hash_ranges(ro, ranges) == want
    ro.release()
    m.close()


def test_verify_names_every_bad_segment_hashed_in_parallel():
    import torch
    t = {"a": torch.arange(3 << 20, dtype=torch.float32), "b": torch.ones(7, dtype=torch.bfloat16)}
    entries, n = mf.layout(t)
    buf = bytearray(n)
    for e, x in zip(entries, t.values()):
        buf[e["offset"]:e["offset"] + e["nbytes"]] = x.numpy().tobytes() if x.dtype != torch.bfloat16 else \
            x.view(torch.int16).numpy().tobytes()
        e["xxh3"] = [mf.hash_bytes(memoryview(buf)[a:b]) for a, b in mf.chunk_ranges(e)]
    man = mf.build(version=1, rank=0, world_size=1, node="n", entries=entries, payload_nbytes=n, meta={})
    assert mf.verify(man, memoryview(buf)) == []
    buf[5] ^= 1
    buf[entries[0]["offset"] + (8 << 20) + 3] ^= 1   # the last segment of "a"
    buf[entries[1]["offset"]] ^= 1
    bad = mf.verify(man, memoryview(buf))
    assert bad == [f"a segment 0 (bytes 0-{4 << 20}) fails its xxh3 checksum",
                   f"a segment 2 (bytes {8 << 20}-{12 << 20}) fails its xxh3 checksum",
                   f"b segment 0 (bytes {entries[1]['offset']}-{entries[1]['offset'] + 14}) fails its xxh3 checksum"]
    # within: only the segments inside the ranges a split rebuild decoded (here "a"'s segments 1 and 2)
    assert mf.verify(man, memoryview(buf), within=[(4 << 20, 12 << 20)]) == [bad[1]]
    assert mf.verify(man, memoryview(buf), within=[(4 << 20, 8 << 20)]) == []


def test_default_threads_divides_the_cores_among_local_ranks(monkeypatch):
    monkeypatch.setattr(checksum.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert checksum.default_threads(8) == 8 and checksum.default_threads(16) == 4 and checksum.default_threads(1) == 8
    monkeypatch.setattr(checksum.os, "sched_getaffinity", lambda pid: {0, 1})
    assert checksum.default_threads(2) == 1 and checksum.default_threads(4) == 1


def test_a_forked_child_hashes_with_its_own_threads():
    """The fork server and the rank harness fork processes whose parent's hash pool is running: the child's
    pool threads do not exist, so queued work would wait forever unless the child starts its own pool."""
    import os
    import signal
    buf = bytes(range(256)) * 40000
    ranges = [(a, a + 5000) for a in range(0, len(buf) - 5000, 50000)]
    want = [_ref(buf, a, b) for a, b in ranges]
    before = checksum.Hasher(2)
    assert before.hash_ranges(buf, ranges) == want and checksum.shared(2).hash_ranges(buf, ranges) == want
    pid = os.fork()
    if pid == 0:   # the child: exit 0 only if both the inherited hasher and the shared one work
        signal.alarm(20)
        ok = before.hash_ranges(buf, ranges) == want and checksum.shared(2).hash_ranges(buf, ranges) == want
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    before.close()
    assert os.waitstatus_to_exitcode(status) == 0, status


def test_the_configured_thread_count_is_kept_by_callers_without_a_config(monkeypatch):
    """The runtime sizes the process's hasher from hash_threads; manifest.verify asks for it with no count
    and must get the same pool, not an auto-sized replacement."""
    monkeypatch.setattr(checksum, "_shared", None)
    configured = checksum.shared(3)
    assert checksum.shared() is configured and configured.threads == 3
    assert checksum.shared(2) is not configured and checksum.shared().threads == 2
    checksum.shared().close()


@pytest.mark.parametrize("threads", [1, 2])
def test_hash_threads_populate_a_fresh_read_only_mapping(threads, monkeypatch):
    # A restore maps the slot without MAP_POPULATE; each hash thread fills the page tables of its own
    # segments first. The digests must not change, also at unaligned starts and where the kernel refuses.
    import os
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, size=(6 << 20) + 4321, dtype=np.uint8).tobytes()
    fd = os.memfd_create("shardsafe-test")
    try:
        os.write(fd, data)
        ranges = [(0, 4 << 20), (4 << 20, (6 << 20) + 4321), (17, 5000), (4095, 4097)]
        want = [_ref(data, a, b) for a, b in ranges]
        for refuse in (False, True):
            if refuse:   # an old kernel: madvise fails, hashing faults the pages in itself
                monkeypatch.setattr(checksum, "MADV_POPULATE_READ", 12345)
                monkeypatch.setattr(checksum, "_madvise", None)
            m = mmap.mmap(fd, len(data), mmap.MAP_SHARED, mmap.PROT_READ)
            h = checksum.Hasher(threads)
            try:
                assert h.hash_ranges(m, ranges, populate=True) == want
            finally:
                h.close()
                m.close()
            if refuse:
                assert checksum._madvise is False   # asked once, then no more
    finally:
        os.close(fd)


# ---- the snapshot copy with its checksums fused (kernels/copy_hash.py, csrc/copy_hash.c) ----------------------

def test_the_fused_copy_is_built_by_the_install_and_uses_a_verified_xxh3():
    # `make venv` builds kernels/libshardsafe_cpu.so with the C compiler; without it every CPU snapshot would
    # read its bytes from DRAM twice (copy, then hash).
    assert checksum.fused_available(), checksum.implementation()
    assert "copy+hash fused: yes" in checksum.implementation()


@pytest.mark.parametrize("n", [0, 1, 4095, 256 << 10, (256 << 10) + 1, 4 << 20, (4 << 20) + 1, (9 << 20) + 13])
def test_copy_and_hash_copies_every_byte_and_gives_python_xxhash_digests_per_segment(n):
    import torch
    seg = 4 << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    dst = torch.zeros(n + 64, dtype=torch.uint8)   # a guard after the end: nothing written past n
    got = checksum.copy_and_hash(dst.data_ptr(), src.data_ptr(), n, seg)
    raw = src.numpy().tobytes()
    assert got == [_ref(raw, a, min(a + seg, n)) for a in range(0, n, seg)]
    assert torch.equal(dst[:n], src) and not dst[n:].any()


def test_copy_and_hash_with_python_xxhash_s_own_library(monkeypatch):
    # Where the system has no libxxhash (SHARDSAFE_XXH3_LIB=none here), python-xxhash's extension serves the
    # streaming API to the fused copy as well: same digests.
    import torch
    monkeypatch.setenv("SHARDSAFE_XXH3_LIB", "none")
    monkeypatch.setattr(checksum, "_xxh3", None)
    assert checksum.implementation().startswith(f"python-xxhash {xxhash.VERSION}")
    assert checksum.fused_available()
    src = torch.randint(0, 256, ((5 << 20) + 3,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    raw = src.numpy().tobytes()
    assert checksum.copy_and_hash(dst.data_ptr(), src.data_ptr(), src.numel(), 1 << 20) == \
        [_ref(raw, a, min(a + (1 << 20), len(raw))) for a in range(0, len(raw), 1 << 20)]
    assert torch.equal(src, dst)


def test_a_library_whose_digests_disagree_is_not_used(monkeypatch, tmp_path):
    # A file that is no xxhash library at all, then the probe's own check: the next candidate is taken.
    monkeypatch.setenv("SHARDSAFE_XXH3_LIB", str(tmp_path / "missing.so"))
    monkeypatch.setattr(checksum, "_xxh3", None)
    assert checksum.implementation().startswith("python-xxhash")
    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", lambda b: 0)   # every library now "disagrees"
    monkeypatch.setattr(checksum, "_xxh3", None)
    monkeypatch.setattr(checksum, "_warned", False)
    assert checksum._native() is False and not checksum.fused_available()


def test_the_kernel_s_missing_library_says_how_to_build_it(monkeypatch, tmp_path):
    from shardsafe.errors import BackendUnavailable
    from shardsafe.kernels import copy_hash
    monkeypatch.setenv("SHARDSAFE_CPU_LIB", str(tmp_path / "nope.so"))
    monkeypatch.setattr(copy_hash, "_lib", None)
    monkeypatch.setattr(copy_hash, "_error", None)
    monkeypatch.setattr(copy_hash, "lib_candidates", lambda: [tmp_path / "nope.so"])
    monkeypatch.setattr(checksum, "_fused_checked", None)   # the first look of a process
    with pytest.raises(BackendUnavailable, match="pip install -e"):
        copy_hash.load()
    assert not checksum.fused_available()
    assert "copy+hash fused: no (libshardsafe_cpu.so not found" in checksum.implementation()


def test_a_fused_copy_that_disagrees_on_the_probe_is_not_used(monkeypatch):
    # The streaming API is checked once per library on a probe (odd segments, a short tail) before any snapshot
    # uses it: a build whose update/digest disagree would seal snapshots that no restore could verify.
    from shardsafe.kernels import copy_hash
    real = copy_hash.copy_hash
    monkeypatch.setattr(copy_hash, "copy_hash", lambda *a, **k: [d ^ 1 for d in real(*a, **k)])
    monkeypatch.setattr(checksum, "_fused_checked", None)
    assert not checksum.fused_available()
    assert "disagree with python-xxhash on a probe" in checksum.implementation()
    monkeypatch.setattr(copy_hash, "copy_hash", real)
    monkeypatch.setattr(checksum, "_fused_checked", None)
    assert checksum.fused_available()
