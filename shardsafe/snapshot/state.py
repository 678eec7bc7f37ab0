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
from abc import ABC, abstractmethod
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Protocol, Sequence

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


class Peers(Protocol):
    """Other ranks' verified payloads of the version being restored, as :meth:`StateAdapter.apply` sees them
    (the restore's ``PeerPayloads`` over the node's holder implements it)."""

    def available(self, ranks: Sequence[int], *, usable: bool = True) -> bool:
        """Collective (every rank calls it, at most once per apply): True on every rank iff every rank's holder
        has the verified payloads of all its ``ranks`` and every rank found this path ``usable``."""

    def tensors(self, rank: int) -> Mapping[str, torch.Tensor]:
        """Views of ``rank``'s payload (valid until apply returns)."""

    def meta(self, rank: int) -> Mapping[str, Any]:
        """``rank``'s snapshot metadata."""


class StateAdapter(ABC):
    """The contract between one framework adapter and the snapshot/restore layer.

    Subclasses implement :meth:`capture` and :meth:`apply`; the other members have the defaults below, and
    an adapter overrides only what its framework needs. The runtime, the snapshot pipeline and the restore
    use exactly these members, nothing else of an adapter.
    """

    uses_peer_payloads: ClassVar[bool] = False
    """True when :meth:`apply` reads other ranks' payloads of the same version from the node's holder (the
    ZeRO-1/2 and distributed-optimizer low-precision params, which would otherwise be all-gathered): the
    restore then passes ``peers`` and verifies first that every rank restores the same payloads."""

    optional_prefixes: tuple[str, ...] = ()
    """Tensor-name prefixes that may exist in a snapshot but not (yet) in the live state: state a fresh
    engine creates lazily at its first step (optimizer moments). A class attribute or a property."""

    restore_notes: Mapping[str, Any] = MappingProxyType({})
    """Set by :meth:`apply`: how the state was put back (e.g. ``{"lp_params": "all-gather"}``); copied into
    the restore's result and its log line. Adapters assign their own dict."""

    @abstractmethod
    def capture(self) -> RankState:
        """Return references to the live state tensors plus synchronous metadata (no copies)."""

    @abstractmethod
    def apply(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
              peers: Peers | None = None) -> None:
        """Copy a verified snapshot (CPU tensors, same names/shapes/dtypes as ``capture``) into the live state.

        Args:
            tensors: name -> CPU tensor viewing the verified payload (read-only memory: copy out of it).
            meta: the snapshot's metadata as ``capture`` returned it (after a JSON round trip).
            peers: other ranks' verified payloads of the same version, only when :attr:`uses_peer_payloads`.
        """

    def validate(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> list[str]:
        """Problems that make this verified snapshot unusable for the live job (another ZeRO stage, another
        optimizer, another LR schedule...), one readable sentence each; empty when it fits. Must not touch
        live state: every rank's answer joins one vote before any rank applies. Default: no checks beyond the
        layout and checksums the restore does itself."""
        return []

    def pending_state_nbytes(self) -> int:
        """Bytes of state :meth:`capture` will hold that do not exist yet (optimizer moments a fresh engine creates
        at its first step), for the budget check at start; the holder checks the real size at the first snapshot.
        Default 0."""
        return 0

    def resharder(self) -> Any:
        """The framework's re-partitioning rules (a ``shardsafe.snapshot.reshard.Resharder``) when a snapshot taken
        at another data-parallel size can be restored into this state; None (the default): it cannot, and such a
        restore is refused before anything is read."""
        return None

    def resharded_problems(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> list[str]:
        """Like :meth:`validate`, for a state re-partitioned to this job's data-parallel size: why
        :meth:`apply_resharded` would refuse it (empty: it fits). Voted on by every rank before any applies."""
        return self.validate(tensors, meta)

    def apply_resharded(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Write a state re-partitioned from snapshots of another data-parallel size (what the resharder built for
        this rank) into the live state, as :meth:`apply` writes a snapshot."""
        raise NotImplementedError(f"{type(self).__name__} cannot apply a re-partitioned state")

    def fingerprint(self) -> Mapping[str, Any]:
        """What makes the run this run (shardsafe/fingerprint.py): JSON-able ``config``, ``model``, ``layout`` and
        ``optimizer`` fields, taken when the engine is built, before any step or restore. Called once, before the
        restore; every snapshot carries it and a restore with another one is refused. Default: none (nothing is
        compared)."""
        return {}


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


# --- casting fp32 masters into low-precision params the way their owner does --------------------------------

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


# Elements per block of copy_and_cast: 256 KiB of fp32 (+ 128 KiB of bf16) stays in one core's L2 between the copy
# that writes it and the cast that reads it. Smaller blocks pay the per-call overhead more often; blocks of a MiB
# and more spill out of L2 and the cast reads from memory again, as a copy then a cast over whole tensors does.
FUSE_BLOCK = 1 << 16


def copy_and_cast(master: torch.Tensor, lp: torch.Tensor, src: torch.Tensor) -> None:
    """``master.copy_(src)`` then ``lp.copy_(master)`` (an owner re-deriving its low-precision params from its fp32
    master, as DeepSpeed's ``update_lp_params`` does for its own partition), in one pass over cache-sized blocks:
    the cast reads what the copy just wrote from the cache instead of memory. Each element goes through the same
    torch conversion as a whole-tensor ``copy_`` (elementwise round-to-nearest-even; NaNs too:
    tests/unit/test_copy_cast.py), so ``lp`` is bit-identical to the unfused result. Falls back to the copy and
    then :func:`cast_like_owner` unless all three are host tensors with the same number of elements and ``master``
    and ``lp`` are contiguous (the blocks are flat views)."""
    fusable = (master.device.type == lp.device.type == src.device.type == "cpu"
               and master.numel() == lp.numel() == src.numel() and master.is_contiguous() and lp.is_contiguous())
    if not fusable:
        master.copy_(src)
        cast_like_owner(lp, master)
        return
    m, d, s = master.view(-1), lp.view(-1), src.reshape(-1)
    for a in range(0, m.numel(), FUSE_BLOCK):
        block = m[a:a + FUSE_BLOCK]
        block.copy_(s[a:a + FUSE_BLOCK])
        d[a:a + FUSE_BLOCK].copy_(block)
