"""A protected DeepSpeed trainer started cold (plain torchrun), with and without py-cpuinfo's answer kept for the boot.

    .venv/bin/python bench/cold_start_bench.py [--runs 6] [--optimizer fused-adamw]

A trainer that torchrun restarts without a fork server imports everything itself, and DeepSpeed's CPU op builders
(FusedAdam's CPU build: DeepSpeed's default optimizer; CPUAdam and friends under offload) ask py-cpuinfo for the
CPU's flags, a Python subprocess per call (adapters/deepspeed/prewarm.py). The DeepSpeed adapter answers those calls from
memory, and from this boot's answer in the holder directory when an earlier process left it there. Each run is one
cold `torchrun --nproc-per-node 1 examples/ds_pretrain_gpt.py --steps 1` (its own job id and holder directory's
cache file as the mode says), timed from the command's start to its exit; runs alternate between the modes:
  * deepspeed (the baseline): the adapter's memo switched off by a wrapper around the script (this file's
    NO_MEMO), so DeepSpeed asks py-cpuinfo itself, twice per op load, as a protected trainer did before;
  * asked: the holder directory has no answer of this boot (the trainer asks py-cpuinfo once and keeps it);
  * kept: the answer of this boot is there (what a restarted trainer finds).
Medians of --runs per mode, each against the baseline.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_MEMO = """
import runpy, sys
from shardsafe.adapters import deepspeed as ss_ds
ss_ds.memo_cpu_info = lambda *a, **k: None   # the baseline: DeepSpeed asks py-cpuinfo itself
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def one_run(holder_dir: str, out: str, optimizer: str, wrapper: str = "") -> float:
    job = f"coldbench-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, SHARDSAFE_HOLDER_DIR=holder_dir, SHARDSAFE_JOB_ID=job, DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1")
    env.pop("SHARDSAFE_RUN_DIR", None)
    t = time.perf_counter()
    script = [wrapper] if wrapper else []
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                        *script, os.path.join(ROOT, "examples", "ds_pretrain_gpt.py"), "--steps", "1", "--optimizer",
                        optimizer, "--d-model", "128", "--seq", "32", "--out", out],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    s = time.perf_counter() - t
    subprocess.run(["pkill", "-f", f"--job-id {job}"], capture_output=True)   # the detached holder it started
    if p.returncode != 0:
        raise SystemExit(f"trainer failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--optimizer", default="fused-adamw")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="shardsafe-coldbench-")
    holders, out = os.path.join(work, "holders"), os.path.join(work, "out")
    os.makedirs(out)
    wrapper = os.path.join(work, "no_memo.py")
    with open(wrapper, "w") as f:
        f.write(NO_MEMO)
    times: dict[str, list[float]] = {"deepspeed": [], "asked": [], "kept": []}
    try:
        for i in range(a.runs):
            for mode in times:
                if mode != "kept":
                    for f in glob.glob(os.path.join(holders, "cpuinfo-*.json")):
                        os.unlink(f)
                times[mode].append(one_run(holders, out, a.optimizer, wrapper if mode == "deepspeed" else ""))
                print(f"run {i} {mode}: {times[mode][-1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"cold protected trainer, --optimizer {a.optimizer}, start -> 1 step -> exit, medians of {a.runs}, "
          "against deepspeed (py-cpuinfo asked by DeepSpeed itself):")
    base = med["deepspeed"]
    for m, v in times.items():
        print(f"  {m:9s} {med[m]:.2f} s  {med[m] / base:.2f}x  {med[m] - base:+.2f} s  (runs "
              f"{', '.join(f'{x:.2f}' for x in sorted(v))})")


if __name__ == "__main__":
    main()
