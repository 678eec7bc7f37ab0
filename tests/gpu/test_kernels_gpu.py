"""CUDA kernels vs the numpy reference, bit-for-bit, and their throughput vs a device-to-device copy.

Skipped (with the reason) without a GPU or without the built ``kernels/libshardsafe_ec.so``;
``scripts/gpu_check.sh`` builds the library and runs this file with ``-rs``.
"""
from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the CUDA kernels are driven through torch tensors")
if not torch.cuda.is_available():
    pytest.skip(f"no CUDA device visible to torch {torch.__version__} (torch.version.cuda={torch.version.cuda})",
                allow_module_level=True)

from shardsafe.kernels import cuda as kcuda  # noqa: E402
from shardsafe.kernels import reference as ref  # noqa: E402
from shardsafe.parity.codec import BackendUnavailable, InvalidFragment, get_codec  # noqa: E402

SIZES = [1, 15, 16, 17, 255, 4097, (1 << 20) + 3]


@pytest.fixture(scope="module", autouse=True)
def lib():
    try:
        return kcuda.load()
    except BackendUnavailable as e:
        pytest.skip(f"CUDA parity backend unavailable: {e}")


def _rand(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy()


@pytest.mark.parametrize("k,m", [(1, 1), (3, 1), (6, 2), (8, 3), (12, 4), (70, 10)])
@pytest.mark.parametrize("misalign", [0, 1])
def test_encode_bit_identical_to_reference(k, m, misalign):
    gen = torch.Generator(device="cuda").manual_seed(k * 100 + m)
    codec = get_codec(k=k, m=m, backend="cuda")
    for n in SIZES:
        # misalign=1: fragments start 1 byte into their allocation, forcing the byte-wise path
        bufs = [_rand(n + misalign, gen) for _ in range(k)]
        data = [b[misalign:] for b in bufs]
        par = codec.encode(data)
        torch.cuda.synchronize()
        want = ref.encode([_np(d) for d in data], m)
        for j in range(m):
            assert np.array_equal(_np(par[j]), want[j]), f"k={k} m={m} n={n} misalign={misalign} parity {j}"


@pytest.mark.parametrize("k,m", [(k, m) for k in range(1, 7) for m in range(1, 4)])
def test_every_erasure_pattern_rebuilt(k, m):
    gen = torch.Generator(device="cuda").manual_seed(7 * k + m)
    codec = get_codec(k=k, m=m, backend="cuda")
    n = 4096 + 13
    data = [_rand(n, gen) for _ in range(k)]
    frags = data + codec.encode(data)
    for e in range(1, m + 1):
        for missing in itertools.combinations(range(k + m), e):
            avail = {i: f for i, f in enumerate(frags) if i not in missing}
            got = codec.reconstruct(avail, list(missing))
            for t, g in zip(missing, got):
                assert torch.equal(g, frags[t]), f"k={k} m={m} lost {missing}: fragment {t}"


def test_c_reconstruct_entry_point_matches(lib):
    k, m, n = 6, 3, (1 << 16) + 5
    gen = torch.Generator(device="cuda").manual_seed(3)
    data = [_rand(n, gen) for _ in range(k)]
    frags = data + get_codec(k=k, m=m, backend="cuda").encode(data)
    missing = [0, 4, 7]
    sources = [i for i in range(k + m) if i not in missing][:k]
    outs = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in missing]
    src = (ctypes.c_void_p * k)(*[frags[s].data_ptr() for s in sources])
    dst = (ctypes.c_void_p * len(missing))(*[o.data_ptr() for o in outs])
    sidx = (ctypes.c_uint8 * k)(*sources)
    tidx = (ctypes.c_uint8 * len(missing))(*missing)
    err = lib.shardsafe_ec_reconstruct(ctypes.addressof(src), ctypes.addressof(sidx), k, m, ctypes.addressof(dst),
                                       ctypes.addressof(tidx), len(missing), n,
                                       torch.cuda.current_stream().cuda_stream)
    assert err == 0, lib.shardsafe_ec_error_string(err)
    torch.cuda.synchronize()
    for o, t in zip(outs, missing):
        assert torch.equal(o, frags[t])


def test_accumulate_and_side_stream():
    k, m, n = 5, 2, (1 << 20) + 7
    gen = torch.Generator(device="cuda").manual_seed(11)
    data = [_rand(n, gen) for _ in range(k)]
    codec = get_codec(k=k, m=m, backend="cuda")
    whole = codec.encode(data)
    # incremental parity: encode the first 3 sources, then xor in the last 2
    rows = codec.generator[k:]
    part = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(m)]
    kcuda.apply_matrix(rows[:, :3], data[:3], part)
    kcuda.apply_matrix(rows[:, 3:], data[3:], part, accumulate=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = codec.encode(data)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for a, b, c in zip(whole, part, on_side):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_rejects_cpu_tensors_and_mixed_devices():
    codec = get_codec(k=2, m=1, backend="cuda")
    with pytest.raises(InvalidFragment, match="CUDA tensor"):
        codec.encode([torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)])
    with pytest.raises(InvalidFragment, match="CUDA tensor"):
        codec.encode([torch.zeros(8, dtype=torch.float32, device="cuda")] * 2)


def _bench(fn, reps: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return float(np.median(times))


@pytest.mark.parametrize("k,m", [(3, 1), (6, 2), (12, 4)])
def test_throughput_vs_device_copy(k, m):
    n = 64 << 20
    gen = torch.Generator(device="cuda").manual_seed(0)
    data = [_rand(n, gen) for _ in range(k)]
    codec = get_codec(k=k, m=m, backend="cuda")
    par = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(m)]
    src = torch.cat(data)
    dst = torch.empty_like(src)
    t_enc = _bench(lambda: codec.encode(data, out=par))
    t_copy = _bench(lambda: dst.copy_(src))
    lost = list(range(m))
    avail = {i: f for i, f in enumerate(data + par) if i not in lost}
    rebuilt = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in lost]
    t_rec = _bench(lambda: codec.reconstruct(avail, lost, out=rebuilt))
    payload = k * n
    enc, rec, cp = payload / t_enc / 1e9, payload / t_rec / 1e9, payload / t_copy / 1e9
    print(f"\nGPU k={k} m={m} {n >> 20} MiB/fragment: encode {enc:.0f} GB/s, rebuild {m} data {rec:.0f} GB/s, "
          f"D2D copy {cp:.0f} GB/s (payload bytes/s); encode/copy = {enc / cp:.2f}")
    for j in range(m):  # the timed outputs are right, too (first and last MiB vs the reference)
        for sl in (slice(0, 1 << 20), slice(n - (1 << 20) - 5, n)):
            want = ref.encode([_np(d[sl]) for d in data], m)
            assert np.array_equal(_np(par[j][sl]), want[j])
    for t, g in zip(lost, rebuilt):
        assert torch.equal(g, data[t])
    assert enc > 0.05 * cp, "encode is pathologically slow compared to a device copy"
