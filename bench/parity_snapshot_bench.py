"""Extra time per snapshot for parity vs the snapshot copy itself, measured in one training run.

    .venv/bin/python bench/parity_snapshot_bench.py [--nodes 3] [--m 1] [--d-model 512 --layers 4] [--steps 12] [--json]

N simulated nodes x 1 rank (DeepSpeed ZeRO-2 bf16, snapshot every step, parity group of N with
m parity shards). Every snapshot event carries the worker's copy time (live tensors -> holder
memory) and parity time (group vote, chunk exchange over gloo, ISA-L encode into the holder,
checksums, seal); the ratio of medians is the extra cost of parity per snapshot. Both run in the
snapshot worker, off the training loop; the stall the loop sees is reported too.
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json", action="store_true")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
