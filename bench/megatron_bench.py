"""Snapshot vs Megatron's dist_checkpointing, same state, same run (megatron-core DistOpt bf16, DP ranks).

    nice -n 5 .venv/bin/python bench/megatron_bench.py [--hidden 640 --layers 8] [--ranks 2] [--repeats 5] [--json]

One job of ``--ranks`` data-parallel ranks on one simulated node (the local launcher starts the node's
holder) trains the tiny-GPT example scaled up (examples/megatron_pretrain_gpt.py: GPTModel with the
local spec, Megatron DDP + DistributedOptimizer, bf16 params, torch AdamW) under
``shardsafe.adapters.megatron.protect``, snapshotting after every optimizer step. Then, on the
same live state, it measures Megatron's own checkpointing as Megatron-LM does it for
``--ckpt-format torch_dist`` (unwrapped model ``sharded_state_dict``, DistOpt ``dp_reshardable``
optimizer state, scheduler; ``TorchDistSaveShardedStrategy`` in a ``FullyParallelSaveStrategyWrapper``
over the DP group; synchronous save; load = ``dist_checkpointing.load`` + ``load_state_dict`` of model,
optimizer and scheduler). Printed: medians of --repeats runs, each ratio naming its baseline:

  * trainer stall per snapshot (capture + submit after the step, plus the next optimizer step's wait for
    the copy, which overlaps the forward/backward) vs the blocking time of ``dist_checkpointing.save`` made durable (fsync of
    every file and directory), and vs the same save left in the page cache;
  * restore from the holder (agree, verify every xxh3 segment, copy in place, main -> bf16 params,
    DistOpt param all-gather) vs the load with a warm page cache and a cold one (files fsync'ed, then
    evicted with posix_fadvise(DONTNEED)), and vs its physical floor: one copy of the same bytes into
    pre-faulted memory where the live tensors are (from pinned host memory on a GPU: the H2D copy).

Times are the slowest rank's (a job waits for it). Needs megatron-core (0.16.1 here) and psutil. On a GPU
machine every rank takes one GPU (NCCL; scripts/gpu_check.sh phase 7 runs it with ``--ranks`` = the GPU count)
and every timed region ends with a device synchronize.
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

from snapshot_bench import evict_tree, fsync_tree  # noqa: E402  (same helpers as the DeepSpeed bench)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import megatron_pretrain_gpt as ex
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from megatron.core.utils import unwrap_model
    from shardsafe.adapters.megatron import protect
    from shardsafe.config import ShardsafeConfig
    from shardsafe.holder import early_open

    torch.set_num_threads(1)
    ex.init_distributed(600.0)   # NCCL on GPUs (one per rank), gloo with the CPU shims otherwise
    rank = dist.get_rank()
    # Collectives of the bench itself go where the backend wants them (NCCL: CUDA tensors); timed regions end
    # with a device synchronize, so asynchronous kernels and copies are inside the time they belong to.
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()
    run = ex.TinyGPT(tp=1, pp=1, bf16=True, num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                     vocab_size=a.vocab, seq_length=a.seq, micro_batch_size=1, num_microbatches=1, dropout=0.0,
                     timeout_s=600.0)
    ex.initialize_parallel(run)
    tr = ex.Trainer(run)

    def set_iteration(i: int) -> None:
        tr.iteration = i

    prot = protect(tr.model_chunks, tr.optimizer, tr.scheduler,
                   ShardsafeConfig(interval=1, memory_budget_gb=a.budget_gb, timeout_s=600.0),
                   get_iteration=lambda: tr.iteration, set_iteration=set_iteration,
                   get_counters=lambda: dict(tr.counters), set_counters=lambda c: tr.counters.update(c))
    pipe = prot.runtime.pipeline

    def mx(v: float) -> float:   # the job waits for its slowest rank
        t = torch.tensor([v], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    leaves = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])   # e.g. DistributedOptimizer[AdamW]
    opt_name = ", ".join(f"{type(o).__name__}[{type(getattr(o, 'optimizer', o)).__name__}]" for o in leaves)
    res: dict = {"params": sum(p.numel() for c in tr.model_chunks for p in c.parameters()),
                 "ranks": dist.get_world_size(), "optimizer": opt_name,
                 "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    # -- stall: real training steps, a snapshot after every step, its copy overlapped with the next step --
    n = a.warmup + a.repeats + 1
    step_s, submit_s, wait_s = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        tr.train_step()               # optimizer.step() first waits for the previous snapshot's copy
        sync()
        t1 = time.perf_counter()
        prot.after_step(tr.iteration)  # capture (references + metadata) and submit
        submit_s.append(time.perf_counter() - t1)
        step_s.append(t1 - t0)
        wait_s.append(prot.last_stall_s)
    pipe.flush()
    hist = [h for h in pipe.history if h.committed]
    assert len(hist) == n, [h.error for h in pipe.history]
    res["state_bytes_per_rank"] = hist[-1].nbytes
    # Trainer stall of snapshot v: its capture + submit after step v, and the wait for its copy inside the
    # optimizer step of v + 1. The first `warmup` snapshots allocate the holder's slots: reported apart.
    stall = [submit_s[v] + wait_s[v + 1] for v in range(n - 1)]
    res["stall_s"] = [mx(x) for x in stall[a.warmup:]]
    res["stall_first_s"] = [mx(x) for x in stall[: a.warmup]]
    res["submit_s"] = [mx(x) for x in submit_s[a.warmup:-1]]
    res["wait_s"] = [mx(x) for x in wait_s[a.warmup + 1:]]
    res["copy_s"] = [mx(h.copy_s) for h in hist[a.warmup:]]
    res["step_s"] = [mx(x - w) for x, w in zip(step_s[a.warmup + 1:], wait_s[a.warmup + 1:])]

    # -- Megatron's dist_checkpointing, as Megatron-LM uses it for --ckpt-format torch_dist ------------------
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    md = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
          "chained_optim_avoid_prefix": True, "dp_cp_group": dp_group}
    model = unwrap_model(tr.model_chunks)

    def state_dict(is_loading: bool) -> dict:
        sd = {"model": model[0].sharded_state_dict(metadata=md), "iteration": tr.iteration}
        sd["optimizer"] = tr.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=md)
        sd["opt_param_scheduler"] = tr.scheduler.state_dict()
        return sd

    def load(path: str) -> None:
        loaded = dist_checkpointing.load(state_dict(True), path, TorchDistLoadShardedStrategy())
        model[0].load_state_dict(loaded["model"])
        tr.optimizer.load_state_dict(loaded["optimizer"])
        tr.scheduler.load_state_dict(loaded["opt_param_scheduler"])

    # Both restore paths are checked, not only timed: the live state is overwritten before the first
    # Megatron load and before every restore, and must come back equal to this copy (the state of the last
    # snapshot: nothing trained since). Megatron's dp_reshardable load leaves torch Adam's `step` alone.
    def live() -> dict:
        out = {k: v for k, v in prot.adapter.capture().tensors.items() if not k.startswith("rng/")}
        out.update({f"model/{k}": v for k, v in tr.model_params().items()})
        return out

    ref = {k: v.detach().clone() for k, v in live().items()}

    def overwrite() -> None:
        with torch.no_grad():
            for t in live().values():
                t.fill_(0)

    def equal(skip_step: bool) -> bool:
        cur = live()
        return all(torch.equal(cur[k], v) for k, v in ref.items() if not (skip_step and k.endswith("/step")))

    # The physical floor of a restore: one copy of the same bytes (the rank state the snapshot holds) into the
    # live tensors' memory, from pre-faulted host memory (pinned where the tensors are on a GPU: an H2D copy).
    snap = prot.adapter.capture().tensors
    floor_src = {k: v.detach().to("cpu", copy=True) for k, v in snap.items()}
    if dev.type == "cuda":
        floor_src = {k: v.pin_memory() for k, v in floor_src.items()}
    floor_dst = {k: torch.empty_like(v).copy_(floor_src[k]) for k, v in snap.items()}   # pre-faulted
    floor_s: list[float] = []

    base = os.path.join(a.ckpt_dir, "dist_ckpt")
    save_pc, save_durable, load_warm, load_cold, restore, phases, early_s = [], [], [], [], [], [], []
    checks = {"megatron_load_restores_state": True, "shardsafe_restore_bit_exact": True}
    for i in range(a.repeats):
        paths = {}
        for durable in (False, True):
            path = paths[durable] = os.path.join(base, f"r{i}{'d' if durable else 'p'}")
            if rank == 0:
                os.makedirs(path)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), dp_group)
            dist_checkpointing.save(state_dict(False), path, strategy)
            if durable:
                fsync_tree(path)
            (save_durable if durable else save_pc).append(mx(time.perf_counter() - t0))
        # An untimed load first: the timed ones then find the allocator as warm as the restore finds the live
        # tensors (otherwise the first load after a save pays page faults for its fresh buffers).
        if i == 0:
            overwrite()
        load(paths[True])
        if i == 0:
            checks["megatron_load_restores_state"] = equal(skip_step=True)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        load(paths[True])
        sync()
        load_warm.append(mx(time.perf_counter() - t0))
        fsync_tree(paths[True])
        evict_tree(paths[True])
        dist.barrier()
        t0 = time.perf_counter()
        load(paths[True])
        sync()
        load_cold.append(mx(time.perf_counter() - t0))
        overwrite()
        sync()
        if a.early_open:   # as a restarted trainer does while it sets up (holder/early_open.py), timed apart
            dist.barrier()
            t0 = time.perf_counter()
            eo = early_open.start({**os.environ, early_open.ENV_EARLY_OPEN: "1" if a.early_open == "verify" else "map"})
            assert eo is not None, "early open: SHARDSAFE_JOB_ID / RANK / the holder socket missing"
            eo.wait()
            early_s.append(mx(time.perf_counter() - t0))
        dist.barrier()
        t0 = time.perf_counter()
        version = prot.runtime.try_restore(prot.adapter)
        sync()
        restore.append(mx(time.perf_counter() - t0))
        assert version is not None, prot.runtime.restored.message
        checks["shardsafe_restore_bit_exact"] &= equal(skip_step=False)
        phases.append(prot.runtime.restored.phases)
        assert not a.early_open or (prot.runtime.restored.notes or {}).get("early_open") == "used", \
            prot.runtime.restored.notes
        assert a.early_open != "verify" or prot.runtime.restored.notes.get("early_verify") == "used", \
            prot.runtime.restored.notes
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for k, t in floor_dst.items():
            t.copy_(floor_src[k], non_blocking=dev.type == "cuda")
        sync()
        floor_s.append(mx(time.perf_counter() - t0))
        dist.barrier()
        if rank == 0:
            res.setdefault("ckpt_bytes", sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(paths[True])
                                             for f in fs))
            for p in paths.values():
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()
    flags = torch.tensor([int(v) for v in checks.values()], dtype=torch.int64, device=dev)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    res["checks"] = {k: bool(f) for k, f in zip(checks, flags.tolist())}
    res.update(save_pagecache_s=save_pc, save_durable_s=save_durable, load_warm_s=load_warm, load_cold_s=load_cold,
               restore_s=restore, restore_phases=phases, floor_s=floor_s, early_open_s=early_s)
    if rank == 0:
        with open(os.path.join(a.out, "bench_result.json"), "w") as f:
            json.dump(res, f)
    prot.close()
    dist.barrier()
    ex.destroy_parallel()
    dist.destroy_process_group()


def report(res: dict, a: argparse.Namespace) -> dict:
    med = statistics.median
    nbytes = res["state_bytes_per_rank"]
    stall = med(res["stall_s"])
    floor = max(stall, 1e-6)
    restore_s = med(res["restore_s"])
    return {
        "model": f"GPTModel local spec, hidden={a.hidden} layers={a.layers} heads={a.heads} vocab={a.vocab} "
                 f"seq={a.seq}, {res['params'] / 1e6:.1f} M params",
        "layout": f"DP{res['ranks']} (TP1 PP1), {res.get('optimizer', 'DistributedOptimizer')}, bf16 params, fp32 main "
                  f"params, on {res.get('device', 'cpu')}",
        "state_bytes_per_rank": nbytes, "state_bytes_total": nbytes * res["ranks"], "ckpt_bytes": res.get("ckpt_bytes"),
        "repeats": a.repeats, "step_s_median": round(med(res["step_s"]), 3),
        "copy_s_median": round(med(res["copy_s"]), 4),
        "stall_ms_median": round(stall * 1e3, 3), "stall_ms_max": round(max(res["stall_s"]) * 1e3, 3),
        "submit_ms_median": round(med(res["submit_s"]) * 1e3, 3), "wait_ms_median": round(med(res["wait_s"]) * 1e3, 3),
        "stall_ms_first_snapshots": [round(s * 1e3, 1) for s in res["stall_first_s"]],
        "save_durable_s": round(med(res["save_durable_s"]), 4), "save_pagecache_s": round(med(res["save_pagecache_s"]), 4),
        "ratio_save_durable_vs_stall": round(med(res["save_durable_s"]) / floor, 1),
        "ratio_save_pagecache_vs_stall": round(med(res["save_pagecache_s"]) / floor, 1),
        "restore_s": round(restore_s, 4),
        "early_open_s": round(med(res["early_open_s"]), 4) if res.get("early_open_s") else 0.0,
        "restore_phases_s_rank0": {k: round(med([p[k] for p in res["restore_phases"]]), 4)
                                   for k in res["restore_phases"][0]},
        "copy_floor_s": round(med(res["floor_s"]), 4),
        "ratio_restore_vs_copy_floor": round(restore_s / med(res["floor_s"]), 2),
        "load_warm_s": round(med(res["load_warm_s"]), 4), "load_cold_s": round(med(res["load_cold_s"]), 4),
        "ratio_load_warm_vs_restore": round(med(res["load_warm_s"]) / restore_s, 2),
        "ratio_load_cold_vs_restore": round(med(res["load_cold_s"]) / restore_s, 2),
        "checks": res["checks"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="")
    p.add_argument("--ckpt-dir", default="", help="local directory for the checkpoints (default: a temp dir)")
    p.add_argument("--ranks", type=int, default=2, help="data-parallel ranks on the one node")
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=10)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-gb", type=float, default=4.0)
    p.add_argument("--early-open", nargs="?", const="verify", choices=["verify", "map"], default=None,
                   help="open the slot before each restore, as a restarted trainer does while it sets up "
                        "(shardsafe.holder.early_open): 'verify' (the default, as SHARDSAFE_EARLY_OPEN unset) maps and "
                        "verifies it, 'map' only maps it (the restore verifies); its time is printed apart")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.repeats < 5:
        p.error("--repeats must be >= 5 (medians of at least five runs)")
    if a.worker:
        worker(a)
        return 0
    from shardsafe.launch import LaunchConfig, LocalLauncher
    tmp = tempfile.mkdtemp(prefix="shardsafe-mbench-", dir=a.ckpt_dir or None)
    run = LocalLauncher(LaunchConfig(nodes=1, nproc_per_node=a.ranks, job_id=f"mbench{os.getpid()}", run_dir=tmp,
                                     max_restarts=0, memory_budget_gb=a.budget_gb, attempt_timeout_s=1800))
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--out", tmp, "--ckpt-dir", tmp,
            "--hidden", str(a.hidden), "--layers", str(a.layers), "--heads", str(a.heads), "--vocab", str(a.vocab),
            "--seq", str(a.seq), "--repeats", str(a.repeats), "--warmup", str(a.warmup), "--budget-gb", str(a.budget_gb)] \
        + (["--early-open", a.early_open] if a.early_open else [])
    t0 = time.time()
    if not run.run(argv).ok:
        print(f"benchmark failed; logs kept in {tmp}", file=sys.stderr)
        return 1
    with open(os.path.join(tmp, "bench_result.json")) as f:
        out = report(json.load(f), a)
    out["wall_s"] = round(time.time() - t0, 1)
    shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        print(json.dumps(out))
        return 0 if all(out["checks"].values()) else 1
    mib = 2 ** 20
    print(f"{out['model']}; {out['layout']}: {out['state_bytes_total'] / mib:.0f} MiB of rank state "
          f"({out['state_bytes_per_rank'] / mib:.0f} MiB/rank); dist checkpoint {out['ckpt_bytes'] / mib:.0f} MiB; "
          f"medians of {a.repeats}; {out['wall_s']} s")
    print(f"training step           {out['step_s_median']:8.3f} s    (snapshot copy {out['copy_s_median'] * 1e3:.1f} ms, "
          f"overlapped with the step)")
    print(f"trainer stall/snapshot  {out['stall_ms_median']:8.3f} ms   (capture+submit {out['submit_ms_median']} ms, "
          f"wait in the next optimizer step {out['wait_ms_median']} ms; max {out['stall_ms_max']} ms; first snapshots, "
          f"allocating: {out['stall_ms_first_snapshots']} ms)")
    print(f"dist_checkpointing.save + fsync        {out['save_durable_s']:7.3f} s -> stall is "
          f"{out['ratio_save_durable_vs_stall']}x smaller (target >= 20x)")
    print(f"dist_checkpointing.save (page cache)   {out['save_pagecache_s']:7.3f} s -> stall is "
          f"{out['ratio_save_pagecache_vs_stall']}x smaller")
    print(f"restore from holder     {out['restore_s']:8.3f} s    (checksums verified; rank 0 phases "
          f"{out['restore_phases_s_rank0']})")
    print(f"copy floor (same bytes, one copy into the live tensors' memory, same run) {out['copy_floor_s']:7.3f} s -> "
          f"restore is {out['ratio_restore_vs_copy_floor']}x the floor (target <= 1.5x)")
    if a.early_open:
        print(f"early open ({a.early_open:6s})     {out['early_open_s']:8.3f} s    (before the restore, beside the trainer's set-up; "
              "not in the restore's time)")
    print(f"dist_checkpointing.load, warm cache    {out['load_warm_s']:7.3f} s -> restore is "
          f"{out['ratio_load_warm_vs_restore']}x faster (target >= 5x)")
    print(f"dist_checkpointing.load, cold cache    {out['load_cold_s']:7.3f} s -> restore is "
          f"{out['ratio_load_cold_vs_restore']}x faster (target >= 10x)")
    print(f"checks (all ranks): {out['checks']}")
    return 0 if all(out["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
