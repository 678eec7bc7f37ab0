"""The snapshot copy with its checksums fused (``csrc/copy_hash.c``): lazy ctypes loader of ``libshardsafe_cpu.so``.

``copy_hash(dst, src, n, seg, api)`` copies ``n`` bytes and returns the xxh3-64 of every ``seg``-byte segment of the
copy, each 256 KiB piece hashed right after it landed, from the core's cache (the C file says why). The xxh3 library
is the caller's (``Xxh3Api``: its streaming functions, as ctypes addresses), so the digests are that library's own.

setup.py builds the library with the system C compiler (``cc``) beside this file for editable installs and into
the wheel otherwise (``SHARDSAFE_SKIP_CPU_BUILD=1`` skips); ``SHARDSAFE_CPU_LIB`` names another file. Without
it, callers keep the unfused path (copy, then hash the landed segments on the hash threads): ``available()``.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Optional

from shardsafe import env as shardsafe_env
from shardsafe.errors import BackendUnavailable, KernelError

LIB_NAME = "libshardsafe_cpu.so"
ABI_VERSION = 1   # must match SHARDSAFE_CPU_ABI_VERSION in csrc/copy_hash.c
PIECE_BYTES = 256 << 10
"""Bytes copied, then hashed, at a time: small enough to stay in a core's L2 between the copy and the hash (a
piece as large as the whole L2 is partly evicted before the hash reads it), large enough that the calls per piece
cost little."""


class Xxh3Api(ctypes.Structure):
    """The XXH3 streaming API of one library, as function addresses (``shardsafe_xxh3_api`` in the C file)."""
    _fields_ = [("create", ctypes.c_void_p), ("free", ctypes.c_void_p), ("reset", ctypes.c_void_p),
                ("update", ctypes.c_void_p), ("digest", ctypes.c_void_p)]


_lib: Optional[ctypes.CDLL] = None
_error: Optional[str] = None
_lock = threading.Lock()


def lib_candidates() -> list[Path]:
    env = shardsafe_env.get(shardsafe_env.CPU_LIB) or None
    return ([Path(env)] if env else []) + [Path(__file__).resolve().parent / LIB_NAME]


def load() -> ctypes.CDLL:
    """The helper library (loaded once per process).

    Raises:
        shardsafe.errors.BackendUnavailable: not built or stale; the message says how to build it.
    """
    global _lib, _error
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None and _error is None:
            _lib, _error = _open()
    if _lib is None:
        raise BackendUnavailable(_error)
    return _lib


def _open() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    path = next((p for p in lib_candidates() if p.is_file()), None)
    if path is None:
        return None, (f"{LIB_NAME} not found (looked at {[str(p) for p in lib_candidates()]}); build it with a C "
                      "compiler: `pip install -e .` in the repository (or `python setup.py --version` there), or set "
                      "SHARDSAFE_CPU_LIB=/path/to/libshardsafe_cpu.so")
    try:
        lib = ctypes.CDLL(str(path))
        lib.shardsafe_cpu_abi_version.argtypes, lib.shardsafe_cpu_abi_version.restype = [], ctypes.c_int
        lib.shardsafe_copy_hash.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                            ctypes.c_size_t, ctypes.POINTER(Xxh3Api),
                                            ctypes.POINTER(ctypes.c_uint64)]
        lib.shardsafe_copy_hash.restype = ctypes.c_int
    except (OSError, AttributeError) as e:
        return None, f"cannot load {path}: {e}; rebuild it (`pip install -e .` in the repository)"
    abi = lib.shardsafe_cpu_abi_version()
    if abi != ABI_VERSION:
        return None, f"{path} has ABI {abi}, this module expects {ABI_VERSION}; rebuild it (`pip install -e .`)"
    return lib, None


def available() -> bool:
    try:
        load()
        return True
    except BackendUnavailable:
        return False


def copy_hash(dst: int, src: int, n: int, seg: int, api: Xxh3Api, piece: int = PIECE_BYTES) -> list[int]:
    """Copy ``n`` bytes from address ``src`` to address ``dst`` and return the xxh3-64 of each ``seg``-byte
    segment of the copy (the last one shorter), as ints. The GIL is released for the whole call.

    Raises:
        BackendUnavailable: the library is not built.
        KernelError: the xxh3 library failed (no memory for its state, or an error code).
    """
    lib = load()
    count = -(-n // seg) if n > 0 else 0
    out = (ctypes.c_uint64 * max(count, 1))()
    rc = lib.shardsafe_copy_hash(dst, src, n, seg, piece, ctypes.byref(api), out)
    if rc != 0:
        raise KernelError(f"shardsafe_copy_hash of {n} bytes failed (code {rc}: "
                          + ("no memory for an xxh3 state" if rc == -1 else "the xxh3 library reported an error")
                          + "); the snapshot is skipped, training continues")
    return list(out[:count])
