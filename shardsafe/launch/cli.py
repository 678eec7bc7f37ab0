"""The launch commands: ``shardsafe launch | agent | control`` (also ``python -m shardsafe.launch ...``).

``launch`` runs a job on simulated nodes of this host (:mod:`.elastic`); ``agent`` is one node's torchrun
agent (:mod:`.agent`, started by ``launch`` and by the sbatch scripts); ``control serve`` is the job's
controller for multi-host launches (:mod:`.controller`) and ``control notify`` leaves it a notification
(:mod:`.markers`). ``python -m shardsafe.launch`` parses the same commands without importing the rest of
shardsafe's CLI (fast enough to call from a SLURM script's polling loop).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

from .agent import AgentOptions, run_agent
from .controller import Controller, attempt_base_from_log, split_endpoint
from .elastic import ElasticConfig, ElasticLauncher
from .errors import EXIT_FATAL, LaunchError
from .markers import CONTROL_DIR, _atomic_write, notify


def _setup_logging(prefix: str) -> None:
    logging.basicConfig(level=os.environ.get("SHARDSAFE_LOG", "INFO"),
                        format=f"%(asctime)s shardsafe[{prefix}] %(levelname)s %(message)s", stream=sys.stderr)


def _script(a: argparse.Namespace) -> list[str]:
    script = list(a.script)
    if script and script[0] == "--":
        script = script[1:]
    if not script:
        raise LaunchError("no training script given: shardsafe launch [options] SCRIPT.py [ARGS...]")
    return script


def cmd_launch(a: argparse.Namespace) -> int:
    _setup_logging("launch")
    script = _script(a)   # every argument is checked before anything starts
    if script[0].endswith(".py") and not os.path.isfile(script[0]):
        raise LaunchError(f"training script {script[0]!r} not found (from {os.getcwd()})")
    run_dir = os.path.abspath(a.run_dir or os.path.join("runs", a.job_id or f"launch-{time.strftime('%Y%m%d-%H%M%S')}"))
    cfg = ElasticConfig(nodes=a.nodes, nproc_per_node=a.nproc_per_node, run_dir=run_dir, job_id=a.job_id,
                        holder_dir=a.holder_dir, memory_budget_gb=a.memory_budget_gb, max_restarts=a.max_restarts,
                        inject=a.inject, hang_timeout_s=a.hang_timeout, grace_s=a.grace,
                        keep_alive_s=a.keep_alive_s, keep_alive_misses=a.keep_alive_misses, timeout_s=a.timeout,
                        preload=_preload_list(a.preload), rendezvous_poll_s=a.rendezvous_poll_s)
    res = ElasticLauncher(cfg).run(script)
    out = {"ok": res.ok, "attempts": res.attempts, "failures": res.failures, "wall_s": round(res.wall_s, 3),
           "nodes": res.nodes, "run_dir": res.run_dir, "job_id": cfg.job_id, "signal": res.signal, "fatal": res.fatal}
    if res.fatal:
        print(f"shardsafe launch: stopped without restarting: {res.fatal}", file=sys.stderr)
    if a.json:
        print(json.dumps(out))
    else:
        how = "ok" if res.ok else (f"stopped by {signal.Signals(res.signal).name}" if res.signal else "FAILED")
        print(f"shardsafe launch: job {cfg.job_id} {how} after {res.attempts} attempt(s) in {res.wall_s:.1f} s; "
              f"failures: {[(f['cause'], f.get('rank'), f.get('node')) for f in res.failures]}; "
              f"TOR: shardsafe tor report {res.run_dir}")
    if res.signal:
        return 128 + res.signal   # the shell's convention for a process ended by that signal
    return 0 if res.ok else (EXIT_FATAL if res.fatal else 1)


def _agent_options(a: argparse.Namespace) -> AgentOptions:
    return AgentOptions(node=a.node, control=a.control, nnodes=a.nnodes, nproc_per_node=a.nproc_per_node,
                        job_id=a.job_id or os.environ.get("SHARDSAFE_JOB_ID") or os.environ.get("SLURM_JOB_ID") or "",
                        run_dir=a.run_dir, holder_dir=a.holder_dir, inject=a.inject, max_restarts=a.max_restarts,
                        local_addr=a.local_addr, monitor_interval_s=a.monitor_interval,
                        rendezvous_poll_s=a.rendezvous_poll_s, keep_alive_s=a.keep_alive_s,
                        keep_alive_misses=a.keep_alive_misses, join_timeout_s=a.join_timeout_s,
                        job_start_t=a.job_start_t, torchrun_args=shlex.split(a.torchrun_args or ""),
                        preload=list(_preload_list(a.preload)))


def _preload_list(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in (text or "").split(",") if m.strip())


def cmd_agent(a: argparse.Namespace) -> int:
    node = a.node or os.environ.get("SHARDSAFE_NODE") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    a.node = node
    _setup_logging(f"agent {node}")
    opts = _agent_options(a)
    if not opts.job_id:
        raise LaunchError("shardsafe agent needs --job-id (or SHARDSAFE_JOB_ID / SLURM_JOB_ID): it names the rendezvous")
    rc = run_agent(opts, _script(a))
    # The agent's exit code is the job's verdict for this node: leave without the interpreter teardown of
    # torch's C++ statics (rendezvous store threads), which can abort a process whose work is done.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def cmd_control(a: argparse.Namespace) -> int:
    if a.action == "notify":
        what = a.what.replace("-", "_")
        if what not in ("node_lost", "job_end"):
            raise LaunchError(f"control notify {a.what!r}: expected node-lost or job-end")
        fields: dict[str, Any] = {}
        if what == "node_lost":
            if not a.node:
                raise LaunchError("notify node-lost needs --node")
            fields["node"] = a.node
        else:
            fields["ok"] = bool(a.ok)
        print(notify(a.run_dir, what, **fields))
        return 0
    _setup_logging("control")
    if a.world_size < 1:
        raise LaunchError("control serve needs --world-size (ranks of a complete attempt)")
    host, port = split_endpoint(a.listen)
    base = attempt_base_from_log(a.run_dir)
    from ..tor import EventLog
    events = EventLog(a.run_dir, source="launcher")
    t_start = a.job_start_t or time.time()
    requeue = int(a.requeue_count or 0)
    if base == 0:
        events.emit("job_start", at=t_start, launcher="torchrun", job_id=a.job_id, slurm_restart_count=requeue)
    else:
        # This run directory has an earlier allocation (a requeue): its work in memory is gone.
        events.emit("failure_detected", at=t_start, attempt=base - 1, cause="requeue", rank=None, node=None,
                    slurm_restart_count=requeue)
        events.emit("restart", at=t_start, attempt=base, slurm_restart_count=requeue)
    ctl = Controller(run_dir=a.run_dir, job_id=a.job_id, world_size=a.world_size, host=host, port=port,
                     max_restarts=a.max_restarts, hang_timeout_s=a.hang_timeout, grace_s=a.grace,
                     attempt_base=base, events=events)
    _atomic_write(os.path.join(a.run_dir, CONTROL_DIR, "ready"), {"endpoint": ctl.endpoint, "pid": os.getpid(),
                                                                  "attempt_base": base})
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ok = False
    try:
        while not stop.is_set():
            ctl.poll()
            if ctl.job_end_request is not None:
                ok = bool(ctl.job_end_request.get("ok"))
                break
            stop.wait(0.1)
    finally:
        ctl.poll()
        ctl.close()
        events.emit("job_end", ok=ok, **({} if ctl.job_end_request else {"cause": "terminated"}))
    return 0


def _add_agent_timing(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-alive-s", type=int, default=2,
                   help="rendezvous heartbeat interval; a lost node is dropped after keep-alive-s x keep-alive-misses")
    p.add_argument("--keep-alive-misses", type=int, default=3)
    p.add_argument("--rendezvous-poll-s", type=float, default=-1.0,
                   help="how often a waiting agent re-reads the rendezvous state; torch's own is 1 s, which every "
                        "restart pays once (default -1: 50 ms per 50 nodes, 50 ms to 1 s)")
    p.add_argument("--preload", default=os.environ.get("SHARDSAFE_PRELOAD", ""),
                   help="comma-separated modules a fork server per node imports once; workers (every start and "
                        "restart) are forked from it instead of importing them again, e.g. "
                        "torch,deepspeed,torch._dynamo (docs/operations.md). Default: none, workers start cold")


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(a: argparse.Namespace) -> int:
        try:
            return fn(a)
        except LaunchError as e:
            print(f"shardsafe {a.cmd}: {e}", file=sys.stderr)
            return 2
    return run


def register_cli(sub) -> None:
    p = sub.add_parser("launch", help="torchrun with one holder per node, fault injection and TOR events (local mode)",
                       description="Run SCRIPT under torch elastic on N simulated nodes of this host: one holder and "
                                   "one torchrun agent per node, c10d rendezvous on 127.0.0.1, launcher events for "
                                   "`shardsafe tor report RUN_DIR`. Under SLURM use scripts/slurm (docs/slurm.md).")
    p.add_argument("--nodes", type=int, default=1, help="simulated nodes (failure domains)")
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--run-dir", default="", help="run directory (default runs/JOB_ID)")
    p.add_argument("--job-id", default="")
    p.add_argument("--holder-dir", default="")
    p.add_argument("--memory-budget-gb", type=float, default=0.0, help="per-holder budget (0 = half the RAM)")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--inject", default="", help="faults, e.g. 'kill-rank:1@30;kill-node:node1@60;hang-rank:0@80' "
                                                "(fault j applies to attempt j)")
    p.add_argument("--hang-timeout", type=float, default=600.0, help="seconds without progress = hang (0 = off)")
    p.add_argument("--grace", type=float, default=1.0, help="seconds to collect evidence of one incident")
    p.add_argument("--timeout", type=float, default=0.0, help="kill the whole job after this long (0 = never)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_agent_timing(p)
    p.add_argument("script", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS]")
    p.set_defaults(func=_guarded(cmd_launch))

    g = sub.add_parser("agent", help="one node's torchrun agent with shardsafe's hooks (used by launch and sbatch)")
    g.add_argument("--node", default="", help="this node's name (default SHARDSAFE_NODE, SLURMD_NODENAME, hostname)")
    g.add_argument("--control", required=True, help="HOST:PORT of the controller's store (= rendezvous endpoint)")
    g.add_argument("--nnodes", required=True, help="torchrun --nnodes (N or MIN:MAX)")
    g.add_argument("--nproc-per-node", type=int, default=1)
    g.add_argument("--job-id", default="")
    g.add_argument("--run-dir", default=os.environ.get("SHARDSAFE_RUN_DIR", ""))
    g.add_argument("--holder-dir", default=os.environ.get("SHARDSAFE_HOLDER_DIR", ""))
    g.add_argument("--inject", default=os.environ.get("SHARDSAFE_INJECT", ""))
    g.add_argument("--max-restarts", type=int, default=3)
    g.add_argument("--local-addr", default="", help="torchrun --local-addr (this node's address for peers)")
    g.add_argument("--monitor-interval", type=float, default=0.1)
    g.add_argument("--join-timeout-s", type=float, default=600.0)
    g.add_argument("--job-start-t", type=float, default=None, help="time.time() of the job start (running TOR)")
    g.add_argument("--torchrun-args", default="", help="extra torchrun arguments, one shell-quoted string")
    _add_agent_timing(g)
    g.add_argument("script", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS]")
    g.set_defaults(func=_guarded(cmd_agent))

    c = sub.add_parser("control", help="the job controller for multi-host launches (serve) and notifications to it")
    c.add_argument("action", choices=["serve", "notify"])
    c.add_argument("what", nargs="?", default="", help="notify: node-lost | job-end")
    c.add_argument("--run-dir", required=True)
    c.add_argument("--listen", default="", help="serve: HOST:PORT for the store (the agents' rendezvous endpoint)")
    c.add_argument("--job-id", default=os.environ.get("SHARDSAFE_JOB_ID") or os.environ.get("SLURM_JOB_ID", ""))
    c.add_argument("--world-size", type=int, default=0, help="serve: ranks of a complete attempt")
    c.add_argument("--max-restarts", type=int, default=3)
    c.add_argument("--hang-timeout", type=float, default=600.0)
    c.add_argument("--grace", type=float, default=3.0)
    c.add_argument("--job-start-t", type=float, default=None)
    c.add_argument("--requeue-count", type=int, default=int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0))
    c.add_argument("--node", default="", help="notify node-lost: the node")
    c.add_argument("--ok", action="store_true", help="notify job-end: the job succeeded")
    c.set_defaults(func=_guarded(cmd_control))


def main(argv: list[str] | None = None) -> int:
    """``python -m shardsafe.launch launch|agent|control ...``: the same commands without importing the
    rest of the CLI (fast enough to call from a SLURM script's polling loop)."""
    p = argparse.ArgumentParser(prog="python -m shardsafe.launch")
    register_cli(p.add_subparsers(dest="cmd", required=True))
    a = p.parse_args(argv)
    return int(a.func(a) or 0)
