"""Snapshot vs disk checkpoint, same state, same run (DeepSpeed ZeRO-2 bf16, 2 ranks, >= 1 GiB of state).

    .venv/bin/python bench/snapshot_bench.py [--d-model 1024 --layers 8] [--repeats 5] [--json]
    .venv/bin/python bench/snapshot_bench.py --pp 2      (PipelineModule PP2 x DP2, ZeRO-1 bf16, 4 ranks)

(The pipeline layout runs ZeRO-1, not BF16_Optimizer: DeepSpeed 0.19.8's load_checkpoint cannot read its own
BF16_Optimizer checkpoint at zero stage 0 -- it hands the model-states file's optimizer dict to
BF16_Optimizer.load_state_dict, which indexes it by data-parallel rank: KeyError 0 -- so there is no
load_checkpoint to compare with.)

Prints medians of --repeats runs and ratios, each naming its baseline measured in this run:
  * copy bandwidth of a snapshot into the holder's pre-faulted shared memory vs memcpy (torch copy_
    into a pre-faulted private buffer of the same size);
  * trainer stall per snapshot (training loop blocked; the copy overlaps the next forward/backward)
    vs the blocking time of engine.save_checkpoint made durable (fsync of every file) and vs the
    page-cache-only save;
  * restore from the holder (every checksum verified, copied in place, lp params re-gathered) vs
    engine.load_checkpoint with a warm page cache and a cold one (pages evicted with
    posix_fadvise(DONTNEED) after fsync).
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


def fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def evict_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    from ds_pretrain_gpt import TinyGPT, batch, pipeline_model
    from shardsafe.adapters.deepspeed import initialize
    from shardsafe.holder.early_open import EarlyOpen
    from shardsafe.snapshot.restore import restore_from_holder

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if a.pp:   # the same GPT as a PipelineModule (ZeRO-1: see the module docstring)
        ns = argparse.Namespace(vocab=a.vocab, d_model=a.d_model, layers=a.layers, heads=a.heads, seq=a.seq, pp=a.pp,
                                partition_method="parameters")
        model = pipeline_model(ns)
    else:
        model = TinyGPT(a.vocab, a.d_model, a.layers, a.heads, a.seq)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 1 if a.pp else 2}, "steps_per_print": 10 ** 9,
           "shardsafe": {"enabled": True, "interval": 1, "memory_budget_gb": a.budget_gb}}
    engine, *_ = initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                            config=cfg)
    hook = engine.shardsafe
    pipe = hook.runtime.pipeline
    dp_rank = engine.mpu.get_data_parallel_rank() if engine.mpu else rank
    if rank == 0:
        print(f"{type(engine).__name__} with {type(engine.optimizer).__name__}", flush=True)

    def train_step() -> None:
        if a.pp:
            engine.train_batch(iter([batch(0, engine.global_steps, dp_rank, 1, a.seq, a.vocab)]))
            return
        x, y = batch(0, engine.micro_steps, rank, 1, a.seq, a.vocab)
        engine.backward(engine(x, y))
        engine.step()

    def mx(v: float) -> float:   # the job waits for its slowest rank
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    res: dict = {}
    # -- stall: real training steps, snapshot every step, copy overlapped with compute -------------
    for _ in range(a.warmup + a.repeats + 1):
        train_step()
    pipe.flush()
    hist = [h for h in pipe.history if h.committed]
    state_bytes = hist[-1].nbytes
    stalls = [mx(h.stall_s) for h in hist[a.warmup:]]   # first snapshots allocate slots: excluded, reported below
    res["state_bytes_per_rank"] = state_bytes
    res["stall_s"] = stalls
    res["stall_first_s"] = [h.stall_s for h in hist[: a.warmup]]
    # -- copy bandwidth: a snapshot with nothing to overlap, vs memcpy of the same tensors ------------
    st = hook.adapter.capture()
    copy_s, memcpy_s = [], []
    priv = {n: torch.empty_like(t).fill_(1) for n, t in st.tensors.items()}   # pre-faulted
    for i in range(a.repeats):
        pipe.submit(10_000 + i, hook.adapter.capture())
        pipe.flush()
        copy_s.append(pipe.history[-1].copy_s)
        t0 = time.perf_counter()
        for n, t in st.tensors.items():
            priv[n].copy_(t)
        memcpy_s.append(time.perf_counter() - t0)
    res["copy_s"], res["memcpy_s"] = copy_s, memcpy_s
    # -- disk checkpoints -------------------------------------------------------------------------------
    base = os.path.join(a.ckpt_dir, "ckpt")
    save_pc, save_durable, load_warm, load_cold, restore, phases, early_s = [], [], [], [], [], [], []
    for i in range(a.repeats):
        for durable in (False, True):
            tag = f"r{i}{'d' if durable else 'p'}"
            dist.barrier()
            t0 = time.perf_counter()
            engine.save_checkpoint(base, tag=tag)
            if durable:
                fsync_tree(os.path.join(base, tag))
            dt = mx(time.perf_counter() - t0)
            (save_durable if durable else save_pc).append(dt)
        tag = f"r{i}d"
        dist.barrier()
        t0 = time.perf_counter()
        engine.load_checkpoint(base, tag=tag)
        load_warm.append(mx(time.perf_counter() - t0))
        evict_tree(os.path.join(base, tag))
        dist.barrier()
        t0 = time.perf_counter()
        engine.load_checkpoint(base, tag=tag)
        load_cold.append(mx(time.perf_counter() - t0))
        dist.barrier()
        prof = None
        if os.environ.get("SHARDSAFE_BENCH_PROFILE") and rank == 0 and i == a.repeats - 1:
            import cProfile   # where one restore's time goes (rank 0, last repeat): --profile
            prof = cProfile.Profile()
            prof.enable()
        early = None
        if a.early_open:   # as a restarted trainer does while it sets up (holder/early_open.py), timed apart
            t0 = time.perf_counter()
            early = EarlyOpen(hook.runtime.paths, rank, verify=a.early_open == "verify").start()
            early.wait()
            early_s.append(mx(time.perf_counter() - t0))
            dist.barrier()
        t0 = time.perf_counter()
        r = restore_from_holder(hook.adapter, hook.runtime.client, rank=rank, coll=hook.runtime.coll, early=early)
        restore.append(mx(time.perf_counter() - t0))
        assert not a.early_open or (r.notes or {}).get("early_open") == "used", r.notes
        assert a.early_open != "verify" or r.notes.get("early_verify") == "used", r.notes
        if prof is not None:
            prof.disable()
            prof.dump_stats(os.environ["SHARDSAFE_BENCH_PROFILE"])
        assert r.version >= 0, r.message
        phases.append(r.phases)
        dist.barrier()
        if rank == 0:
            for t in (f"r{i}p", f"r{i}d"):
                shutil.rmtree(os.path.join(base, t), ignore_errors=True)
        dist.barrier()
    res.update(save_pagecache_s=save_pc, save_durable_s=save_durable, load_warm_s=load_warm, load_cold_s=load_cold,
               restore_s=restore, restore_phases=phases, early_open_s=early_s)
    if rank == 0:
        with open(os.path.join(a.out, "bench_result.json"), "w") as f:
            json.dump(res, f)
    hook.close()
    dist.barrier()
    dist.destroy_process_group()


def report(res: dict, a: argparse.Namespace) -> dict:
    med = statistics.median
    nbytes = res["state_bytes_per_rank"]
    copy_gbs = nbytes / med(res["copy_s"]) / 1e9
    memcpy_gbs = nbytes / med(res["memcpy_s"]) / 1e9
    stall = med(res["stall_s"])
    stall_floor = max(stall, 1e-6)
    world = 2 * max(a.pp, 1)
    out = {
        "model": f"TinyGPT vocab={a.vocab} d={a.d_model} layers={a.layers}", "ranks": world,
        "layout": f"PipelineModule PP{a.pp} x DP2, ZeRO-1" if a.pp else "ZeRO-2", "dtype": "bf16",
        # rank 0's (pipeline stages differ in size: the first holds the embeddings)
        "state_bytes_per_rank": nbytes, "repeats": a.repeats,
        "copy_GBps": round(copy_gbs, 3), "memcpy_GBps": round(memcpy_gbs, 3),
        "ratio_copy_vs_memcpy": round(copy_gbs / memcpy_gbs, 3),
        "stall_ms_median": round(stall * 1e3, 3), "stall_ms_max": round(max(res["stall_s"]) * 1e3, 3),
        "stall_ms_first_snapshots": [round(s * 1e3, 1) for s in res["stall_first_s"]],
        "save_durable_s": round(med(res["save_durable_s"]), 4), "save_pagecache_s": round(med(res["save_pagecache_s"]), 4),
        "ratio_save_durable_vs_stall": round(med(res["save_durable_s"]) / stall_floor, 1),
        "ratio_save_pagecache_vs_stall": round(med(res["save_pagecache_s"]) / stall_floor, 1),
        "restore_s": round(med(res["restore_s"]), 4),
        "early_open_s": round(med(res["early_open_s"]), 4) if res.get("early_open_s") else 0.0,
        "restore_phases_s_rank0": {k: round(med([p[k] for p in res["restore_phases"]]), 4) for k in res["restore_phases"][0]},
        "load_warm_s": round(med(res["load_warm_s"]), 4), "load_cold_s": round(med(res["load_cold_s"]), 4),
        "ratio_load_warm_vs_restore": round(med(res["load_warm_s"]) / med(res["restore_s"]), 2),
        "ratio_load_cold_vs_restore": round(med(res["load_cold_s"]) / med(res["restore_s"]), 2),
    }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="")
    p.add_argument("--ckpt-dir", default="")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-gb", type=float, default=6.0)
    p.add_argument("--pp", type=int, default=0, help="pipeline stages (PipelineModule x 2 data-parallel ranks)")
    p.add_argument("--early-open", nargs="?", const="verify", choices=["verify", "map"], default=None,
                   help="open the slot before each restore, as a restarted trainer does while it sets up "
                        "(shardsafe.holder.early_open): 'verify' (the default, as SHARDSAFE_EARLY_OPEN unset) maps and "
                        "verifies it, 'map' only maps it (the restore verifies); its time is printed apart")
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", default="", help="write a cProfile of rank 0's last restore to this file")
    a = p.parse_args()
    if a.profile:
        os.environ["SHARDSAFE_BENCH_PROFILE"] = os.path.abspath(a.profile)
    if a.worker:
        worker(a)
        return 0
    from shardsafe.launch import LaunchConfig, LocalLauncher
    tmp = tempfile.mkdtemp(prefix="shardsafe-bench-", dir=a.ckpt_dir or None)
    run = LocalLauncher(LaunchConfig(nodes=1, nproc_per_node=2 * max(a.pp, 1), job_id=f"bench{os.getpid()}", run_dir=tmp,
                                     max_restarts=0, memory_budget_gb=a.budget_gb, attempt_timeout_s=3000))
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--out", tmp, "--ckpt-dir", tmp,
            "--vocab", str(a.vocab), "--d-model", str(a.d_model), "--layers", str(a.layers), "--heads", str(a.heads),
            "--seq", str(a.seq), "--repeats", str(a.repeats), "--warmup", str(a.warmup), "--budget-gb", str(a.budget_gb),
            "--pp", str(a.pp)] + (["--early-open", a.early_open] if a.early_open else [])
    if not run.run(argv).ok:
        print(f"benchmark failed; logs kept in {tmp}", file=sys.stderr)
        return 1
    with open(os.path.join(tmp, "bench_result.json")) as f:
        out = report(json.load(f), a)
    shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"{out['model']}, {out['layout']} bf16, {out['ranks']} ranks on one node: "
          f"{out['state_bytes_per_rank'] / 2**20:.0f} MiB of rank state on rank 0; medians of {a.repeats}")
    print(f"copy into holder      {out['copy_GBps']:7.2f} GB/s   vs memcpy (same run) {out['memcpy_GBps']:.2f} GB/s  "
          f"-> {out['ratio_copy_vs_memcpy']:.2f}x of memcpy")
    print(f"trainer stall/snapshot {out['stall_ms_median']:7.3f} ms   (max {out['stall_ms_max']} ms; first snapshots "
          f"allocating: {out['stall_ms_first_snapshots']} ms)")
    print(f"save_checkpoint+fsync {out['save_durable_s']:8.3f} s    -> stall is {out['ratio_save_durable_vs_stall']}x smaller")
    print(f"save_checkpoint (page cache) {out['save_pagecache_s']:.3f} s -> stall is {out['ratio_save_pagecache_vs_stall']}x smaller")
    print(f"restore from holder   {out['restore_s']:8.3f} s    (checksums verified; rank 0 phases "
          f"{out['restore_phases_s_rank0']})")
    if a.early_open:
        print(f"early open ({a.early_open:6s})   {out['early_open_s']:8.3f} s    (before the restore, beside the trainer's set-up; "
              "not in the restore's time)")
    print(f"load_checkpoint warm  {out['load_warm_s']:8.3f} s    -> restore is {out['ratio_load_warm_vs_restore']}x faster")
    print(f"load_checkpoint cold  {out['load_cold_s']:8.3f} s    -> restore is {out['ratio_load_cold_vs_restore']}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
