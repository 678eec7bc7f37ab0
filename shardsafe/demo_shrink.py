"""`shardsafe demo --shrink`: continue at a smaller data-parallel size when a node is lost, grow back, and compare
with the framework's own reshard.

4 simulated nodes and no spare; one is lost, the launcher continues on the others at the largest data-parallel size
that keeps the global batch, the node returns and the job grows back at the next committed version. The oracle is
the framework's own reshard: plain runs of the same stretches, each loading the previous one's checkpoint of the
version the protected run re-formed at, saved at one size and loaded at the next:

* DeepSpeed (``--engine deepspeed``, ``deepspeed-3d``): universal checkpoints (``ds_to_universal``, loaded with
  ``load_universal``). With ``deepspeed-3d`` the nodes run one rank per pipeline stage, and the stages stay while
  the data-parallel size changes.
* Megatron (``--engine megatron``, TP x PP ranks per node): megatron-core's ``dist_checkpointing`` with the
  DistributedOptimizer's fully reshardable format, as Megatron-LM's ``--dist-ckpt-optim-fully-reshardable`` saves
  and loads it (examples/megatron_dist_ckpt.py).

Every loss the protected run kept from each stretch and every rank's final state are compared with the oracle's.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .demo import _Plan, _read_events, _resolve, _tor_summary, summarize
from .errors import ConfigError, ShardsafeError
from .launch.local import LaunchConfig, LocalLauncher
from .launch.presets import PRESETS, without_runtime

class OracleError(RuntimeError, ShardsafeError):
    """The oracle of ``--shrink`` could not be built (one of its runs or conversions failed); the message says where
    its logs are."""


def oracle_preload(engine: str) -> list[str]:
    """What the oracle's fork server imports: the engine's framework and nothing of shardsafe's runtime (a forked
    trainer computes what a cold one does: tests/fault pins it); each stretch would otherwise pay the imports of
    every rank at once."""
    return without_runtime(PRESETS["megatron" if engine == "megatron" else "deepspeed"])


def batch_args(engine: str, micro: int, accumulation: int) -> list[str]:
    """The example's micro-batch and accumulation flags (Megatron's: --micro-batch-size, --num-microbatches)."""
    if engine == "megatron":
        return ["--micro-batch-size", str(micro), "--num-microbatches", str(accumulation)]
    return ["--micro-batch", str(micro), "--gas", str(accumulation)]

SHRINK_MICRO, SHRINK_GAS = 2, 3
"""The protected run's batch: micro-batch 2 x accumulation 3 x D = 4 is 24 samples, which data-parallel size 3 keeps
with accumulation 4: the job continues on all 3 nodes left (Megatron: accumulation is its number of micro-batches)."""


SHRINK_STEP_SLEEP_S = 0.25
"""Seconds the protected run pauses per step after the node's return (see run_shrink_demo)."""


ORACLE_KINDS = {"deepspeed": "DeepSpeed universal checkpoint (ds_to_universal, load_universal)",
                "megatron": "Megatron dist_checkpointing, fully reshardable DistributedOptimizer (saved at one "
                            "data-parallel size, loaded at the next)"}


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


def oracle_fork_server(log_dir: str, engine: str = "deepspeed"):
    """The fork server every stretch of one oracle forks its trainers from (started once: its imports are seconds of
    CPU); the caller closes it. None when it cannot start: the stretches then start their trainers cold."""
    from .launch.local import trainer_env
    from .launch.prewarm import ForkServer, PrewarmError
    probe = LaunchConfig(job_id="oracle", run_dir=log_dir)
    try:
        return ForkServer(oracle_preload(engine), env=trainer_env(probe),
                          log_path=os.path.join(log_dir, "prewarm.log")).start()
    except PrewarmError as e:
        print(f"shardsafe demo: the oracle's trainers start cold: {e}", file=sys.stderr, flush=True)
        return None


def _oracle_run(a: argparse.Namespace, plan: _Plan, seg: dict[str, Any], prev: str, out: str, job: str,
                full: int, mp: int = 1, forks=None) -> str:
    """One stretch of the oracle: a plain run at the stretch's size with the same global batch (accumulation scaled
    by full / dp, ``full`` the full data-parallel size), loading the previous stretch's checkpoint and saving its own
    at the stretch's last step (DeepSpeed: then converted with ds_to_universal; Megatron: reshardable as saved).
    ``mp`` ranks per model replica (pipeline stages; Megatron: TP x PP), ``a.nproc_per_node`` per node. Returns the
    checkpoint's folder ("" for the last stretch). ``forks``: the oracle's fork server (:func:`oracle_fork_server`),
    else one for this stretch alone."""
    megatron = a.engine == "megatron"
    cmd = [sys.executable, plan.script, *plan.common, "--steps", str(seg["last"]),
           *batch_args(a.engine, SHRINK_MICRO, SHRINK_GAS * full // seg["dp"]), *plan.unprotect, "--out", out]
    if prev:
        cmd += ["--load-dir", prev] if megatron else ["--load", prev, "--load-universal"]
    save = seg.get("save", False)
    ckpt = os.path.join(out, "ckpt")
    if save:
        cmd += ["--save-dir", ckpt, "--save-at", str(seg["last"])] + ([] if megatron else ["--save-tied-copies"])
    run = LocalLauncher(LaunchConfig(nodes=seg["dp"] * mp // a.nproc_per_node, nproc_per_node=a.nproc_per_node,
                                     job_id=f"{job}-o{seg['dp']}-{seg['first']}", run_dir=out, start_holders=False,
                                     max_restarts=0, preload=() if forks else oracle_preload(a.engine)),
                      fork_server=forks)
    res = run.run(cmd)
    if not res.ok:
        raise OracleError(f"the oracle's run at data-parallel size {seg['dp']} (steps {seg['first'] + 1}.."
                           f"{seg['last']}) failed; see {out}/trainer_rank*.log")
    if not save or megatron:
        return ckpt if save else ""
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
    if getattr(a, "restart", "full") != "full":
        raise ConfigError("--shrink with --restart in-place: the shrink demo loses a whole node, which restarts "
                          "every trainer; drop --restart in-place")
    # deepspeed-3d: PP stages per replica; megatron: TP x PP ranks. Every node runs one model replica: after a node
    # loss every node left still runs ranks, so every holder that keeps a stage's snapshots is read by the restore
    # (a node that runs none cannot serve it; with one rank per node, D' would leave such a node idle).
    mp = {"deepspeed-3d": a.pp if a.pp > 1 else 2, "megatron": a.tp * a.pp}.get(a.engine, 1)
    a.nodes = 4 if a.nodes is None else a.nodes
    a.nproc_per_node = mp if a.nproc_per_node is None else a.nproc_per_node
    if a.nodes < 2 or a.nproc_per_node != mp:
        raise ConfigError(f"--shrink loses one of --nnodes >= 2 nodes of one model replica each ({mp} rank(s): "
                          f"{'TP x PP' if a.engine == 'megatron' else 'one per pipeline stage'}); got --nnodes "
                          f"{a.nodes} --nproc-per-node {a.nproc_per_node}")
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
    preload = PRESETS["megatron" if a.engine == "megatron" else "deepspeed"] if a.preload is None else a.preload
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
    cmd = [sys.executable, plan.script, *plan.common, *batch_args(a.engine, SHRINK_MICRO, SHRINK_GAS), *plan.protect,
           "--out", run_dir, "--step-sleep", str(SHRINK_STEP_SLEEP_S), "--step-sleep-after", str(joined)]
    r1 = run.run(cmd)
    measured = time.time() - t_run
    sizes = r1.data_parallel_sizes
    say(f"      {'done' if r1.ok else 'FAILED'} in {r1.wall_s:.1f} s after {r1.attempts} attempt(s) at data-parallel "
        f"sizes {sizes}" + ("" if r1.ok else f"{': ' + r1.fatal if r1.fatal else ''}; see {run_dir}"))
    segs = _kept_segments(run_dir, r1.attempt_sizes, a.steps) if r1.ok else []
    oracle: dict[str, Any] = {"kind": ORACLE_KINDS["megatron" if a.engine == "megatron" else "deepspeed"],
                              "segments": [{k: s_[k] for k in ("dp", "first", "last")} for s_ in segs],
                              "ran": False, "error": None}
    mismatches = ["the protected run failed"] if not r1.ok else []
    if r1.ok:
        say(f"[2/3] oracle: plain runs of {len(segs)} stretch(es) at sizes {[s_['dp'] for s_ in segs]}, each loading "
            "the previous one's checkpoint of the version the protected run re-formed at")
        forks = oracle_fork_server(base, a.engine)
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


