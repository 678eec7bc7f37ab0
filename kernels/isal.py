"""ISA-L erasure coding through ctypes: zero-copy, GIL released, the CPU production path.

The library is the one bundled in the pyeclib wheel (``pyeclib.libs/libisal-pyeclib.so.2``,
ISA-L 2.32; binary wheels 1.6.2 to 1.8.0 carry it, 1.6.0/1.6.1 are source-only) or the system ``libisal.so.2`` (Debian/Ubuntu ``libisal2``); ``SHARDSAFE_ISAL_LIB``
names a file explicitly. We call ISA-L directly instead of through pyeclib because pyeclib copies
every fragment twice, holds the GIL, only decodes ``bytes`` and crashes above 2 GiB (see
docs/parity.md); ctypes works on any C-contiguous uint8 buffer, including numpy views of mmap'ed
shared memory, and releases the GIL for the duration of each call.

Tables: ``ec_init_tables`` expands a coefficient matrix into 32 bytes per coefficient. They are
cached keyed by the coefficients, so the encode tables of a (k, m) and the decode tables of each
erasure pattern are built once per process.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import threading
from collections import OrderedDict
from typing import Iterator, Mapping, Sequence

import numpy as np

from shardsafe import env as shardsafe_env
from shardsafe.errors import BackendUnavailable, InvalidParameter

from . import reference

BACKEND = "isal"

_MAX_CALL = 1 << 30
"""Bytes per ec_encode_data call: its ``len`` is a C int, so stay well below 2 GiB."""

_lib: ctypes.CDLL | None = None
_lib_path: str | None = None
_load_error: str | None = None
_load_lock = threading.Lock()


def _candidates() -> Iterator[str]:
    """The libraries to try, in order, each looked up only when the ones before it did not load:
    ``ctypes.util.find_library`` runs ``ldconfig -p`` (and gcc where that finds nothing) as subprocesses, a
    cost in every trainer's start that is wasted when the wheel's copy is there."""
    env = shardsafe_env.get(shardsafe_env.ISAL_LIB) or None
    if env:
        yield env
    # find_spec locates the wheel without importing pyeclib (which would load liberasurecode).
    spec = importlib.util.find_spec("pyeclib")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            libs = os.path.join(os.path.dirname(loc), "pyeclib.libs")
            yield from sorted(glob.glob(os.path.join(libs, "libisal*.so*")))
    yield "libisal.so.2"
    found = ctypes.util.find_library("isal")
    if found:
        yield found


def _bind(lib: ctypes.CDLL) -> None:
    # argtypes everywhere: without them a 64-bit pointer passed as a Python int is truncated.
    u8p = ctypes.c_void_p
    lib.ec_init_tables.argtypes = [ctypes.c_int, ctypes.c_int, u8p, u8p]
    lib.ec_init_tables.restype = None
    lib.ec_encode_data.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, u8p, u8p, u8p]
    lib.ec_encode_data.restype = None
    lib.gf_gen_cauchy1_matrix.argtypes = [u8p, ctypes.c_int, ctypes.c_int]
    lib.gf_gen_cauchy1_matrix.restype = None
    lib.gf_invert_matrix.argtypes = [u8p, u8p, ctypes.c_int]
    lib.gf_invert_matrix.restype = ctypes.c_int
    lib.gf_mul.argtypes = [ctypes.c_ubyte, ctypes.c_ubyte]
    lib.gf_mul.restype = ctypes.c_ubyte


def load() -> ctypes.CDLL:
    """Load and bind ISA-L once.

    Raises:
        shardsafe.errors.BackendUnavailable: no candidate library loads or exports the EC API.
    """
    global _lib, _lib_path, _load_error
    if _lib is not None:
        return _lib
    with _load_lock:
        if _lib is None and _load_error is None:
            tried = []
            for path in _candidates():
                try:
                    lib = ctypes.CDLL(path)
                    _bind(lib)
                except (OSError, AttributeError) as e:
                    tried.append(f"{path}: {e}")
                    continue
                # 0x11D field: gf_mul(2, 128) = 0x100 ^ 0x11D = 0x1D = 29
                if lib.gf_mul(2, 128) != 29:
                    tried.append(f"{path}: unexpected field (gf_mul(2,128)={lib.gf_mul(2, 128)})")
                    continue
                _lib, _lib_path = lib, path
                break
            else:
                _load_error = "; ".join(tried) or "no candidate library"
    if _lib is None:
        raise BackendUnavailable(
            f"ISA-L is not loadable (tried: {_load_error}). {_pyeclib_note()}Install one of: the parity extra "
            f"(pip install 'shardsafe[parity]'), or pip install --only-binary pyeclib '{PYECLIB_REQUIREMENT}' (its binary wheels bundle "
            "pyeclib.libs/libisal-pyeclib.so.2); the system package libisal2 (Debian/Ubuntu: apt install libisal2; "
            "RHEL/Fedora: dnf install isa-l); or set SHARDSAFE_ISAL_LIB=/path/to/libisal.so.2.")
    return _lib


PYECLIB_REQUIREMENT = "pyeclib>=1.6.2,<1.9"
"""The pyeclib releases whose binary wheels (x86_64, aarch64) bundle libisal (setup.py's parity extra)."""


def _pyeclib_note() -> str:
    """Why the installed pyeclib did not provide ISA-L, if one is installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        v = version("pyeclib")
    except PackageNotFoundError:
        return "pyeclib is not installed. "
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    spec = importlib.util.find_spec("pyeclib")
    locs = (spec.submodule_search_locations or []) if spec is not None else []
    bundled = [p for loc in locs for p in glob.glob(os.path.join(os.path.dirname(loc), "pyeclib.libs", "libisal*.so*"))]
    if bundled:
        return f"pyeclib {v} bundles {bundled[0]}, which did not load (see above). "
    return (f"pyeclib {v} is installed but brings no libisal-pyeclib.so.2 (a source build, or a release outside "
            f"{PYECLIB_REQUIREMENT}). ")


def library_path() -> str | None:
    """Path of the loaded library (None before a successful :func:`load`)."""
    return _lib_path


def available() -> bool:
    try:
        load()
        return True
    except Exception:  # noqa: BLE001 - availability probe
        return False


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def gen_cauchy1_matrix(k: int, m: int) -> np.ndarray:
    """ISA-L's own generator matrix ((k+m) x k); tests pin it equal to the reference's."""
    lib = load()
    a = np.zeros((k + m, k), dtype=np.uint8)
    lib.gf_gen_cauchy1_matrix(_ptr(a), k + m, k)
    return a


def invert_matrix(a: np.ndarray) -> np.ndarray:
    """``gf_invert_matrix`` on a copy (ISA-L eliminates its input in place)."""
    lib = load()
    src = np.array(a, dtype=np.uint8, order="C")
    n = src.shape[0]
    if src.ndim != 2 or src.shape[1] != n:
        raise InvalidParameter(f"invert_matrix needs a square matrix, got shape {src.shape}")
    out = np.zeros((n, n), dtype=np.uint8)
    if lib.gf_invert_matrix(_ptr(src), _ptr(out), n) != 0:
        raise InvalidParameter("matrix is singular")
    return out


class _TableCache:
    """LRU of ec_init_tables outputs keyed by (k, rows, coefficient bytes)."""

    def __init__(self, maxsize: int = 1024) -> None:
        self._d: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._max = maxsize
        self._lock = threading.Lock()

    def get(self, coeffs: np.ndarray) -> np.ndarray:
        rows, k = coeffs.shape
        key = rows.to_bytes(2, "little") + k.to_bytes(2, "little") + coeffs.tobytes()
        with self._lock:
            t = self._d.get(key)
            if t is not None:
                self._d.move_to_end(key)
                return t
        c = np.ascontiguousarray(coeffs, dtype=np.uint8)
        t = np.empty(32 * k * rows, dtype=np.uint8)
        load().ec_init_tables(k, rows, _ptr(c), _ptr(t))
        t.setflags(write=False)
        with self._lock:
            self._d[key] = t
            if len(self._d) > self._max:
                self._d.popitem(last=False)
        return t


_tables = _TableCache()


def apply_matrix(coeffs: np.ndarray, sources: Sequence[np.ndarray], outs: Sequence[np.ndarray],
                 *, lo: int = 0, hi: int | None = None) -> None:
    """outs[r][lo:hi] = sum_i coeffs[r, i] * sources[i][lo:hi] via ``ec_encode_data``.

    Args:
        coeffs: uint8 (rows, k).
        sources: k C-contiguous 1-D uint8 arrays of equal length (read-only is fine).
        outs: rows writable C-contiguous 1-D uint8 arrays of that length.
        lo, hi: byte range to process (lets callers split one call over threads).
    """
    rows, k = coeffs.shape
    hi = sources[0].shape[0] if hi is None else hi
    if hi <= lo or rows == 0:
        return
    lib = load()
    tbl = _tables.get(coeffs)
    src_base = [_ptr(s) for s in sources]
    dst_base = [_ptr(o) for o in outs]
    src_arr = (ctypes.c_void_p * k)()
    dst_arr = (ctypes.c_void_p * rows)()
    tptr = _ptr(tbl)
    off = lo
    while off < hi:
        n = min(_MAX_CALL, hi - off)
        for i, p in enumerate(src_base):
            src_arr[i] = p + off
        for r, p in enumerate(dst_base):
            dst_arr[r] = p + off
        lib.ec_encode_data(n, k, rows, tptr, ctypes.addressof(src_arr), ctypes.addressof(dst_arr))
        off += n


# --- same-signature entry points (all kernel modules) --------------------------------------------

def encode(data: Sequence[np.ndarray], m: int, *, out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """k equal-length uint8 arrays -> m parity arrays (the guarded API: :meth:`shardsafe.parity.codec.Codec.encode`)."""
    return reference.encode_with(apply_matrix, data, m, out=out, generator=gen_cauchy1_matrix(len(data), m))


def reconstruct(available: Mapping[int, np.ndarray], missing: Sequence[int], *, k: int, m: int,
                out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """Rebuild fragments ``missing`` from ``available`` (guarded: :meth:`shardsafe.parity.codec.Codec.reconstruct`)."""
    return reference.reconstruct_with(apply_matrix, available, missing, k=k, m=m, out=out,
                                      generator=gen_cauchy1_matrix(k, m), invert=invert_matrix)
