"""Rank state: what one training rank owns and needs to continue exactly.

An engine adapter (DeepSpeed, Megatron) turns its live objects into a :class:`RankState`:
named tensors that the snapshot pipeline copies byte-for-byte into the holder, plus a small
JSON-able ``meta`` dict (counters, scheduler state, optimizer hyper-parameters, RNG tuples).
Restore hands the same names back as CPU tensors viewing the verified payload, and the adapter
copies them *into its existing tensors* (never through a framework's load_state_dict).

No pickle: ``meta`` must survive ``json.dumps``; anything binary belongs in ``tensors``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np
import torch


@dataclass
class RankState:
    """Args:
        tensors: name -> tensor (any device, any dtype). Copied asynchronously, overlapping the next
            forward/backward, until ``wait_copied`` returns before the next optimizer step: a live
            tensor may be handed over only if nothing but the optimizer step mutates it. State the
            forward pass changes (module buffers such as running statistics, FP8 amax histories)
            must be cloned in ``capture``.
        meta: JSON-serialisable scalars/lists/dicts, captured synchronously (cheap).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class StateAdapter(Protocol):
    """What the runtime needs from an engine adapter."""

    def capture(self) -> RankState:
        """Return references to the live state tensors plus synchronous metadata (no copies)."""

    def apply(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Copy a verified snapshot (CPU tensors, same names/shapes/dtypes as ``capture``) into the live state."""


# --- RNG: every generator a training step can draw from -------------------------------------------

def capture_rng(prefix: str = "rng") -> RankState:
    """torch CPU (+ every CUDA device), python ``random`` and numpy legacy global RNG."""
    st = RankState()
    st.tensors[f"{prefix}/torch_cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            st.tensors[f"{prefix}/torch_cuda{i}"] = s
    ver, internal, gauss = random.getstate()
    st.tensors[f"{prefix}/python"] = torch.tensor(internal, dtype=torch.int64)
    st.meta[f"{prefix}/python"] = {"version": ver, "gauss": gauss}
    name, keys, pos, has_gauss, cached = np.random.get_state()
    st.tensors[f"{prefix}/numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64))
    st.meta[f"{prefix}/numpy"] = {"name": name, "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    return st


def apply_rng(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], prefix: str = "rng") -> None:
    torch.set_rng_state(tensors[f"{prefix}/torch_cpu"].clone())
    i = 0
    while f"{prefix}/torch_cuda{i}" in tensors:
        torch.cuda.set_rng_state(tensors[f"{prefix}/torch_cuda{i}"].clone(), i)
        i += 1
    pm = meta[f"{prefix}/python"]
    internal = tuple(int(x) for x in tensors[f"{prefix}/python"].tolist())
    random.setstate((pm["version"], internal, pm["gauss"]))
    nm = meta[f"{prefix}/numpy"]
    keys = tensors[f"{prefix}/numpy"].numpy().astype(np.uint32)
    np.random.set_state((nm["name"], keys, nm["pos"], nm["has_gauss"], nm["cached"]))


# --- casting a peer's fp32 shard the way its owner does -----------------------------------------------

CAST_CHUNK = 1 << 26   # elements per staged chunk (256 MiB of fp32) when source and destination differ in device


def cast_like_owner(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` with the dtype conversion done on ``dst``'s device, as the owner of ``src``
    did it (its fp32 master lives where ``dst`` lives). A CPU->GPU ``copy_`` with a dtype change may
    convert on the CPU, whose rounding is not guaranteed to be the GPU kernel's bit for bit; staging
    the fp32 bytes on the device first keeps the result identical to the owner's, in bounded chunks."""
    if dst.device == src.device:
        dst.copy_(src)
        return
    d, s = dst.view(-1), src.reshape(-1)
    for a in range(0, d.numel(), CAST_CHUNK):
        d[a:a + CAST_CHUNK].copy_(s[a:a + CAST_CHUNK].to(dst.device))
