"""Restart cost: trainers forked from a pre-warmed fork server vs started cold (shardsafe.launch.prewarm), and
kill -> next iteration under ``shardsafe launch`` (torch elastic), torch's rendezvous polling vs shardsafe's.

    .venv/bin/python bench/restart_bench.py [--engine deepspeed|megatron] [--runs 5] [--steps 20] [--json]
    .venv/bin/python bench/restart_bench.py --launcher elastic [--runs 5] [--compare-early-open]
                                            [--model-args "--d-model 1024 ..."] [--holder-budget-gb 6]
    .venv/bin/python bench/restart_bench.py --launcher all [--runs 5]     # sbatch rows need root (local SLURM)

One job per run under the local launcher (2 simulated nodes x 2 ranks, one holder each, a snapshot every
step): rank 3 SIGKILLs itself at step --kill-at, the group restarts and restores from the holders, and
the job finishes. Runs alternate between cold starts (``preload=()``, the baseline) and forked starts
(``PRELOAD_DEEPSPEED`` / ``PRELOAD_MEGATRON``), so drift on this shared machine hits both alike. Per run,
from the event log:

* recovery: failure detected -> the last rank's ``train_ready`` of the restarted attempt (restart,
  imports, framework set-up and the restore from the holder);
* first start: ``attempt_start`` of attempt 0 -> its last ``train_ready`` (for the forked mode this
  excludes the fork server's imports, which run before it; they are reported separately);
* exit: the last iteration -> the launcher's ``attempt_end`` of the finishing attempt (the trainers'
  end: final state, process group, interpreter teardown);
* wall: the whole job, fork server included.

Medians over --runs of each mode; ratios are forked / cold (the baseline) of the same run of the script.

``--launcher elastic``: the same job under ``shardsafe launch``'s launcher (ElasticLauncher: one torchrun agent
per simulated node, c10d rendezvous, forked workers). Runs alternate between torch's own rendezvous polling
(``rendezvous_poll_s=1``, the baseline) and shardsafe's (the default, by job size: 10 ms here). Per run, from the
event log, the time from the SIGKILL (the injector's ``t_fault``) to the end of the restarted attempt's first
iteration, and its parts: detection (-> ``failure_detected``), re-rendezvous (-> the new round's
``attempt_start``), worker start and set-up (-> the last rank's ``restore_start``), restore (-> the last
``restore_end``), to the first step (-> the last ``train_ready``), the first iteration (-> the last rank's first
``iteration`` event).

``--launcher all``: kill -> next iteration with the same phases per launcher, shardsafe's defaults everywhere:
the local launcher (forked trainers), ``shardsafe launch``, and scripts/slurm/pretrain_deepspeed.sbatch on the
tests' local SLURM cluster (2 slurmd "nodes" on this host, scripts/slurm/local_cluster.sh; root only).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from shardsafe.launch import PRELOAD_DEEPSPEED, PRELOAD_MEGATRON, LaunchConfig, LocalLauncher  # noqa: E402
from shardsafe.launch.elastic import ElasticConfig, ElasticLauncher  # noqa: E402
from shardsafe.runcheck import read_jsonl  # noqa: E402

# The DeepSpeed example's model as this bench measures it (RESULTS' figures): wider than the example's default, which
# is sized for the tests; --model-args comes after it and wins.
DS_MODEL = ("--d-model", "128", "--seq", "32")


def one_run(a: argparse.Namespace, preload: tuple[str, ...], k: int) -> dict:
    d = tempfile.mkdtemp(prefix="restart-bench-")
    try:
        if a.engine == "deepspeed":
            cmd = [sys.executable, os.path.join(ROOT, "examples", "ds_pretrain_gpt.py"), "--steps", str(a.steps),
                   "--zero-stage", "2", "--dtype", "bf16", "--optimizer", a.optimizer, *DS_MODEL, "--out", d]
        else:
            cmd = [sys.executable, os.path.join(ROOT, "examples", "megatron_pretrain_gpt.py"), "--steps", str(a.steps),
                   "--tp", "2", "--bf16", "--shardsafe", "--out", d]
        cfg = LaunchConfig(nodes=2, nproc_per_node=2, job_id=f"rb{os.getpid()}x{k}", run_dir=d, max_restarts=1,
                           inject=f"kill-rank:3@{a.kill_at}", memory_budget_gb=a.holder_budget_gb, preload=preload)
        t0 = time.time()
        res = LocalLauncher(cfg).run(cmd)
        wall = time.time() - t0
        if not res.ok or res.attempts != 2:
            raise SystemExit(f"run failed ({res}); see {d}")
        ev = read_jsonl(os.path.join(d, "events.jsonl"))

        def last(kind: str, attempt: int) -> float:
            return max(e["t"] for e in ev if e["kind"] == kind and int(e.get("attempt") or 0) == attempt)

        detected = next(e["t"] for e in ev if e["kind"] == "failure_detected")
        start0 = next(e["t"] for e in ev if e["kind"] == "attempt_start" and int(e.get("attempt") or 0) == 0)
        pre = next((e["seconds"] for e in ev if e["kind"] == "prewarm_ready"), 0.0)
        done = next(e["t"] for e in ev if e["kind"] == "attempt_end" and e.get("cause") == "finished")
        return {"recovery_s": last("train_ready", 1) - detected, "first_start_s": last("train_ready", 0) - start0,
                "exit_s": done - last("iteration", 1), "wall_s": wall, "prewarm_s": pre}
    finally:
        shutil.rmtree(d, ignore_errors=True)


PHASES = (("detect", "failure_detected"), ("rendezvous", "attempt_start"), ("worker start", "restore_start"),
          ("restore", "restore_end"), ("to the first step", "train_ready"), ("first iteration", "iteration"))


def kill_phases(ev: list[dict]) -> dict:
    """From a run's event log: the SIGKILL (the injector's ``t_fault``) to the end of the restarted attempt's first
    iteration, and its parts (PHASES), each from the end of the previous one."""
    t_fault = next(e["t_fault"] for e in ev if e["kind"] == "fault_injected")
    marks = {"kill": t_fault}
    for name, kind in PHASES:
        if kind in ("failure_detected", "attempt_start"):
            marks[name] = min(e["t"] for e in ev if e["kind"] == kind and int(e.get("attempt") or 0) ==
                              (0 if kind == "failure_detected" else 1))
        else:   # the last rank to get there (all of them must before the group trains)
            by_rank: dict = {}
            for e in ev:
                if e["kind"] == kind and int(e.get("attempt") or 0) == 1:
                    by_rank.setdefault(e.get("rank"), e["t"])   # the rank's first such event of attempt 1
            marks[name] = max(by_rank.values())
    out, prev = {}, t_fault
    for name, _ in PHASES:
        out[name] = marks[name] - prev
        prev = marks[name]
    out["kill -> next iteration"] = marks["first iteration"] - t_fault
    return out


def _train_cmd(a: argparse.Namespace, d: str) -> list[str]:
    if a.engine == "deepspeed":
        return [os.path.join(ROOT, "examples", "ds_pretrain_gpt.py"), "--steps", str(a.steps), "--zero-stage", "2",
                "--dtype", "bf16", "--optimizer", a.optimizer, *DS_MODEL, "--out", d] + shlex.split(a.model_args)
    return [os.path.join(ROOT, "examples", "megatron_pretrain_gpt.py"), "--steps", str(a.steps), "--tp", "2",
            "--bf16", "--shardsafe", "--out", d] + shlex.split(a.model_args)


def one_elastic_run(a: argparse.Namespace, poll: float, k: int) -> dict:
    d = tempfile.mkdtemp(prefix="restart-bench-elastic-")
    try:
        preload = PRELOAD_DEEPSPEED if a.engine == "deepspeed" else PRELOAD_MEGATRON
        cfg = ElasticConfig(nodes=2, nproc_per_node=2, run_dir=d, job_id=f"rbe{os.getpid()}x{k}", max_restarts=1,
                            inject=f"kill-rank:3@{a.kill_at}", memory_budget_gb=a.holder_budget_gb, preload=preload,
                            rendezvous_poll_s=poll, timeout_s=600)
        res = ElasticLauncher(cfg).run(_train_cmd(a, d))
        if not res.ok or res.attempts != 2:
            raise SystemExit(f"run failed ({res}); see {d}")
        ev = read_jsonl(os.path.join(d, "events.jsonl"))
        # how many of the restarted attempt's ranks took their early open's verification (holder/early_open.py)
        early = sum(1 for e in ev if e.get("kind") == "restore_end" and int(e.get("attempt") or 0) == 1
                    and (e.get("notes") or {}).get("early_verify") == "used")
        return {**kill_phases(ev), "ranks early-verified": early}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def one_local_kill_run(a: argparse.Namespace, k: int) -> dict:
    """The local launcher (forked trainers): kill -> next iteration, same phases."""
    d = tempfile.mkdtemp(prefix="restart-bench-local-")
    try:
        preload = PRELOAD_DEEPSPEED if a.engine == "deepspeed" else PRELOAD_MEGATRON
        cfg = LaunchConfig(nodes=2, nproc_per_node=2, job_id=f"rbl{os.getpid()}x{k}", run_dir=d, max_restarts=1,
                           inject=f"kill-rank:3@{a.kill_at}", memory_budget_gb=a.holder_budget_gb, preload=preload)
        res = LocalLauncher(cfg).run([sys.executable] + _train_cmd(a, d))
        if not res.ok or res.attempts != 2:
            raise SystemExit(f"run failed ({res}); see {d}")
        return kill_phases(read_jsonl(os.path.join(d, "events.jsonl")))
    finally:
        shutil.rmtree(d, ignore_errors=True)


class LocalSlurm:
    """The local SLURM cluster of the tests (scripts/slurm/local_cluster.sh): 2 slurmd "nodes" on this host."""

    def __init__(self) -> None:
        import subprocess
        self.sp = subprocess
        self.base = tempfile.mkdtemp(prefix="restart-bench-slurm-", dir="/tmp")
        os.chmod(self.base, 0o755)   # munged wants every parent of its socket world-executable
        d = os.path.join(self.base, "c")
        self.env = {**os.environ, "SLURM_CI_DIR": d, "SLURM_CI_NODES": "2",
                    "SLURM_CI_PORT": str(17600 + os.getpid() % 300 * 3)}
        up = subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm", "local_cluster.sh"), "up"], env=self.env,
                            capture_output=True, text=True, timeout=900)
        if up.returncode != 0:
            raise SystemExit(f"local SLURM cluster did not come up:\n{up.stderr[-2000:]}")
        self.env["SLURM_CONF"] = f"{d}/etc/slurm.conf"

    def run(self, a: argparse.Namespace, k: int) -> dict:
        d = tempfile.mkdtemp(prefix="job-", dir=self.base)
        os.makedirs(os.path.join(d, "out"))
        preload = PRELOAD_DEEPSPEED if a.engine == "deepspeed" else PRELOAD_MEGATRON
        script = "pretrain_deepspeed.sbatch" if a.engine == "deepspeed" else "pretrain_megatron.sbatch"
        env = {**self.env, "SS_PYTHON": sys.executable, "SS_RUN_DIR": os.path.join(d, "run"),
               "SS_HOLDER_DIR": os.path.join(d, "holders"), "SS_MEMORY_BUDGET_GB": str(a.holder_budget_gb), "SS_SPARES": "0",
               "SS_NPROC_PER_NODE": "2", "SS_INJECT": f"kill-rank:3@{a.kill_at}", "SS_PRELOAD": ",".join(preload),
               "SS_SCRIPT_ARGS": " ".join(_train_cmd(a, os.path.join(d, "out"))[1:]), "DS_ACCELERATOR": "cpu",
               "OMP_NUM_THREADS": "1"}
        sub = self.sp.run(["sbatch", "--parsable", "-N2", f"--output={d}/job.out",
                           os.path.join(ROOT, "scripts", "slurm", script)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
        if sub.returncode != 0:
            raise SystemExit(f"sbatch failed: {sub.stderr}")
        jid, deadline, state = sub.stdout.strip().split(";")[0], time.time() + 600, ""
        while time.time() < deadline:
            out = self.sp.run(["scontrol", "show", "job", "-o", jid], env=env, capture_output=True, text=True,
                              timeout=30).stdout
            state = (out.split("JobState=", 1)[1].split()[0] if "JobState=" in out else "")
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                break
            time.sleep(0.3)
        if state != "COMPLETED":
            try:
                with open(f"{d}/job.out", errors="replace") as f:
                    tail = f.read()[-3000:]
            except OSError:
                tail = "(no job output)"
            logs = os.path.join(d, "run", "logs")
            for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
                with open(os.path.join(logs, name), errors="replace") as f:
                    tail += f"\n==== {name}\n" + f.read()[-1500:]
            raise SystemExit(f"sbatch job {jid} ended {state or 'never'}:\n{tail}")
        ev = read_jsonl(os.path.join(d, "run", "events.jsonl"))
        if sum(1 for e in ev if e["kind"] == "attempt_start") != 2:
            raise SystemExit(f"sbatch job {jid}: expected 2 attempts; see {d}")
        shutil.rmtree(d, ignore_errors=True)
        return kill_phases(ev)

    def close(self) -> None:
        self.sp.run(["bash", os.path.join(ROOT, "scripts", "slurm", "local_cluster.sh"), "down"], env=self.env,
                    capture_output=True, text=True, timeout=180)
        shutil.rmtree(self.base, ignore_errors=True)


def main_launchers(a: argparse.Namespace) -> None:
    """kill -> next iteration per launcher: local (forked), shardsafe launch, sbatch on the local SLURM cluster."""
    slurm = None
    if os.geteuid() == 0 and (shutil.which("sbatch") or shutil.which("apt-get")):
        slurm = LocalSlurm()
    else:
        print("sbatch: not measured (the local SLURM cluster needs root and slurm packages or apt-get)", file=sys.stderr)
    runners = {"local launcher": lambda k: one_local_kill_run(a, k),
               "shardsafe launch": lambda k: one_elastic_run(a, -1.0, 1000 + k)}
    if slurm is not None:
        runners["sbatch (local SLURM)"] = lambda k: slurm.run(a, k)
    got: dict[str, list[dict]] = {m: [] for m in runners}
    try:
        for k in range(a.runs):
            order = list(runners) if k % 2 == 0 else list(runners)[::-1]
            for mode in order:
                r = runners[mode](k)
                got[mode].append(r)
                print(f"run {k} {mode:22s}: kill -> next iteration {r['kill -> next iteration']:.2f} s", file=sys.stderr,
                      flush=True)
    finally:
        if slurm is not None:
            slurm.close()
    med = {m: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for m, rs in got.items()}
    spread = {m: [round(r["kill -> next iteration"], 3) for r in rs] for m, rs in got.items()}
    out = {"engine": a.engine, "runs": a.runs, "ranks": 4, "medians": med, "per_run": spread,
           "load_average": os.getloadavg()[0]}
    if a.json:
        print(json.dumps(out))
        return
    print(f"kill -> next iteration per launcher: {a.engine}, 2 nodes x 2 ranks, forked workers, rank 3 SIGKILLed at "
          f"step {a.kill_at}; medians of {a.runs} runs per launcher (alternating order)")
    modes = list(med)
    print(f"  {'phase':26s} " + " ".join(f"{m:>22s}" for m in modes))
    for key in [n for n, _ in PHASES] + ["kill -> next iteration"]:
        print(f"  {key:26s} " + " ".join(f"{med[m][key]:20.3f} s" for m in modes))
    for m in modes:
        print(f"  {m}: " + " / ".join(f"{x:.2f}" for x in spread[m]) + " s")


def main_elastic(a: argparse.Namespace) -> None:
    if a.compare_early_open:
        # Both with shardsafe's polling; the trainers read SHARDSAFE_EARLY_OPEN from the launcher's environment.
        modes = {"early open: map": ("map", -1.0), "early open: verify": ("1", -1.0)}
        baseline = "the restore verifying (SHARDSAFE_EARLY_OPEN=map)"
    else:
        modes = {"torch poll 1 s": (None, 1.0), "shardsafe poll": (None, -1.0)}
        baseline = "torch's rendezvous polling (1 s)"
    names = list(modes)
    got: dict[str, list[dict]] = {m: [] for m in names}
    saved = os.environ.get("SHARDSAFE_EARLY_OPEN")
    try:
        for k in range(a.runs):
            for mode in (names if k % 2 == 0 else names[::-1]):
                env, poll = modes[mode]
                if env is not None:
                    os.environ["SHARDSAFE_EARLY_OPEN"] = env
                r = one_elastic_run(a, poll, 2 * k + (mode != names[0]))
                got[mode].append(r)
                print(f"run {k} {mode:18s}: kill -> next iteration {r['kill -> next iteration']:.2f} s",
                      file=sys.stderr, flush=True)
    finally:
        if saved is None:
            os.environ.pop("SHARDSAFE_EARLY_OPEN", None)
        else:
            os.environ["SHARDSAFE_EARLY_OPEN"] = saved
    med = {m: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for m, rs in got.items()}
    base, tuned = med[names[0]], med[names[1]]
    out = {"engine": a.engine, "launcher": "shardsafe launch (torch elastic)", "runs": a.runs, "ranks": 4,
           "medians": med, "ratio": tuned["kill -> next iteration"] / base["kill -> next iteration"],
           "load_average": os.getloadavg()[0]}
    if a.json:
        print(json.dumps(out))
        return
    print(f"kill -> next iteration under shardsafe launch: {a.engine}, 2 nodes x 2 ranks, forked workers, rank 3 "
          f"SIGKILLed at step {a.kill_at}; medians of {a.runs} runs per mode (alternating); baseline = {baseline} "
          "in the same run" + (f"; trainer arguments {a.model_args!r}" if a.model_args else ""))
    print(f"  {'phase':26s} {names[0]:>18s} {names[1]:>18s}")
    for key in [n for n, _ in PHASES] + ["kill -> next iteration"]:
        print(f"  {key:26s} {base[key]:16.3f} s {tuned[key]:16.3f} s")
    print(f"  {names[1]} / {names[0]}: {out['ratio']:.2f}x")
    print(f"  ranks whose restore took the early verification (median of 4): {base['ranks early-verified']:.0f} / "
          f"{tuned['ranks early-verified']:.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["deepspeed", "megatron"], default="deepspeed")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kill-at", type=int, default=8)
    p.add_argument("--optimizer", default="torch-adamw",
                   help="the DeepSpeed example's --optimizer (fused-adamw: DeepSpeed's default FusedAdam, whose CPU "
                        "op every trainer loads at start)")
    p.add_argument("--model-args", default="",
                   help="more arguments for the example trainer (--launcher elastic|all), e.g. a larger model: "
                        "'--vocab 8192 --d-model 1024 --layers 8 --heads 16' (with --holder-budget-gb to hold it)")
    p.add_argument("--holder-budget-gb", type=float, default=1.0, help="each node's holder's memory budget")
    p.add_argument("--compare-early-open", action="store_true",
                   help="--launcher elastic: alternate the early open mapping only (SHARDSAFE_EARLY_OPEN=map, the "
                        "baseline) and mapping and verifying (the default) instead of the two rendezvous pollings")
    p.add_argument("--json", action="store_true")
    p.add_argument("--launcher", choices=["local", "elastic", "all"], default="local",
                   help="local: forked vs cold restarts under the local launcher; elastic: kill -> next iteration "
                        "under shardsafe launch, torch's rendezvous polling vs shardsafe's; all: kill -> next "
                        "iteration per launcher (local, shardsafe launch, sbatch on the local SLURM cluster)")
    a = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if a.launcher == "elastic":
        main_elastic(a)
        return
    if a.launcher == "all":
        main_launchers(a)
        return
    preload = PRELOAD_DEEPSPEED if a.engine == "deepspeed" else PRELOAD_MEGATRON
    got: dict[str, list[dict]] = {"cold": [], "forked": []}
    for k in range(a.runs):
        for mode in (("cold", "forked") if k % 2 == 0 else ("forked", "cold")):
            r = one_run(a, () if mode == "cold" else preload, 2 * k + (mode == "forked"))
            got[mode].append(r)
            print(f"run {k} {mode:6s}: recovery {r['recovery_s']:.2f} s, first start {r['first_start_s']:.2f} s, "
                  f"wall {r['wall_s']:.2f} s" + (f" (fork server ready in {r['prewarm_s']:.2f} s)" if r["prewarm_s"] else ""),
                  file=sys.stderr, flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in got.items()}
    out = {"engine": a.engine, "runs": a.runs, "steps": a.steps, "ranks": 4, "preload": list(preload),
           "cold": med["cold"], "forked": med["forked"],
           "recovery_ratio": med["forked"]["recovery_s"] / med["cold"]["recovery_s"],
           "first_start_ratio": med["forked"]["first_start_s"] / med["cold"]["first_start_s"],
           "exit_ratio": med["forked"]["exit_s"] / med["cold"]["exit_s"],
           "wall_ratio": med["forked"]["wall_s"] / med["cold"]["wall_s"],
           "load_average": os.getloadavg()[0]}
    if a.json:
        print(json.dumps(out))
        return
    print(f"restart bench: {a.engine}, 2 nodes x 2 ranks, {a.steps} steps, one rank SIGKILLed at step {a.kill_at}; "
          f"medians of {a.runs} runs per mode (alternating); baseline = cold starts in the same run")
    print(f"  preload: {','.join(preload)} (fork server ready in {med['forked']['prewarm_s']:.2f} s, before attempt 0)")
    for key, label in (("recovery_s", "recovery (failure detected -> training again)"),
                       ("first_start_s", "first start (attempt 0 -> training)"),
                       ("exit_s", "exit (last iteration -> attempt end)"), ("wall_s", "job wall time")):
        c, f = med["cold"][key], med["forked"][key]
        print(f"  {label:48s} cold {c:6.2f} s   forked {f:6.2f} s   forked/cold {f / c:.2f}x  ({c / f:.1f}x faster)")


if __name__ == "__main__":
    main()
