"""xxh3-64 checksums of payload segments, computed by several threads at once, off the GIL.

Every snapshot is checksummed per ``CHUNK_BYTES`` segment (manifest.py) and every restore verifies every
segment before a byte is applied. python-xxhash holds the GIL while it hashes: measured here (xxhash 3.8.2,
a 1 GiB buffer), a Python thread spinning beside ``xxh3_64_intdigest`` made 7% of its free-running progress,
beside a numpy copy of the same bytes 97%. So threads cannot hash in parallel through its API, and a
hashing snapshot worker stalls the training thread's Python. Its extension module exports the C library's
``XXH3_64bits`` symbol; called through ``ctypes.CDLL`` (which releases the GIL for the length of a foreign
call) it gives the same digest with the GIL released. When the symbol cannot be found (another build of
the module), hashing falls back to python-xxhash on the calling thread, and says so once.

``Hasher(threads)`` hashes lists of segments on a small thread pool (``threads`` from the config's
``hash_threads``; 0 picks the node's usable cores divided by its local ranks, at most 8); ``submit`` lets the
snapshot copy hash the segments it has copied while it copies the next ones.

A restore reads a slot it has just mapped: its page tables are empty. ``populate=True`` has every hash
thread fill the page tables of its own segments (``madvise(MADV_POPULATE_READ)``, Linux 5.14+) before it
hashes them, so that the population, single-threaded in the kernel under ``MAP_POPULATE``, is split over the
threads like the hashing (measured here, 1 GiB of 4 KiB shmem pages: 20 ms to populate in one call, 45 ms
when the hash faults the pages in one by one as it reads). Where the advice is refused (older kernels)
the hash faults the pages in as it reads.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import xxhash

log = logging.getLogger("shardsafe.payload.checksum")

MAX_AUTO_THREADS = 8
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)   # Linux value; Python < 3.12 lacks the name
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_lib_lock = threading.Lock()
_xxh3: Any = None        # the ctypes function, False when unavailable, None before the first look
_warned = False


def _native() -> Any:
    """``XXH3_64bits(const void*, size_t) -> uint64`` from python-xxhash's extension, or False."""
    global _xxh3, _warned
    if _xxh3 is None:
        with _lib_lock:
            if _xxh3 is None:
                try:
                    from xxhash import _xxhash
                    fn = ctypes.CDLL(_xxhash.__file__).XXH3_64bits
                    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
                    probe = b"shardsafe xxh3 probe"
                    if fn(probe, len(probe)) != xxhash.xxh3_64_intdigest(probe):
                        raise OSError("XXH3_64bits of the extension disagrees with xxh3_64_intdigest")
                    _xxh3 = fn
                except (ImportError, OSError, AttributeError) as e:
                    _xxh3 = False
                    if not _warned:
                        _warned = True
                        log.warning("shardsafe: xxh3 checksums run under the GIL on one thread (python-xxhash "
                                    "%s exports no usable XXH3_64bits: %s); snapshots and restores verify "
                                    "slower", xxhash.VERSION, e)
    return _xxh3


_madvise: Any = None     # libc madvise through ctypes (the call releases the GIL), False when unusable


def _populate(addr: int, n: int) -> None:
    """Fill the page tables for ``[addr, addr + n)`` of a shared mapping (best effort: a refusal only means
    the hash takes the faults)."""
    global _madvise
    if _madvise is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _madvise = fn
        except (OSError, AttributeError):
            _madvise = False
    if not _madvise or n <= 0:
        return
    start = addr - addr % PAGE
    if _madvise(start, addr + n - start, MADV_POPULATE_READ) != 0:
        _madvise = False   # EINVAL before Linux 5.14: stop asking


def native_available() -> bool:
    """Whether checksums run off the GIL (the ctypes path)."""
    return bool(_native())


def _base_address(buf: Any) -> tuple[int, Any]:
    """(address of the first byte, an object that keeps the buffer exported) for any contiguous buffer,
    read-only ones included (a restore maps holder slots read-only)."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return int(arr.ctypes.data) if arr.size else 0, arr


def digest(buf: Any, start: int = 0, end: Optional[int] = None) -> str:
    """The xxh3-64 hex digest of ``buf[start:end]`` (the manifest's format)."""
    fn = _native()
    mv = memoryview(buf).cast("B")
    end = len(mv) if end is None else end
    if not fn:
        return format(xxhash.xxh3_64_intdigest(mv[start:end]), "016x")
    base, keep = _base_address(mv)
    try:
        return format(fn(base + start, end - start), "016x")
    finally:
        del keep
        mv.release()


def default_threads(local_ranks: Optional[int] = None) -> int:
    """The node's usable cores over its local ranks (LOCAL_WORLD_SIZE), at least 1, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        cores = os.cpu_count() or 1
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(MAX_AUTO_THREADS, cores // max(1, local_ranks)))


class Hasher:
    """Segment checksums on ``threads`` threads. ``hash_ranges(buf, ranges)`` returns the hex digests of
    ``buf[a:b]`` for every ``(a, b)`` in order; ``submit`` does the same in the background. With one thread
    (or without the native path) the caller's thread hashes and no pool is started."""

    def __init__(self, threads: int = 0):
        self.threads = default_threads() if threads <= 0 else int(threads)
        if not native_available():
            self.threads = 1   # under the GIL more threads only add switching
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pid != os.getpid():
                # Forked (the fork server's trainers, the tests' rank harness): the parent's pool threads do not
                # exist here, and work queued to them would wait forever. Start this process's own.
                self._pool, self._pid, self._lock = None, os.getpid(), threading.Lock()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="shardsafe-xxh3")
            return self._pool

    def hash_ranges(self, buf: Any, ranges: Sequence[tuple[int, int]], *, populate: bool = False) -> list[str]:
        ranges = list(ranges)
        if self.threads <= 1 or len(ranges) <= 1:
            return _hash_serial(buf, ranges, populate)
        return self.submit(buf, ranges, populate=populate).result()

    def submit(self, buf: Any, ranges: Iterable[tuple[int, int]], *,
               populate: bool = False) -> "Future[list[str]]":
        """The digests of ``ranges`` of ``buf``, computed on the pool (split into ``threads`` interleaved
        parts, so that neighbouring segments, which tend to be equally hot in the cache, go to different
        threads). ``buf`` must stay mapped until the future is done. ``populate``: a fresh mapping, each
        thread fills the page tables of its segments first."""
        ranges = list(ranges)
        out: Future = Future()
        if not ranges:
            out.set_result([])
            return out
        n = min(self.threads, len(ranges))
        if n <= 1:
            pool = self._executor()
            return pool.submit(_hash_serial, buf, ranges, populate)
        pool = self._executor()
        parts = [pool.submit(_hash_serial, buf, ranges[i::n], populate) for i in range(n)]

        def _join(_f: Future) -> None:
            if not all(p.done() for p in parts) or out.done():
                return
            try:
                res: list[str] = [""] * len(ranges)
                for i, p in enumerate(parts):
                    res[i::n] = p.result()
                out.set_result(res)
            except BaseException as e:  # noqa: BLE001 (handed to the waiter as is)
                if not out.done():
                    out.set_exception(e)

        for p in parts:
            p.add_done_callback(_join)
        return out

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)


def _hash_serial(buf: Any, ranges: Sequence[tuple[int, int]], populate: bool = False) -> list[str]:
    fn = _native()
    mv = memoryview(buf).cast("B")
    try:
        if not fn:
            return [format(xxhash.xxh3_64_intdigest(mv[a:b]), "016x") for a, b in ranges]
        base, keep = _base_address(mv)
        try:
            out = []
            for a, b in ranges:
                if populate:
                    _populate(base + a, b - a)
                out.append(format(fn(base + a, b - a), "016x"))
            return out
        finally:
            del keep
    finally:
        mv.release()


_shared: Optional[Hasher] = None
_shared_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _shared, _shared_lock, _lib_lock
    _shared, _shared_lock, _lib_lock = None, threading.Lock(), threading.Lock()   # a lock held at fork stays held


os.register_at_fork(after_in_child=_after_fork_in_child)


def shared(threads: int = 0) -> Hasher:
    """This process's hasher (one pool per process: the snapshot worker and the restore share it).
    ``threads`` > 0 (the config's ``hash_threads``) sizes it, and a later, different count resizes it;
    0 takes the hasher as it is (auto-sized when there is none yet), so a caller without a config (the
    verify of a restore) does not undo the runtime's choice."""
    global _shared
    with _shared_lock:
        if _shared is not None and threads <= 0:
            return _shared
        want = default_threads() if threads <= 0 else int(threads)
        if _shared is None or (_shared.threads != want and native_available()):
            old, _shared = _shared, Hasher(want)
            if old is not None:
                old.close()
        return _shared
