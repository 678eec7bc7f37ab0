"""Run the tiny DeepSpeed GPT under the local launcher (real processes, real SIGKILL) and compare."""
import os
import sys
import uuid

from shardsafe.launch import PRELOAD_DEEPSPEED, LaunchConfig, LocalLauncher
from shardsafe.runcheck import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "ds_pretrain_gpt.py")


def run_job(run_dir, *, stage, dtype, steps, nodes=2, nproc=1, inject="", extra=(), shardsafe=True,
            max_restarts=3, budget_gb=0.5, start_holders=True, job_id=None, watcher=None, preload=None):
    """Protected runs fork their trainers from a pre-warmed server (shardsafe.prewarm); unprotected
    (reference) runs start every trainer cold, so each bit-exact comparison also checks that a forked
    trainer computes what a cold one does."""
    if preload is None:
        preload = PRELOAD_DEEPSPEED if shardsafe else ()
    cfg = LaunchConfig(nodes=nodes, nproc_per_node=nproc, job_id=job_id or f"t{uuid.uuid4().hex[:8]}",
                       run_dir=str(run_dir), inject=inject, max_restarts=max_restarts, memory_budget_gb=budget_gb,
                       start_holders=start_holders and shardsafe, attempt_timeout_s=300, preload=tuple(preload))
    launcher = LocalLauncher(cfg)
    cmd = [sys.executable, SCRIPT, "--steps", str(steps), "--zero-stage", str(stage), "--dtype", dtype,
           "--out", str(run_dir), *extra] + ([] if shardsafe else ["--no-shardsafe"])
    if watcher is not None:
        watcher(launcher)
    return launcher.run(cmd)


def restores(run_dir):
    """attempt -> restored version (min over ranks; -1 = fresh start)."""
    out = {}
    for e in read_jsonl(os.path.join(str(run_dir), "events.jsonl")):
        if e.get("kind") == "restore_end":
            a = int(e.get("attempt") or 0)
            out[a] = min(out.get(a, e["version"]), e["version"])
    return out


def trainer_logs(run_dir):
    txt = ""
    for f in sorted(os.listdir(run_dir)):
        if f.startswith("trainer_rank"):
            with open(os.path.join(run_dir, f), errors="replace") as fh:
                txt += fh.read()
    return txt
