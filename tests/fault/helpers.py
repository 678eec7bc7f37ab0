"""Run the tiny DeepSpeed GPT under the local launcher (real processes, real SIGKILL) and compare."""
import dataclasses
import os
import shutil
import sys
import tempfile
import uuid

from shardsafe.launch import PRELOAD_DEEPSPEED, PRELOAD_HF, PRELOAD_MEGATRON, LaunchConfig, LocalLauncher
from shardsafe.launch.local import trainer_env
from shardsafe.launch.presets import without_runtime
from shardsafe.launch.prewarm import ForkServer
from shardsafe.runcheck import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "ds_pretrain_gpt.py")
# An unchanged DeepSpeed program (it imports nothing of shardsafe): its config's "shardsafe" block alone protects it.
PLAIN = os.path.join(ROOT, "examples", "ds_plain_gpt.py")
PLAIN_BASE = os.path.join(ROOT, "configs", "deepspeed", "plain_zero2_bf16.json")
PLAIN_STEPS = 10


# Unprotected runs (the references) fork their trainers from a server that imported the frameworks and nothing
# of shardsafe's runtime (py-cpuinfo's answer is remembered as for protected runs), unless they start cold. A
# cold trainer pays its imports and first-step compilations itself: an 8-rank reference took 26.5 s cold and
# 6.9 s forked on this 2-core machine, and the references were a third of the suite's time. The references that
# pin "a forked trainer computes what a cold one does" stay cold (cold=True at their call sites): DeepSpeed
# ZeRO-1 in fp32, ZeRO-3 in bf16 and ZeRO-2 in fp16 (test_deepspeed_resume.py), DeepSpeed's FusedAdam and CPUAdam kernels
# (test_deepspeed_optimizers.py), workers forked under torch elastic
# (test_launch.py), Megatron's tp2_dp2 and Megatron-LM's loop (test_megatron_resume.py, where a cold plain run
# also shows what a program without the flags imports), HF's Trainer (test_hf_trainer.py's module reference, which
# also shows what a Trainer without the block imports). SHARDSAFE_TEST_COLD_REFERENCES=1 starts every
# reference cold.
PLAIN_DEEPSPEED, PLAIN_MEGATRON, PLAIN_HF = (without_runtime(p) for p in (PRELOAD_DEEPSPEED, PRELOAD_MEGATRON,
                                                                           PRELOAD_HF))
ALL_REFERENCES_COLD = os.environ.get("SHARDSAFE_TEST_COLD_REFERENCES", "0") == "1"


def reference_preload(plain: tuple, cold: bool) -> tuple:
    """What an unprotected reference run's trainers are forked from: nothing (cold) or ``plain``."""
    return () if cold or ALL_REFERENCES_COLD else plain


def cached_reference(cache: dict, key, cold: bool, run, shared=None):
    """The session's reference run for ``key``: ``run()`` (its run directory) once per (key, cold); a cold run
    also serves a caller that asks for a forked one. ``shared``: a folder the test processes share (pytest-xdist's
    workers): ``run(folder)`` runs there once for all of them, under a file lock, and a finished one is reused."""
    for k in ((key, True), (key, cold)):
        if k in cache:
            return cache[k]
    if shared is None:
        cache[(key, cold)] = run()
        return cache[(key, cold)]
    import hashlib

    from filelock import FileLock
    os.makedirs(shared, exist_ok=True)
    name = {c: hashlib.sha1(repr((key, c)).encode()).hexdigest()[:12] for c in (True, False)}
    with FileLock(os.path.join(shared, name[cold] + ".lock")):
        for c in (True, cold):
            if os.path.exists(os.path.join(shared, name[c], ".done")):
                cache[(key, cold)] = shared / name[c]
                return cache[(key, cold)]
        d = shared / name[cold]
        if d.exists():   # a worker that failed half-way: its folder is not a reference
            shutil.rmtree(d)
        d.mkdir()
        run(d)
        (d / ".done").touch()
    cache[(key, cold)] = d
    return d


def run_job(run_dir, *, stage, dtype, steps, nodes=2, nproc=1, inject="", extra=(), shardsafe=True,
            max_restarts=3, budget_gb=0.5, start_holders=True, job_id=None, watcher=None, preload=None, holder_dir="",
            env=None):
    """Protected runs fork their trainers from a pre-warmed server (shardsafe.launch.prewarm); unprotected
    runs start every trainer cold unless given a ``preload`` (``reference_preload``)."""
    if preload is None:
        preload = PRELOAD_DEEPSPEED if shardsafe else ()
    cfg = LaunchConfig(nodes=nodes, nproc_per_node=nproc, job_id=job_id or f"t{uuid.uuid4().hex[:8]}",
                       run_dir=str(run_dir), inject=inject, max_restarts=max_restarts, memory_budget_gb=budget_gb,
                       start_holders=start_holders and shardsafe, attempt_timeout_s=300, holder_dir=holder_dir,
                       env=dict(env or {}))
    cmd = [sys.executable, SCRIPT, "--steps", str(steps), "--zero-stage", str(stage), "--dtype", dtype,
           "--out", str(run_dir), *extra] + ([] if shardsafe else ["--no-shardsafe"])
    return launch(cfg, cmd, preload=preload, watcher=watcher)


def plain_config(path, *, block=True, **shardsafe):
    """PLAIN's DeepSpeed config at ``path``: the block updated with ``shardsafe``, or without the block."""
    import json
    with open(PLAIN_BASE) as f:
        cfg = json.load(f)
    if block:
        cfg["shardsafe"].update(shardsafe)
    else:
        del cfg["shardsafe"]
    with open(path, "w") as f:
        json.dump(cfg, f)
    return str(path)


def plain_job(run_dir, cfg_path, *, inject="", max_restarts=1, ckpt="", save_every=0, config_as="path",
              protected=True, client_state="step"):
    """PLAIN on 2 simulated nodes x 1 rank under the local launcher; an unprotected run starts its trainers cold
    (what a program without the block imports is checked on it)."""
    cfg = LaunchConfig(nodes=2, nproc_per_node=1, job_id=f"p{uuid.uuid4().hex[:8]}", run_dir=str(run_dir),
                       inject=inject, max_restarts=max_restarts, memory_budget_gb=0.5, start_holders=protected,
                       holder_dir=os.path.join(str(run_dir), "holders"), attempt_timeout_s=300)
    cmd = [sys.executable, PLAIN, "--config", cfg_path, "--config-as", config_as, "--steps", str(PLAIN_STEPS),
           "--out", str(run_dir), "--client-state", client_state] + \
        (["--ckpt-dir", ckpt, "--save-every", str(save_every)] if ckpt else [])
    return launch(cfg, cmd, preload=PRELOAD_DEEPSPEED if protected else ())


# One fork server per preload and trainer environment for the whole tests/fault package, as successive jobs on
# one node could share one: each protected run forks its trainers from it instead of paying the server's
# imports again (2.5-4 s per run on this machine). pytest changes PYTEST_CURRENT_TEST for every test; the
# trainers of a shared server get one fixed value, else every run would differ from the server's environment.
_FORK_SERVERS: list = []
_PINNED_ENV = {"PYTEST_CURRENT_TEST": "shardsafe tests (shared fork server)"}


def launch(cfg: LaunchConfig, cmd, *, preload=(), watcher=None):
    """Run one job under the LocalLauncher. With a preload its trainers are forked from the package's shared
    fork server for that preload and environment, and every one of them must have been (no cold start)."""
    server = None
    if preload:
        cfg = dataclasses.replace(cfg, env={**cfg.env, **_PINNED_ENV}, preload=())
        env = trainer_env(cfg)
        # a server with this preload that would fork these trainers (its own rule: same interpreter, same
        # environment but for the per-rank and SHARDSAFE_* variables)
        server = next((s for s in _FORK_SERVERS if s.preload == list(preload) and not s.accepts(cmd, env)), None)
        if server is None:
            log_dir = tempfile.mkdtemp(prefix="shardsafe-forks-")
            server = ForkServer(preload, env=env, log_path=os.path.join(log_dir, "prewarm.log")).launch()
            server.wait_ready()
            _FORK_SERVERS.append(server)
    launcher = LocalLauncher(cfg, fork_server=server)
    if watcher is not None:
        watcher(launcher)
    res = launcher.run(cmd)
    if server is not None:
        assert res.cold_starts == 0 and res.forked_starts > 0, (
            f"{res.cold_starts} trainers started cold, {res.forked_starts} forked; see the warning logged by "
            "shardsafe.launch.prewarm for why")
    return res


def close_fork_servers() -> None:
    for server in _FORK_SERVERS:
        server.close()
        if server.log_path:   # the folder made for its log
            shutil.rmtree(os.path.dirname(server.log_path), ignore_errors=True)
    _FORK_SERVERS.clear()


def restores(run_dir):
    """attempt -> restored version (min over ranks; -1 = fresh start)."""
    out = {}
    for e in read_jsonl(os.path.join(str(run_dir), "events.jsonl")):
        if e.get("kind") == "restore_end":
            a = int(e.get("attempt") or 0)
            out[a] = min(out.get(a, e["version"]), e["version"])
    return out


def committed_everywhere(run_dir, world: int, attempt: int = 0) -> int:
    """The newest version every rank of ``attempt`` logged as committed (-1: none). A restore after that attempt
    takes it, or the one after it when that one was sealed everywhere while its vote was still out."""
    return min(max((int(e["version"]) for e in read_jsonl(os.path.join(str(run_dir), "events.jsonl"))
                    if e.get("kind") == "snapshot" and e.get("rank") == r and int(e.get("attempt") or 0) == attempt
                    and e.get("committed")), default=-1) for r in range(world))


def early_opens(run_dir, what: str = "early_open"):
    """(attempt, rank) -> how the restore's early open (``what="early_verify"``: its verification) went ("used",
    "missed: why"; shardsafe.holder.early_open)."""
    return {(int(e.get("attempt") or 0), e["rank"]): e.get("notes", {}).get(what, "absent")
            for e in read_jsonl(os.path.join(str(run_dir), "events.jsonl"))
            if e.get("kind") == "restore_end" and e.get("version", -1) >= 0}


def trainer_logs(run_dir):
    txt = ""
    for f in sorted(os.listdir(run_dir)):
        if f.startswith("trainer_rank"):
            with open(os.path.join(run_dir, f), errors="replace") as fh:
                txt += fh.read()
    return txt


def agent_log_tails(run_dir, lines=15) -> str:
    """The last lines of every agent's log (its workers' tracebacks land there): for an assertion's message, so a
    failure that a loaded machine alone shows says what the ranks saw."""
    out = []
    logs = os.path.join(str(run_dir), "logs")
    for f in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        if f.startswith("agent_node"):
            with open(os.path.join(logs, f), errors="replace") as fh:
                out.append(f"--- {f}\n" + "".join(fh.readlines()[-lines:]))
    return "\n".join(out)


def live_holders(run_dir, wait_s=10.0):
    """Holder processes whose command line names ``run_dir`` that are still alive after ``wait_s`` (a job must
    leave none behind: launcher-started, rank-started and replacement holders alike)."""
    import time
    deadline = time.time() + wait_s
    while True:
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if b"holder" in cmd and str(run_dir).encode() in cmd and state != "Z":
                alive.append(int(pid))
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.2)


def resumed_without_start_over(run_dir, v, steps, world=2):
    """Every rank's attempt 1 began right after the restored version v and ran to ``steps``; step 1 ran in
    attempt 0 only (a deterministic run that starts over would also end bit-exact)."""
    from shardsafe.runcheck import losses_by_attempt
    for r in range(world):
        by = losses_by_attempt(str(run_dir), r)
        assert min(by[1]) == v + 1 and 1 in by[0] and 1 not in by[1] and max(by[1]) == steps, (r, v, by)
