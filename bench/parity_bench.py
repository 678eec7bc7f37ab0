#!/usr/bin/env python3
"""Parity codec throughput: shardsafe's codec vs pyeclib and vs memory bandwidth, in one run.

For each (k, m) one codeword of k data fragments of ``--mib`` MiB each (one member's share; the
payload is k x that), packed at ``topology.chunk_stride`` in one pre-faulted buffer as a holder
lays them out, is encoded into m parity fragments, and m data fragments (the worst case: matrix
inversion, k reads) are rebuilt. GB/s are decimal and always **payload bytes / median wall
time** of ``--reps`` runs (for rebuild too, as in docs/parity.md), so every row is comparable with
the memcpy baseline, which copies the same payload into pre-faulted memory.

Baselines measured in the same run:
  * memcpy: ``np.copyto`` of the k*S payload into a pre-faulted buffer (the bandwidth any
    snapshot copy pays);
  * pyeclib ``isa_l_rs_cauchy`` through its public API (``ECDriver.encode`` on the payload,
    ``ECDriver.reconstruct`` on its ``bytes`` fragments), called on <= 512 MiB pieces because it
    crashes above 2 GiB. Its parity is checked equal to ours (fragments minus the 80-byte header).

``--gpu`` measures the CUDA backend instead (encode, rebuild, device-to-device copy), checks its
bit-identity against the CPU reference, and is what scripts/gpu_check.sh runs.

Examples::

    nice -n 10 python bench/parity_bench.py                 # 256 MiB per member, (3,1) (6,2) (12,4)
    python bench/parity_bench.py --mib 16 --reps 5 --json   # quick, machine-readable
    python bench/parity_bench.py --gpu --json-out "$OUT/gpu_results.json"
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from shardsafe.parity.codec import ParityError, available_backends, get_codec  # noqa: E402
from shardsafe.parity.topology import chunk_stride  # noqa: E402

PIECE = 512 << 20  # pyeclib: payload per call (it segfaults above 2 GiB and copies everything twice)
HEADER = 80  # pyeclib fragment header


def _median_time(fn: Callable[[], Any], reps: int) -> tuple[float, float, list[float]]:
    """(median wall s, median thread-CPU s, wall times). The CPU time of the calling thread (ISA-L,
    np.copyto and pyeclib all run in it) is robust to other jobs descheduling us on a shared box."""
    fn()  # warm-up: tables, page faults of fresh outputs
    wall, cpu = [], []
    for _ in range(reps):
        c0, t0 = time.thread_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return statistics.median(wall), statistics.median(cpu), wall


def _fill(buf: np.ndarray, seed: int) -> None:
    """Random bytes, cheaply: a random 4 MiB block written at shifting offsets (throughput does not
    depend on the data, but parity checks need varied bytes)."""
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    flat = buf.reshape(-1)
    for i, lo in enumerate(range(0, flat.size, block.size)):
        hi = min(flat.size, lo + block.size)
        flat[lo:hi] = np.roll(block, i * 4097)[: hi - lo]


def _prefaulted(shape: tuple[int, ...]) -> np.ndarray:
    a = np.empty(shape, dtype=np.uint8)
    a.fill(1)  # touch every page now, so no timed call pays first-touch faults
    return a


def _packed(count: int, size: int, stride: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """``count`` fragments of ``size`` bytes packed at ``stride`` in one pre-faulted buffer, the way
    a holder lays out a member's chunks or a codeword's staging area (see topology.chunk_stride)."""
    arena = _prefaulted(((count - 1) * stride + size,))
    return arena, [arena[i * stride: i * stride + size] for i in range(count)]


def bench_cpu(k: int, m: int, size: int, reps: int, threads: int, with_pyeclib: bool) -> dict[str, Any]:
    payload = k * size
    stride = chunk_stride(size)
    _, frags = _packed(k + m, size, stride)
    data, parity = frags[:k], frags[k:]
    for i, d in enumerate(data):
        _fill(d, seed=k * 31 + m * 7 + i)
    row: dict[str, Any] = {"k": k, "m": m, "fragment_bytes": size, "fragment_stride": stride, "payload_bytes": payload}

    _, dst = _packed(k, size, stride)

    def memcpy() -> None:
        for d, s_ in zip(dst, data):
            np.copyto(d, s_)
    t, c, ts = _median_time(memcpy, reps)
    row["memcpy_gbps"], row["memcpy_cpu_gbps"], row["memcpy_times_s"] = payload / t / 1e9, payload / c / 1e9, ts
    del dst

    codec = get_codec(k=k, m=m, threads=threads)
    row["backend"] = codec.backend
    t, c, ts = _median_time(lambda: codec.encode(data, out=parity), reps)
    row["encode_gbps"], row["encode_cpu_gbps"], row["encode_times_s"] = payload / t / 1e9, payload / c / 1e9, ts

    lost = list(range(m))  # m data fragments: the expensive pattern (inverted sub-matrix, k reads)
    avail = {i: f for i, f in enumerate(frags) if i not in lost}
    _, rebuilt = _packed(m, size, stride)
    t, c, ts = _median_time(lambda: codec.reconstruct(avail, lost, out=rebuilt), reps)
    row["rebuild_gbps"], row["rebuild_cpu_gbps"], row["rebuild_times_s"] = payload / t / 1e9, payload / c / 1e9, ts
    if not all(np.array_equal(r, d) for r, d in zip(rebuilt, data)):
        raise SystemExit(f"rebuild produced wrong bytes for k={k} m={m}")
    del rebuilt, avail

    if with_pyeclib:
        row.update(_bench_pyeclib(k, m, data, parity, reps))
    return row


def _bench_pyeclib(k: int, m: int, data: list[np.ndarray], parity: list[np.ndarray], reps: int) -> dict[str, Any]:
    """pyeclib on the same codewords: piece p of the payload is the concatenation of bytes
    [p*L, (p+1)*L) of every data fragment, so its fragments are slices of ours and its parity must
    equal the matching slices of our parity (checked for every piece). Building a piece is a copy
    outside the timed calls."""
    from pyeclib.ec_iface import ECDriver
    drv = ECDriver(ec_type="isa_l_rs_cauchy", k=k, m=m)
    size = data[0].size
    chunk = max(1, min(size, PIECE // k))
    lost = list(range(m))
    piece = np.empty(k * chunk, dtype=np.uint8)
    identical = True
    enc_times, rec_times, enc_cpu, rec_cpu = [], [], [], []
    for rep in range(reps + 1):  # round 0: warm-up and parity check
        te = tr = ce = cr = 0.0
        for lo in range(0, size, chunk):
            hi = min(size, lo + chunk)
            buf = piece[: k * (hi - lo)]
            for i, d in enumerate(data):
                buf[i * (hi - lo):(i + 1) * (hi - lo)] = d[lo:hi]
            c0, t0 = time.thread_time(), time.perf_counter()
            frags = drv.encode(buf)
            te += time.perf_counter() - t0
            ce += time.thread_time() - c0
            if rep == 0:
                identical &= all(frags[k + j][HEADER:] == parity[j][lo:hi].tobytes() for j in range(m))
            keep = [f for i, f in enumerate(frags) if i not in lost]
            del frags
            c0, t0 = time.thread_time(), time.perf_counter()
            out = drv.reconstruct(keep, lost)
            tr += time.perf_counter() - t0
            cr += time.thread_time() - c0
            del keep, out
        if rep:
            enc_times.append(te)
            rec_times.append(tr)
            enc_cpu.append(ce)
            rec_cpu.append(cr)
    payload = k * size
    return {"pyeclib_encode_gbps": payload / statistics.median(enc_times) / 1e9,
            "pyeclib_rebuild_gbps": payload / statistics.median(rec_times) / 1e9,
            "pyeclib_encode_cpu_gbps": payload / statistics.median(enc_cpu) / 1e9,
            "pyeclib_rebuild_cpu_gbps": payload / statistics.median(rec_cpu) / 1e9,
            "pyeclib_encode_times_s": enc_times, "pyeclib_rebuild_times_s": rec_times,
            "pyeclib_parity_identical": bool(identical), "pyeclib_piece_bytes": k * chunk}


def bench_gpu(k: int, m: int, size: int, reps: int) -> dict[str, Any]:
    import torch
    from shardsafe.kernels import reference as ref

    codec = get_codec(k=k, m=m, backend="cuda")
    gen = torch.Generator(device="cuda").manual_seed(k * 31 + m)
    data = torch.randint(0, 256, (k, size), dtype=torch.uint8, device="cuda", generator=gen)
    rows = list(data)
    parity = torch.empty((m, size), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(data)

    def timed(fn: Callable[[], Any]) -> float:
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        return statistics.median(ts)

    payload = k * size
    row: dict[str, Any] = {"k": k, "m": m, "fragment_bytes": size, "payload_bytes": payload, "backend": "cuda",
                           "device": torch.cuda.get_device_name()}
    row["d2d_copy_gbps"] = payload / timed(lambda: dst.copy_(data)) / 1e9
    row["encode_gbps"] = payload / timed(lambda: codec.encode(rows, out=list(parity))) / 1e9
    lost = list(range(m))
    avail = {i: f for i, f in enumerate(rows + list(parity)) if i not in lost}
    rebuilt = torch.empty((m, size), dtype=torch.uint8, device="cuda")
    row["rebuild_gbps"] = payload / timed(lambda: codec.reconstruct(avail, lost, out=list(rebuilt))) / 1e9
    torch.cuda.synchronize()
    row["rebuild_identical"] = bool(torch.equal(rebuilt, data[:m]))

    # bit-identity vs the CPU code: the whole parity vs ISA-L (itself pinned to the reference by the
    # unit tests) when loadable, and head/odd-tail slices vs the numpy reference always
    host = data.cpu().numpy()
    gpu_par = parity.cpu().numpy()
    checks = {}
    if available_backends().get("isal") is None:
        checks["full_vs_isal"] = bool(np.array_equal(np.stack(get_codec(k=k, m=m, backend="isal").encode(host)), gpu_par))
    for name, sl in (("head_1MiB_vs_reference", slice(0, 1 << 20)), ("tail_vs_reference", slice(size - (1 << 20) - 3, size))):
        want = ref.encode([np.ascontiguousarray(h[sl]) for h in host], m)
        checks[name] = bool(np.array_equal(np.stack(want), gpu_par[:, sl]))
    odd = size - 5  # an odd length through the same kernel (vector body + byte tail)
    odd_par = codec.encode([r[:odd] for r in rows])
    torch.cuda.synchronize()
    want = ref.encode([np.ascontiguousarray(h[odd - 4099:odd]) for h in host], m)
    checks["odd_length_tail_vs_reference"] = bool(all(np.array_equal(p[odd - 4099:].cpu().numpy(), w) for p, w in zip(odd_par, want)))
    row["bit_identical"] = checks
    row["encode_vs_d2d"] = row["encode_gbps"] / row["d2d_copy_gbps"]
    return row


def _configs(text: list[str]) -> list[tuple[int, int]]:
    out = []
    for c in text:
        k, m = c.split(",")
        out.append((int(k), int(m)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="MiB per data fragment (one member's share), default 256")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per measurement (median reported), default 5")
    ap.add_argument("--configs", nargs="+", default=["3,1", "6,2", "12,4"], help="k,m pairs")
    ap.add_argument("--threads", type=int, default=1, help="ISA-L threads per call (default 1)")
    ap.add_argument("--no-pyeclib", action="store_true", help="skip the pyeclib baseline")
    ap.add_argument("--gpu", action="store_true", help="benchmark the CUDA backend instead of the CPU one")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--json-out", help="also write the JSON document to this file")
    args = ap.parse_args(argv)
    if args.reps < 5 and not args.json:
        print(f"note: --reps {args.reps} < 5, medians are noisy", file=sys.stderr)

    size = args.mib << 20
    configs = _configs(args.configs)
    doc: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]) if argv is None else argv,
        "host": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(), "numpy": np.__version__, "mib_per_fragment": args.mib, "reps": args.reps,
        "gbps_definition": "payload bytes (k x fragment) / median wall time, 1e9",
        "backends": available_backends(), "results": [],
    }
    with_pyeclib = not args.no_pyeclib and not args.gpu
    if with_pyeclib:
        try:
            import pyeclib  # noqa: F401
        except ImportError:
            print("pyeclib not installed: skipping its baseline (pip install 'shardsafe[parity]')", file=sys.stderr)
            with_pyeclib = False
    for k, m in configs:
        try:
            row = bench_gpu(k, m, size, args.reps) if args.gpu else bench_cpu(k, m, size, args.reps, args.threads,
                                                                                with_pyeclib)
        except ParityError as e:  # e.g. no GPU / kernels not built: say why, no traceback
            print(f"parity_bench: k={k} m={m}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        doc["results"].append(row)
        if not args.json:
            _print_row(row, args.gpu)
    doc["loadavg_end"] = os.getloadavg()
    text = json.dumps(doc, indent=2)
    if args.json:
        print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0


def _print_row(r: dict[str, Any], gpu: bool) -> None:
    head = f"k={r['k']:>2} m={r['m']} {r['fragment_bytes'] >> 20} MiB/fragment ({r['backend']})"
    if gpu:
        print(f"{head}: encode {r['encode_gbps']:.1f} GB/s, rebuild {r['m']} lost {r['rebuild_gbps']:.1f} GB/s, "
              f"D2D copy {r['d2d_copy_gbps']:.1f} GB/s; encode/D2D copy = {r['encode_vs_d2d']:.2f}x; "
              f"bit-identical {r['bit_identical']}", flush=True)
        return
    def g(key: str) -> str:  # wall (thread-CPU) GB/s
        return f"{r[key]:.2f} ({r[key.replace('_gbps', '_cpu_gbps')]:.2f})"
    print(f"{head}  GB/s of payload, median wall (thread-CPU time):", flush=True)
    print(f"    shardsafe {r['backend']}: encode {g('encode_gbps')}, rebuild {r['m']} lost data {g('rebuild_gbps')}",
          flush=True)
    print(f"    memcpy (np.copyto into pre-faulted memory): {g('memcpy_gbps')}", flush=True)
    print(f"    encode / memcpy = {r['encode_gbps'] / r['memcpy_gbps']:.2f}x "
          f"({r['encode_cpu_gbps'] / r['memcpy_cpu_gbps']:.2f}x)   rebuild / memcpy = "
          f"{r['rebuild_gbps'] / r['memcpy_gbps']:.2f}x ({r['rebuild_cpu_gbps'] / r['memcpy_cpu_gbps']:.2f}x)", flush=True)
    if "pyeclib_encode_gbps" in r:
        print(f"    pyeclib isa_l_rs_cauchy: encode {g('pyeclib_encode_gbps')}, reconstruct "
              f"{g('pyeclib_rebuild_gbps')} (parity identical to ours: {r['pyeclib_parity_identical']})", flush=True)
        print(f"    encode / pyeclib encode = {r['encode_gbps'] / r['pyeclib_encode_gbps']:.1f}x "
              f"({r['encode_cpu_gbps'] / r['pyeclib_encode_cpu_gbps']:.1f}x)   rebuild / pyeclib reconstruct = "
              f"{r['rebuild_gbps'] / r['pyeclib_rebuild_gbps']:.1f}x "
              f"({r['rebuild_cpu_gbps'] / r['pyeclib_rebuild_cpu_gbps']:.1f}x)", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
