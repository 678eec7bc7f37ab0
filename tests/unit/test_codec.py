"""The erasure code, four implementations compared byte-for-byte.

numpy reference (the spec) == ISA-L via ctypes == pyeclib ``isa_l_rs_cauchy`` (public API,
fragments minus their 80-byte header) == ``kernels/csrc/gf256.h`` compiled with g++ (the header the
CUDA kernels use), over every erasure pattern of every k <= 8, m <= 3 on odd sizes; plus the
codec's guards and error messages.
"""
from __future__ import annotations

import ctypes
import inspect
import itertools
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardsafe.parity import codec as parity
from shardsafe.kernels import cuda as kcuda
from shardsafe.kernels import isal as kisal
from shardsafe.kernels import reference as ref
from shardsafe.parity.codec import (BackendUnavailable, InsufficientFragments, InvalidFragment, InvalidParameter,
                              ParityError, get_codec)

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "kernels" / "csrc"
# Odd lengths around ISA-L's and the header's vector widths (16/32/64 B) and their tails.
SIZES = [1, 15, 17, 63, 65, 127, 129, 257, 1001]
PYECLIB_HEADER = 80


def _require_isal():
    if not kisal.available():
        pytest.skip(f"ISA-L not loadable here: {parity.available_backends()['isal']}")


# --- the g++ build of the shared header -------------------------------------------------------------

class HostGF:
    """ctypes view of gf256_host.cpp (the CUDA header's arithmetic, compiled for the CPU)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        vp, i, u8, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint8, ctypes.c_size_t
        lib.ss_host_gf_mul.argtypes, lib.ss_host_gf_mul.restype = [u8, u8], u8
        lib.ss_host_gf_inv.argtypes, lib.ss_host_gf_inv.restype = [u8], u8
        lib.ss_host_gen_cauchy1.argtypes, lib.ss_host_gen_cauchy1.restype = [vp, i, i], None
        lib.ss_host_invert_matrix.argtypes, lib.ss_host_invert_matrix.restype = [vp, vp, i], i
        lib.ss_host_decode_matrix.argtypes, lib.ss_host_decode_matrix.restype = [i, i, vp, vp, i, vp], i
        lib.ss_host_encode.argtypes, lib.ss_host_encode.restype = [vp, i, vp, i, vp, sz, i, i], i
        self.lib = lib

    def gen(self, k: int, m: int) -> np.ndarray:
        a = np.zeros((k + m, k), dtype=np.uint8)
        self.lib.ss_host_gen_cauchy1(a.ctypes.data, k, m)
        return a

    def invert(self, a: np.ndarray) -> np.ndarray | None:
        a = np.ascontiguousarray(a, dtype=np.uint8)
        out = np.zeros_like(a)
        return out if self.lib.ss_host_invert_matrix(a.ctypes.data, out.ctypes.data, a.shape[0]) == 0 else None

    def decode_matrix(self, k: int, m: int, sources, targets) -> np.ndarray:
        s = np.array(sources, dtype=np.uint8)
        t = np.array(targets, dtype=np.uint8)
        out = np.zeros((len(t), k), dtype=np.uint8)
        rc = self.lib.ss_host_decode_matrix(k, m, s.ctypes.data, t.ctypes.data, len(t), out.ctypes.data)
        assert rc == 0, f"ss_gf_decode_matrix returned {rc} for sources {sources} targets {targets}"
        return out

    def apply(self, coeffs: np.ndarray, sources, *, vec16: bool, accumulate_into=None) -> list[np.ndarray]:
        c = np.ascontiguousarray(coeffs, dtype=np.uint8)
        rows, k = c.shape
        n = sources[0].shape[0]
        outs = [np.zeros(n, np.uint8) for _ in range(rows)] if accumulate_into is None else accumulate_into
        src = (ctypes.c_void_p * k)(*[s.ctypes.data for s in sources])
        dst = (ctypes.c_void_p * rows)(*[o.ctypes.data for o in outs])
        rc = self.lib.ss_host_encode(ctypes.addressof(src), k, ctypes.addressof(dst), rows, c.ctypes.data, n,
                                     int(accumulate_into is not None), int(vec16))
        assert rc == 0
        return outs


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> HostGF:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: cannot compile kernels/csrc/gf256_host.cpp to check the CUDA header on CPU")
    out = tmp_path_factory.mktemp("gf256") / "libgf256_host.so"
    cmd = [gxx, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-I", str(CSRC),
           str(CSRC / "gf256_host.cpp"), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"g++ failed:\n{' '.join(cmd)}\n{r.stderr}"
    return HostGF(out)


@pytest.fixture(scope="module")
def pyeclib_driver():
    ec_iface = pytest.importorskip("pyeclib.ec_iface", reason="pyeclib not installed (pip install 'shardsafe[parity]')")
    if not ec_iface.check_backend_available("isa_l_rs_cauchy"):
        pytest.skip("pyeclib is installed but its isa_l_rs_cauchy backend is not available")
    cache = {}

    def get(k: int, m: int):
        if (k, m) not in cache:
            cache[(k, m)] = ec_iface.ECDriver(ec_type="isa_l_rs_cauchy", k=k, m=m)
        return cache[(k, m)]
    return get


# --- field and matrices -------------------------------------------------------------------------------

def test_field_tables_match_header_and_isal(host):
    a = np.arange(256)
    for x in range(256):
        got = np.array([host.lib.ss_host_gf_mul(x, int(y)) for y in a], dtype=np.uint8)
        np.testing.assert_array_equal(got, ref.GF_MUL[x], err_msg=f"gf_mul row {x}")
    assert [host.lib.ss_host_gf_inv(x) for x in range(256)] == [0] + [int(ref.GF_INV[x]) for x in range(1, 256)]
    for x in range(1, 256):
        assert ref.gf_mul(x, ref.gf_inv(x)) == 1
    if kisal.available():
        lib = kisal.load()
        rng = np.random.default_rng(1)
        for x, y in rng.integers(0, 256, size=(2000, 2)):
            assert lib.gf_mul(int(x), int(y)) == ref.gf_mul(int(x), int(y))


@pytest.mark.parametrize("k,m", [(1, 1), (3, 1), (6, 2), (12, 4), (32, 4), (10, 1), (200, 56)])
def test_generator_matrix_identical_everywhere(host, k, m):
    a = ref.gen_cauchy1_matrix(k, m)
    np.testing.assert_array_equal(a[:k], np.eye(k, dtype=np.uint8))
    np.testing.assert_array_equal(host.gen(k, m), a)
    if kisal.available():
        np.testing.assert_array_equal(kisal.gen_cauchy1_matrix(k, m), a)


def test_matrix_inverse_agrees(host):
    _require_isal()
    rng = np.random.default_rng(2)
    for k, m in [(4, 2), (8, 3), (12, 4)]:
        a = ref.gen_cauchy1_matrix(k, m)
        for _ in range(10):
            rows = sorted(rng.choice(k + m, size=k, replace=False))
            inv = ref.invert_matrix(a[rows])
            np.testing.assert_array_equal(ref.matmul(inv, a[rows]), np.eye(k, dtype=np.uint8))
            np.testing.assert_array_equal(kisal.invert_matrix(a[rows]), inv)
            np.testing.assert_array_equal(host.invert(a[rows]), inv)
    singular = np.array([[1, 2], [1, 2]], dtype=np.uint8)
    with pytest.raises(ValueError):
        ref.invert_matrix(singular)
    with pytest.raises(ValueError):
        kisal.invert_matrix(singular)
    assert host.invert(singular) is None


def test_cauchy_code_is_mds():
    # Every k-subset of generator rows must be invertible, or some erasure pattern is unrecoverable
    # (ISA-L's Vandermonde generator fails this from k=24, m=4; Cauchy never should).
    for k, m in [(8, 3), (12, 4)]:
        a = ref.gen_cauchy1_matrix(k, m)
        for lost in itertools.combinations(range(k + m), m):
            rows = [i for i in range(k + m) if i not in lost]
            ref.invert_matrix(a[rows])  # raises if singular


# --- every erasure pattern, four implementations ----------------------------------------------------

@pytest.mark.parametrize("k,m", [(k, m) for k in range(1, 9) for m in range(1, 4)])
def test_every_erasure_pattern_all_backends_agree(k, m, host, pyeclib_driver):
    _require_isal()
    rng = np.random.default_rng(1000 * k + m)
    n = k + m
    length = SIZES[(k * 3 + m) % len(SIZES)]
    data = [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(k)]
    rc, ic = get_codec(k=k, m=m, backend="reference"), get_codec(k=k, m=m, backend="isal")

    parity_ref = rc.encode(data)
    parity_isal = ic.encode(data)
    gen = ref.gen_cauchy1_matrix(k, m)
    parity_host_vec = host.apply(gen[k:], data, vec16=True)
    parity_host_byte = host.apply(gen[k:], data, vec16=False)
    drv = pyeclib_driver(k, m)
    pfrags = drv.encode(np.concatenate(data).tobytes())
    assert [len(f) - PYECLIB_HEADER for f in pfrags] == [length] * n
    for j in range(m):
        want = parity_ref[j]
        np.testing.assert_array_equal(parity_isal[j], want, err_msg=f"isal parity {j}")
        np.testing.assert_array_equal(parity_host_vec[j], want, err_msg=f"header vec16 parity {j}")
        np.testing.assert_array_equal(parity_host_byte[j], want, err_msg=f"header byte parity {j}")
        assert pfrags[k + j][PYECLIB_HEADER:] == want.tobytes(), f"pyeclib parity {j}"
    for i in range(k):
        assert pfrags[i][PYECLIB_HEADER:] == data[i].tobytes()

    frags = data + parity_ref
    for e in range(1, m + 1):
        for missing in itertools.combinations(range(n), e):
            available = {i: frags[i] for i in range(n) if i not in missing}
            want = [frags[i] for i in missing]
            for codec in (rc, ic):
                got = codec.reconstruct(available, list(missing))
                for t, g, w in zip(missing, got, want):
                    assert np.array_equal(g, w), f"{codec.backend} rebuilt fragment {t} wrong, lost {missing}"
            sources = rc.fragments_needed(list(missing))
            assert sources == [i for i in range(n) if i not in missing][:k]
            rows = host.decode_matrix(k, m, sources, missing)
            np.testing.assert_array_equal(rows, rc.coefficients(sources, missing))
            np.testing.assert_array_equal(rows, ic.coefficients(sources, missing))
            got_host = host.apply(rows, [frags[s] for s in sources], vec16=True)
            for t, g, w in zip(missing, got_host, want):
                assert np.array_equal(g, w), f"header rebuilt fragment {t} wrong, lost {missing}"
            # pyeclib only decodes `bytes` fragments (anything else aborts the process).
            rebuilt = drv.reconstruct([pfrags[i] for i in range(n) if i not in missing], list(missing))
            by_index = {drv.get_metadata(f, 1)["index"]: f for f in rebuilt}
            for t, w in zip(missing, want):
                assert by_index[t][PYECLIB_HEADER:] == w.tobytes(), f"pyeclib rebuilt {t}, lost {missing}"
    # more than m lost: every backend refuses
    for missing in itertools.islice(itertools.combinations(range(n), m + 1), 5):
        available = {i: frags[i] for i in range(n) if i not in missing}
        for codec in (rc, ic):
            with pytest.raises(InsufficientFragments, match="persistent tier"):
                codec.reconstruct(available, list(missing))


@pytest.mark.parametrize("length", [0, 1, 16, 33, 4096 + 7])
def test_decode_reassembles_payload_in_place(length):
    k, m = 5, 2
    codec = get_codec(k=k, m=m)
    rng = np.random.default_rng(length)
    payload = rng.integers(0, 256, k * length, dtype=np.uint8)
    data = payload.reshape(k, length)  # a 2-D array is the sequence of its rows, zero-copy
    par = codec.encode(data)
    restored = np.zeros_like(payload)
    lost = {1, 6}
    avail = {i: f for i, f in enumerate(list(data) + par) if i not in lost}
    out = codec.decode(avail, out=restored.reshape(k, length))
    np.testing.assert_array_equal(restored, payload)
    assert all(np.shares_memory(o, restored) for o in out) or length == 0
    plain = codec.decode(avail)
    np.testing.assert_array_equal(np.concatenate(plain), payload)


def test_decode_in_place_in_a_staging_buffer():
    # The replacement receives surviving chunks straight into their slots; decode fills the gaps.
    k, m, length = 4, 2, 999
    codec = get_codec(k=k, m=m)
    rng = np.random.default_rng(9)
    data = rng.integers(0, 256, (k, length), dtype=np.uint8)
    par = codec.encode(data)
    staging = np.zeros((k, length), np.uint8)
    staging[[0, 3]] = data[[0, 3]]
    avail = {0: staging[0], 3: staging[3], 4: par[0], 5: par[1]}
    codec.decode(avail, out=staging)
    np.testing.assert_array_equal(staging, data)
    with pytest.raises(InvalidFragment, match=r"decode: out\[1\] overlaps available\[0\]"):
        codec.decode(avail, out=[staging[1], staging[0], staging[2], staging[3]])


def test_large_k_matches_reference():
    _require_isal()
    k, m, length = 100, 5, 777
    rng = np.random.default_rng(12)
    data = [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(k)]
    want = ref.encode(data, m)
    for g, w in zip(kisal.encode(data, m), want):
        np.testing.assert_array_equal(g, w)
    frags = data + want
    lost = [3, 50, 99, 101, 104]
    got = kisal.reconstruct({i: f for i, f in enumerate(frags) if i not in lost}, lost, k=k, m=m)
    for g, i in zip(got, lost):
        np.testing.assert_array_equal(g, frags[i])


def test_encode_into_preallocated_shared_buffer_is_zero_copy():
    k, m, length = 6, 2, 4099
    codec = get_codec(k=k, m=m)
    rng = np.random.default_rng(3)
    data = [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(k)]
    arena = np.zeros(m * length + 64, dtype=np.uint8)  # e.g. one shared-memory segment
    views = [arena[64 + j * length: 64 + (j + 1) * length] for j in range(m)]
    got = codec.encode(data, out=views)
    assert all(g is v for g, v in zip(got, views))
    np.testing.assert_array_equal(arena[64:].reshape(m, length), np.stack(ref.encode(data, m)))
    assert not arena[:64].any()


def test_read_only_inputs_accepted():
    k, m = 3, 1
    raw = bytes(range(256)) * 3
    data = [np.frombuffer(raw, dtype=np.uint8, offset=i * 256, count=256) for i in range(k)]
    assert not data[0].flags.writeable
    np.testing.assert_array_equal(get_codec(k=k, m=m).encode(data)[0], ref.encode(data, m)[0])


def test_isal_chunked_and_threaded_calls_match_reference(monkeypatch):
    _require_isal()
    k, m, length = 7, 3, 3 * 4096 + 77
    rng = np.random.default_rng(4)
    data = [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(k)]
    want = ref.encode(data, m)
    monkeypatch.setattr(kisal, "_MAX_CALL", 4096 + 64)  # exercise the < 2 GiB call splitting
    for codec in (get_codec(k=k, m=m, backend="isal"), get_codec(k=k, m=m, backend="isal", threads=3)):
        monkeypatch.setattr(type(codec), "_MIN_SLICE", 1024)
        got = codec.encode(data)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        avail = {i: f for i, f in enumerate(data + want) if i not in (0, 4, 8)}
        for g, i in zip(codec.reconstruct(avail, [0, 4, 8]), (0, 4, 8)):
            np.testing.assert_array_equal(g, (data + want)[i])


def test_header_multi_pass_structure(host):
    # k > SS_MAX_K (64) and rows > SS_MAX_ROWS (8) take several passes, exactly like the CUDA launcher.
    rng = np.random.default_rng(5)
    k, rows, length = 70, 10, 333
    coeffs = rng.integers(0, 256, (rows, k), dtype=np.uint8)
    coeffs[3] = 1  # an all-ones row: the XOR path
    coeffs[4, :5] = 0
    src = [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(k)]
    want = [np.zeros(length, np.uint8) for _ in range(rows)]
    ref.apply_matrix(coeffs, src, want)
    for vec16 in (True, False):
        got = host.apply(coeffs, src, vec16=vec16)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    base = [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(rows)]
    acc = host.apply(coeffs, src, vec16=True, accumulate_into=[b.copy() for b in base])
    for a, b, w in zip(acc, base, want):
        np.testing.assert_array_equal(a, b ^ w)


def test_zero_length_fragments():
    codec = get_codec(k=3, m=2)
    data = [np.empty(0, np.uint8)] * 3
    par = codec.encode(data)
    assert [p.shape for p in par] == [(0,), (0,)]
    assert [r.shape for r in codec.reconstruct({0: data[0], 2: data[2], 3: par[0]}, [1])] == [(0,)]


def test_kernel_modules_share_one_signature():
    def shape(f):  # names, kinds and defaults; annotations differ (numpy arrays vs torch tensors)
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]
    for name in ("encode", "reconstruct"):
        sig = shape(getattr(ref, name))
        assert shape(getattr(kisal, name)) == sig
        assert shape(getattr(kcuda, name)) == sig


def test_spec_is_json_able():
    import json
    spec = get_codec(k=4, m=2).spec()
    assert json.loads(json.dumps(spec))["code"] == parity.CODE_ID and spec["k"] == 4 and spec["m"] == 2


# --- guards and errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    ({"k": 0, "m": 1}, "k must be >= 1; got k=0"),
    ({"k": -3, "m": 1}, "k must be >= 1"),
    ({"k": 4, "m": 0}, "m must be >= 1; got m=0"),
    ({"k": "4", "m": 1}, "k must be an int"),
    ({"k": True, "m": 1}, "k must be an int"),
    ({"k": 4, "m": 1.0}, "m must be an int"),
    ({"k": 200, "m": 57}, "k \\+ m must be <= 256"),
    ({"k": 4, "m": 1, "backend": "jerasure"}, "unknown parity backend 'jerasure'"),
    ({"k": 4, "m": 1, "backend": "reference", "threads": 2}, "does not accept options \\['threads'\\]"),
    ({"k": 4, "m": 1, "backend": "isal", "threads": 0}, "threads must be an int >= 1"),
])
def test_bad_construction(kw, match):
    if kw.get("backend") == "isal":
        _require_isal()
    with pytest.raises(InvalidParameter, match=match):
        get_codec(**kw)


def test_codec_construction_is_keyword_only():
    with pytest.raises(TypeError):
        parity.ReferenceCodec(4, 2)  # type: ignore[misc]
    with pytest.raises(TypeError):
        get_codec(4, 2)  # type: ignore[misc]


def test_fragment_errors_say_what_to_do():
    codec = get_codec(k=3, m=1)
    good = [np.zeros(10, np.uint8) for _ in range(3)]
    with pytest.raises(InvalidFragment, match="expected 3 data fragments .* got 2"):
        codec.encode(good[:2])
    with pytest.raises(InvalidFragment, match=r"data\[2\] has 11 bytes, data\[0\] has 10.*chunk_size"):
        codec.encode(good[:2] + [np.zeros(11, np.uint8)])
    with pytest.raises(InvalidFragment, match="numpy uint8 array; got ndarray\\(dtype=float32.*np.frombuffer"):
        codec.encode(good[:2] + [np.zeros(10, np.float32)])
    with pytest.raises(InvalidFragment, match="c_contiguous=False"):
        codec.encode(good[:2] + [np.zeros(20, np.uint8)[::2]])
    with pytest.raises(InvalidFragment, match="got bytes"):
        codec.encode(good[:2] + [bytes(10)])
    with pytest.raises(InvalidFragment, match=r"out\[0\] has 9 bytes; the fragments have 10"):
        codec.encode(good, out=[np.zeros(9, np.uint8)])
    ro = np.zeros(10, np.uint8)
    ro.setflags(write=False)
    with pytest.raises(InvalidFragment, match="read-only"):
        codec.encode(good, out=[ro])
    with pytest.raises(InvalidFragment, match="overlaps an input"):
        codec.encode(good, out=[good[1]])
    with pytest.raises(InvalidFragment, match="must hold 1 arrays"):
        codec.encode(good, out=[np.zeros(10, np.uint8)] * 2)


def test_index_errors_and_insufficient_fragments():
    k, m = 4, 2
    codec = get_codec(k=k, m=m)
    frags = [np.full(8, i, np.uint8) for i in range(k)]
    frags += codec.encode(frags)
    avail = {i: f for i, f in enumerate(frags)}
    with pytest.raises(InvalidParameter, match="fragment indices in 0..5"):
        codec.reconstruct({i: f for i, f in avail.items() if i != 1}, [6])
    with pytest.raises(InvalidParameter, match="both available and missing"):
        codec.reconstruct(avail, [1])
    with pytest.raises(InvalidParameter, match="twice"):
        codec.reconstruct({i: f for i, f in avail.items() if i != 1}, [1, 1])
    with pytest.raises(InvalidParameter, match="mapping"):
        codec.reconstruct(list(frags), [1])  # type: ignore[arg-type]
    three_gone = {i: f for i, f in avail.items() if i not in (0, 2, 5)}
    with pytest.raises(InsufficientFragments, match=r"need k=4 surviving fragments .* only 3 survive") as ei:
        codec.reconstruct(three_gone, [0, 2, 5])
    assert isinstance(ei.value, ParityError) and "at most 2 lost" in str(ei.value)
    with pytest.raises(InsufficientFragments):
        codec.reconstruct({i: f for i, f in avail.items() if i not in (0, 2, 5)}, [0])  # 5 unavailable too
    with pytest.raises(InsufficientFragments):
        codec.decode({i: f for i, f in avail.items() if i not in (0, 1, 2)})
    with pytest.raises(InsufficientFragments):
        codec.fragments_needed([0, 1, 2])
    with pytest.raises(InsufficientFragments):
        codec.fragments_needed([0], unavailable=[1, 4])
    assert codec.fragments_needed([1]) == [0, 2, 3, 4]
    assert codec.fragments_needed([4]) == [0, 1, 2, 3]
    assert codec.fragments_needed([0], unavailable=[4]) == [1, 2, 3, 5]


def test_isal_missing_falls_back_to_reference_with_warning(monkeypatch, caplog):
    monkeypatch.setattr(kisal, "_lib", None)
    monkeypatch.setattr(kisal, "_load_error", None)
    monkeypatch.setattr(kisal, "_candidates", lambda: ["/nonexistent/libisal.so.2"])
    monkeypatch.setattr(parity, "_warned_fallback", False)
    with pytest.raises(BackendUnavailable, match="pip install 'shardsafe\\[parity\\]'.*SHARDSAFE_ISAL_LIB"):
        get_codec(k=3, m=1, backend="isal")
    with caplog.at_level(logging.WARNING, logger="shardsafe.parity.codec"):
        codec = get_codec(k=3, m=1, threads=4)
    assert codec.backend == "reference"
    assert "ISA-L unavailable" in caplog.text
    assert parity.available_backends()["isal"] is not None


def test_cuda_backend_unavailable_is_clear():
    torch = pytest.importorskip("torch", reason="torch not installed")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the unavailable path is not reachable here (tests/gpu covers the backend)")
    with pytest.raises(BackendUnavailable, match="needs a GPU"):
        get_codec(k=3, m=1, backend="cuda")


def test_placement_and_codec_import_without_torch():
    code = ("import sys; import shardsafe.parity.topology, shardsafe.kernels.reference, shardsafe.kernels.isal, "
            "shardsafe.kernels.cuda; bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("backend", ["reference", "isal"])
@pytest.mark.parametrize("k,m,lost", [(3, 1, [1]), (7, 1, [0]), (4, 2, [2, 5])])
def test_partial_products_summed_along_the_survivors_equal_reconstruct(backend, k, m, lost):
    """The chain repair's arithmetic (shardsafe.parity.repair): the first survivor sends c_0 * s_0, each next one
    adds c_j * s_j to what it received (coefficient 1 on it), and the last sum is the lost fragment, byte for byte
    what reconstruct() rebuilds from all k sources at once; a wrong coefficient shape is refused."""
    if backend == "isal":
        _require_isal()
    codec = get_codec(k=k, m=m, backend=backend)
    rng = np.random.default_rng(k * 10 + m)
    data = [rng.integers(0, 256, 1001, dtype=np.uint8) for _ in range(k)]
    frags = dict(enumerate(data + codec.encode(data)))
    sources = codec.fragments_needed(lost)
    want = codec.reconstruct({i: frags[i] for i in sources}, lost)
    coeffs = codec.coefficients(sources, lost)
    for t, target in enumerate(lost):
        acc = np.empty(1001, dtype=np.uint8)
        codec.combine(coeffs[t:t + 1, :1], [frags[sources[0]]], [acc])
        for j in range(1, k):
            nxt = np.empty_like(acc)
            codec.combine(np.array([[1, coeffs[t, j]]], dtype=np.uint8), [acc, frags[sources[j]]], [nxt])
            acc = nxt
        assert np.array_equal(acc, want[t]) and np.array_equal(acc, frags[target])
    with pytest.raises(InvalidFragment, match="expected"):
        codec.combine(coeffs, [frags[sources[0]]], [np.empty(1001, dtype=np.uint8)])
