"""Shared-memory segments owned by the holder: memfds, mode 0600, pre-faulted once and reused.

memfd instead of /dev/shm names: nothing to leak when a holder dies (the kernel frees the pages when the last fd or
mapping goes), nothing another job can open by name, and the fd travels to trainers over the holder socket
(SCM_RIGHTS). Pages are allocated up front with fallocate so a trainer's copy never pays first-touch zero-fill (a
page fault and a zeroed page per 4 KiB: several times the cost of a warm copy).

Huge pages where the node allows them. Whether tmpfs memory (memfds included) comes in 2 MiB pages is the kernel's
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` (an administrator's setting; most distros ship ``never``). On
4 KiB pages a restore's mapping of 1 GiB is 262,144 page-table entries to fill, and xxh3 over it runs TLB-bound; on
2 MiB pages it is 512 entries, the hash is no longer held back by TLB misses, and the copy out is unchanged
(bench/RESULTS.md, the restore on 2 MiB pages). With ``within_size``/``always``/``force`` fallocate already
allocates huge pages; with ``advise`` only faults through a mapping marked ``MADV_HUGEPAGE`` do, so the holder marks
its mapping and allocates through it (``MADV_POPULATE_WRITE``, which fails with an errno where a touch would SIGBUS
the holder on a full node), then fallocates the rest as in the other modes. A trainer mapping the memfd later gets
the huge pages mapped whole (PMD) without marking its own.
"""
from __future__ import annotations

import ctypes
import mmap
import os

ALIGN = 2 << 20  # round segment sizes to 2 MiB: fewer reallocations when the payload grows a little
SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)   # Linux 5.14+; Python < 3.12 lacks the name


def shmem_huge_setting() -> str:
    """The kernel's transparent-huge-page policy for shared memory (the bracketed word of
    ``shmem_enabled``: always, within_size, advise, never, deny, force), "" where there is none."""
    try:
        with open(SHMEM_ENABLED) as f:
            words = f.read().split()
    except OSError:
        return ""
    return next((w[1:-1] for w in words if w.startswith("[")), "")


def huge_pages_possible() -> bool:
    """Whether holder segments may be backed by 2 MiB pages on this node (the kernel still decides per page:
    a fragmented node hands out 4 KiB pages where it cannot find 2 MiB)."""
    return shmem_huge_setting() in ("always", "within_size", "advise", "force")


_libc_madvise = None


def _madvise(m: mmap.mmap, advice: int) -> bool:
    """madvise over a whole mapping through libc (releases the GIL; mmap.madvise holds it). False on error."""
    global _libc_madvise
    if _libc_madvise is None:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
        _libc_madvise = fn
    buf = (ctypes.c_char * len(m)).from_buffer(m)
    try:
        return _libc_madvise(ctypes.addressof(buf), len(m), advice) == 0
    finally:
        del buf   # the exported buffer must go before the mapping can close


def round_size(nbytes: int) -> int:
    return max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)


class Segment:
    """One memfd of ``size`` bytes with the holder's own read/write mapping."""

    def __init__(self, name: str, size: int):
        self.name = name
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self.map: mmap.mmap | None = None
        try:
            os.fchmod(self.fd, 0o600)
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if shmem_huge_setting() == "advise" and hasattr(mmap, "MADV_HUGEPAGE"):
                # Allocate through the marked mapping (see the module docstring); whatever this could not
                # allocate (an old kernel, no memory) is left to the fallocate below, which says why.
                if _madvise(self.map, mmap.MADV_HUGEPAGE):
                    _madvise(self.map, MADV_POPULATE_WRITE)
            # Reserve the pages now (tmpfs honours fallocate): an over-committed node fails here,
            # at allocation, with ENOSPC/ENOMEM, not later inside a trainer's copy with SIGBUS.
            os.posix_fallocate(self.fd, 0, size)
        except BaseException:
            if self.map is not None:
                self.map.close()
            os.close(self.fd)
            raise

    def readonly_fd(self) -> int:
        """A new O_RDONLY fd on the same memory, for readers that must not write."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:
            pass  # a view is still exported; the fd close below still releases our reference
        os.close(self.fd)
