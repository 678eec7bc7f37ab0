"""CUDA erasure coding on torch CUDA tensors: lazy ctypes loader of ``libshardsafe_ec.so``.

The library is built from ``kernels/csrc/*.cu`` by setup.py when nvcc is present (or by
``scripts/gpu_check.sh``); ``SHARDSAFE_EC_LIB`` names another file. Nothing here is imported by the
package at import time, and torch is only imported when the backend is used, so CPU-only installs
never touch CUDA.

Calls take ``tensor.data_ptr()`` device pointers and enqueue on
``torch.cuda.current_stream(device)``: order them with other work through torch's stream
semantics (``torch.cuda.stream(s)``, events), exactly like a torch op. Nothing synchronizes.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from shardsafe import env as shardsafe_env
from shardsafe.errors import BackendUnavailable, KernelError

from . import reference

BACKEND = "cuda"
LIB_NAME = "libshardsafe_ec.so"
ABI_VERSION = 1  # must match SS_EC_ABI_VERSION in csrc/ec_kernels.cu

_lib: ctypes.CDLL | None = None
_lib_path: str | None = None
_lock = threading.Lock()


def _unavailable(msg: str) -> Exception:
    return BackendUnavailable(msg)


def lib_candidates() -> list[Path]:
    env = shardsafe_env.get(shardsafe_env.EC_LIB) or None
    return ([Path(env)] if env else []) + [Path(__file__).resolve().parent / LIB_NAME]


def _bind(lib: ctypes.CDLL) -> None:
    vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.shardsafe_ec_abi_version.argtypes, lib.shardsafe_ec_abi_version.restype = [], i
    lib.shardsafe_ec_device_count.argtypes, lib.shardsafe_ec_device_count.restype = [], i
    lib.shardsafe_ec_error_string.argtypes, lib.shardsafe_ec_error_string.restype = [i], ctypes.c_char_p
    lib.shardsafe_ec_encode.argtypes = [vp, i, vp, i, vp, sz, i, vp]
    lib.shardsafe_ec_encode.restype = i
    lib.shardsafe_ec_encode_cauchy.argtypes = [vp, i, vp, i, sz, vp]
    lib.shardsafe_ec_encode_cauchy.restype = i
    lib.shardsafe_ec_reconstruct.argtypes = [vp, vp, i, i, vp, vp, i, sz, vp]
    lib.shardsafe_ec_reconstruct.restype = i


def load() -> ctypes.CDLL:
    """Load the kernel library and check that a GPU is usable.

    Raises:
        shardsafe.errors.BackendUnavailable: torch has no CUDA, no device, or the library is
            missing/stale; the message says which and how to fix it.
    """
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        try:
            import torch
        except ImportError as e:
            raise _unavailable(f"the cuda parity backend needs torch ({e}); install a CUDA build of torch") from None
        if not torch.cuda.is_available():
            raise _unavailable(
                f"the cuda parity backend needs a GPU, but torch {torch.__version__} sees none "
                f"(torch.version.cuda={torch.version.cuda}); use backend='isal' on CPU buffers")
        path = next((p for p in lib_candidates() if p.is_file()), None)
        if path is None:
            raise _unavailable(
                f"{LIB_NAME} not found (looked at {[str(p) for p in lib_candidates()]}). Build it with nvcc: "
                "`python setup.py build_kernels` (or pip install -e .) in the repo, "
                "or set SHARDSAFE_EC_LIB=/path/to/libshardsafe_ec.so")
        try:
            lib = ctypes.CDLL(str(path))
            _bind(lib)
        except (OSError, AttributeError) as e:
            raise _unavailable(f"cannot load {path}: {e}; rebuild it with the nvcc matching this driver") from None
        abi = lib.shardsafe_ec_abi_version()
        if abi != ABI_VERSION:
            raise _unavailable(f"{path} has ABI {abi}, this module expects {ABI_VERSION}; rebuild the kernels")
        n = lib.shardsafe_ec_device_count()
        if n <= 0:
            why = lib.shardsafe_ec_error_string(-n).decode() if n < 0 else "no device"
            raise _unavailable(
                f"{path} cannot use a GPU ({why}, code {n}). A CUDA runtime newer than the driver gives "
                "'driver version is insufficient': rebuild with the toolkit matching the driver/torch CUDA")
        _lib, _lib_path = lib, str(path)
        return lib


def available() -> bool:
    try:
        load()
        return True
    except Exception:  # noqa: BLE001 - availability probe
        return False


def _ptrs(tensors: Sequence[Any]) -> ctypes.Array:
    arr = (ctypes.c_void_p * len(tensors))()
    for j, t in enumerate(tensors):
        arr[j] = t.data_ptr()
    return arr


def _check(err: int, what: str) -> None:
    if err != 0:
        raise KernelError(f"{what} failed: CUDA error {err} ({_lib.shardsafe_ec_error_string(err).decode()})")


def apply_matrix(coeffs: np.ndarray, sources: Sequence[Any], outs: Sequence[Any], *, accumulate: bool = False) -> None:
    """outs[r] (=|^=) sum_i coeffs[r, i] * sources[i], enqueued on the current stream of their device.

    Args:
        coeffs: uint8 (rows, k) host matrix.
        sources: k contiguous uint8 CUDA tensors of equal length (one device).
        outs: rows contiguous uint8 CUDA tensors of that length, not overlapping the sources.
        accumulate: xor into ``outs`` instead of overwriting (incremental parity).
    """
    import torch
    lib = load()
    c = np.ascontiguousarray(coeffs, dtype=np.uint8)
    rows, k = c.shape
    n = sources[0].numel()
    dev = sources[0].device
    src, dst = _ptrs(sources), _ptrs(outs)  # keep the pointer arrays alive across the call
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev).cuda_stream
        err = lib.shardsafe_ec_encode(ctypes.addressof(src), k, ctypes.addressof(dst), rows,
                                      c.ctypes.data, n, int(accumulate), stream)
    _check(err, "shardsafe_ec_encode")


# --- same-signature entry points (all kernel modules) --------------------------------------------

def _torch_ops():
    import torch
    return reference.ArrayOps(flat=lambda t: t.view(-1),
                              empty=lambda like, n: torch.empty(n, dtype=torch.uint8, device=like.device))


def encode(data: Sequence[Any], m: int, *, out: Sequence[Any] | None = None) -> list[Any]:
    """k equal-length uint8 CUDA tensors -> m parity tensors (guarded: :meth:`shardsafe.parity.codec.Codec.encode`)."""
    return reference.encode_with(apply_matrix, data, m, out=out, ops=_torch_ops())


def reconstruct(available: Mapping[int, Any], missing: Sequence[int], *, k: int, m: int,
                out: Sequence[Any] | None = None) -> list[Any]:
    """Rebuild fragments ``missing`` from ``available`` (guarded: :meth:`shardsafe.parity.codec.Codec.reconstruct`)."""
    return reference.reconstruct_with(apply_matrix, available, missing, k=k, m=m, out=out, ops=_torch_ops())
