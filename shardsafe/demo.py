"""`shardsafe demo`: train a tiny GPT on simulated nodes, kill a trainer mid-run, restore from RAM.

Two runs of the same job: an uninterrupted reference (plain deepspeed.initialize) and a protected
run that takes a real SIGKILL; the demo then checks every loss and every rank's final state bit for
bit, and reports what the restore cost.

``--shrink``: 4 simulated nodes and no spare; one is lost, the launcher continues on the others at the largest
data-parallel size that keeps the global batch, the node returns and the job grows back at the next committed
version. The oracle is DeepSpeed's own reshard: plain runs chained through universal checkpoints of the same
versions (``ds_to_universal``, loaded with ``load_universal`` at each size), compared loss for loss and state for
state with what the protected run kept from each of its sizes. With ``--engine deepspeed-3d`` the nodes run one rank
per pipeline stage, and the stages stay while the data-parallel size changes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cliargs import hidden_alias, seconds, whole
from .errors import ConfigError, ShardsafeError
from .launch.local import LaunchConfig, LocalLauncher
from .launch.cli import fault_spec_arg, preload_arg
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
    return _plan(a, a.nodes * a.nproc_per_node)


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
                                     preload=preload))
    t_run = time.time()
    r1 = run.run([sys.executable, plan.script, *plan.common, *plan.protect, "--out", run_dir])
    measured = time.time() - t_run   # the wall time TOR must account for, measured outside the launcher
    say(f"      done in {r1.wall_s:.1f} s after {r1.attempts} attempt(s); failures: "
        + ", ".join(f"{f['cause']} of " + (f"rank {f['rank']}" if f.get("rank") is not None else f"node {f.get('node')}")
                    for f in r1.failures))
    say("[3/3] comparing every loss and every rank's final state with the reference (torch.equal)")
    cmp = compare_runs(run_dir, ref_dir, world, a.steps) if r1.ok else None
    out = {"engine": a.engine, "zero_stage": plan.stage,
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


# ---- --shrink: continue at a smaller data-parallel size, grow back, against DeepSpeed's universal checkpoint ----

class OracleError(RuntimeError, ShardsafeError):
    """The oracle of ``--shrink`` could not be built (one of its runs or conversions failed); the message says where
    its logs are."""


ORACLE_PRELOAD = without_runtime(PRESETS["deepspeed"])
"""The oracle's plain runs fork their trainers from a server that imported the frameworks and nothing of shardsafe's
runtime (a forked trainer computes what a cold one does: tests/fault pins it); each stretch would otherwise pay the
imports of every rank at once."""

SHRINK_MICRO, SHRINK_GAS = 2, 3
"""The protected run's batch: micro-batch 2 x accumulation 3 x D = 4 is 24 samples, which data-parallel size 3 keeps
with accumulation 4: the job continues on all 3 nodes left."""


SHRINK_STEP_SLEEP_S = 0.25
"""Seconds the protected run pauses per step after the node's return (see run_shrink_demo)."""


def _kept_segments(run_dir: str, sizes: list[int], steps: int) -> list[dict[str, Any]]:
    """The protected run as stretches of one data-parallel size: each stretch's attempts and the steps it kept,
    (first, last], first = the version the stretch's first attempt restored (the version every rank had when the
    job was re-formed)."""
    from .runcheck import read_jsonl
    restored: dict[int, int] = {}
    for e in read_jsonl(os.path.join(run_dir, "events.jsonl")):
        if e.get("kind") == "restore_end" and e.get("attempt") is not None:
            a = int(e["attempt"])
            restored[a] = min(restored.get(a, 10 ** 9), int(e.get("version", -1)))
    segs: list[dict[str, Any]] = []
    for a, d in enumerate(sizes):
        if segs and segs[-1]["dp"] == d:
            segs[-1]["attempts"].append(a)
        else:
            segs.append({"dp": d, "attempts": [a], "first": 0, "last": steps})
    for prev, seg in zip(segs, segs[1:]):
        # an attempt killed inside its restore wrote no restore_end: the stretch starts at the first one that did
        done = [restored[a] for a in seg["attempts"] if restored.get(a, -1) >= 0]
        prev["last"] = seg["first"] = done[0] if done else 0
    return segs


def oracle_fork_server(log_dir: str):
    """The fork server every stretch of one oracle forks its trainers from (started once: its imports are seconds of
    CPU); the caller closes it. None when it cannot start: the stretches then start their trainers cold."""
    from .launch.local import trainer_env
    from .launch.prewarm import ForkServer, PrewarmError
    probe = LaunchConfig(job_id="oracle", run_dir=log_dir)
    try:
        return ForkServer(ORACLE_PRELOAD, env=trainer_env(probe), log_path=os.path.join(log_dir, "prewarm.log")).start()
    except PrewarmError as e:
        print(f"shardsafe demo: the oracle's trainers start cold: {e}", file=sys.stderr, flush=True)
        return None


def _oracle_run(a: argparse.Namespace, plan: "_Plan", seg: dict[str, Any], prev: str, out: str, job: str,
                full: int, mp: int = 1, forks=None) -> str:
    """One stretch of the oracle: a plain run at the stretch's size with the same global batch (accumulation scaled
    by full / dp, ``full`` the full data-parallel size), loading the previous stretch's universal checkpoint, saving
    its own at the stretch's last step and converting it with ds_to_universal. ``mp`` ranks per model replica (the
    pipeline's stages), ``a.nproc_per_node`` per node. Returns the converted checkpoint's folder ("" for the last
    stretch). ``forks``: the oracle's fork server (:func:`oracle_fork_server`), else one for this stretch alone."""
    gas = SHRINK_GAS * full // seg["dp"]
    cmd = [sys.executable, plan.script, *plan.common, "--steps", str(seg["last"]), "--micro-batch", str(SHRINK_MICRO),
           "--gas", str(gas), "--no-shardsafe", "--out", out]
    if prev:
        cmd += ["--load", prev, "--load-universal"]
    save = seg.get("save", False)
    ckpt = os.path.join(out, "ckpt")
    if save:
        cmd += ["--save-dir", ckpt, "--save-at", str(seg["last"])]
    run = LocalLauncher(LaunchConfig(nodes=seg["dp"] * mp // a.nproc_per_node, nproc_per_node=a.nproc_per_node,
                                     job_id=f"{job}-o{seg['dp']}-{seg['first']}", run_dir=out, start_holders=False,
                                     max_restarts=0, preload=() if forks else ORACLE_PRELOAD),
                      fork_server=forks)
    res = run.run(cmd)
    if not res.ok:
        raise OracleError(f"the oracle's run at data-parallel size {seg['dp']} (steps {seg['first'] + 1}.."
                           f"{seg['last']}) failed; see {out}/trainer_rank*.log")
    if not save:
        return ""
    tag = f"global_step{seg['last']}"
    _to_universal(os.path.join(ckpt, tag), os.path.join(ckpt, f"{tag}_universal"), forks)
    return ckpt


def _to_universal(src: str, dst: str, forks=None) -> None:
    """DeepSpeed's ``ds_to_universal`` of checkpoint folder ``src`` into ``dst``, forked from the oracle's fork server
    when there is one (it has DeepSpeed imported: seconds of CPU a fresh interpreter pays again), else a subprocess."""
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", src, "--output_folder", dst,
           "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]
    log, child = dst + ".log", None
    if forks is not None:
        with open(log, "wb") as f:
            child = forks.fork_or_cold(cmd, env=forks.env, stdout=f.fileno(), stderr=f.fileno(), who="ds_to_universal")
    if child is not None:
        try:
            rc = child.wait(600)
        except subprocess.TimeoutExpired:
            child.kill()
            raise
        err = Path(log).read_text(errors="replace")
    else:
        conv = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              timeout=600)
        rc, err = conv.returncode, conv.stderr
    if rc != 0:
        raise OracleError(f"ds_to_universal of {src} failed (exit {rc}): {err.strip()[-800:]}")


def _compare_segments(run_dir: str, segs: list[dict[str, Any]], steps: int, mp: int = 1) -> list[str]:
    """Every loss the protected run kept from each stretch against the oracle's run of that stretch (same size,
    same ranks), and every rank's final state against the last stretch's: the mismatches (empty = bit-identical)."""
    import torch

    from .payload.manifest import load_tensors
    from .runcheck import effective_losses, read_jsonl
    bad: list[str] = []
    for seg in segs:
        for r in range(seg["dp"] * mp):
            kept: dict[int, str] = {}
            for rec in read_jsonl(os.path.join(run_dir, f"losses_rank{r}.jsonl")):
                if int(rec.get("attempt", 0)) in seg["attempts"] and seg["first"] < int(rec["step"]) <= seg["last"]:
                    kept[int(rec["step"])] = rec["loss"]   # an attempt's last record of a step counts
            want = effective_losses(seg["dir"], r)
            for st in range(seg["first"] + 1, seg["last"] + 1):
                if kept.get(st) != want.get(st):
                    bad.append(f"data-parallel {seg['dp']} rank {r} step {st}: {kept.get(st)} != {want.get(st)}")
    last = segs[-1]
    for r in range(last["dp"] * mp):
        try:
            x = load_tensors(os.path.join(run_dir, f"final_rank{r}"))
            y = load_tensors(os.path.join(last["dir"], f"final_rank{r}"))
        except FileNotFoundError as e:
            bad.append(f"rank {r}: {e}")
            continue
        bad += [f"rank {r}: final {k}" for k in sorted(x.keys() ^ y.keys())[:5]]
        bad += [f"rank {r}: final {k}" for k in sorted(x.keys() & y.keys()) if not torch.equal(x[k], y[k])]
    return bad


def run_shrink_demo(a: argparse.Namespace) -> dict[str, Any]:
    from .runcheck import resume_problems
    if a.engine not in ("deepspeed", "deepspeed-3d"):
        raise ConfigError(f"--shrink runs --engine deepspeed or deepspeed-3d, whose oracle is DeepSpeed's universal "
                          f"checkpoint; --engine {a.engine} is not supported with it")
    # deepspeed-3d: PP stages per replica. Every node runs one rank of each stage: after a node loss every node
    # left still runs ranks, so every holder that keeps a stage's snapshots is read by the restore (a node that
    # runs none cannot serve it; with one rank per node, D' would leave such a node idle).
    mp = (a.pp if a.pp > 1 else 2) if a.engine == "deepspeed-3d" else 1
    a.nodes = 4 if a.nodes is None else a.nodes
    a.nproc_per_node = mp if a.nproc_per_node is None else a.nproc_per_node
    if a.nodes < 2 or a.nproc_per_node != mp:
        raise ConfigError(f"--shrink loses one of --nnodes >= 2 nodes of {mp} rank(s) each (one per pipeline stage); "
                          f"got --nnodes {a.nodes} --nproc-per-node {a.nproc_per_node}")
    a.steps = 30 if a.steps is None else a.steps
    kill = a.kill_at or (a.steps * 2) // 5
    join = kill + max(2, a.steps // 5)
    if join >= a.steps:
        raise ConfigError(f"--steps {a.steps}: the node is lost at step {kill} and returns at {join}, before the last "
                          "step; pass more --steps or an earlier --kill-at")
    plan = _resolve(a)
    world, lost = a.nodes * mp, f"node{a.nodes - 1}"
    full_dp = a.nodes
    inject = a.inject or f"kill-node:{lost}@{kill};add-node:{lost}@{join}"
    keep = bool(a.run_dir)
    base = a.run_dir or tempfile.mkdtemp(prefix="shardsafe-demo-")
    run_dir = os.path.join(base, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    job = f"demo{os.getpid()}"
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))
    batch = SHRINK_MICRO * SHRINK_GAS * full_dp
    say(f"[1/3] protected run: {a.nodes} simulated nodes of {mp} rank(s), no spare, {a.engine} {plan.layout}, "
        f"{a.steps} steps, global batch {batch} samples; {inject}: {lost} is lost, the job continues on the nodes "
        f"left after {a.shrink_after_s:g} s, {lost} returns and the job grows back at the next committed version")
    preload = PRESETS["deepspeed"] if a.preload is None else a.preload
    run = LocalLauncher(LaunchConfig(nodes=a.nodes, nproc_per_node=mp, job_id=job, run_dir=run_dir, inject=inject,
                                     max_restarts=3, memory_budget_gb=a.memory_budget_gb, preload=preload, spares=0,
                                     shrink_after_s=a.shrink_after_s, global_batch=batch, micro_batch=SHRINK_MICRO,
                                     model_parallel=mp))
    t_run = time.time()
    from .faults import FaultKind, parse
    joined = min([f.step for f in parse(inject) if f.kind is FaultKind.ADD_NODE] or [a.steps])
    # The launcher grows the job at the first version committed after the node joined; steps of a tiny model can
    # outrun its polling to the last step (then the job ends at D' and no grow is shown). A pause per step after
    # the join gives it the time; it changes no result.
    cmd = [sys.executable, plan.script, *plan.common, "--micro-batch", str(SHRINK_MICRO), "--gas", str(SHRINK_GAS),
           *plan.protect, "--out", run_dir, "--step-sleep", str(SHRINK_STEP_SLEEP_S), "--step-sleep-after",
           str(joined)]
    r1 = run.run(cmd)
    measured = time.time() - t_run
    sizes = r1.data_parallel_sizes
    say(f"      {'done' if r1.ok else 'FAILED'} in {r1.wall_s:.1f} s after {r1.attempts} attempt(s) at data-parallel "
        f"sizes {sizes}" + ("" if r1.ok else f"{': ' + r1.fatal if r1.fatal else ''}; see {run_dir}"))
    segs = _kept_segments(run_dir, r1.attempt_sizes, a.steps) if r1.ok else []
    oracle: dict[str, Any] = {"kind": "DeepSpeed universal checkpoint (ds_to_universal, load_universal)",
                              "segments": [{k: s_[k] for k in ("dp", "first", "last")} for s_ in segs],
                              "ran": False, "error": None}
    mismatches = ["the protected run failed"] if not r1.ok else []
    if r1.ok:
        say(f"[2/3] oracle: plain runs of {len(segs)} stretch(es) at sizes {[s_['dp'] for s_ in segs]}, each loading "
            "the previous one's universal checkpoint of the version the protected run re-formed at")
        forks = oracle_fork_server(base)
        try:
            prev = ""
            for i, seg in enumerate(segs):
                seg["save"] = i + 1 < len(segs)
                seg["dir"] = os.path.join(base, f"oracle{i}")
                shutil.rmtree(seg["dir"], ignore_errors=True)
                prev = _oracle_run(a, plan, seg, prev, seg["dir"], job, full_dp, mp, forks)
            oracle["ran"] = True
            say("[3/3] comparing every kept loss of each stretch and every rank's final state with the oracle")
            mismatches = _compare_segments(run_dir, segs, a.steps, mp)
        except (OracleError, OSError, subprocess.SubprocessError) as e:
            oracle["error"] = str(e)
            mismatches = [f"oracle: {e}"]
        finally:
            if forks is not None:
                forks.close()
    ev = [e for e in _read_events(run_dir) if e.get("source") == "launcher"]
    problems = resume_problems(run_dir, world) if r1.ok else []
    out = {"engine": a.engine, "zero_stage": plan.stage, "layout": plan.layout, "dtype": a.dtype, "steps": a.steps,
           "nodes": a.nodes, "ranks": world, "failures_injected": len(r1.failures), "attempts": r1.attempts,
           "data_parallel_sizes": sizes, "shrinks": sum(e["kind"] == "shrink" for e in ev),
           "grows": sum(e["kind"] == "grow" for e in ev), "oracle": oracle,
           **summarize(run_dir, world),
           "bit_identical": bool(r1.ok and oracle["ran"] and not mismatches),
           "resumed": bool(r1.ok and not problems), "resume_problems": problems[:10], "mismatches": mismatches[:10],
           "wall_s": round(r1.wall_s, 2), "reference_wall_s": None,
           "run_dir": run_dir if keep else None, **_tor_summary(run_dir, measured)}
    if not keep:
        shutil.rmtree(base, ignore_errors=True)
    return out


def _read_events(run_dir: str) -> list[dict[str, Any]]:
    from .runcheck import read_jsonl
    return read_jsonl(os.path.join(run_dir, "events.jsonl"))


def cmd_demo(a: argparse.Namespace) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    t0 = time.time()
    out = run_shrink_demo(a) if a.shrink else run_demo(a)
    report = out.pop("tor_report", "")
    if a.json:
        print(json.dumps(out))
    else:
        print()
        print(f"shardsafe demo: {out['ranks']} ranks on {out['nodes']} nodes, {out['engine']} {out['layout']}, "
              f"{out['steps']} steps")
        print(f"  failures injected : {out['failures_injected']} (SIGKILL)")
        print(f"  restores          : {out['restores']} from tiers {out['restore_tiers']} "
              f"(versions {out['restored_versions']}), {out['restore_seconds']:.3f} s in all")
        print(f"  node losses       : {out['node_losses']}; {out['rebuilt_bytes'] / 2**20:.1f} MiB rebuilt from parity "
              f"in {out['rebuild_seconds']:.3f} s")
        print(f"  lost iterations   : {out['lost_iterations']}")
        print(f"  snapshot stall    : median {out['snapshot_stall_ms_median']} ms over {out['snapshots']} snapshots "
              f"({out['snapshots_committed']} committed)")
        print(f"  bit-identical     : {out['bit_identical']}" + ("" if out["bit_identical"] else f"  {out['mismatches']}"))
        print(f"  resumed           : {out['resumed']}" + ("" if out["resumed"] else f"  {out['resume_problems']}"))
        pw = out.get("prewarm")
        starts = {k: (out.get("tor_breakdown") or {}).get(k, 0.0) for k in ("startup", "restart")}
        print("  trainer starts    : " + (f"forked from a fork server that imported {','.join(pw['preload'])} "
                                         f"once in {pw['seconds']:.2f} s" if pw else "cold (every trainer imports "
                                         "its modules itself)")
              + f"; startup {starts['startup']:.2f} s + restart {starts['restart']:.2f} s over all attempts")
        if a.shrink:
            o = out["oracle"]
            print(f"  data-parallel     : sizes {out['data_parallel_sizes']}: {out['shrinks']} shrink(s), "
                  f"{out['grows']} grow(s)")
            print(f"  oracle            : {o['kind']}, stretches "
                  + ", ".join(f"{g['dp']} ranks steps {g['first'] + 1}-{g['last']}" for g in o["segments"])
                  + ("" if o["ran"] else f"  (not run: {o['error'] or 'the protected run failed'})"))
        print(f"  wall time         : {time.time() - t0:.1f} s (" + (f"reference {out['reference_wall_s']} s, "
              if out["reference_wall_s"] is not None else "") + f"protected {out['wall_s']} s)")
        if "tor_t_obs" in out:
            print(f"  TOR accounting    : T_obs {out['tor_t_obs']:.3f} s vs {out['measured_wall_s']:.3f} s measured "
                  f"({100 * out['tor_t_obs_vs_wall']:.2f}% apart, limit 2%); breakdown sums to T_obs - T_opt "
                  f"(gap {out['tor_breakdown_gap_s']:.1e} s): {'ok' if out['tor_accounted'] else 'MISMATCH'}")
        if out["run_dir"]:
            print(f"  run directory     : {out['run_dir']}  (shardsafe tor report {out['run_dir']})")
        print()
        print(report)
    return 0 if out["bit_identical"] and out["resumed"] and out.get("tor_accounted", True) else 1


def register_cli(sub) -> None:
    p = sub.add_parser("demo", help="kill a trainer mid-run, restore from the holders, compare bit for bit")
    p.add_argument("--engine", default="deepspeed", choices=["deepspeed", "deepspeed-3d", "megatron"],
                   help="deepspeed: examples/ds_pretrain_gpt.py (ZeRO); deepspeed-3d: the same GPT as a DeepSpeed "
                        "PipelineModule (PP x DP, tied embedding; BF16_Optimizer in bf16, ZeRO-1 in fp32); megatron: "
                        "examples/megatron_pretrain_gpt.py (megatron-core GPT, DDP + DistributedOptimizer, TP/PP/DP)")
    p.add_argument("--steps", type=whole(1, "steps"), default=None,
                   help="training steps (default: 100 for deepspeed and deepspeed-3d, 40 for megatron)")
    p.add_argument("--zero-stage", type=int, default=2, choices=[1, 2, 3], help="deepspeed only: the ZeRO stage")
    p.add_argument("--tp", type=whole(1), default=2, help="megatron only: tensor-parallel size")
    p.add_argument("--pp", type=whole(1), default=1, help="megatron: pipeline-parallel size; deepspeed-3d: stages "
                                                         "(default: 1 for megatron, 2 for deepspeed-3d)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"], help="training precision")
    p.add_argument("--optimizer", default="torch-adamw", choices=["torch-adamw", "fused-adamw"],
                   help="deepspeed and deepspeed-3d: torch.optim.AdamW (torch_adam) or DeepSpeed's default FusedAdam, "
                        "whose CPU build compiles once (about a minute) on first use")
    hidden_alias(p, "--nodes", p.add_argument(
        "--nnodes", dest="nodes", type=whole(1, "nodes"), default=None, metavar="N",
        help="simulated nodes (default: 2, 4 with deepspeed-3d)"))
    hidden_alias(p, "--nproc_per_node", p.add_argument(
        "--nproc-per-node", type=whole(1, "processes"), default=None, metavar="N",
        help="trainers per node (default: 2, 1 with deepspeed-3d)"))
    p.add_argument("--kill-at", type=whole(0, "steps"), default=0, metavar="STEP",
                   help="step at which the last rank is SIGKILLed (default: 0, 2/5 of the run; the last node is "
                        "lost at 3/4)")
    p.add_argument("--inject", type=fault_spec_arg, default="", metavar="FAULTS",
                   help="a fault spec replacing the demo's two faults (default: none; see shardsafe.faults)")
    p.add_argument("--memory-budget-gb", type=float, default=1.0, metavar="GB", help="memory budget of each holder")
    p.add_argument("--preload", type=preload_arg, default=None, metavar="PRESET|MODULES",
                   help="what the protected run's fork server imports once; its trainers (first start and every "
                        f"restart) are forked from it: a preset ({', '.join(PRESETS)}) or modules separated by commas "
                        "(default: the engine's preset, megatron or deepspeed; none or '' starts every trainer cold). "
                        "The reference run always starts cold")
    p.add_argument("--run-dir", default="",
                   help="keep both runs (event logs included) under this directory (default: a temporary one, "
                        "removed at the end)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--shrink", action="store_true",
                   help="continue at a smaller data-parallel size instead: 4 nodes, no spare, the last node is lost at "
                        "2/5 of the run (--kill-at) and returns a fifth of the run later; compared with DeepSpeed's "
                        "universal checkpoint of the same versions (deepspeed engine, or deepspeed-3d on nodes of one "
                        "rank per stage; default 30 steps)")
    p.add_argument("--shrink-after-s", type=seconds, default=1.0, metavar="S",
                   help="--shrink: how long the launcher waits for a node before continuing on the nodes left")
    p.set_defaults(func=cmd_demo)
