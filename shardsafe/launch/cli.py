"""The launch commands: ``shardsafe launch | agent | control`` (also ``python -m shardsafe.launch ...``).

``launch`` runs a job on simulated nodes of this host (:mod:`.elastic`); ``agent`` is one node's torchrun
agent (:mod:`.agent`, started by ``launch`` and by the sbatch scripts); ``control serve`` is the job's
controller for multi-host launches (:mod:`.controller`) and ``control notify`` leaves it a notification
(:mod:`.markers`). ``python -m shardsafe.launch`` parses the same commands without importing the rest of
shardsafe's CLI (fast enough to call from a SLURM script's polling loop).

Options follow torchrun's names (``--nnodes``, ``--nproc-per-node``, ``--max-restarts``, ``--local-addr``) and end
in ``-s`` when they take seconds; the other spellings (``--nodes``, ``--hang-timeout``, ``--grace``, ``--timeout``,
``--monitor-interval``) are accepted as hidden aliases, so command lines written with them keep working. Every value
is checked while parsing, so a bad one is one line on stderr and exit code 2 before anything starts
(:mod:`shardsafe.cliargs`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from typing import Any, Callable

from .. import env
from ..cliargs import Parser, hidden_alias, positive_seconds, seconds, usage_error, whole
from ..errors import ConfigError
from .agent import AgentOptions, run_agent
from .controller import Controller, attempt_base_from_log, split_endpoint
from .elastic import ElasticConfig, ElasticLauncher
from .errors import EXIT_FATAL, LaunchError
from .markers import CONTROL_DIR, _atomic_write, notify
from .presets import PRESETS, preload_modules
from .shrink import shrink_after_s

HOLDER_DIR_DEFAULT = "$SHARDSAFE_HOLDER_DIR, else shardsafe-<uid> under $XDG_RUNTIME_DIR or /tmp"


def _setup_logging(prefix: str) -> None:
    logging.basicConfig(level=env.get(env.LOG, default="INFO"),
                        format=f"%(asctime)s shardsafe[{prefix}] %(levelname)s %(message)s", stream=sys.stderr)


def _script(a: argparse.Namespace) -> list[str]:
    script = list(a.script)
    if script and script[0] == "--":
        script = script[1:]
    if not script:
        raise LaunchError("no training script given: shardsafe launch [options] SCRIPT.py [ARGS...]")
    return script


# ---- value types (argparse names the option in the message) ------------------------------------------------

def fault_spec_arg(text: str) -> str:
    """An argparse type: a fault spec (shardsafe.faults) that parses."""
    from ..faults import parse
    try:
        parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def preload_arg(text: str) -> tuple[str, ...]:
    """An argparse type: ``--preload`` as the modules it names (:func:`.presets.preload_modules`)."""
    try:
        return preload_modules(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _node_range(text: str) -> str:
    """torchrun's --nnodes: N or MIN:MAX, 1 <= MIN <= MAX."""
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        low = high = 0
    if low < 1 or high < low:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or MIN:MAX nodes with 1 <= MIN <= MAX, e.g. 4 or 4:4")
    return text


def _poll_s(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds, or a negative number for the default")
    return v


def _endpoint(text: str) -> str:
    try:
        split_endpoint(text)
    except LaunchError as e:
        raise argparse.ArgumentTypeError(f"{e}, e.g. 10.0.0.1:29400") from None
    return text


# ---- the commands ------------------------------------------------------------------------------------------

def cmd_launch(a: argparse.Namespace) -> int:
    script = _script(a)   # every argument is checked before anything starts
    if script[0].endswith(".py") and not os.path.isfile(script[0]):
        raise LaunchError(f"training script {script[0]!r} not found (from {os.getcwd()})")
    _setup_logging("launch")
    run_dir = os.path.abspath(a.run_dir or os.path.join("runs", a.job_id or f"launch-{time.strftime('%Y%m%d-%H%M%S')}"))
    cfg = ElasticConfig(nodes=a.nodes, nproc_per_node=a.nproc_per_node, run_dir=run_dir, job_id=a.job_id,
                        holder_dir=a.holder_dir, memory_budget_gb=a.memory_budget_gb, max_restarts=a.max_restarts,
                        inject=a.inject, hang_timeout_s=a.hang_timeout_s, grace_s=a.grace_s,
                        keep_alive_s=a.keep_alive_s, keep_alive_misses=a.keep_alive_misses, timeout_s=a.timeout_s,
                        preload=a.preload, rendezvous_poll_s=a.rendezvous_poll_s, spares=a.spares,
                        shrink_after_s=a.shrink_after_s, model_parallel=a.model_parallel,
                        global_batch=a.global_batch, micro_batch=a.micro_batch, restart=a.restart)
    res = ElasticLauncher(cfg).run(script)
    out = {"ok": res.ok, "attempts": res.attempts, "failures": res.failures, "wall_s": round(res.wall_s, 3),
           "nodes": res.nodes, "run_dir": res.run_dir, "job_id": cfg.job_id, "signal": res.signal, "fatal": res.fatal,
           "data_parallel_sizes": res.data_parallel_sizes}
    if res.fatal:
        print(f"shardsafe launch: stopped without restarting: {res.fatal}", file=sys.stderr)
    if a.json:
        print(json.dumps(out))
    else:
        how = "ok" if res.ok else (f"stopped by {signal.Signals(res.signal).name}" if res.signal else "FAILED")
        print(f"shardsafe launch: job {cfg.job_id} {how} after {res.attempts} attempt(s) in {res.wall_s:.1f} s; "
              f"failures: {[(f['cause'], f.get('rank'), f.get('node')) for f in res.failures]}; "
              + (f"data-parallel sizes {res.data_parallel_sizes}; " if len(res.data_parallel_sizes) > 1 else "")
              + f"TOR: shardsafe tor report {res.run_dir}")
    if res.signal:
        return 128 + res.signal   # the shell's convention for a process ended by that signal
    return 0 if res.ok else (EXIT_FATAL if res.fatal else 1)


def _agent_options(a: argparse.Namespace) -> AgentOptions:
    return AgentOptions(node=a.node, control=a.control, nnodes=a.nnodes, nproc_per_node=a.nproc_per_node,
                        job_id=a.job_id or env.launcher_job_id(),
                        run_dir=a.run_dir, holder_dir=a.holder_dir, inject=a.inject, max_restarts=a.max_restarts,
                        local_addr=a.local_addr, monitor_interval_s=a.monitor_interval_s,
                        rendezvous_poll_s=a.rendezvous_poll_s, keep_alive_s=a.keep_alive_s,
                        keep_alive_misses=a.keep_alive_misses, join_timeout_s=a.join_timeout_s,
                        job_start_t=a.job_start_t, torchrun_args=shlex.split(a.torchrun_args or ""),
                        preload=list(a.preload), rdzv_id=a.rdzv_id, full_world_size=a.full_world_size)


def cmd_agent(a: argparse.Namespace) -> int:
    node = a.node or env.node_name()
    a.node = node
    try:
        shlex.split(a.torchrun_args or "")
    except ValueError as e:
        raise LaunchError(f"--torchrun-args {a.torchrun_args!r}: {e}; expected one shell-quoted string") from None
    opts = _agent_options(a)
    if not opts.job_id:
        raise LaunchError("which job? pass --job-id (or set SHARDSAFE_JOB_ID / SLURM_JOB_ID): it names the "
                          "rendezvous every agent of the job joins")
    script = _script(a)
    _setup_logging(f"agent {node}")
    rc = run_agent(opts, script)
    # The agent's exit code is the job's verdict for this node: leave without the interpreter teardown of
    # torch's C++ statics (rendezvous store threads), which can abort a process whose work is done.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def cmd_notify(a: argparse.Namespace) -> int:
    what = a.what.replace("-", "_")
    if not os.path.isdir(a.run_dir):
        # The controller made it; a notification anywhere else would never be read.
        raise LaunchError(f"run directory {a.run_dir!r} does not exist: pass the --run-dir that `control serve` "
                          "of this job was started with")
    fields: dict[str, Any] = {}
    if what == "node_lost":
        if not a.node:
            raise LaunchError("notify node-lost needs --node NODE (the node that left the job)")
        fields["node"] = a.node
    elif what == "resize":
        if not (a.from_dp and a.to_dp and a.world_size) or a.from_dp == a.to_dp:
            raise LaunchError("notify resize needs --from-dp, --to-dp (another size) and --world-size: the "
                              "data-parallel sizes before and after, and the ranks of an attempt at the new size")
        fields.update(from_dp=a.from_dp, to_dp=a.to_dp, world_size=a.world_size, nodes=a.node.split(",") if a.node
                      else None, reason=a.reason or None)
    else:
        fields["ok"] = bool(a.ok)
    print(notify(a.run_dir, what, **fields))
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    _setup_logging("control")
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
                     max_restarts=a.max_restarts, hang_timeout_s=a.hang_timeout_s, grace_s=a.grace_s,
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
    # job_end closes T_obs, and the batch script waits for this process before it ends: skip the interpreter's
    # teardown of torch and the store (seconds on a loaded batch host) so that SLURM's record of the job ends
    # when job_end says. Everything is written: the event log appends unbuffered, logging is flushed here.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cmd_shrink_plan(a: argparse.Namespace) -> int:
    """``control shrink-plan``: the size a job continues at on the nodes left (shardsafe.launch.shrink), for the
    sbatch scripts: ``DP NODES`` on stdout, or the reason on stderr and exit code 3 (waiting for a spare)."""
    from .shrink import job_shape, shrink_target
    shape = job_shape(nodes=a.nnodes, ranks_per_node=a.nproc_per_node, model_parallel=a.model_parallel,
                      global_batch=a.global_batch, micro_batch=a.micro_batch, command=_script(a) if a.script else ())
    if shape.model_parallel != a.model_parallel:   # the scripts count replicas with SS_MODEL_PARALLEL
        print(f"shardsafe control shrink-plan: the command's Megatron-LM flags make a model replica of "
              f"{shape.model_parallel} ranks, the script counts {a.model_parallel}: set SS_MODEL_PARALLEL="
              f"{shape.model_parallel}", file=sys.stderr)
        return EXIT_FATAL
    shape = dataclasses.replace(shape, dp=a.from_dp or shape.dp)
    try:
        d = shrink_target(shape, a.nodes_left)
    except ConfigError as e:
        print(f"shardsafe control shrink-plan: {e}", file=sys.stderr)
        return EXIT_FATAL
    print(d.dp, d.nodes)
    print(d.reason, file=sys.stderr)
    return 0


def cmd_control(a: argparse.Namespace) -> int:
    """``control serve``, ``control notify`` or ``control shrink-plan``, by ``a.action``."""
    return {"notify": cmd_notify, "shrink-plan": cmd_shrink_plan}.get(a.action, cmd_serve)(a)


def _guarded(fn: Callable[[argparse.Namespace], int], prog: str) -> Callable[[argparse.Namespace], int]:
    """A LaunchError (or a ConfigError of a launcher setting) ends the command before anything runs: one line,
    exit code 2. Its message says what to change (which is not always an option: a holder that cannot start)."""
    def run(a: argparse.Namespace) -> int:
        try:
            return fn(a)
        except (LaunchError, ConfigError) as e:
            return usage_error(prog, str(e), hint=False)
    return run


# ---- the parsers -------------------------------------------------------------------------------------------

def _add_restarts_and_timing(p: argparse.ArgumentParser, *, grace_s: float) -> None:
    """What ``launch`` and ``control serve`` share: restarts, the hang watchdog, incident collection."""
    p.add_argument("--max-restarts", type=whole(0), default=3, metavar="N",
                   help="restarts of the worker group before the job fails (torchrun --max-restarts)")
    hidden_alias(p, "--hang-timeout", p.add_argument(
        "--hang-timeout-s", type=seconds, default=600.0, metavar="S",
        help="seconds without an iteration before the attempt counts as hung and is restarted (0 = off)"))
    hidden_alias(p, "--grace", p.add_argument(
        "--grace-s", type=seconds, default=grace_s, metavar="S",
        help="seconds to collect the reports of one incident (which rank or node failed first) before acting"))


def _add_agent_timing(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-alive-s", type=whole(1, "seconds"), default=2, metavar="S",
                   help="rendezvous heartbeat interval in whole seconds; a lost node is dropped after "
                        "keep-alive-s x keep-alive-misses")
    p.add_argument("--keep-alive-misses", type=whole(1), default=3, metavar="N",
                   help="missed heartbeats before a node counts as lost")
    p.add_argument("--rendezvous-poll-s", type=_poll_s, default=-1.0, metavar="S",
                   help="how often a waiting agent re-reads the rendezvous state; torch's own is 1 s, which every "
                        "restart pays; after a wait's first second it backs off to 1 s (default -1: 1 ms per node of "
                        "the job, between 10 ms and 1 s)")
    p.add_argument("--preload", type=preload_arg, default=env.get(env.PRELOAD),
                   metavar="PRESET|MODULES",
                   help="a fork server per node imports these once and every worker (every start and restart) is "
                        f"forked from it instead of importing them again: a preset ({', '.join(PRESETS)}) or "
                        "modules separated by commas (docs/operations.md, \"Pre-warmed restarts\"). Default: "
                        "$SHARDSAFE_PRELOAD, else none (workers start cold)")


def _add_resize(p: argparse.ArgumentParser) -> None:
    """What a lost node's empty place does to the job (docs/operations.md, "Continuing on fewer nodes")."""
    g = p.add_argument_group("lost nodes and spares", "a lost node is replaced by a spare while there is one; with "
                             "none left the job waits --shrink-after-s for a node, then continues at a smaller "
                             "data-parallel size that keeps the global batch, and grows back when a node joins")
    g.add_argument("--spares", type=whole(0, "nodes"), default=None, metavar="N",
                   help="spare nodes, each takes a lost node's place at once (default: every lost node is replaced; "
                        "0: none)")
    g.add_argument("--shrink-after-s", type=seconds, default=None, metavar="S",
                   help="with no spare left, seconds to wait for a node before continuing at a smaller data-parallel "
                        f"size (0 = never, wait for a node; default: {shrink_after_s(None):g}, 3 x the rendezvous "
                        "timeout)")
    _add_batch(g)


def _add_batch(g) -> None:
    g.add_argument("--model-parallel", type=whole(1, "ranks"), default=1, metavar="N",
                   help="ranks of one model replica (TP x PP x CP): a smaller size keeps replicas whole (default: 1, "
                        "or TP x PP x CP from a Megatron-LM script's flags)")
    g.add_argument("--global-batch", type=whole(0, "samples"), default=0, metavar="N",
                   help="the global batch in samples, kept at every size by more gradient accumulation (default: 0, "
                        "from the script's --deepspeed_config if it names one, else from Megatron-LM's "
                        "--micro-batch-size and --global-batch-size, else not known: no shrinking)")
    g.add_argument("--micro-batch", type=whole(0, "samples"), default=0, metavar="N",
                   help="samples per rank and micro-batch, with --global-batch (default: 0, from the DeepSpeed config "
                        "or the Megatron-LM flags)")


def _add_script(p: argparse.ArgumentParser) -> None:
    p.add_argument("script", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS]",
                   help="the training script and its arguments (everything from here on is the script's; "
                        "a leading -- is dropped)")


def register_cli(sub) -> None:
    p = sub.add_parser("launch", help="torchrun with one holder per node, fault injection and TOR events (local mode)",
                       description="Run SCRIPT under torch elastic on N simulated nodes of this host: one holder and "
                                   "one torchrun agent per node, c10d rendezvous on 127.0.0.1, launcher events for "
                                   "`shardsafe tor report RUN_DIR`. Under SLURM use scripts/slurm (docs/slurm.md). "
                                   "Exit codes: 0 done, 1 failed after its restarts, 2 usage error, 3 an error no "
                                   "restart fixes, 128+N stopped by signal N.")
    hidden_alias(p, "--nodes", p.add_argument(
        "--nnodes", dest="nodes", type=whole(1, "nodes"), default=1, metavar="N",
        help="simulated nodes (failure domains), each with its own holder and agent"))
    hidden_alias(p, "--nproc_per_node", p.add_argument(
        "--nproc-per-node", type=whole(1, "processes"), default=1, metavar="N", help="trainer processes per node"))
    p.add_argument("--run-dir", default="", help="run directory: event log, logs, outputs (default: runs/JOB_ID, or "
                                           "runs/launch-<date>-<time> without --job-id)")
    # $SHARDSAFE_JOB_ID when set, as the trainers, `holder` and `status` take it: an id the user exported is not
    # replaced by a random one, and `shardsafe export SRC DST -- shardsafe launch ...` replays under SRC's job id
    p.add_argument("--job-id", default=env.get(env.JOB_ID),
                   help="names the job's holders and rendezvous (default: $SHARDSAFE_JOB_ID, else launch-<8 random "
                        "hex digits>)")
    p.add_argument("--holder-dir", default="", help=f"where the holders' sockets live (default: {HOLDER_DIR_DEFAULT})")
    # checked by ElasticConfig (launch.holders.budget_problem), which also knows this node's RAM
    p.add_argument("--memory-budget-gb", type=float, default=0.0, metavar="GB",
                   help="memory budget of each holder in GiB; 0 = half the node's RAM")
    _add_restarts_and_timing(p, grace_s=1.0)
    p.add_argument("--inject", type=fault_spec_arg, default="", metavar="FAULTS",
                   help="faults to inject (default: none), e.g. 'kill-rank:1@30;kill-node:node1@60;hang-rank:0@80': "
                        "the j-th entry applies to attempt j")
    hidden_alias(p, "--timeout", p.add_argument(
        "--timeout-s", type=seconds, default=0.0, metavar="S", help="kill the whole job after this long (0 = never)"))
    p.add_argument("--json", action="store_true", help="print one JSON object with the outcome on stdout")
    p.add_argument("--restart", choices=env.RESTART_MODES, default=env.get(env.RESTART) or "full",
                   help="full: a dead worker restarts every worker (torch elastic's way); in-place: only the dead "
                        "rank starts again and the others continue in their processes, for programs that train "
                        "inside shardsafe.inplace.run (docs/operations.md, \"Restart in place\"). Default: "
                        "$SHARDSAFE_RESTART, else full")
    _add_resize(p)
    _add_agent_timing(p)
    _add_script(p)
    p.set_defaults(func=_guarded(cmd_launch, "shardsafe launch"))

    g = sub.add_parser("agent", help="one node's torchrun agent with shardsafe's hooks (used by launch and sbatch)",
                       description="One node's torchrun agent (torch elastic's LocalElasticAgent) with job-wide "
                                   "attempt numbers and reports to the job's controller; `shardsafe launch` and the "
                                   "sbatch scripts start one per node.")
    g.add_argument("--node", default="",
                   help="this node's name (default: $SHARDSAFE_NODE, else $SLURMD_NODENAME, else the host name)")
    g.add_argument("--control", required=True, type=_endpoint, metavar="HOST:PORT",
                   help="the controller's store (`control serve --listen`), also the c10d rendezvous endpoint")
    g.add_argument("--nnodes", required=True, type=_node_range, metavar="N|MIN:MAX", help="torchrun --nnodes")
    hidden_alias(g, "--nproc_per_node", g.add_argument(
        "--nproc-per-node", type=whole(1, "processes"), default=1, metavar="N", help="workers on this node"))
    g.add_argument("--job-id", default="", help="names the rendezvous (default: $SHARDSAFE_JOB_ID, else $SLURM_JOB_ID)")
    g.add_argument("--run-dir", default=env.get(env.RUN_DIR),
                   help="the job's run directory (default: $SHARDSAFE_RUN_DIR)")
    g.add_argument("--holder-dir", default=env.get(env.HOLDER_DIR),
                   help=f"where the holders' sockets live (default: {HOLDER_DIR_DEFAULT})")
    g.add_argument("--inject", type=fault_spec_arg, default=env.get(env.INJECT), metavar="FAULTS",
                   help="faults for the workers (default: $SHARDSAFE_INJECT, else none)")
    g.add_argument("--max-restarts", type=whole(0), default=3, metavar="N", help="torchrun --max-restarts")
    g.add_argument("--local-addr", default="",
                   help="torchrun --local-addr: this node's address for its peers (default: torchrun's choice)")
    hidden_alias(g, "--monitor-interval", g.add_argument(
        "--monitor-interval-s", type=positive_seconds, default=0.1, metavar="S",
        help="how often the agent checks its workers (torchrun --monitor-interval)"))
    g.add_argument("--join-timeout-s", type=positive_seconds, default=600.0, metavar="S",
                   help="how long a rendezvous round may take to form")
    g.add_argument("--job-start-t", type=float, default=None, metavar="UNIX_TIME",
                   help="time.time() at the job's start, for the running TOR (default: the workers' first event)")
    g.add_argument("--torchrun-args", default="",
                   help="more torchrun arguments, one shell-quoted string (default: none)")
    g.add_argument("--rdzv-id", default="",
                   help="torchrun --rdzv-id (default: the job id); a job re-formed at another size uses a new one")
    g.add_argument("--full-world-size", type=whole(0, "ranks"), default=0, metavar="N",
                   help="the job's full world size, exported to the workers as SHARDSAFE_FULL_WORLD_SIZE (default: 0, "
                        "not exported); the rounds run fewer ranks while the job continues at a smaller "
                        "data-parallel size")
    _add_agent_timing(g)
    _add_script(g)
    g.set_defaults(func=_guarded(cmd_agent, "shardsafe agent"))

    c = sub.add_parser("control", help="the job controller for multi-host launches (serve) and notifications to it",
                       description="`control serve` runs the job's controller (the agents' rendezvous store, the "
                                   "progress watchdog, the launcher's TOR events); `control notify` leaves it a "
                                   "notification in the run directory. The sbatch scripts call both.")
    csub = c.add_subparsers(dest="action", metavar="serve|notify|shrink-plan", required=True)
    s = csub.add_parser("serve", help="run the job's controller until job-end is notified or a signal stops it")
    s.add_argument("--run-dir", required=True, help="the job's run directory (events.jsonl, control/)")
    s.add_argument("--listen", required=True, type=_endpoint, metavar="HOST:PORT",
                   help="where the store listens: the agents' --control and rendezvous endpoint")
    s.add_argument("--world-size", required=True, type=whole(1, "ranks"), metavar="N",
                   help="ranks of a complete attempt")
    s.add_argument("--job-id", default=env.launcher_job_id(),
                   help="the job id in the events (default: $SHARDSAFE_JOB_ID, else $SLURM_JOB_ID)")
    _add_restarts_and_timing(s, grace_s=3.0)
    s.add_argument("--job-start-t", type=float, default=None, metavar="UNIX_TIME",
                   help="time.time() at the job's start (default: now)")
    s.add_argument("--requeue-count", type=whole(0), default=int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0),
                   metavar="N", help="SLURM requeues so far (default: $SLURM_RESTART_COUNT, else 0)")
    s.set_defaults(func=_guarded(cmd_serve, "shardsafe control serve"))
    n = csub.add_parser("notify", help="leave the controller a notification: node-lost NODE, job-end or resize")
    n.add_argument("what", choices=["node-lost", "job-end", "resize"],
                   help="node-lost (with --node), job-end (with --ok when the job succeeded) or resize (with "
                        "--from-dp, --to-dp and --world-size: the script re-formed the job at another size)")
    n.add_argument("--run-dir", required=True, help="the run directory `control serve` was started with")
    n.add_argument("--node", default="", help="node-lost: the node that left the job (required there); resize: the "
                                              "nodes of the new size, separated by commas (default: none)")
    n.add_argument("--ok", action="store_true", help="job-end: the job succeeded")
    n.add_argument("--from-dp", type=whole(1, "replicas"), default=0, metavar="D",
                   help="resize: the data-parallel size before (default: none, required there)")
    n.add_argument("--to-dp", type=whole(1, "replicas"), default=0, metavar="D",
                   help="resize: the data-parallel size after (default: none, required there)")
    n.add_argument("--world-size", type=whole(1, "ranks"), default=0, metavar="N",
                   help="resize: the ranks of an attempt at the new size (default: none, required there)")
    n.add_argument("--reason", default="", help="resize: why, for the event (default: none)")
    n.set_defaults(func=_guarded(cmd_notify, "shardsafe control notify"))
    sp = csub.add_parser("shrink-plan", help="the data-parallel size a job continues at on the nodes left",
                         description="Print `DP NODES`: the largest data-parallel size below the job's that the nodes "
                                     "left run and that keeps the global batch, and the nodes it uses (the sbatch "
                                     "scripts call it when no spare is left). Exit code 3 with the reason on stderr "
                                     "when there is none.")
    sp.add_argument("--nnodes", required=True, type=whole(1, "nodes"), metavar="N", help="the full-size job's nodes")
    sp.add_argument("--nproc-per-node", type=whole(1, "ranks"), default=1, metavar="N", help="ranks per node")
    sp.add_argument("--nodes-left", required=True, type=whole(0, "nodes"), metavar="K", help="nodes still up")
    sp.add_argument("--from-dp", type=whole(0, "replicas"), default=0, metavar="D",
                    help="the size the job runs at now (default: 0, the full size)")
    _add_batch(sp)
    _add_script(sp)
    sp.set_defaults(func=_guarded(cmd_shrink_plan, "shardsafe control shrink-plan"))


def main(argv: list[str] | None = None) -> int:
    """``python -m shardsafe.launch launch|agent|control ...``: the same commands without importing the
    rest of the CLI (fast enough to call from a SLURM script's polling loop)."""
    p = Parser(prog="python -m shardsafe.launch")
    register_cli(p.add_subparsers(dest="cmd", metavar="launch|agent|control", required=True))
    a = p.parse_args(argv)
    return int(a.func(a) or 0)
