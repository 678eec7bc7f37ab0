"""Holder segments on 2 MiB pages where the node's shmem huge-page policy allows it (holder/segments.py).

The policy is the kernel's (``shmem_enabled``), not something a test may change: the same test runs under
whichever policy the machine has and checks the outcome the policy implies, from the page tables of a
read-only mapping like the one a restore makes (``/proc/self/smaps``: ShmemPmdMapped).
"""
import mmap
import os

import numpy as np
import pytest

from shardsafe.holder import segments
from shardsafe.holder.segments import Segment, huge_pages_possible, shmem_huge_setting


@pytest.mark.parametrize("text, want", [
    ("always within_size advise [never] deny force\n", "never"),
    ("always within_size [advise] never deny force\n", "advise"),
    ("[always] within_size advise never deny force", "always"),
    ("", ""),
])
def test_the_bracketed_policy_is_read(tmp_path, monkeypatch, text, want):
    f = tmp_path / "shmem_enabled"
    f.write_text(text)
    monkeypatch.setattr(segments, "SHMEM_ENABLED", str(f))
    assert shmem_huge_setting() == want


def test_no_policy_file_means_no_huge_pages(tmp_path, monkeypatch):
    monkeypatch.setattr(segments, "SHMEM_ENABLED", str(tmp_path / "absent"))
    assert shmem_huge_setting() == "" and not huge_pages_possible()


def _pmd_mapped_kib(addr: int) -> int:
    """ShmemPmdMapped of the mapping that starts at ``addr`` in this process."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{addr:x}":
            for field in lines[i + 1:]:
                if "-" in field.split()[0]:
                    break   # the next mapping
                if field.startswith("ShmemPmdMapped:"):
                    return int(field.split()[1])
            return 0
    raise AssertionError(f"no mapping at {addr:#x} in /proc/self/smaps")


def test_a_readers_mapping_gets_the_page_size_the_policy_implies():
    size = 8 << 20
    seg = Segment("shardsafe.test.hugepages", size)
    try:
        pattern = np.arange(size, dtype=np.uint8)
        np.frombuffer(seg.map, dtype=np.uint8)[:] = pattern
        fd = seg.readonly_fd()
        ro = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        os.close(fd)
        try:
            view = np.frombuffer(ro, dtype=np.uint8)
            assert np.array_equal(view, pattern)   # every page faulted in, the bytes are the holder's
            addr = view.ctypes.data
            del view
            pmd = _pmd_mapped_kib(addr)
        finally:
            ro.close()
    finally:
        seg.close()
    policy = shmem_huge_setting()
    print(f"shmem_enabled={policy!r}: {pmd} KiB of the reader's 8 MiB mapped in 2 MiB pages")
    if huge_pages_possible():
        # The kernel may still fall back to 4 KiB pages where it finds no free 2 MiB; never for all four.
        assert pmd > 0, f"shmem_enabled={policy!r} allows huge pages but the segment got none"
    else:
        assert pmd == 0, f"shmem_enabled={policy!r} but {pmd} KiB are PMD-mapped"


def test_the_mapping_is_released_when_allocation_fails(monkeypatch):
    """A failing fallocate (a full node) closes the mapping and the memfd: nothing is left behind."""
    def refuse(fd, offset, length):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(segments.os, "posix_fallocate", refuse)
    name = f"shardsafe.test.full.{os.getpid()}"
    with pytest.raises(OSError, match="No space"):
        Segment(name, 4 << 20)
    # Only this segment's memfd and mapping are looked for: other fds of the process (pytest-xdist's channel,
    # threads of earlier tests) come and go meanwhile.
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    assert not [ln for ln in links if name in ln], links
    with open("/proc/self/maps") as f:
        assert name not in f.read()
