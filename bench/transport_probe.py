"""How fast gloo moves bytes between two processes on this host (the parity exchange's transport).

    .venv/bin/python bench/transport_probe.py [--mib 32] [--reps 6]

Two forked processes join a gloo group over a FileStore and exchange ``--mib`` MiB: ``bidir`` both
send and receive at once (isend + irecv, the parity exchange's pattern), ``one_way`` rank 0 sends
and rank 1 receives. Medians of ``--reps`` (the first round is dropped); GB/s per direction.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def _rank(rank: int, store: str, nbytes: int, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    send = torch.ones(nbytes, dtype=torch.uint8)
    recv = torch.empty(nbytes, dtype=torch.uint8)
    res = {}
    for mode in ("bidir", "one_way"):
        ts = []
        for _ in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "bidir":
                a, b = dist.isend(send, 1 - rank), dist.irecv(recv, 1 - rank)
                a.wait()
                b.wait()
            elif rank == 0:
                dist.send(send, 1)
            else:
                dist.recv(recv, 0)
            dist.barrier()
            ts.append(time.perf_counter() - t0)
        res[mode] = statistics.median(ts[1:])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=32)
    p.add_argument("--reps", type=int, default=6)
    a = p.parse_args()
    nbytes = a.mib << 20
    with tempfile.TemporaryDirectory(prefix="shardsafe-probe-") as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _rank(1, store, nbytes, a.reps, out)
            except BaseException:  # noqa: BLE001
                code = 1
            os._exit(code)
        _rank(0, store, nbytes, a.reps, out)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            print("probe failed in rank 1", file=sys.stderr)
            return 1
        res = json.load(open(out))
    for mode, s in res.items():
        print(f"{mode:8s} {a.mib} MiB per direction: {s * 1e3:7.1f} ms = {nbytes / s / 1e9:5.2f} GB/s per direction")
    return 0


if __name__ == "__main__":
    sys.exit(main())
