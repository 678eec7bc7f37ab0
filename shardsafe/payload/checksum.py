"""xxh3-64 checksums of payload segments, computed off the GIL: beside the copy, fused with it, or on threads.

Every snapshot is checksummed per ``CHUNK_BYTES`` segment (manifest.py) and every restore verifies every segment
before a byte is applied. python-xxhash holds the GIL while it hashes: a Python thread beside ``xxh3_64_intdigest``
on a large buffer all but stops, where beside a numpy copy of the same bytes (which releases the GIL) it runs at
nearly full speed. So the C functions are called through ``ctypes.CDLL``, which releases the GIL for the length of a
foreign call, from the first library that gives python-xxhash's digests:

1. the system's libxxhash (Debian/Ubuntu ``libxxhash0``, RHEL ``xxhash-libs``; ``SHARDSAFE_XXH3_LIB`` names
   another file, ``none`` skips it), through its ``*_dispatch`` entry points where it has them: they pick
   AVX2 / AVX-512 at run time: wider vectors than python-xxhash's build (SSE2, the x86-64 baseline its wheels
   are compiled for), which tells on data in the cache; from DRAM both are memory-bound;
2. python-xxhash's own extension module, which exports the same C symbols;
3. python-xxhash's API on the calling thread, under the GIL (said once in the log).

A CPU snapshot copies and hashes in one pass where it can (``copy_and_hash``: kernels/copy_hash.py, each
256 KiB piece hashed from the cache right after it landed, on the copying thread); otherwise ``Hasher(threads)``
hashes lists of landed segments on a small thread pool (``threads`` from the config's ``hash_threads``; 0 picks
the node's usable cores divided by its local ranks, at most 8) while the copy goes on, as it does for the GPU's
D2H copies and for every restore's verification.

A restore reads a slot it has just mapped: its page tables are empty. ``populate=True`` has every hash thread fill
the page tables of its own segments (``madvise(MADV_POPULATE_READ)``, Linux 5.14+) before it hashes them, so that
the population, single-threaded in the kernel under ``MAP_POPULATE``, is split over the threads like the hashing
(filling the tables in one call is cheaper than a page fault per 4 KiB page, which is what the hash pays when it
faults the pages in one by one as it reads). Where the advice is refused (older kernels) the hash faults the pages
in as it reads.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import xxhash

from .. import env as shardsafe_env
from ..errors import BackendUnavailable, KernelError
from ..kernels import copy_hash as _fused

log = logging.getLogger(__name__)

MAX_AUTO_THREADS = 8
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)   # Linux value; Python < 3.12 lacks the name
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_lib_lock = threading.Lock()
_PROBE = bytes(range(256)) * 4100 + b"shardsafe xxh3 probe"   # > 1 MiB: covers xxh3's short, mid and long paths
_PROBE_SIZES = (0, 1, 3, 4, 9, 16, 17, 128, 129, 240, 241, 1024, 1031, 65536 + 7, len(_PROBE))


@dataclass(frozen=True)
class Xxh3Lib:
    """One library's XXH3 entry points (ctypes), checked against python-xxhash's digests."""
    name: str
    oneshot: Any                                 # XXH3_64bits[_dispatch](const void*, size_t) -> uint64
    api: Optional[_fused.Xxh3Api] = None        # the streaming API, for the fused copy (None: not exported)
    handle: Any = None                           # keeps the CDLL alive


_xxh3: Any = None        # the chosen Xxh3Lib, False when none is usable (the GIL path), None before the first look
_warned = False


def _bind_lib(path: str, label: str) -> Xxh3Lib:
    """A library's XXH3 functions, the runtime-dispatched ones where it exports them.

    Raises:
        OSError, AttributeError: not loadable, or a function missing or disagreeing with python-xxhash.
    """
    lib = ctypes.CDLL(path)
    dispatch = hasattr(lib, "XXH3_64bits_dispatch") and hasattr(lib, "XXH3_64bits_update_dispatch")
    one = lib.XXH3_64bits_dispatch if dispatch else lib.XXH3_64bits
    one.restype, one.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
    for n in _PROBE_SIZES:
        if one(_PROBE, n) != xxhash.xxh3_64_intdigest(_PROBE[:n]):
            raise OSError(f"{path}: XXH3_64bits disagrees with python-xxhash's xxh3_64 ({n} bytes)")
    api = None
    if all(hasattr(lib, f) for f in ("XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset",
                                     "XXH3_64bits_update", "XXH3_64bits_digest")):
        upd = lib.XXH3_64bits_update_dispatch if dispatch else lib.XXH3_64bits_update
        addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value   # noqa: E731
        api = _fused.Xxh3Api(addr(lib.XXH3_createState), addr(lib.XXH3_freeState), addr(lib.XXH3_64bits_reset),
                             addr(upd), addr(lib.XXH3_64bits_digest))
    return Xxh3Lib(f"{label}{' (runtime dispatch)' if dispatch else ''}", one, api, lib)


def _candidates() -> list[tuple[str, str]]:
    """(path, label) of the libraries to try, best first."""
    out = []
    env = shardsafe_env.get(shardsafe_env.XXH3_LIB).strip()
    if env.lower() != "none":
        path = env or ctypes.util.find_library("xxhash") or "libxxhash.so.0"
        out.append((path, f"libxxhash ({path})"))
    from xxhash import _xxhash
    out.append((_xxhash.__file__, f"python-xxhash {xxhash.VERSION}"))
    return out


def _native() -> Any:
    """The first usable Xxh3Lib, or False (hashing then holds the GIL on one thread)."""
    global _xxh3, _warned
    if _xxh3 is None:
        with _lib_lock:
            if _xxh3 is None:
                why = []
                for path, label in _candidates():
                    try:
                        _xxh3 = _bind_lib(path, label)
                        break
                    except (ImportError, OSError, AttributeError) as e:
                        why.append(f"{label}: {e}")
                else:
                    _xxh3 = False
                    if not _warned:
                        _warned = True
                        log.warning("shardsafe: xxh3 checksums run under the GIL on one thread (no library exports "
                                    "a usable XXH3_64bits: %s); snapshots and restores verify slower", "; ".join(why))
    return _xxh3


def implementation() -> str:
    """Which xxh3 this process uses and whether the snapshot copy is fused with it (for logs and benches)."""
    lib = _native()
    if not lib:
        return f"python-xxhash {xxhash.VERSION} under the GIL"
    return f"{lib.name}; copy+hash fused: " + ("yes" if fused_available() else f"no ({_fused_unavailable_reason()})")


_fused_checked: Any = None   # (Xxh3Lib, problem or "") of the last probe of the fused path


def fused_available() -> bool:
    """Whether ``copy_and_hash`` runs: the helper library is built, the xxh3 library exports its streaming API,
    and the fused copy of a probe gave python-xxhash's digests (checked once per library)."""
    return not _fused_unavailable_reason()


def _fused_unavailable_reason() -> str:
    global _fused_checked
    lib = _native()
    if not lib or lib.api is None:
        return "the xxh3 library exports no streaming API"
    if _fused_checked is not None and _fused_checked[0] is lib:
        return _fused_checked[1]
    why = ""
    try:
        src = np.frombuffer(_PROBE, dtype=np.uint8)
        dst = np.zeros_like(src)
        seg = 65536 + 3   # odd segments: pieces, a segment boundary inside a piece, a short tail
        got = _fused.copy_hash(int(dst.ctypes.data), int(src.ctypes.data), src.size, seg, lib.api)
        if got != [xxhash.xxh3_64_intdigest(_PROBE[a:a + seg]) for a in range(0, len(_PROBE), seg)] or \
                dst.tobytes() != _PROBE:
            why = f"{lib.name}: the fused copy's digests or bytes disagree with python-xxhash on a probe"
            log.warning("shardsafe: %s; snapshots copy, then hash", why)
    except BackendUnavailable as e:
        why = str(e)
    except KernelError as e:
        why = f"{lib.name}: {e}"
    _fused_checked = (lib, why)
    return why


def copy_and_hash(dst: int, src: int, n: int, seg: int) -> list[str]:
    """Copy ``n`` bytes from address ``src`` to address ``dst``; the hex xxh3 of every ``seg``-byte segment of
    the copy (the manifest's format), hashed piece by piece from the cache. Only where ``fused_available()``.

    Raises:
        shardsafe.errors.KernelError: the xxh3 library failed (the caller skips the snapshot).
    """
    return [format(d, "016x") for d in _fused.copy_hash(dst, src, n, seg, _native().api)]


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
        return format(fn.oneshot(base + start, end - start), "016x")
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
                out.append(format(fn.oneshot(base + a, b - a), "016x"))
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
