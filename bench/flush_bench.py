"""Persistent-tier flushing: training step time with flushing on vs off, and flush throughput.

    .venv/bin/python bench/flush_bench.py [--d-model 512 --layers 4] [--blocks 6 --steps-per-block 10] [--persist-every 10] [--json]

One run, 2 ranks (ZeRO-2 bf16) on one simulated node with its holder; snapshot every step. Blocks
of steps alternate between flushing off and on (every --persist-every-th snapshot flushed,
fsync'ed, to a local directory), so drift on this shared machine hits both alike; the ratio is median step time on /
off. Flush throughput (holder-side seconds per flush, from its `flush` events) is compared with a
plain sequential write + fsync of the same number of bytes measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    from ds_pretrain_gpt import TinyGPT, batch
    from shardsafe.adapters.deepspeed import initialize

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyGPT(a.vocab, a.d_model, a.layers, 8, a.seq)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9,
           "shardsafe": {"enabled": True, "interval": 1, "memory_budget_gb": 4, "persist_dir": a.persist_dir,
                         "persist_every": a.persist_every, "persist_keep": 2, "persist_mbps": a.persist_mbps}}
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rt = engine.shardsafe.runtime
    flush_fn = rt.pipeline.flush_to_disk
    step_s = {"off": [], "on": []}
    for _ in range(2):   # warm-up: allocations, first flush
        x, y = batch(0, engine.micro_steps, rank, 2, a.seq, a.vocab)
        engine.backward(engine(x, y))
        engine.step()
    for b in range(a.blocks):
        mode = "on" if b % 2 else "off"
        rt.pipeline.flush_to_disk = flush_fn if mode == "on" else None
        for _ in range(a.steps_per_block):
            dist.barrier()
            t0 = time.perf_counter()
            x, y = batch(0, engine.micro_steps, rank, 2, a.seq, a.vocab)
            engine.backward(engine(x, y))
            engine.step()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            step_s[mode].append(float(t))
    engine.shardsafe.flush()
    nbytes = engine.shardsafe.runtime.pipeline.history[-1].nbytes
    if rank == 0:
        with open(os.path.join(a.out, "flush_result.json"), "w") as f:
            json.dump({"step_s": step_s, "bytes_per_rank": nbytes}, f)
    engine.shardsafe.close()
    dist.barrier()
    dist.destroy_process_group()


def plain_write_s(nbytes: int, where: str, repeats: int = 5) -> list[float]:
    data = os.urandom(1 << 20) * (nbytes >> 20) + os.urandom(nbytes & ((1 << 20) - 1))
    out = []
    for i in range(repeats):
        p = os.path.join(where, f"plain{i}.bin")
        t0 = time.perf_counter()
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        mv = memoryview(data)
        done = 0
        while done < len(mv):
            done += os.write(fd, mv[done: done + (8 << 20)])
        os.fsync(fd)
        os.close(fd)
        out.append(time.perf_counter() - t0)
        os.unlink(p)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="")
    p.add_argument("--persist-dir", default="")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--steps-per-block", type=int, default=10)
    p.add_argument("--persist-every", type=int, default=10, help="flush every K-th snapshot (config default 10)")
    p.add_argument("--persist-mbps", type=float, default=0.0, help="flush bandwidth cap (0 = none)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    from shardsafe.launch import LaunchConfig, LocalLauncher
    from shardsafe.runcheck import read_jsonl
    tmp = tempfile.mkdtemp(prefix="shardsafe-flushbench-")
    persist = os.path.join(tmp, "persist")
    run = LocalLauncher(LaunchConfig(nodes=1, nproc_per_node=2, job_id=f"flush{os.getpid()}", run_dir=tmp,
                                     max_restarts=0, memory_budget_gb=4, attempt_timeout_s=1800))
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--out", tmp, "--persist-dir", persist,
            "--vocab", str(a.vocab), "--d-model", str(a.d_model), "--layers", str(a.layers), "--seq", str(a.seq),
            "--blocks", str(a.blocks), "--steps-per-block", str(a.steps_per_block),
            "--persist-every", str(a.persist_every), "--persist-mbps", str(a.persist_mbps)]
    if not run.run(argv).ok:
        print(f"benchmark failed; logs kept in {tmp}", file=sys.stderr)
        return 1
    with open(os.path.join(tmp, "flush_result.json")) as f:
        res = json.load(f)
    flushes = [e for e in read_jsonl(os.path.join(tmp, "events.jsonl")) if e.get("kind") == "flush" and e.get("ok")]
    nbytes = res["bytes_per_rank"]
    plain = plain_write_s(nbytes, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    med = statistics.median
    on, off = med(res["step_s"]["on"]), med(res["step_s"]["off"])
    flush_s = med([e["seconds"] for e in flushes]) if flushes else float("nan")
    out = {"model": f"TinyGPT vocab={a.vocab} d={a.d_model} layers={a.layers}", "ranks": 2, "bytes_per_rank": nbytes,
           "step_ms_flush_off": round(off * 1e3, 2), "step_ms_flush_on": round(on * 1e3, 2),
           "ratio_step_on_vs_off": round(on / off, 4), "flushes": len(flushes),
           "flush_MBps": round(nbytes / flush_s / 1e6, 1), "plain_write_fsync_MBps": round(nbytes / med(plain) / 1e6, 1),
           "ratio_flush_vs_plain_write": round(med(plain) / flush_s, 3),
           "steps_per_mode": len(res["step_s"]["on"]), "persist_every": a.persist_every}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"{out['model']}, ZeRO-2 bf16, 2 ranks, {nbytes / 2**20:.1f} MiB per rank; snapshot every step; "
          f"{out['steps_per_mode']} steps per mode in alternating blocks")
    print(f"step time, flushing off  {out['step_ms_flush_off']:8.2f} ms (median)")
    print(f"step time, flushing on   {out['step_ms_flush_on']:8.2f} ms  -> {100 * (out['ratio_step_on_vs_off'] - 1):+.1f}% "
          f"vs off (every {a.persist_every}. snapshot flushed, {out['flushes']} flushes)")
    print(f"flush throughput         {out['flush_MBps']:8.1f} MB/s vs plain sequential write+fsync of the same bytes "
          f"{out['plain_write_fsync_MBps']:.1f} MB/s -> {out['ratio_flush_vs_plain_write']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
