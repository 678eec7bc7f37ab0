"""Extra time per snapshot for parity vs the snapshot copy itself, measured in one training run.

    .venv/bin/python bench/parity_snapshot_bench.py [--nodes 3] [--m 1] [--d-model 512 --layers 4] [--steps 12] [--json]

N simulated nodes x 1 rank (DeepSpeed ZeRO-2 bf16, snapshot every step, parity group of N with
m parity shards). Every snapshot event carries the worker's copy time (live tensors -> holder
memory) and parity time (group vote, chunk exchange over gloo, ISA-L encode into the holder,
checksums, seal); the ratio of medians is the extra cost of parity per snapshot. Both run in the
snapshot worker, off the training loop; the stall the loop sees is reported too.

Then, in the same run, the same pipeline without training (``alone``): N forked ranks with their
own holders snapshot a state of the same size through SnapshotPipeline + ParityExchange, so the
parity cost can be told apart from the contention with training on a machine with few cores.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "ds_pretrain_gpt.py")


def _alone_rank(rank: int, world: int, root: str, nbytes: int, m: int, reps: int) -> dict:
    """One rank of the no-training run: snapshot ``nbytes`` of state ``reps`` times with parity."""
    import torch
    import torch.distributed as dist
    from shardsafe.parity.exchange import ParityExchange, gather_places, plan_parity
    from shardsafe.holder.client import HolderClient
    from shardsafe.holder.paths import HolderPaths
    from shardsafe.snapshot.pipeline import GlooAgreement, SnapshotPipeline
    from shardsafe.snapshot.state import RankState

    client = HolderClient(HolderPaths(root, "alone", f"n{rank}"), timeout_s=30).connect()
    places = gather_places(rank, world, f"n{rank}", rank)
    ex = ParityExchange(plan_parity(places, group_size=0, parity_shards=m), rank, timeout_s=30)
    pipe = SnapshotPipeline(client, rank=rank, world_size=world, node=f"n{rank}", agreement=GlooAgreement(), parity=ex)
    g = torch.Generator().manual_seed(rank)
    n = nbytes // 4
    st = {"master": torch.randn(n // 3, generator=g), "exp_avg": torch.randn(n // 3, generator=g),
          "exp_avg_sq": torch.rand(n - 2 * (n // 3), generator=g)}
    for v in range(1, reps + 1):
        dist.barrier()
        pipe.submit(v, RankState(dict(st), {"v": v}))
        if not pipe.flush(timeout=120):
            raise RuntimeError(f"snapshot {v} not committed: {pipe.history[-1].error}")
    pipe.close()
    hist = pipe.history[2:]   # the first two allocate slots and staging
    return {"copy_s": [h.copy_s for h in hist], "parity_s": [h.parity_s for h in hist],
            "phases": [h.parity_phases for h in hist]}


def forked_ranks(nodes: int, job: str, budget_gb: float, target, *args, timeout_s: float = 600) -> list[dict]:
    """Run ``target(rank, nodes, root, *args)`` on ``nodes`` forked ranks (gloo over a FileStore), one holder per
    simulated node (``HolderPaths(root, job, f"n{rank}")``, ``budget_gb`` each). Returns each rank's result (a
    JSON-able dict), by rank. bench/rebuild_bench.py runs its ranks through this too."""
    import multiprocessing as mp
    import subprocess
    import time
    from datetime import timedelta
    from shardsafe.holder.client import holder_command
    from shardsafe.holder.paths import HolderPaths
    root = tempfile.mkdtemp(prefix=f"shardsafe-bench-{job}-")
    holders = []
    try:
        for r in range(nodes):
            proc = subprocess.Popen(holder_command(HolderPaths(root, job, f"n{r}"), budget_gb=budget_gb),
                                    stdout=subprocess.PIPE)
            if not proc.stdout.readline().startswith(b"holder ready"):
                raise RuntimeError("holder did not start")
            holders.append(proc)

        def child(rank: int) -> None:
            import torch
            torch.set_num_threads(1)
            code = 0
            try:
                store = torch.distributed.FileStore(os.path.join(root, "store"), nodes)
                torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=nodes,
                                                     timeout=timedelta(seconds=timeout_s))
                with open(os.path.join(root, f"r{rank}.json"), "w") as f:
                    json.dump(target(rank, nodes, root, *args), f)
            except BaseException as e:  # noqa: BLE001
                code = 1
                print(f"rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
            finally:
                os._exit(code)
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=child, args=(r,)) for r in range(nodes)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        if any(p.exitcode != 0 for p in procs):
            for p in procs:
                if p.is_alive():
                    p.kill()
            raise RuntimeError("a rank failed (its error is above)")
        return [json.load(open(os.path.join(root, f"r{r}.json"))) for r in range(nodes)]
    finally:
        for proc in holders:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def run_alone(nodes: int, m: int, nbytes: int, reps: int = 9) -> dict:
    """The pipeline with parity on ``nodes`` forked ranks, one holder each, no training."""
    per = forked_ranks(nodes, "alone", nbytes * 8 / 2**30 + 0.5, _alone_rank, nbytes, m, reps)
    med = statistics.median
    # Per snapshot, the slowest rank's time (the group commits when its slowest member is done).
    copy = [max(p["copy_s"][i] for p in per) for i in range(len(per[0]["copy_s"]))]
    parity = [max(p["parity_s"][i] for p in per) for i in range(len(per[0]["parity_s"]))]
    keys = per[0]["phases"][0].keys()
    return {"copy_ms": round(med(copy) * 1e3, 2), "parity_ms": round(med(parity) * 1e3, 2),
            "ratio_parity_vs_copy": round(med(parity) / med(copy), 3), "snapshots": len(copy),
            "parity_phases_ms_rank0": {k: round(med(ph[k] for ph in per[0]["phases"]) * 1e3, 2) for k in keys}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-alone", action="store_true", help="skip the run without training")
    a = p.parse_args()
    from shardsafe.launch import LaunchConfig, LocalLauncher
    from shardsafe.runcheck import read_jsonl
    tmp = tempfile.mkdtemp(prefix="shardsafe-paritybench-")
    run = LocalLauncher(LaunchConfig(nodes=a.nodes, nproc_per_node=1, job_id=f"pb{os.getpid()}", run_dir=tmp,
                                     max_restarts=0, memory_budget_gb=4, attempt_timeout_s=1800))
    res = run.run([sys.executable, EXAMPLE, "--steps", str(a.steps), "--zero-stage", "2", "--dtype", "bf16",
                   "--vocab", str(a.vocab), "--d-model", str(a.d_model), "--layers", str(a.layers), "--heads", "8",
                   "--shardsafe-json", json.dumps({"parity_shards": a.m}), "--out", tmp])
    if not res.ok:
        print(f"benchmark failed; logs kept in {tmp}", file=sys.stderr)
        return 1
    snaps = [e for e in read_jsonl(os.path.join(tmp, "events.jsonl")) if e.get("kind") == "snapshot" and e.get("committed")]
    shutil.rmtree(tmp, ignore_errors=True)
    snaps = [e for e in snaps if e["version"] > 2]   # the first snapshots allocate slots and staging
    med = statistics.median
    copy_s, parity_s = med(e["copy_s"] for e in snaps), med(e["parity_s"] for e in snaps)
    out = {"nodes": a.nodes, "k": a.nodes - a.m, "m": a.m, "bytes_per_rank": snaps[-1]["bytes"], "snapshots": len(snaps),
           "copy_ms": round(copy_s * 1e3, 2), "parity_ms": round(parity_s * 1e3, 2),
           "hash_ms": round(med(e["hash_s"] for e in snaps) * 1e3, 2),
           "ratio_parity_vs_copy": round(parity_s / copy_s, 3),
           "stall_ms_median": round(med(e["stall_s"] for e in snaps) * 1e3, 3),
           "parity_phases_ms": {k: round(med(e["parity_phases"][k] for e in snaps) * 1e3, 2)
                                for k in snaps[-1].get("parity_phases", {})}}
    if not a.no_alone:
        out["alone"] = run_alone(a.nodes, a.m, snaps[-1]["bytes"])
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"{a.nodes} nodes x 1 rank, RS(k={out['k']}, m={a.m}), {out['bytes_per_rank'] / 2**20:.1f} MiB per rank, "
          f"{out['snapshots']} snapshots (medians)")
    print(f"snapshot copy   {out['copy_ms']:8.2f} ms")
    print(f"checksums       {out['hash_ms']:8.2f} ms")
    print(f"parity          {out['parity_ms']:8.2f} ms  -> {out['ratio_parity_vs_copy']:.2f}x of the copy time "
          f"(target <= 0.5x); phases {out['parity_phases_ms']} ms")
    print(f"training stall  {out['stall_ms_median']:8.3f} ms per snapshot")
    if "alone" in out:
        al = out["alone"]
        print(f"without training (same state size, {al['snapshots']} snapshots, slowest rank): copy {al['copy_ms']:.2f} ms, "
              f"parity {al['parity_ms']:.2f} ms -> {al['ratio_parity_vs_copy']:.2f}x; rank 0 phases {al['parity_phases_ms_rank0']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
