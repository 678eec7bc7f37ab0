"""The specification of shardsafe's erasure code, in numpy.

Reed-Solomon over GF(2^8) with field polynomial x^8+x^4+x^3+x^2+1 (0x11D) and the systematic
Cauchy generator matrix of ISA-L's ``gf_gen_cauchy1_matrix``::

    A[i][j] = 1 if i == j                      for data rows   0 <= i < k
    A[i][j] = inverse(i XOR j)                 for parity rows k <= i < k+m

Fragment ``i`` of a codeword is ``sum_j A[i][j] * data_j`` (byte-wise, GF arithmetic), so fragments
0..k-1 are the data itself and k..k+m-1 the parity. Any k fragments determine the codeword
(the Cauchy construction is MDS for every erasure pattern), which is what ISA-L, pyeclib's
``isa_l_rs_cauchy``, the shared C/CUDA header (``csrc/gf256.h``) and this module must agree on
bit-for-bit; tests check all four against each other.

This module is the oracle: slow (an order of magnitude below ISA-L) but obviously correct. Production code uses
:mod:`shardsafe.kernels.isal` on CPU and :mod:`shardsafe.kernels.cuda` on GPU. The module-level
:func:`encode` / :func:`reconstruct` have the same signatures in all three kernel modules.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from shardsafe.errors import InsufficientFragments, InvalidFragment, InvalidParameter

POLY = 0x11D
"""Field polynomial (ISA-L, pyeclib, galois' default GF(2^8) all use it)."""

BACKEND = "reference"


def _build_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    exp = np.zeros(512, dtype=np.uint8)
    log = np.zeros(256, dtype=np.int32)
    x = 1
    for i in range(255):  # 2 generates the multiplicative group for 0x11D
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= POLY
    exp[255:510] = exp[0:255]
    a = np.arange(256)
    # MUL[c] is the 256-entry product table of coefficient c: the same tables the CUDA kernel
    # keeps in shared memory and the np.take lookups below use.
    mul = np.zeros((256, 256), dtype=np.uint8)
    mul[1:, 1:] = exp[(log[1:, None] + log[None, 1:])]
    inv = np.zeros(256, dtype=np.uint8)
    inv[1:] = exp[255 - log[a[1:]]]
    return exp, log, mul, inv


GF_EXP, GF_LOG, GF_MUL, GF_INV = _build_tables()
GF_EXP.setflags(write=False)
GF_LOG.setflags(write=False)
GF_MUL.setflags(write=False)
GF_INV.setflags(write=False)


def gf_mul(a: int, b: int) -> int:
    """Product of two field elements (ints 0..255)."""
    return int(GF_MUL[a, b])


def gf_inv(a: int) -> int:
    """Multiplicative inverse; raises ZeroDivisionError for 0."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return int(GF_INV[a])


def gen_cauchy1_matrix(k: int, m: int) -> np.ndarray:
    """The (k+m) x k generator matrix, identical to ISA-L ``gf_gen_cauchy1_matrix(a, k+m, k)``.

    Args:
        k: data fragments (>= 1).
        m: parity fragments (>= 0, k + m <= 256).
    Returns:
        uint8 array of shape (k+m, k), rows 0..k-1 the identity.
    """
    if k < 1 or m < 0 or k + m > 256:
        raise InvalidParameter(f"need k >= 1, m >= 0, k + m <= 256; got k={k}, m={m}")
    a = np.zeros((k + m, k), dtype=np.uint8)
    a[np.arange(k), np.arange(k)] = 1
    i = np.arange(k, k + m)[:, None]
    j = np.arange(k)[None, :]
    a[k:] = GF_INV[i ^ j]  # i >= k > j, so i ^ j != 0
    return a


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """GF(2^8) matrix product of small uint8 matrices (a: r x s, b: s x c)."""
    a = np.asarray(a, dtype=np.uint8)
    b = np.asarray(b, dtype=np.uint8)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise InvalidParameter(f"matmul shapes do not match: {a.shape} x {b.shape}")
    # products[r, s, c] = a[r, s] * b[s, c]; the GF sum is XOR over s
    products = GF_MUL[a[:, :, None], b[None, :, :]]
    return np.bitwise_xor.reduce(products, axis=1).astype(np.uint8) if a.shape[1] else \
        np.zeros((a.shape[0], b.shape[1]), dtype=np.uint8)


def invert_matrix(a: np.ndarray) -> np.ndarray:
    """Inverse of a square uint8 matrix over GF(2^8) (Gauss-Jordan).

    Raises:
        ValueError: the matrix is singular (never happens for k rows of a Cauchy generator).
    """
    a = np.array(a, dtype=np.uint8)  # copy: eliminated in place
    n = a.shape[0]
    if a.ndim != 2 or a.shape[1] != n:
        raise InvalidParameter(f"invert_matrix needs a square matrix, got shape {a.shape}")
    inv = np.eye(n, dtype=np.uint8)
    for col in range(n):
        nz = np.nonzero(a[col:, col])[0]
        if nz.size == 0:
            raise InvalidParameter(f"matrix is singular (no pivot in column {col})")
        p = col + int(nz[0])
        if p != col:
            a[[col, p]] = a[[p, col]]
            inv[[col, p]] = inv[[p, col]]
        s = GF_INV[a[col, col]]
        a[col] = GF_MUL[s][a[col]]
        inv[col] = GF_MUL[s][inv[col]]
        for r in range(n):
            f = a[r, col]
            if r != col and f:
                a[r] ^= GF_MUL[f][a[col]]
                inv[r] ^= GF_MUL[f][inv[col]]
    return inv


def decode_matrix(k: int, m: int, sources: Sequence[int], targets: Sequence[int],
                  *, generator: np.ndarray | None = None, invert=invert_matrix) -> np.ndarray:
    """Coefficients that rebuild fragments ``targets`` from the k fragments ``sources``.

    target_t = sum_s D[t][s] * fragment[sources[s]] with D = A[targets] . inverse(A[sources]).
    When the sources are exactly the data fragments, A[sources] is the identity and D = A[targets]
    (re-encoding), so no inversion is done.

    Args:
        k, m: code parameters.
        sources: k distinct fragment indices (any order; D's columns follow it).
        targets: fragment indices to rebuild.
        generator: the (k+m) x k generator, default :func:`gen_cauchy1_matrix`.
        invert: matrix inversion to use (the ISA-L backend passes ``gf_invert_matrix``).
    Returns:
        uint8 array (len(targets), k).
    """
    a = gen_cauchy1_matrix(k, m) if generator is None else generator
    src = list(sources)
    if len(src) != k or len(set(src)) != k:
        raise InvalidParameter(f"need exactly k={k} distinct source fragments, got {src}")
    if src == list(range(k)):
        return np.ascontiguousarray(a[list(targets)])
    return matmul(a[list(targets)], invert(a[src]))


_BLOCK = 1 << 18  # 256 KiB: a block of every source and output stays in L2 between passes


def apply_matrix(coeffs: np.ndarray, sources: Sequence[np.ndarray], outs: Sequence[np.ndarray]) -> None:
    """outs[r] = sum_i coeffs[r, i] * sources[i] over GF(2^8), byte-wise (the primitive of every op).

    Args:
        coeffs: uint8 (rows, k).
        sources: k 1-D uint8 arrays of equal length.
        outs: rows writable 1-D uint8 arrays of that length (must not alias sources).
    """
    rows, k = coeffs.shape
    n = sources[0].shape[0] if k else 0
    tmp = np.empty(min(n, _BLOCK), dtype=np.uint8)
    for lo in range(0, n, _BLOCK):
        hi = min(n, lo + _BLOCK)
        t = tmp[: hi - lo]
        for r in range(rows):
            acc = outs[r][lo:hi]
            acc[...] = 0
            for i in range(k):
                c = int(coeffs[r, i])
                if c == 0:
                    continue
                if c == 1:  # identity and all-ones rows: plain XOR
                    np.bitwise_xor(acc, sources[i][lo:hi], out=acc)
                else:
                    np.take(GF_MUL[c], sources[i][lo:hi], out=t)
                    np.bitwise_xor(acc, t, out=acc)


# --- the rebuild rule and the same-signature entry points (all kernel modules) -----------------------

def select_sources(k: int, m: int, missing: Sequence[int], unavailable: Sequence[int] = ()) -> list[int]:
    """The k fragments a rebuild reads: the lowest surviving indices (data before parity).

    Preferring data keeps the common case cheap: with every data fragment present a rebuild is a
    re-encode with no matrix inversion. The codec (:class:`shardsafe.parity.codec.Codec`) and
    :class:`shardsafe.parity.topology.ParityGroup` (which plans which peer sends what) apply this same
    rule, so all three always agree.

    Raises:
        InsufficientFragments: fewer than k fragments survive.
    """
    gone = set(missing) | set(unavailable)
    alive = [i for i in range(k + m) if i not in gone]
    if len(alive) < k:
        raise InsufficientFragments(
            f"need k={k} surviving fragments to rebuild {sorted(set(missing))}, but only {len(alive)} survive "
            f"({alive}; lost or unavailable: {sorted(gone)}). An RS(k={k}, m={m}) codeword survives at most "
            f"{m} lost fragments; restore it from the persistent tier.")
    return alive[:k]


class ArrayOps(NamedTuple):
    """How a kernel module's entry points handle its arrays (numpy here and in isal, torch CUDA in cuda)."""

    flat: Callable[[Any], Any]            # a 1-D view of one C-contiguous fragment
    empty: Callable[[Any, int], Any]      # a new uint8 fragment of n bytes like the given one


NUMPY_OPS = ArrayOps(flat=lambda a: np.asarray(a).reshape(-1),
                     empty=lambda like, n: np.empty(n, dtype=np.uint8))


def _outputs(op: str, out: Sequence[Any] | None, count: int, length: int, like: Any, ops: ArrayOps) -> tuple[list, list]:
    if out is None:
        made = [ops.empty(like, length) for _ in range(count)]
        return made, made
    outs = list(out)
    flat = [ops.flat(o) for o in outs]
    if len(outs) != count or any(f.shape[0] != length for f in flat):
        raise InvalidFragment(f"{op}: out must be {count} writable fragments of {length} bytes; got "
                              f"{[f.shape[0] for f in flat]}")
    return outs, flat


def encode_with(apply: Callable, data: Sequence[Any], m: int, *, out: Sequence[Any] | None = None,
                ops: ArrayOps = NUMPY_OPS, generator: np.ndarray | None = None) -> list[Any]:
    """The entry point :func:`encode` of every kernel module, on that module's ``apply_matrix``.

    Checks only what the kernels need (counts and equal lengths); :class:`shardsafe.parity.codec.Codec`
    is the guarded API with the full argument checks.
    """
    k = len(data)
    if k < 1 or m < 1 or k + m > 256:
        raise InvalidParameter(f"encode: need k >= 1 data fragments and 1 <= m, k + m <= 256; got k={k}, m={m}")
    src = [ops.flat(d) for d in data]
    length = src[0].shape[0]
    if any(s.shape[0] != length for s in src):
        raise InvalidFragment(f"encode: data fragments must have one length; got {[s.shape[0] for s in src]}")
    outs, flat = _outputs("encode", out, m, length, data[0], ops)
    a = gen_cauchy1_matrix(k, m) if generator is None else generator
    if length:
        apply(np.ascontiguousarray(a[k:]), src, flat)
    return outs


def reconstruct_with(apply: Callable, available: Mapping[int, Any], missing: Sequence[int], *, k: int, m: int,
                     out: Sequence[Any] | None = None, ops: ArrayOps = NUMPY_OPS,
                     generator: np.ndarray | None = None, invert: Callable = invert_matrix) -> list[Any]:
    """The entry point :func:`reconstruct` of every kernel module, on that module's ``apply_matrix``."""
    targets = [int(t) for t in missing]
    if not targets:
        return [] if out is None else list(out)
    sources = select_sources(k, m, targets, [i for i in range(k + m) if i not in available])
    src = [ops.flat(available[i]) for i in sources]
    length = src[0].shape[0]
    if any(s.shape[0] != length for s in src):
        raise InvalidFragment(f"reconstruct: fragments must have one length; got {[s.shape[0] for s in src]}")
    outs, flat = _outputs("reconstruct", out, len(targets), length, available[sources[0]], ops)
    if length:
        apply(decode_matrix(k, m, sources, targets, generator=generator, invert=invert), src, flat)
    return outs


def encode(data: Sequence[np.ndarray], m: int, *, out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """k equal-length uint8 arrays -> m parity arrays (the guarded API: :meth:`shardsafe.parity.codec.Codec.encode`)."""
    return encode_with(apply_matrix, data, m, out=out)


def reconstruct(available: Mapping[int, np.ndarray], missing: Sequence[int], *, k: int, m: int,
                out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """Rebuild fragments ``missing`` from ``available`` (guarded: :meth:`shardsafe.parity.codec.Codec.reconstruct`)."""
    return reconstruct_with(apply_matrix, available, missing, k=k, m=m, out=out)
