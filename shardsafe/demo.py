"""`shardsafe demo`: train a tiny GPT on simulated nodes, kill a trainer mid-run, restore from RAM.

Two runs of the same job: an uninterrupted reference (plain deepspeed.initialize) and a protected
run that takes a real SIGKILL; the demo then checks every loss and every rank's final state bit for
bit, and reports what the restore cost.

``--shrink`` (shardsafe/demo_shrink.py): no spare node; one is lost, the job continues at a smaller data-parallel
size and grows back, compared with the framework's own reshard.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .launch.local import LaunchConfig, LocalLauncher
from .launch.presets import PRESETS, without_runtime

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def summarize(run_dir: str, world: int) -> dict[str, Any]:
    """Restores, tiers, lost iterations and stalls, from the run's event log and loss files."""
    from .runcheck import losses_by_attempt, read_jsonl   # torch: imported only when a demo runs
    ev = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    by_attempt = [losses_by_attempt(run_dir, r) for r in range(world)]
    restores = [e for e in ev if e.get("kind") == "restore_end"]
    restored = {}   # attempt -> (version, max seconds over ranks, tier)
    for e in restores:
        a = int(e.get("attempt") or 0)
        v, s, t = restored.get(a, (e["version"], 0.0, e["tier"]))
        restored[a] = (min(v, e["version"]), max(s, e["seconds"]), e["tier"])
    lost = 0
    for a, (version, _, _) in sorted(restored.items()):
        if a == 0 or version < 0:
            continue
        done = [max(b.get(a - 1, [0])) for b in by_attempt]   # steps finished by every rank before the failure
        lost += max(0, min(done) - version)
    rec = [restored[a] for a in sorted(restored) if a > 0 and restored[a][0] >= 0]
    rebuild_s: dict[int, float] = {}
    for e in restores:
        a = int(e.get("attempt") or 0)
        rebuild_s[a] = max(rebuild_s.get(a, 0.0), float(e.get("rebuild_seconds") or 0.0))
    stalls = [e["stall_s"] * 1e3 for e in ev if e.get("kind") == "snapshot"]
    return {
        "restores": len(rec),
        "restore_tier": rec[-1][2] if rec else "none",
        "restore_tiers": [r[2] for r in rec],
        "node_losses": sum(1 for e in ev if e.get("kind") == "failure_detected" and e.get("cause") == "node_loss"),
        "rebuilt_bytes": sum(int(e.get("rebuilt_bytes") or 0) for e in restores),
        "rebuild_seconds": round(sum(rebuild_s.values()), 4),
        "restored_versions": [r[0] for r in rec],
        "lost_iterations": lost,
        "restore_seconds": round(sum(r[1] for r in rec), 4),
        "snapshot_stall_ms_median": round(statistics.median(stalls), 3) if stalls else None,
        "snapshots": len(stalls),
        "snapshots_committed": sum(1 for e in ev if e.get("kind") == "snapshot" and e.get("committed")),
        "restarts_in_place": _restarts_in_place(ev, world),
        "prewarm": next(({"preload": e.get("preload"), "seconds": e.get("seconds")} for e in ev
                         if e.get("kind") == "prewarm_ready"), None),
    }


def tor_accounting_check(rep, wall_s: float) -> dict[str, Any]:
    """Does the TOR report account for the run? T_obs within 2 % of the wall time the launcher measured,
    and the breakdown summing to T_obs - T_opt."""
    gap = rep.t_obs - rep.t_opt - sum(rep.breakdown.values())
    off = abs(rep.t_obs - wall_s) / wall_s if wall_s > 0 else float("inf")
    return {"tor_t_obs": round(rep.t_obs, 3), "tor_t_opt": round(rep.t_opt, 3),
            "tor_t_obs_vs_wall": round(off, 5), "tor_breakdown_gap_s": round(gap, 9),
            "tor_accounted": bool(off <= 0.02 and abs(gap) <= 1e-6)}


@dataclass
class _Plan:
    """What the demo runs for one engine: the example script, its arguments, and how to describe it."""
    script: str
    common: list
    layout: str
    plain: str          # how the reference run trains (no shardsafe)
    protect: list       # arguments of the protected run
    unprotect: list     # arguments of the reference run
    stage: int | None   # DeepSpeed's zero_optimization.stage


def _plan(a: argparse.Namespace, world: int) -> _Plan:
    if a.engine == "megatron":
        if world % (a.tp * a.pp):
            raise ConfigError(f"--tp {a.tp} x --pp {a.pp} does not divide the {world} ranks "
                              f"(--nnodes {a.nodes} x --nproc-per-node {a.nproc_per_node}); pick sizes whose "
                              "product divides it")
        return _Plan(str(EXAMPLES / "megatron_pretrain_gpt.py"),
                     ["--steps", str(a.steps), "--tp", str(a.tp), "--pp", str(a.pp)] + (["--bf16"] if a.dtype == "bf16" else []),
                     f"TP{a.tp} x PP{a.pp} x DP{world // (a.tp * a.pp)}, DistributedOptimizer, {a.dtype}",
                     "plain megatron-core", ["--shardsafe", "--shardsafe-memory-budget-gb", repr(a.memory_budget_gb)],
                     [], None)
    if a.engine == "deepspeed-3d":
        pp = a.pp if a.pp > 1 else 2
        if world % pp:
            raise ConfigError(f"--pp {pp} does not divide the {world} ranks (--nnodes {a.nodes} x --nproc-per-node "
                              f"{a.nproc_per_node}); pick a stage count that divides it")
        stage = 0 if a.dtype == "bf16" else 1   # bf16 with stage 0 under a pipeline is BF16_Optimizer; fp32: ZeRO-1
        return _Plan(str(EXAMPLES / "ds_pretrain_gpt.py"),
                     ["--steps", str(a.steps), "--pp", str(pp), "--zero-stage", str(stage), "--dtype", a.dtype,
                      "--optimizer", a.optimizer],
                     f"PipelineModule PP{pp} x DP{world // pp} (tied embedding), "
                     + ("BF16_Optimizer" if stage == 0 else "ZeRO-1") + f", {a.dtype}",
                     "plain deepspeed.initialize", [], ["--no-shardsafe"], stage)
    return _Plan(str(EXAMPLES / "ds_pretrain_gpt.py"),
                 ["--steps", str(a.steps), "--zero-stage", str(a.zero_stage), "--dtype", a.dtype, "--optimizer",
                  a.optimizer],
                 f"ZeRO-{a.zero_stage} {a.dtype}", "plain deepspeed.initialize", [], ["--no-shardsafe"], a.zero_stage)


def _tor_summary(run_dir: str, measured: float) -> dict[str, Any]:
    """The run's TOR report and whether it accounts for the wall time measured outside the launcher."""
    try:
        from .tor import compute_tor, read_events, report_dict, report_text
        rep = compute_tor(read_events(run_dir))
        d = report_dict(rep)
        return {"tor": d.get("tor"), "tor_breakdown": d.get("breakdown"), "tor_report": report_text(rep),
                **tor_accounting_check(rep, measured), "measured_wall_s": round(measured, 3)}
    except Exception as e:  # the demo's verdict does not depend on accounting
        return {"tor_report": f"TOR report unavailable: {e}"}


def _resolve(a: argparse.Namespace) -> _Plan:
    """Fill in the engine's defaults and check every argument before anything starts (ConfigError: a usage
    error, said in one line)."""
    if a.nodes is None or a.nproc_per_node is None:
        # DeepSpeed's pipeline topology puts a stage's data-parallel ranks on consecutive ranks: one rank per node
        # keeps each stage's parity group on distinct nodes.
        dn, dp = (4, 1) if a.engine == "deepspeed-3d" else (2, 2)
        a.nodes = dn if a.nodes is None else a.nodes
        a.nproc_per_node = dp if a.nproc_per_node is None else a.nproc_per_node
    if a.steps is None:
        a.steps = 40 if a.engine == "megatron" else 100
    if a.steps < 3 and not a.inject:
        raise ConfigError(f"--steps {a.steps}: the demo kills a rank at 2/5 of the run and a node at 3/4; pass "
                          "--steps 3 or more, or your own --inject")
    if a.kill_at and a.kill_at >= a.steps:
        raise ConfigError(f"--kill-at {a.kill_at}: expected a step before the last (< --steps {a.steps}), or 0 for "
                          "2/5 of the run")
    from .launch.holders import budget_problem
    problem = budget_problem(a.memory_budget_gb)
    if problem:
        raise ConfigError(problem)
    plan = _plan(a, a.nodes * a.nproc_per_node)
    a.restart = getattr(a, "restart", "full")   # a Namespace built by a program, not the CLI, may lack it
    if a.restart == "in-place":   # the example trains inside shardsafe.inplace.run
        plan.protect = [*plan.protect, "--in-place"]
    return plan


def run_demo(a: argparse.Namespace) -> dict[str, Any]:
    from .runcheck import compare_runs
    plan = _resolve(a)
    world = a.nodes * a.nproc_per_node
    keep = bool(a.run_dir)
    base = a.run_dir or tempfile.mkdtemp(prefix="shardsafe-demo-")
    ref_dir, run_dir = os.path.join(base, "reference"), os.path.join(base, "run")
    for d in (ref_dir, run_dir):
        shutil.rmtree(d, ignore_errors=True)
    inject = a.inject or (f"kill-rank:{world - 1}@{a.kill_at or (a.steps * 2) // 5};"
                          f"kill-node:node{a.nodes - 1}@{(a.steps * 3) // 4}")
    job = f"demo{os.getpid()}"
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))

    say(f"[1/3] reference run: {world} ranks on {a.nodes} simulated nodes, {a.engine} {plan.layout}, "
        f"{a.steps} steps, no failures, {plan.plain}")
    preload = PRESETS["megatron" if a.engine == "megatron" else "deepspeed"] if a.preload is None else a.preload
    # The reference's trainers fork from a server with the same frameworks and nothing of shardsafe's runtime
    # (with --preload none both runs start cold)
    ref = LocalLauncher(LaunchConfig(nodes=a.nodes, nproc_per_node=a.nproc_per_node, job_id=job + "-ref",
                                     run_dir=ref_dir, start_holders=False, max_restarts=0,
                                     preload=without_runtime(preload)))
    r0 = ref.run([sys.executable, plan.script, *plan.common, *plan.unprotect, "--out", ref_dir])
    if not r0.ok:
        raise SystemExit(f"the reference run failed; see {ref_dir}/trainer_rank*.log")
    say(f"      done in {r0.wall_s:.1f} s")
    say(f"[2/3] protected run: snapshot every step into one holder per node, parity across nodes; "
        f"injected faults: {inject} (a SIGKILLed trainer, then a whole node: its trainers and holder)")
    run = LocalLauncher(LaunchConfig(nodes=a.nodes, nproc_per_node=a.nproc_per_node, job_id=job, run_dir=run_dir,
                                     inject=inject, max_restarts=3, memory_budget_gb=a.memory_budget_gb,
                                     preload=preload, restart=a.restart))
    t_run = time.time()
    r1 = run.run([sys.executable, plan.script, *plan.common, *plan.protect, "--out", run_dir])
    measured = time.time() - t_run   # the wall time TOR must account for, measured outside the launcher
    say(f"      done in {r1.wall_s:.1f} s after {r1.attempts} attempt(s); failures: "
        + ", ".join(f"{f['cause']} of " + (f"rank {f['rank']}" if f.get("rank") is not None else f"node {f.get('node')}")
                    for f in r1.failures))
    say("[3/3] comparing every loss and every rank's final state with the reference (torch.equal)")
    cmp = compare_runs(run_dir, ref_dir, world, a.steps) if r1.ok else None
    out = {"engine": a.engine, "zero_stage": plan.stage, "restart": a.restart,
           "layout": plan.layout, "dtype": a.dtype, "steps": a.steps,
           "nodes": a.nodes, "ranks": world, "failures_injected": len(r1.failures), "attempts": r1.attempts,
           **summarize(run_dir, world),
           "bit_identical": bool(cmp and cmp.bit_identical),
           # every restarted attempt continued right after the version it restored (it did not start over)
           "resumed": bool(cmp and not cmp.resume_problems),
           "resume_problems": cmp.resume_problems[:10] if cmp else [],
           "mismatches": (cmp.loss_mismatches + cmp.state_mismatches)[:10] if cmp else ["protected run failed"],
           "wall_s": round(r1.wall_s, 2), "reference_wall_s": round(r0.wall_s, 2),
           "run_dir": run_dir if keep else None, **_tor_summary(run_dir, measured)}
    if not keep:
        shutil.rmtree(base, ignore_errors=True)
    return out


def _restarts_in_place(ev: list[dict[str, Any]], world: int) -> int:
    """Restarts after which fewer trainers started than the job has ranks: the others went on in their processes."""
    started: dict[int, int] = {}
    for e in ev:
        if e.get("kind") == "trainer_start":
            a = int(e.get("attempt") or 0)
            started[a] = started.get(a, 0) + 1
    return sum(1 for a, n in started.items() if a > 0 and n < world)


def _read_events(run_dir: str) -> list[dict[str, Any]]:
    from .runcheck import read_jsonl
    return read_jsonl(os.path.join(run_dir, "events.jsonl"))
