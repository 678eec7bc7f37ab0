"""Local launcher: N simulated nodes on one host, one holder per node, whole-group restarts or in-place ones.

This is the local mode behind ``shardsafe demo`` and the tests: every simulated node gets its own
node name (SHARDSAFE_NODE) and its own holder process, started outside the restarted worker group
so it survives trainer failures. When any trainer fails, the whole worker group is killed and
restarted (torch elastic's semantics), up to ``max_restarts`` times; holders keep their memory.

A lost node (``kill-node``) is replaced at once by a fresh node of the same name with an empty holder, unless
``spares`` limits the spares: then the launcher waits ``shrink_after_s`` for a node to join (``add-node``) and
otherwise continues on the nodes left at a smaller data-parallel size, and grows back at the next committed
version once a node joins (:mod:`.resize`, docs/operations.md "Continuing on fewer nodes"). Rank-to-node
placement is stable: rank r runs on the (r // nproc_per_node)-th node in use, in slot order (node i holds slot i
until it is lost; a node that joins takes the lowest empty slot), so with every node up rank r runs on node
r // nproc_per_node, as before.

The helpers both launchers share are in :mod:`.holders` and :mod:`.signals`; the elastic launcher (torchrun,
``shardsafe launch``) is :mod:`.elastic`.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .. import env as names
from ..collectives import lazy_gloo_env
from ..errors import ConfigError
from ..fatal import describe as describe_fatal, read_fatal
from ..holder.client import holder_command, stop_holders
from ..holder.early_open import ENV_TRAINER
from ..holder.paths import HolderPaths, HolderSecurityError
from ..tor.events import JsonlTail, NullEventLog
from ..faults import FaultKind, for_attempt, parse
from .errors import LaunchError
from .holders import budget_problem, holder_budget_env, holder_env, holder_failure, holder_running, kill_serving_holder
from .prewarm import ForkServer, PrewarmError
from .resize import GROW, WAIT, CommitWatch, Membership, Plan
from .shrink import job_shape, shrink_after_s
from .signals import SignalStop

log = logging.getLogger(__name__)


STORE_TIMEOUT_S = 60.0


@dataclass(kw_only=True)
class LaunchConfig:
    nodes: int = 1
    """Simulated nodes (failure domains), each with its own holder."""
    nproc_per_node: int = 1
    """Trainer processes per node."""
    job_id: str
    """Scopes holders' sockets and memory."""
    run_dir: str
    """Per-run directory: event log, trainer logs, outputs."""
    holder_dir: str = ""
    """Where holder sockets live (default: the config default)."""
    memory_budget_gb: float = 0.0
    """Per-holder budget (0 = half the node's RAM)."""
    max_restarts: int = 3
    """Failures the worker group is restarted after before the job gives up (a planned restart to grow back to a
    larger size is none)."""
    inject: str = ""
    """Fault spec (see shardsafe.faults); fault j applies to attempt j."""
    start_holders: bool = True
    """Start one holder per node before the first attempt."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for trainers."""
    attempt_timeout_s: float = 600.0
    """An attempt running longer than this is killed as hung."""
    preload: tuple[str, ...] = ()
    """Modules a fork server imports once before the first attempt; the trainers of every attempt are then
    forked from it instead of importing them again (shardsafe.launch.prewarm). Empty: every trainer starts cold."""
    spares: int | None = None
    """Spare nodes: each takes a lost node's place at once (fresh, empty holder, the lost node's name). None: every
    lost node is replaced (no shrinking); 0: a lost node's place stays empty until a node joins (``add-node``)."""
    shrink_after_s: float | None = None
    """With no spare left: seconds to wait for a node to join before continuing at a smaller data-parallel size
    (0 = never: wait for a node; None = 3 x the agents' rendezvous timeout, shardsafe.launch.shrink)."""
    model_parallel: int = 1
    """Ranks of one model replica (TP x PP): a smaller size keeps them whole."""
    global_batch: int = 0
    """The job's global batch in samples (0 = from the command's DeepSpeed config, else not known: no shrinking)."""
    micro_batch: int = 0
    """Samples per rank and micro-batch (with global_batch)."""
    join_timeout_s: float = 600.0
    """How long to wait for a node when the job can neither replace a lost one nor shrink; then it fails."""
    restart: str = "full"
    """"full": a dead trainer restarts every trainer; "in-place": only the dead ones start again, for a program that
    trains inside shardsafe.inplace.run (docs/operations.md "Restart in place")."""

    def __post_init__(self) -> None:
        if self.restart not in names.RESTART_MODES:
            raise ConfigError(f"restart={self.restart!r}: expected one of {', '.join(names.RESTART_MODES)}")
        if self.nodes < 1 or self.nproc_per_node < 1:
            raise ConfigError(f"need nodes >= 1 and nproc_per_node >= 1, got {self.nodes} and {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.join_timeout_s > 0:
            raise ConfigError(f"join_timeout_s must be > 0 seconds, got {self.join_timeout_s!r}")
        self.shrink_after_s = shrink_after_s(self.shrink_after_s)
        if self.spares is not None and self.spares < 0:
            raise ConfigError(f"spares must be >= 0 (None: every lost node is replaced at once), got {self.spares}")
        job_shape(nodes=self.nodes, ranks_per_node=self.nproc_per_node, model_parallel=self.model_parallel,
                  global_batch=self.global_batch, micro_batch=self.micro_batch)   # fail fast on a bad layout
        for f in parse(self.inject):  # fail fast on a malformed spec
            if f.kind in (FaultKind.KILL_NODE, FaultKind.ADD_NODE):
                for n in f.target.split("+"):
                    if n not in {self.node_name(i) for i in range(self.nodes)}:
                        raise ConfigError(f"{f.kind.value} target {n!r}: local nodes are named node0..node"
                                          f"{self.nodes - 1}")
        problem = budget_problem(self.memory_budget_gb)
        if problem:
            raise ConfigError(problem.replace("--memory-budget-gb", "LaunchConfig.memory_budget_gb"))
        if not self.holder_dir:
            self.holder_dir = names.holder_dir()

    def node_name(self, i: int) -> str:
        return f"node{i}"


@dataclass
class LaunchResult:
    ok: bool
    attempts: int
    failures: list[dict[str, Any]]
    wall_s: float
    forked_starts: int = 0    # trainers forked from the fork server (every attempt)
    cold_starts: int = 0      # trainers started as fresh processes
    signal: int | None = None  # the signal that stopped the launcher (SIGTERM, SIGINT, SIGHUP)
    fatal: str = ""           # the error no restart can fix that ended the job (shardsafe.fatal), if any
    data_parallel_sizes: list[int] = field(default_factory=list)   # the sizes the job went through, in order
    attempt_sizes: list[int] = field(default_factory=list)         # each attempt's data-parallel size


def trainer_env(cfg: LaunchConfig) -> dict[str, str]:
    """What every trainer of a LocalLauncher job gets before its per-rank variables (and what its fork
    server imports with)."""
    env = {**os.environ, **lazy_gloo_env(os.environ), **cfg.env, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           names.RESTART: cfg.restart}
    env.pop(ENV_TRAINER, None)   # each trainer is one, not a process another trainer started (early_open.trainer_process)
    return env


class LocalLauncher:
    def __init__(self, cfg: LaunchConfig, *, fork_server: ForkServer | None = None):
        """``fork_server``: an already launched :class:`ForkServer` to fork the trainers from, kept open
        after the job (several jobs on one host share its imports; the caller closes it). Its preload
        and environment are the caller's business: a trainer it does not accept starts cold."""
        if fork_server is not None and cfg.preload:
            raise ConfigError("LocalLauncher: pass either LaunchConfig.preload (the launcher starts its own fork "
                             "server) or fork_server (a shared one), not both")
        self.cfg = cfg
        os.makedirs(cfg.run_dir, exist_ok=True)
        try:
            from ..tor import EventLog
            self.events = EventLog(cfg.run_dir, source="launcher")
        except Exception:   # accounting never stops a launch
            self.events = NullEventLog()
        self.holders: dict[str, subprocess.Popen] = {}
        self.t_start = time.time()
        self.forks: ForkServer | None = fork_server
        self._shared_forks = fork_server is not None
        self.starts = {"forked": 0, "cold": 0}
        self._store = None   # the current attempt's c10d store (_rendezvous_store)
        self.instance = f"{cfg.job_id}.{os.getpid()}.{uuid.uuid4().hex[:8]}"   # this run of the job (shardsafe.jobid)
        self.members: Membership | None = None   # the job's nodes and size (run() makes it: it knows the command)
        self.sizes: list[int] = []               # each attempt's data-parallel size
        self._joined: set[tuple[int, str]] = set()   # add-node faults done: (attempt, fault)

    # ---- holders ----------------------------------------------------------------------------------
    def paths(self, node: str) -> HolderPaths:
        return HolderPaths(self.cfg.holder_dir, self.cfg.job_id, node)

    def start_holder(self, node: str) -> None:
        p = self.paths(node)
        try:
            p.ensure_dir()
        except HolderSecurityError as e:   # another user's directory: said as a launch error, nothing started
            raise LaunchError(str(e)) from None
        if holder_running(p):
            raise LaunchError(f"a holder for job id {self.cfg.job_id!r} on {node} is already running ({p.socket}): "
                               "another job uses this id. Give this job its own job_id, or stop the other one")
        cmd = holder_command(p, budget_gb=self.cfg.memory_budget_gb, run_dir=self.cfg.run_dir)
        log_path = os.path.join(self.cfg.run_dir, f"holder_{node}.log")
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=logf,
                                    start_new_session=True, env=holder_env(self.cfg.inject))
        line = proc.stdout.readline()  # "holder ready: ..." once the socket is bound
        if not line.startswith(b"holder ready"):
            proc.kill()
            raise LaunchError(holder_failure(node, proc.wait(), log_path))
        self.holders[node] = proc

    def kill_node_holder(self, node: str) -> None:
        """Node loss: the holder dies with SIGKILL and its memory with it."""
        kill_serving_holder(self.paths(node))
        proc = self.holders.pop(node, None)
        if proc is not None:
            proc.kill()
            proc.wait()
        try:
            os.unlink(self.paths(node).socket)
        except FileNotFoundError:
            pass

    def stop_holders(self) -> None:
        stop_holders([(self.paths(node), proc) for node, proc in self.holders.items()])
        self.holders.clear()

    # ---- workers ----------------------------------------------------------------------------------
    def _launch_fork_server(self) -> None:
        """Start the fork server's imports; they overlap the holders' start (see :meth:`_fork_server_ready`)."""
        c = self.cfg
        self.forks = ForkServer(c.preload, env=trainer_env(c), log_path=os.path.join(c.run_dir, "prewarm.log"))
        self.forks.launch()

    def _fork_server_ready(self) -> None:
        try:
            self.forks.wait_ready()
            self.events.emit("prewarm_ready", preload=list(self.cfg.preload), seconds=round(self.forks.ready_s, 3))
        except PrewarmError as e:
            log.warning("%s; trainers start cold", e)
            self.forks = None

    def _rendezvous_store(self) -> int:
        """Serve this attempt's c10d store from the launcher, as torchrun's agent does, and return its port.

        Why: a port found free and handed to rank 0 to bind can be taken in between by any process on the node
        (every gloo connection draws an ephemeral port), and rank 0 then dies in ``init_process_group``. The
        store is bound here before a trainer starts; ``TORCHELASTIC_USE_AGENT_STORE=True`` makes every rank's
        ``env://`` / ``tcp://`` init a client of it. A new store per attempt: no key of a dead attempt is
        seen by the next one (torch relies on the same)."""
        from torch.distributed import TCPStore
        self._store = None   # the previous attempt's server stops first
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=STORE_TIMEOUT_S))
        return int(self._store.port)

    def _spawn(self, cmd: list[str], attempt: int) -> list[Any]:
        self._port = self._rendezvous_store()
        return [self._start(cmd, rank, attempt) for rank in range(self.members.world())]

    def _start(self, cmd: list[str], rank: int, attempt: int) -> Any:
        """Trainer ``rank`` of ``attempt``, on its node, a client of the attempt's store (:attr:`_port`)."""
        c, m = self.cfg, self.members
        port, world, nodes = self._port, m.world(), m.active
        node = m.rank_nodes()[rank]
        local = rank % c.nproc_per_node
        env = {**trainer_env(c),
               "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
               "LOCAL_WORLD_SIZE": str(c.nproc_per_node), "GROUP_RANK": str(nodes.index(node)),
               "GROUP_WORLD_SIZE": str(len(nodes)),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               names.NODE: node, names.JOB_ID: c.job_id, names.FULL_WORLD_SIZE: str(m.world(m.full_dp)),
               names.HOLDER_DIR: c.holder_dir, names.RUN_DIR: c.run_dir,
               names.ATTEMPT: str(attempt), names.INJECT: c.inject,
               names.JOB_START_T: repr(self.t_start), names.INSTANCE: self.instance,
               **(holder_budget_env(c.memory_budget_gb) if c.start_holders else {})}
        log_path = os.path.join(c.run_dir, f"trainer_rank{rank}.log")
        with open(log_path, "ab") as out:
            out.write(f"==== attempt {attempt} ====\n".encode())
            out.flush()
            proc = self.forks and self.forks.fork_or_cold(cmd, env=env, stdout=out.fileno(), stderr=out.fileno())
            self.starts["cold" if proc is None else "forked"] += 1
            if proc is None:
                proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        return proc

    def _node_fault(self, attempt: int):
        return next(iter(for_attempt(parse(self.cfg.inject), attempt, {FaultKind.KILL_NODE})), None)

    def _kill_holder(self, fault, attempt: int) -> None:
        """kill-holder: the node's holder alone dies (SIGKILL); its trainers run on and its first rank starts
        a new one. The attempt goes on, so this is no failure of the launcher's."""
        kill_serving_holder(self.paths(fault.target))
        proc = self.holders.get(fault.target)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self.events.emit("holder_killed", node=fault.target, fault=str(fault), attempt=attempt)
        log.warning("injected holder kill: %s at step %d (its trainers run on)", fault.target, fault.step)

    def _kill_nodes(self, procs: list[subprocess.Popen], fault, attempt: int) -> dict[str, Any] | None:
        """Node loss: SIGKILL the node's trainers and its holder (its shared memory dies with it). Which node
        takes its place, if any, is the membership's decision after the attempt (:meth:`_next_plan`). None when
        no node of the loss ran a rank of this attempt (an idle node): the attempt goes on."""
        m = self.members
        nodes = [n for n in fault.target.split("+") if n in m.live]
        t_fault = time.time()
        placed = m.rank_nodes()
        for rank, p in enumerate(procs):
            if placed[rank] in nodes and p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:   # a forked trainer the fork server reaped, its exit not read yet
                    pass
        for node in nodes:
            self.kill_node_holder(node)
        ran = m.lose(nodes)
        log.warning("injected node loss: %s at step %d (trainers and holder SIGKILLed)%s", "+".join(nodes) or
                    fault.target, fault.step, "" if ran else "; it ran no rank of this attempt, which goes on")
        if not ran:
            return None
        return {"cause": "node_loss", "node": "+".join(nodes), "attempt": attempt, "rc": -9, "t_fault": t_fault,
                "rank": None}

    def _join(self, fault, why: str) -> None:
        """add-node: the node (back from a repair, or a spare arriving late) joins with a fresh, empty holder."""
        node, m = fault.target, self.members
        if node in m.live:
            log.warning("injected node join %s: %s is in the job already; nothing joins", fault, node)
            return
        if not m.join(node):
            log.warning("injected node join %s: the job has all the nodes it needs; %s stays out", fault, node)
            return
        if self.cfg.start_holders:
            self.start_holder(node)
        log.warning("node %s joined the job (%s) with an empty holder; nodes up: %s", node, why, ", ".join(m.live))

    def _joins_due(self, attempt: int, reached: int | None) -> None:
        """The add-node faults of ``attempt`` due at step ``reached`` (None: before it starts: step 0 only)."""
        for f in for_attempt(parse(self.cfg.inject), attempt, {FaultKind.ADD_NODE}):
            key = (attempt, str(f))
            if key not in self._joined and (f.step == 0 if reached is None else f.step <= reached):
                self._joined.add(key)
                self._join(f, f"{f}, attempt {attempt}")

    def _resize(self, plan: Plan, attempt: int) -> None:
        """Re-form the job as ``plan`` says; a new size is a ``shrink`` or ``grow`` event (docs/tor.md), written
        before the attempt at that size starts."""
        m = self.members
        if plan.dp != m.dp:
            self.events.emit(plan.action, from_dp=m.dp, to_dp=plan.dp, attempt=attempt, nodes=list(plan.nodes),
                             reason=plan.reason)
            log.warning("%s: %s; ranks on %s", plan.action, plan.reason, ", ".join(plan.nodes))
        m.apply(plan)

    def _next_plan(self, attempt: int, stop: SignalStop) -> Plan | None:
        """After a node loss in the attempt before ``attempt``: spares take the lost nodes' places, else wait for a
        node to join, shrink after ``shrink_after_s``, or wait for a node when no smaller size keeps the batch.
        None: the job cannot go on (no node joined within join_timeout_s) or a signal stopped it."""
        c, m = self.cfg, self.members
        for node in m.take_spares():
            if c.start_holders:
                self.start_holder(node)   # the spare: a fresh node with an empty holder in the lost one's place
            log.warning("spare node %s takes the lost node's place%s", node,
                        "" if m.spares is None else f" ({m.spares} spare(s) left)")
        t0, said = time.monotonic(), ""
        while stop.received is None:
            self._joins_due(attempt, None)
            plan = m.plan(time.monotonic() - t0)
            if plan.action != WAIT:
                self._resize(plan, attempt)
                return plan
            if plan.reason != said:
                (log.error if plan.refused else log.warning)("%s", plan.reason)
                said = plan.reason
            if time.monotonic() - t0 > c.join_timeout_s:
                log.error("no node joined within join_timeout_s=%g s and the job cannot continue on the %d node(s) "
                          "up: giving up (%s)", c.join_timeout_s, len(m.live), plan.reason)
                return None
            time.sleep(0.05)
        return None

    @staticmethod
    def _kill_all(procs: list[subprocess.Popen]) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            p.wait()

    def run(self, cmd: list[str]) -> LaunchResult:
        """Run the job to the end: success, ``max_restarts`` exhausted, an error no restart can fix
        (shardsafe.fatal: stops at once, ``LaunchResult.fatal``), or SIGTERM/SIGINT/SIGHUP
        (``LaunchResult.signal``). Trainers and holders are stopped in every case. A planned restart (growing
        back to a larger size) is no failure and does not count against ``max_restarts``."""
        c = self.cfg
        t0 = self.t_start = time.time()
        shape = job_shape(nodes=c.nodes, ranks_per_node=c.nproc_per_node, model_parallel=c.model_parallel,
                          global_batch=c.global_batch, micro_batch=c.micro_batch, command=cmd)
        self.members = Membership([c.node_name(i) for i in range(c.nodes)], shape, spares=c.spares,
                                  shrink_after_s=c.shrink_after_s)
        self.events.emit("job_start", nodes=c.nodes, nproc_per_node=c.nproc_per_node, cmd=" ".join(cmd)[:500])
        failures: list[dict[str, Any]] = []
        ok, fatal = False, ""
        attempt = 0
        kept = None   # the trainers a restart in place keeps
        with SignalStop() as stop:
            try:
                self._start_node_services(stop)
                while stop.received is None:
                    if kept is None:
                        self._joins_due(attempt, None)
                        self.events.emit("attempt_start", attempt=attempt)
                        self.sizes.append(self.members.dp)
                        procs = self._spawn(cmd, attempt)
                    else:
                        procs, kept = kept, None
                    failed = self._watch(procs, attempt, stop)
                    if stop.received is not None:
                        break
                    if failed and len(failures) < c.max_restarts and self._can_restart_in_place(failed, procs, attempt):
                        self.events.emit("failure_detected", **failed)
                        failures.append(failed)
                        self.events.emit("attempt_end", attempt=attempt, rc=failed.get("rc"), cause=failed["cause"])
                        attempt += 1
                        self.events.emit("restart", attempt=attempt)
                        self.events.emit("attempt_start", attempt=attempt)
                        self.sizes.append(self.members.dp)
                        kept = self._restart_in_place(cmd, procs, attempt)
                        continue
                    if failed and failed["cause"] == GROW:   # planned: stop at the commit, restart larger
                        plan = failed.pop("plan")
                        self._resize(plan, attempt + 1)
                        self._kill_all(procs)
                        self.events.emit("attempt_end", attempt=attempt, rc=failed.get("rc"), cause=GROW,
                                         version=failed.get("version"))
                        attempt += 1
                        self.events.emit("restart", attempt=attempt)
                        continue
                    if failed:
                        self._kill_all(procs)
                        records = read_fatal(c.run_dir, attempt)
                        if records:   # a ConfigError / RestoreError: every restart would end the same way
                            fatal = describe_fatal(records)
                            failed.update(cause="fatal_error", error=records[0].get("type"),
                                          message=str(records[0].get("message"))[:2000])
                        self.events.emit("failure_detected", **failed)
                        failures.append(failed)
                        self.events.emit("attempt_end", attempt=attempt, rc=failed.get("rc"), cause=failed["cause"])
                        if fatal:
                            log.error("attempt %d failed with %s", attempt, fatal)
                            break
                        log.warning("attempt %d failed (%s); %s", attempt, failed,
                                    "restarting" if len(failures) <= c.max_restarts else "giving up")
                        if len(failures) > c.max_restarts or self._next_plan(attempt + 1, stop) is None:
                            break
                        attempt += 1
                        self.events.emit("restart", attempt=attempt)
                        continue
                    self.events.emit("attempt_end", attempt=attempt, rc=0, cause="finished")
                    ok = True
                    break
            finally:
                self._store = None
                self.stop_holders()
                if self.forks is not None and not self._shared_forks:
                    self.forks.close()
                extra = {"signal": stop.received, "cause": "terminated"} if stop.received is not None else {}
                self.events.emit("job_end", ok=ok, **extra)
        return LaunchResult(ok=ok, attempts=attempt + 1, failures=failures, wall_s=time.time() - t0,
                            forked_starts=self.starts["forked"], cold_starts=self.starts["cold"],
                            signal=stop.received, fatal=fatal, attempt_sizes=list(self.sizes),
                            data_parallel_sizes=[d for i, d in enumerate(self.sizes)
                                                 if i == 0 or d != self.sizes[i - 1]])

    def _can_restart_in_place(self, failed: dict[str, Any], procs: list, attempt: int) -> bool:
        """Whether only the dead trainers start again (``restart="in-place"``): they died on their own (no node loss
        or hang), none exited 75, none of an error no restart fixes. The store is ours: rank 0 may be among them."""
        from ..inplace import EXIT_NOT_IN_PLACE
        if self.cfg.restart != "in-place" or failed.get("cause") != "rank_exit":
            return False
        why = ""
        if read_fatal(self.cfg.run_dir, attempt):
            why = "a trainer died of an error no restart fixes"
        elif any(p.poll() == EXIT_NOT_IN_PLACE for p in procs):
            why = f"a trainer exited with {EXIT_NOT_IN_PLACE}: it could not restart in place"
        if why:
            log.warning("attempt %d: not restarting in place (%s): every trainer restarts", attempt, why)
        return not why

    def _restart_in_place(self, cmd: list[str], procs: list, attempt: int) -> list:
        """Start the dead trainers again as ``attempt``; tell the survivors (the notice of every node, then
        shardsafe.inplace.SIGNAL to each one's main thread). Returns the attempt's trainers."""
        from ..inplace import SIGNAL, write_notice
        from .replace import signal_main_thread
        dead = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        log.warning("rank(s) %s died; restarting them in place as attempt %d", dead, attempt)
        procs = [self._start(cmd, r, attempt) if r in dead else p for r, p in enumerate(procs)]
        for node in self.members.active:
            write_notice(self.cfg.run_dir, node, attempt, dead)
        for r, p in enumerate(procs):
            if r not in dead and p.poll() is None:
                try:
                    signal_main_thread(p.pid, SIGNAL)
                except ProcessLookupError:
                    pass   # it died meanwhile: the next poll sees it
        return procs

    def _start_node_services(self, stop: SignalStop) -> None:
        """The fork server (its preload overlaps the holders' start) and one holder per simulated node."""
        c = self.cfg
        if c.preload:
            self._launch_fork_server()
        if c.start_holders:
            for i in range(c.nodes):
                if stop.received is None:
                    self.start_holder(c.node_name(i))
        if c.preload:
            self._fork_server_ready()

    def _watch(self, procs: list, attempt: int, stop: SignalStop) -> dict[str, Any] | None:
        """Poll one attempt's trainers until they all finish (None), one fails, hangs past the attempt timeout
        or is killed by an injected node fault (the failure record), a node joined and the attempt committed a
        version since (cause GROW, with the plan: not a failure), or a signal stops the job (None, after killing
        them). Injected holder kills and node joins happen here too, at their step."""
        c, m = self.cfg, self.members
        started = time.monotonic()
        node_fault = self._node_fault(attempt)
        holder_faults = for_attempt(parse(c.inject), attempt, {FaultKind.KILL_HOLDER})
        joins = for_attempt(parse(c.inject), attempt, {FaultKind.ADD_NODE})
        watch = _EventTail(os.path.join(c.run_dir, "events.jsonl"), attempt) \
            if node_fault or holder_faults or joins else None
        commits = CommitWatch(c.run_dir, attempt, m.world())
        placed = m.rank_nodes()
        while True:
            if stop.received is not None:
                self._kill_all(procs)
                self.events.emit("attempt_end", attempt=attempt, rc=None, cause="terminated")
                return None
            while holder_faults and watch.reached(holder_faults[0].step):
                self._kill_holder(holder_faults.pop(0), attempt)
            if joins and watch.reached(min(f.step for f in joins)):
                commits.arm()   # the next commit is one after the node is back, not after its holder started
                self._joins_due(attempt, watch.best)
                joins = [f for f in joins if (attempt, str(f)) not in self._joined]
            if node_fault and watch.reached(node_fault.step):
                lost = self._kill_nodes(procs, node_fault, attempt)
                node_fault = None
                if lost is not None:
                    return lost
            grow = m.grow_plan()   # a node joined while the job runs smaller: back to a larger size at the next commit
            if grow is not None:
                version = commits.committed()
                if version is not None:
                    log.warning("version %d committed on every rank since a node joined: stopping attempt %d to "
                                "grow back", version, attempt)
                    return {"cause": GROW, "plan": grow, "attempt": attempt, "version": version, "rc": None}
            codes = [p.poll() for p in procs]
            exited = rank_exit(codes)
            if exited is not None:
                return {"cause": "rank_exit", **exited, "attempt": attempt, "node": placed[exited["rank"]]}
            if all(rc == 0 for rc in codes):
                return None
            if time.monotonic() - started > c.attempt_timeout_s:
                return {"cause": "hang", "attempt": attempt}
            time.sleep(0.05)


def rank_exit(codes: list) -> dict[str, Any] | None:
    """The failure among the trainers' exit codes (``Popen.poll()``: None while running): ``{"rank", "rc"}`` and,
    when several failed, the others under ``also``; None while none failed. Seen together in one poll (a busy
    launcher polls late), a rank killed by a signal is the cause: the ranks that exited with an error are its peers
    failing on the lost connection. Among equals, the lowest rank."""
    bad = [(r, rc) for r, rc in enumerate(codes) if rc not in (None, 0)]
    if not bad:
        return None
    r, rc = min(bad, key=lambda b: (b[1] > 0, b[0]))
    out: dict[str, Any] = {"rank": r, "rc": rc}
    if len(bad) > 1:
        out["also"] = [{"rank": o, "rc": orc} for o, orc in bad if o != r]
    return out


class _EventTail:
    """Follows events.jsonl incrementally: has any trainer of this attempt finished iteration >= step?

    Only this attempt's iterations count: an earlier attempt already reached the steps a restored
    one repeats, and a node fault for attempt j must hit attempt j's training, not its start."""

    def __init__(self, path: str, attempt: int = 0):
        self.path, self.best, self.attempt = path, 0, attempt
        self._tail = JsonlTail(path, contains=b'"iteration"')

    def reached(self, step: int) -> bool:
        if not os.path.exists(self.path):
            return False
        for ev in self._tail.poll():
            if ev.get("kind") == "iteration" and int(ev.get("attempt") or 0) == self.attempt:
                self.best = max(self.best, int(ev.get("iteration", 0)))
        return self.best >= step


def example_command(script: str, *args: str) -> list[str]:
    return [sys.executable, script, *args]
