"""The erasure codec contract: Reed-Solomon over GF(2^8), one API over the backends in kernels/.

The code is Reed-Solomon RS(k, m) over GF(2^8), field polynomial 0x11D, with ISA-L's systematic
Cauchy generator (``gf_gen_cauchy1_matrix``); :mod:`shardsafe.kernels.reference` is its
specification. A codeword has ``n = k + m`` equal-length fragments: indices ``0..k-1`` are the
data, ``k..k+m-1`` the parity, and any ``k`` of them rebuild the rest.

Backends (all bit-identical, checked against each other and against pyeclib in tests):

* ``isal``: ISA-L through ctypes (:mod:`shardsafe.kernels.isal`), numpy arrays, zero-copy, GIL
  released; the CPU production path.
* ``reference``: numpy lookup tables, ~20x slower; the oracle, and the fallback when ISA-L is
  missing.
* ``cuda``: the kernels in ``kernels/csrc`` (:mod:`shardsafe.kernels.cuda`), on torch CUDA
  tensors, enqueued on the current stream.

Usage::

    codec = get_codec(k=3, m=1)                     # ISA-L if loadable, else reference (warns)
    parity = codec.encode([d0, d1, d2])             # or encode(..., out=[shm_view])
    [d1] = codec.reconstruct({0: d0, 2: d2, 3: parity[0]}, [1])

Fragments are C-contiguous uint8 arrays of one length (any shape; a 2-D ``(k, L)`` array works as
the sequence of its rows). Every public method checks its arguments before any byte is touched
and raises a :class:`ParityError` subclass that says what was expected, what came and what to do.

This part imports neither torch nor torch.distributed.
"""
from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

log = logging.getLogger(__name__)

CODE_ID = "rs-cauchy1-gf256-0x11d"
"""Names the code (generator, field) in snapshot manifests; change it if the math ever changes."""
MAX_FRAGMENTS = 256
"""k + m limit: the Cauchy construction needs k + m distinct field elements."""
BACKENDS = ("isal", "reference", "cuda")


# The errors and the rebuild rule live below this module (shardsafe.errors, the spec in kernels/reference.py) so that
# the backends in kernels/ never import the codec: the codec uses the kernels, not the other way round.
from ..errors import (BackendUnavailable, InsufficientFragments, InvalidFragment,  # noqa: E402,F401
                      InvalidParameter, KernelError, ParityError)
from ..kernels.reference import select_sources  # noqa: E402,F401


def _check_km(k: Any, m: Any) -> tuple[int, int]:
    for name, v, lo in (("k", k, 1), ("m", m, 1)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InvalidParameter(f"{name} must be an int >= {lo}; got {v!r} ({type(v).__name__})")
        if v < lo:
            raise InvalidParameter(
                f"{name} must be >= {lo}; got {name}={v}. "
                + ("k counts data fragments (group size minus parity)." if name == "k" else
                   "m counts parity fragments, the number of losses survived; use m >= 1."))
    k, m = int(k), int(m)
    if k + m > MAX_FRAGMENTS:
        raise InvalidParameter(
            f"k + m must be <= {MAX_FRAGMENTS} (GF(2^8) Cauchy code); got k={k}, m={m} (n={k + m}). "
            "Use smaller parity groups.")
    return k, m


class _LRU:
    def __init__(self, maxsize: int) -> None:
        self._d: OrderedDict[Any, Any] = OrderedDict()
        self._max = maxsize
        self._lock = threading.Lock()

    def get_or_make(self, key: Any, make) -> Any:
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
                return v
        v = make()
        with self._lock:
            self._d[key] = v
            if len(self._d) > self._max:
                self._d.popitem(last=False)
        return v


# --- the contract ----------------------------------------------------------------------------------

class Codec(ABC):
    """RS(k, m) erasure codec over equal-length uint8 fragments.

    Public methods hold the guards; subclasses implement :meth:`_apply` (and the array plumbing
    when their arrays are not numpy). Instances are stateless apart from caches and are safe to
    share between threads.

    Args:
        k: data fragments per codeword (>= 1).
        m: parity fragments per codeword (>= 1, k + m <= 256).
    """

    backend: ClassVar[str] = "abstract"

    def __init__(self, *, k: int, m: int) -> None:
        self._k, self._m = _check_km(k, m)
        self._generator = self._make_generator()
        self._generator.setflags(write=False)
        self._parity_rows = np.ascontiguousarray(self._generator[self._k:])
        self._rows_cache = _LRU(maxsize=1024)

    # --- properties -----------------------------------------------------------------------------
    @property
    def k(self) -> int:
        return self._k

    @property
    def m(self) -> int:
        return self._m

    @property
    def n(self) -> int:
        return self._k + self._m

    @property
    def generator(self) -> np.ndarray:
        """The (k+m) x k generator matrix (read-only)."""
        return self._generator

    def spec(self) -> dict[str, Any]:
        """JSON-able description of the code, for snapshot manifests (backend is informative only:
        every backend produces the same bytes)."""
        return {"code": CODE_ID, "k": self._k, "m": self._m, "backend": self.backend}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(k={self._k}, m={self._m})"

    # --- operations -----------------------------------------------------------------------------
    def encode(self, data: Sequence[Any], *, out: Sequence[Any] | None = None) -> list[Any]:
        """Compute the m parity fragments of k data fragments.

        Args:
            data: k C-contiguous uint8 arrays of equal length (read-only views are fine).
            out: optional m writable arrays of that length to write the parity into (e.g. views of
                a shared-memory segment); nothing is allocated then.
        Returns:
            The m parity fragments (the ``out`` objects when given).
        """
        src = self._fragments("encode", "data", data, self._k)
        length = self._nbytes(src[0]) if src else 0
        outs, flat = self._outputs("encode", out, self._m, length, like=src[0], inputs=src)
        if length:
            self._apply(self._parity_rows, src, flat)
        return outs

    def reconstruct(self, available: Mapping[int, Any], missing: Sequence[int], *,
                    out: Sequence[Any] | None = None) -> list[Any]:
        """Rebuild the fragments ``missing`` (data or parity) from surviving ones.

        Args:
            available: fragment index -> array for (at least k) surviving fragments of one
                codeword; extra ones are ignored (the lowest indices are read, see
                :func:`select_sources`).
            missing: fragment indices to rebuild (0..k-1 data, k..k+m-1 parity), none of them in
                ``available``.
            out: optional writable arrays, one per ``missing`` entry, in the same order.
        Returns:
            The rebuilt fragments, in the order of ``missing``.
        Raises:
            InsufficientFragments: fewer than k fragments available.
        """
        targets = self._indices("reconstruct", "missing", missing)
        avail = self._available("reconstruct", available, targets)
        if not targets:
            return [] if out is None else list(out)
        sources = select_sources(self._k, self._m, targets, [i for i in range(self.n) if i not in avail])
        src = [avail[i] for i in sources]
        length = self._nbytes(src[0])
        outs, flat = self._outputs("reconstruct", out, len(targets), length, like=src[0], inputs=src)
        if length:
            self._apply(self.coefficients(sources, targets), src, flat)
        return outs

    def decode(self, available: Mapping[int, Any], *, out: Sequence[Any] | None = None) -> list[Any]:
        """The k data fragments of a codeword: present ones passed through, missing ones rebuilt.

        Args:
            available: fragment index -> array, at least k fragments of one codeword.
            out: optional k writable arrays; every data fragment is written there (present ones
                copied unless ``out[i]`` already is ``available[i]``'s memory), e.g. to reassemble
                a payload in a staging buffer where the surviving chunks were received in place.
        Returns:
            k data fragments in index order (the ``out`` objects when given).
        """
        avail = self._available("decode", available, [])
        lost = [i for i in range(self._k) if i not in avail]
        select_sources(self._k, self._m, lost, [i for i in range(self.n) if i not in avail])  # enough left?
        if out is None:
            rebuilt = iter(self.reconstruct(avail, lost)) if lost else iter(())
            return [avail[i] if i in avail else next(rebuilt) for i in range(self._k)]
        like = next(iter(avail.values()))
        outs, flat = self._outputs("decode", out, self._k, self._nbytes(like), like=like, inputs=[])
        copies = []
        for i in range(self._k):
            if i in avail and self._same_memory(flat[i], avail[i]):
                continue  # already in place
            for j, a in avail.items():
                if self._aliases(flat[i], a):
                    raise InvalidFragment(f"decode: out[{i}] overlaps available[{j}]; an output may only be "
                                          "exactly its own fragment's memory (in place) or separate memory.")
            if i in avail:
                copies.append(i)
        if lost:
            self.reconstruct(avail, lost, out=[flat[i] for i in lost])
        for i in copies:
            self._copy(flat[i], avail[i])
        return outs

    def fragments_needed(self, missing: Sequence[int], *, unavailable: Sequence[int] = ()) -> list[int]:
        """Which fragments a rebuild of ``missing`` reads (pyeclib's ``fragments_needed``).

        Args:
            missing: fragment indices to rebuild.
            unavailable: further fragments known to be gone (not to be rebuilt now).
        Returns:
            k fragment indices, ascending.
        Raises:
            InsufficientFragments: more than m fragments missing or unavailable.
        """
        targets = self._indices("fragments_needed", "missing", missing)
        gone = self._indices("fragments_needed", "unavailable", unavailable)
        return select_sources(self._k, self._m, targets, gone)

    def coefficients(self, sources: Sequence[int], targets: Sequence[int]) -> np.ndarray:
        """Coefficient rows rebuilding ``targets`` from the k fragments ``sources`` (cached per pattern).

        Returns:
            Read-only uint8 (len(targets), k); column s multiplies fragment ``sources[s]``.
        """
        key = (tuple(int(s) for s in sources), tuple(int(t) for t in targets))

        def make() -> np.ndarray:
            from shardsafe.kernels import reference
            try:
                rows = reference.decode_matrix(self._k, self._m, key[0], key[1], generator=self._generator,
                                               invert=self._invert)
            except ValueError as e:  # singular: impossible for the Cauchy generator; never silent
                raise KernelError(f"decode matrix for sources {key[0]} is not invertible ({e}); "
                                  "the generator matrix is corrupt") from e
            rows = np.ascontiguousarray(rows, dtype=np.uint8)
            rows.setflags(write=False)
            return rows

        return self._rows_cache.get_or_make(key, make)

    def combine(self, coeffs: np.ndarray, sources: Sequence[Any], out: Sequence[Any]) -> None:
        """``out[r] = sum_i coeffs[r, i] * sources[i]`` over GF(2^8), for any number of sources: the step of a
        repair that rebuilds a fragment from partial products (shardsafe.parity.repair), where each survivor
        adds its own fragment times its coefficient to what the previous one sent (coefficient 1 on that).

        Args:
            coeffs: uint8 (len(out), len(sources)), e.g. columns of :meth:`coefficients`.
            sources: 1-D arrays of equal length.
            out: writable 1-D arrays of that length, none of them one of ``sources``.
        """
        coeffs = np.ascontiguousarray(coeffs, dtype=np.uint8)
        src = [self._flat("combine", "sources", x, writable=False) for x in sources]
        flat = [self._flat("combine", "out", x, writable=True) for x in out]
        if coeffs.shape != (len(flat), len(src)):
            raise InvalidFragment(f"combine: coeffs has shape {coeffs.shape}; expected ({len(flat)}, {len(src)}) "
                                  "(one row per output, one column per source).")
        self._same_length("combine", "sources and out", src + flat, list(range(len(src) + len(flat))))
        if src and self._nbytes(src[0]):
            self._apply(coeffs, src, flat)

    # --- backend hooks --------------------------------------------------------------------------
    @abstractmethod
    def _apply(self, coeffs: np.ndarray, sources: list[Any], outs: list[Any]) -> None:
        """outs[r] = sum_i coeffs[r, i] * sources[i] over GF(2^8); all 1-D, equal, non-zero length."""

    def _make_generator(self) -> np.ndarray:
        from shardsafe.kernels import reference
        return reference.gen_cauchy1_matrix(self._k, self._m)

    def _invert(self, a: np.ndarray) -> np.ndarray:
        from shardsafe.kernels import reference
        return reference.invert_matrix(a)

    # --- array plumbing (numpy; CudaCodec overrides for torch CUDA tensors) ----------------------
    _array_kind = "C-contiguous numpy uint8 array"
    _array_hint = ("wrap raw buffers with np.frombuffer(buf, dtype=np.uint8) (zero-copy) or copy with "
                   "np.ascontiguousarray(x).view(np.uint8)")

    def _flat(self, op: str, what: str, x: Any, *, writable: bool) -> Any:
        ok = isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.flags.c_contiguous
        if not ok:
            got = (f"{type(x).__name__}(dtype={x.dtype}, shape={x.shape}, c_contiguous={x.flags.c_contiguous})"
                   if isinstance(x, np.ndarray) else type(x).__name__)
            raise InvalidFragment(f"{op}: {what} must be a {self._array_kind}; got {got}. Use {self._array_hint}.")
        if writable and not x.flags.writeable:
            raise InvalidFragment(f"{op}: {what} is read-only; pass a writable array (e.g. a view of a "
                                  "shared-memory segment opened read-write).")
        return x.reshape(-1)

    def _nbytes(self, flat: Any) -> int:
        return int(flat.shape[0])

    def _empty(self, like: Any, nbytes: int) -> Any:
        return np.empty(nbytes, dtype=np.uint8)

    def _copy(self, dst: Any, src: Any) -> None:
        np.copyto(dst, src)

    def _aliases(self, a: Any, b: Any) -> bool:
        return bool(np.may_share_memory(a, b))

    def _same_memory(self, a: Any, b: Any) -> bool:
        return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.nbytes == b.nbytes

    # --- guards ---------------------------------------------------------------------------------
    def _fragments(self, op: str, what: str, frags: Sequence[Any], count: int) -> list[Any]:
        try:
            items = list(frags)
        except TypeError:
            raise InvalidFragment(f"{op}: {what} must be a sequence of {count} arrays; got "
                                  f"{type(frags).__name__}") from None
        if len(items) != count:
            raise InvalidFragment(
                f"{op}: expected {count} {what} fragments for RS(k={self._k}, m={self._m}); got {len(items)}. "
                f"Pass exactly {count} (use a codec built with the group's k and m).")
        flat = [self._flat(op, f"{what}[{i}]", x, writable=False) for i, x in enumerate(items)]
        self._same_length(op, what, flat, range(count))
        return flat

    def _same_length(self, op: str, what: str, flat: Sequence[Any], names: Sequence[int]) -> None:
        if not flat:
            return
        n0 = self._nbytes(flat[0])
        for name, f in zip(names, flat):
            if self._nbytes(f) != n0:
                raise InvalidFragment(
                    f"{op}: every fragment must have the same length; {what}[{name}] has {self._nbytes(f)} "
                    f"bytes, {what}[{names[0]}] has {n0}. Pad each member's chunks to the group's "
                    "chunk size (ParityGroup.chunk_size).")

    def _indices(self, op: str, what: str, idx: Sequence[int]) -> list[int]:
        try:
            items = list(idx)
        except TypeError:
            raise InvalidParameter(f"{op}: {what} must be a sequence of fragment indices; got "
                                   f"{type(idx).__name__}") from None
        out: list[int] = []
        for i in items:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < self.n:
                raise InvalidParameter(
                    f"{op}: {what} must hold fragment indices in 0..{self.n - 1} (0..{self._k - 1} data, "
                    f"{self._k}..{self.n - 1} parity); got {i!r} in {items}.")
            if int(i) in out:
                raise InvalidParameter(f"{op}: {what} lists fragment {int(i)} twice ({items}); list each once.")
            out.append(int(i))
        return out

    def _available(self, op: str, available: Mapping[int, Any], targets: Sequence[int]) -> dict[int, Any]:
        if not isinstance(available, Mapping):
            raise InvalidParameter(f"{op}: available must be a mapping fragment index -> array; got "
                                   f"{type(available).__name__}")
        keys = self._indices(op, "available", list(available.keys()))
        both = sorted(set(keys) & set(targets))
        if both:
            raise InvalidParameter(f"{op}: fragments {both} are both available and missing; a fragment "
                                   "to rebuild must not be passed as a source.")
        flat = {i: self._flat(op, f"available[{i}]", available[i], writable=False) for i in sorted(keys)}
        self._same_length(op, "available", list(flat.values()), list(flat.keys()))
        return flat

    def _outputs(self, op: str, out: Sequence[Any] | None, count: int, length: int, *, like: Any,
                 inputs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        if out is None:
            flat = [self._empty(like, length) for _ in range(count)]
            return flat, flat
        try:
            outs = list(out)
        except TypeError:
            raise InvalidFragment(f"{op}: out must be a sequence of {count} arrays; got {type(out).__name__}") from None
        if len(outs) != count:
            raise InvalidFragment(f"{op}: out must hold {count} arrays (one per output fragment); got {len(outs)}.")
        flat = [self._flat(op, f"out[{i}]", x, writable=True) for i, x in enumerate(outs)]
        for i, f in enumerate(flat):
            if self._nbytes(f) != length:
                raise InvalidFragment(f"{op}: out[{i}] has {self._nbytes(f)} bytes; the fragments have {length}. "
                                      "Allocate outputs of the fragment length.")
            for j, g in enumerate(flat[:i]):
                if self._aliases(f, g):
                    raise InvalidFragment(f"{op}: out[{i}] overlaps out[{j}]; outputs need distinct memory.")
            for s in inputs:
                if self._aliases(f, s):
                    raise InvalidFragment(f"{op}: out[{i}] overlaps an input fragment; the kernels stream "
                                          "inputs while writing outputs, so they must not share memory.")
        return outs, flat


# --- backends --------------------------------------------------------------------------------------

class ReferenceCodec(Codec):
    """numpy lookup-table codec: the oracle (an order of magnitude slower than ISA-L)."""

    backend = "reference"

    def _apply(self, coeffs: np.ndarray, sources: list[Any], outs: list[Any]) -> None:
        from shardsafe.kernels import reference
        reference.apply_matrix(coeffs, sources, outs)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _thread_pool(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:  # noqa: SLF001 - grow only
            old, _pool = _pool, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardsafe-ec")
            if old is not None:
                old.shutdown(wait=False)
        return _pool


class IsalCodec(Codec):
    """ISA-L through ctypes: zero-copy on any C-contiguous uint8 buffer, GIL released.

    Args:
        k, m: see :class:`Codec`.
        threads: split each call over this many threads (64-byte aligned slices) when it is at
            least ``threads`` MiB long. ISA-L saturates memory bandwidth with one or two threads, so
            more only helps on many-core hosts with idle cores (default 1).
    Raises:
        BackendUnavailable: ISA-L cannot be loaded.
    """

    backend = "isal"
    _MIN_SLICE = 1 << 20

    def __init__(self, *, k: int, m: int, threads: int = 1) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InvalidParameter(f"threads must be an int >= 1; got {threads!r}")
        from shardsafe.kernels import isal
        isal.load()  # fail at construction, not on the first encode
        self._isal = isal
        self._threads = threads
        super().__init__(k=k, m=m)

    def _make_generator(self) -> np.ndarray:
        return self._isal.gen_cauchy1_matrix(self._k, self._m)

    def _invert(self, a: np.ndarray) -> np.ndarray:
        return self._isal.invert_matrix(a)

    def _apply(self, coeffs: np.ndarray, sources: list[Any], outs: list[Any]) -> None:
        n = sources[0].shape[0]
        parts = min(self._threads, n // self._MIN_SLICE)
        if parts <= 1:
            self._isal.apply_matrix(coeffs, sources, outs)
            return
        step = ((n + parts - 1) // parts + 63) // 64 * 64  # 64-byte aligned slices: ISA-L's vector width
        futs = [_thread_pool(self._threads).submit(self._isal.apply_matrix, coeffs, sources, outs,
                                                   lo=lo, hi=min(n, lo + step))
                for lo in range(0, n, step)]
        for f in futs:
            f.result()


class CudaCodec(Codec):
    """The CUDA kernels (``kernels/csrc``) on torch CUDA uint8 tensors, enqueued on the current stream.

    Raises:
        BackendUnavailable: torch without CUDA, no GPU, or ``libshardsafe_ec.so`` not built.
    """

    backend = "cuda"
    _array_kind = "contiguous torch.uint8 CUDA tensor"
    _array_hint = "t.contiguous().view(torch.uint8) on the device (zero-copy for contiguous tensors)"

    def __init__(self, *, k: int, m: int) -> None:
        from shardsafe.kernels import cuda
        cuda.load()
        self._cuda = cuda
        super().__init__(k=k, m=m)

    def _apply(self, coeffs: np.ndarray, sources: list[Any], outs: list[Any]) -> None:
        self._cuda.apply_matrix(coeffs, sources, outs)

    def _flat(self, op: str, what: str, x: Any, *, writable: bool) -> Any:
        import torch
        if not (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype == torch.uint8 and x.is_contiguous()):
            got = (f"Tensor(dtype={x.dtype}, device={x.device}, contiguous={x.is_contiguous()})"
                   if isinstance(x, torch.Tensor) else type(x).__name__)
            raise InvalidFragment(f"{op}: {what} must be a {self._array_kind}; got {got}. Use {self._array_hint}.")
        return x.view(-1)

    def _nbytes(self, flat: Any) -> int:
        return int(flat.numel())

    def _empty(self, like: Any, nbytes: int) -> Any:
        import torch
        return torch.empty(nbytes, dtype=torch.uint8, device=like.device)

    def _copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def _aliases(self, a: Any, b: Any) -> bool:
        if a.device != b.device:
            raise InvalidFragment(f"fragments live on different devices ({a.device}, {b.device}); "
                                  "put one codeword's fragments on one GPU.")
        a0, b0 = a.data_ptr(), b.data_ptr()
        return a0 < b0 + b.numel() and b0 < a0 + a.numel()

    def _same_memory(self, a: Any, b: Any) -> bool:
        return a.device == b.device and a.data_ptr() == b.data_ptr() and a.numel() == b.numel()

    def _same_length(self, op: str, what: str, flat: Sequence[Any], names: Sequence[int]) -> None:
        super()._same_length(op, what, flat, names)
        devs = {f.device for f in flat}
        if len(devs) > 1:
            raise InvalidFragment(f"{op}: {what} fragments are on several devices {sorted(map(str, devs))}; "
                                  "one codeword's fragments must share one GPU.")


_CODECS: dict[str, type[Codec]] = {"isal": IsalCodec, "reference": ReferenceCodec, "cuda": CudaCodec}
_warned_fallback = False


def get_codec(*, k: int, m: int, backend: str = "auto", **options: Any) -> Codec:
    """Build a codec.

    Args:
        k, m: code parameters (k data + m parity fragments per codeword).
        backend: ``"auto"`` (ISA-L if loadable, else the numpy reference with a logged warning),
            ``"isal"``, ``"reference"`` or ``"cuda"`` (torch CUDA tensors; never chosen by auto,
            which serves numpy arrays).
        **options: backend options, e.g. ``threads=`` for ISA-L.
    Returns:
        A :class:`Codec`.
    Raises:
        InvalidParameter: bad k/m, unknown backend or option.
        BackendUnavailable: an explicitly requested backend cannot be used.
    """
    global _warned_fallback
    _check_km(k, m)
    if backend == "auto":
        try:
            return _construct(IsalCodec, k, m, options)
        except BackendUnavailable as e:
            if not _warned_fallback:
                _warned_fallback = True
                log.warning("ISA-L unavailable, using the numpy reference codec (about 20x slower): %s", e)
            options = {key: v for key, v in options.items() if key != "threads"}
            return _construct(ReferenceCodec, k, m, options)
    cls = _CODECS.get(backend)
    if cls is None:
        raise InvalidParameter(f"unknown parity backend {backend!r}; choose one of 'auto', {', '.join(map(repr, BACKENDS))}")
    return _construct(cls, k, m, options)


def _construct(cls: type[Codec], k: int, m: int, options: dict[str, Any]) -> Codec:
    try:
        return cls(k=k, m=m, **options)
    except TypeError as e:
        raise InvalidParameter(f"backend {cls.backend!r} does not accept options {sorted(options)} ({e})") from None


@lru_cache(maxsize=256)
def available_backends() -> dict[str, str | None]:
    """Backend name -> None when usable here, else the reason it is not."""
    out: dict[str, str | None] = {"reference": None}
    for name in ("isal", "cuda"):
        try:
            mod = __import__(f"shardsafe.kernels.{name}", fromlist=["load"])
            mod.load()
            out[name] = None
        except BackendUnavailable as e:
            out[name] = str(e)
    return out


# --- stripe exchange over process groups (snapshot owner) ------------------------------------------
