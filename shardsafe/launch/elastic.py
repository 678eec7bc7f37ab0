"""`shardsafe launch`: torch elastic (torchrun) with one holder per node and launcher events for TOR.

Torch elastic restarts workers and admits new nodes; shardsafe does not re-implement that. What it adds
around torchrun:

* **Holders outside the worker group.** One holder per node is started before any worker and is not a
  child of the torchrun agent, so worker restarts (which kill the worker group) never touch it.
* **One attempt number for the whole job**, drawn by the agents (:mod:`.agent`).
* **Launcher events** exactly once per attempt, whichever agent saw what first, from one controller per
  job (:mod:`.controller`, :mod:`.incidents`), with a progress watchdog for hangs.

Local mode (:class:`ElasticLauncher`, ``shardsafe launch --nnodes N --nproc-per-node G``) simulates N
nodes on this host: one holder and one torchrun agent per node (``SHARDSAFE_NODE=nodeI``), c10d
rendezvous on 127.0.0.1 served by the launcher itself (so losing any simulated node never takes the
rendezvous down). ``--inject kill-node:NODE@STEP`` SIGKILLs that node's agent, workers and holder and
a fresh node (agent + empty holder) joins while spares last (``--spares``, default: always); with none left the
launcher waits ``--shrink-after-s`` for a node (``add-node:NODE@STEP``), then stops the agents and starts new ones
on the nodes left at a smaller data-parallel size (a new rendezvous of fewer nodes), and back at the full size
once a node joined and the attempt committed a version (:mod:`.resize`). ``kill-rank`` and ``hang-rank`` happen
inside trainers (:mod:`.faults`). Under SLURM the scripts in scripts/slurm start holders and agents with srun and
run ``shardsafe control serve`` on the batch host (docs/slurm.md).

Rank placement: torch elastic's rendezvous numbers nodes afresh every round, so after a node is
replaced a rank can land on another node than its snapshot; restore moves it (shardsafe.parity.placement).

Nothing here imports torch at module level.
"""
from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .. import env as names
from ..errors import ConfigError
from ..fatal import describe as describe_fatal, read_fatal
from .controller import Controller
from .errors import LaunchError
from ..faults import NODE_FAULTS, FaultKind, for_attempt, parse as parse_faults
from .incidents import Evidence
from .markers import LOG_DIR
from .resize import WAIT, CommitWatch, Membership, Plan
from .shrink import job_shape, shrink_after_s

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ElasticConfig:
    nodes: int = 1
    """Simulated nodes (failure domains), each with its own holder and torchrun agent."""
    nproc_per_node: int = 1
    """Workers per node."""
    run_dir: str
    """Per-run directory: events.jsonl, logs/agent_NODE.log, holder logs, the trainers' outputs."""
    job_id: str = ""
    """Scopes holders, store keys and the rendezvous (default: a fresh unique id)."""
    holder_dir: str = ""
    """Where holder sockets live (default: shardsafe's default holder dir)."""
    memory_budget_gb: float = 0.0
    """Per-holder budget (0 = half the node's RAM)."""
    max_restarts: int = 3
    """torchrun --max-restarts: worker-group restarts before the job gives up."""
    inject: str = ""
    """Fault spec (shardsafe.faults); fault j applies to attempt j. kill-node is done by the launcher."""
    hang_timeout_s: float = 600.0
    """No iteration event for this long = a hang (0 = no watchdog)."""
    grace_s: float = 1.0
    """Evidence of one incident is collected this long before the failure is reported."""
    keep_alive_s: int = 2
    """Rendezvous heartbeat interval (s); a lost node's agent is dropped after keep_alive_s * keep_alive_misses."""
    keep_alive_misses: int = 3
    join_timeout_s: float = 300.0
    """How long a rendezvous round may take to form."""
    monitor_interval_s: float = 0.1
    rendezvous_poll_s: float = -1.0
    """How often a waiting agent re-reads the rendezvous state (< 0: by job size; shardsafe.launch.agent)."""
    start_holders: bool = True
    """Start one holder per node before the agents (else trainers start detached ones themselves)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for agents and workers."""
    timeout_s: float = 0.0
    """Give up (and kill everything) after this long (0 = never)."""
    preload: tuple[str, ...] = ()
    """Modules each node's fork server imports once; its workers are forked from it instead of importing them
    again at every start and restart (shardsafe.launch.prewarm). Empty: torch elastic starts workers cold."""
    spares: int | None = None
    """Spare nodes that replace lost ones at once (None: always; 0: a lost node's place stays empty)."""
    shrink_after_s: float | None = None
    """With no spare left: the wait for a node before continuing at a smaller data-parallel size (0 = never;
    None = 3 x the agents' rendezvous timeout). Below join_timeout_s, which the waiting agents give up after."""
    model_parallel: int = 1
    """Ranks of one model replica (TP x PP)."""
    global_batch: int = 0
    """Global batch in samples (0: from the script's DeepSpeed config, else not known: no shrinking)."""
    micro_batch: int = 0
    """Samples per rank and micro-batch (with global_batch)."""
    restart: str = "full"
    """How a dead worker is restarted: "full" (every worker, torch elastic's way) or "in-place" (only the dead rank;
    the others go on in their processes: shardsafe.inplace)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nproc_per_node < 1:
            raise LaunchError(f"need nodes >= 1 and nproc_per_node >= 1, got {self.nodes} and {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise LaunchError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.keep_alive_s < 1 or self.keep_alive_misses < 1:
            raise LaunchError("keep_alive_s and keep_alive_misses must be >= 1 (torch's c10d rendezvous takes whole seconds)")
        from .holders import budget_problem
        problem = budget_problem(self.memory_budget_gb)
        if problem:
            raise LaunchError(problem)
        for name, flag in (("hang_timeout_s", "--hang-timeout-s"), ("grace_s", "--grace-s"), ("timeout_s", "--timeout-s")):
            v = getattr(self, name)
            if not v >= 0:
                raise LaunchError(f"{flag} must be >= 0 seconds (0 = off), got {v!r}")
        if not self.join_timeout_s > 0:
            raise LaunchError(f"join_timeout_s must be > 0 seconds, got {self.join_timeout_s!r}")
        try:
            self.shrink_after_s = shrink_after_s(self.shrink_after_s)
            job_shape(nodes=self.nodes, ranks_per_node=self.nproc_per_node, model_parallel=self.model_parallel,
                      global_batch=self.global_batch, micro_batch=self.micro_batch)
        except ConfigError as e:
            raise LaunchError(str(e)) from None
        if self.restart not in names.RESTART_MODES:
            raise LaunchError(f"--restart {self.restart!r}: expected one of {', '.join(names.RESTART_MODES)}")
        if self.spares is not None and self.spares < 0:
            raise LaunchError(f"--spares must be >= 0 (default: a lost node is always replaced), got {self.spares}")
        if self.spares is not None and 0 < self.join_timeout_s <= self.shrink_after_s:
            raise LaunchError(f"--shrink-after-s {self.shrink_after_s:g} must be below the rendezvous join timeout "
                              f"{self.join_timeout_s:g} s: the agents waiting for the lost node's place give up after "
                              "it, before the job could shrink")
        faults = parse_faults(self.inject)   # fail fast on a malformed spec
        for f in faults:
            if f.kind in NODE_FAULTS:
                for n in f.target.split("+"):
                    if not (n.startswith("node") and n[4:].isdigit()):
                        raise LaunchError(f"{f.kind.value} target {n!r}: local nodes are named node0..node{self.nodes - 1}")
        if not self.job_id:
            self.job_id = f"launch-{uuid.uuid4().hex[:8]}"
        if not self.holder_dir:
            self.holder_dir = names.holder_dir()


@dataclass
class LaunchResult:
    ok: bool
    attempts: int
    failures: list[dict[str, Any]]
    wall_s: float
    nodes: list[str]
    """Every node that took part, replacements included."""
    run_dir: str
    signal: int | None = None
    """The signal (SIGTERM, SIGINT, SIGHUP) that stopped the launcher, if one did."""
    fatal: str = ""
    """The error no restart can fix that ended the job (shardsafe.fatal), if any."""
    data_parallel_sizes: list[int] = field(default_factory=list)
    """The data-parallel sizes the job ran at, in order (one entry unless it shrank or grew)."""


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torch elastic's workers run in their own sessions)."""
    import psutil
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


class ElasticLauncher:
    """Local mode of ``shardsafe launch``: N simulated nodes on this host under torch elastic."""

    def __init__(self, cfg: ElasticConfig):
        self.cfg = cfg
        os.makedirs(os.path.join(cfg.run_dir, LOG_DIR), exist_ok=True)
        from ..tor import EventLog
        self.events = EventLog(cfg.run_dir, source="launcher")
        self.holders: dict[str, subprocess.Popen] = {}
        self.agents: dict[str, Any] = {}   # node -> its agent (a Popen, or forked from agent_forks)
        self.agent_forks: Any = None       # the fork server the agents are forked from (shardsafe.launch.agentforks)
        self.lost: set[str] = set()
        self.all_nodes: list[str] = []
        self._next_node = cfg.nodes
        self.controller: Controller | None = None
        self.t_start = time.time()
        self.members: Membership | None = None   # the job's nodes and size (run() makes it: it knows the script)
        self.generation = 0                      # rendezvous generations: one more per re-forming
        self.sizes: list[int] = []
        self._wait: tuple[int, float] | None = None       # (next attempt, since): a lost node's place is empty
        self._grow: tuple[int, CommitWatch] | None = None  # (attempt, its commits) once a node joined at a smaller size
        self._said = ""
        self.instance = f"{cfg.job_id}.{os.getpid()}.{uuid.uuid4().hex[:8]}"   # this run of the job (shardsafe.jobid)

    # ---- holders ---------------------------------------------------------------------------------------
    def start_holders(self, nodes: list[str]) -> None:
        """Start one holder per node (in parallel) and wait until each serves its socket."""
        from ..holder.client import holder_command
        from ..holder.paths import HolderPaths, HolderSecurityError
        from .holders import holder_env, holder_failure, holder_running
        started = {}
        for node in nodes:
            p = HolderPaths(self.cfg.holder_dir, self.cfg.job_id, node)
            try:
                p.ensure_dir()
            except HolderSecurityError as e:   # another user's directory: said as a launch error, nothing started
                raise LaunchError(str(e)) from None
            if holder_running(p):
                raise LaunchError(f"a holder for job id {self.cfg.job_id!r} on {node} is already running ({p.socket}): "
                                  "another job uses this id. Give this job its own --job-id, or stop the other one "
                                  "(`shardsafe status --job-id ...` shows what it holds)")
            cmd = holder_command(p, budget_gb=self.cfg.memory_budget_gb, run_dir=self.cfg.run_dir)
            with open(os.path.join(self.cfg.run_dir, LOG_DIR, f"holder_{node}.log"), "ab") as logf:
                started[node] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=logf,
                                                 start_new_session=True, env=holder_env(self.cfg.inject))
            self.holders[node] = started[node]
        for node, proc in started.items():
            line = proc.stdout.readline()   # "holder ready: SOCKET" once the socket is bound
            if not line.startswith(b"holder ready"):
                proc.kill()
                self.holders.pop(node, None)
                raise LaunchError(holder_failure(node, proc.wait(), os.path.join(self.cfg.run_dir, LOG_DIR,
                                                                                  f"holder_{node}.log")))

    def stop_holders(self) -> None:
        """Ask every holder to stop (they free their memory), then wait; SIGKILL what does not stop."""
        from ..holder.client import stop_holders
        from ..holder.paths import HolderPaths
        stop_holders([(HolderPaths(self.cfg.holder_dir, self.cfg.job_id, node), proc)
                      for node, proc in self.holders.items()])
        self.holders.clear()

    # ---- agents ----------------------------------------------------------------------------------------
    @staticmethod
    def node_addr(node: str) -> str:
        """A loopback address per simulated node (127.0.1xx.1: all of 127/8 is local), as real nodes have
        their own. Torch elastic orders a round's nodes by address, so the order is by node number here
        (a replacement node sorts last) instead of by agent pid."""
        i = int(node[4:])
        return f"127.0.{100 + i}.1" if i < 155 else ""

    def start_agent(self, node: str) -> None:
        c, ctl, m = self.cfg, self.controller, self.members
        k = len(m.active)
        restarts = max(0, c.max_restarts - len(ctl.book.failures))   # the job's budget, not each new agent's own
        cmd = [sys.executable, "-m", "shardsafe.launch", "agent", "--node", node, "--control", ctl.endpoint,
               "--nnodes", f"{k}:{k}", "--nproc-per-node", str(c.nproc_per_node),
               "--job-id", c.job_id, "--run-dir", c.run_dir, "--holder-dir", c.holder_dir,
               "--rdzv-id", f"{c.job_id}.g{self.generation}" if self.generation else c.job_id,
               "--full-world-size", str(m.world(m.full_dp)),
               "--max-restarts", str(restarts), "--monitor-interval-s", str(c.monitor_interval_s),
               "--keep-alive-s", str(c.keep_alive_s), "--keep-alive-misses", str(c.keep_alive_misses),
               "--join-timeout-s", str(c.join_timeout_s), "--job-start-t", repr(self.t_start),
               "--rendezvous-poll-s", repr(c.rendezvous_poll_s)]
        if c.inject:
            cmd += ["--inject", c.inject]
        if c.preload:
            cmd += ["--preload", ",".join(c.preload)]
        if self.node_addr(node):
            cmd += ["--local-addr", self.node_addr(node)]
        env = self._agent_env()
        logf = open(os.path.join(c.run_dir, LOG_DIR, f"agent_{node}.log"), "ab")
        cmd += ["--", *self._script]
        p = None
        if self.agent_forks is not None:
            p = self.agent_forks.fork_or_cold(cmd, env=env, stdout=logf.fileno(), stderr=logf.fileno(), who="agents")
        self.agents[node] = p or subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf,
                                                  stderr=subprocess.STDOUT, env=env, start_new_session=True)
        logf.close()
        if node not in self.all_nodes:
            self.all_nodes.append(node)

    def _agent_env(self) -> dict[str, str]:
        """Every agent's environment (one for all: the agents' fork server imported with it)."""
        from .holders import holder_budget_env
        c = self.cfg
        env = {**os.environ, **c.env, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), names.INSTANCE: self.instance,
               **(holder_budget_env(c.memory_budget_gb) if c.start_holders else {}), names.RESTART: c.restart}
        env.pop(names.ATTEMPT, None)   # the agent numbers attempts
        env.pop(names.TRAINER, None)   # its workers are trainers, not processes of one (early_open.trainer_process)
        return env

    def kill_node(self, node: str) -> None:
        """Node loss: SIGKILL the node's agent, its workers and its holder (its memory dies with it)."""
        self.lost.add(node)
        agent = self.agents.get(node)
        if agent is not None:
            _kill_tree(agent.pid)
        from ..holder.paths import HolderPaths
        from .holders import kill_serving_holder
        kill_serving_holder(HolderPaths(self.cfg.holder_dir, self.cfg.job_id, node))   # also one a rank started
        holder = self.holders.pop(node, None)
        if holder is not None:
            holder.kill()
        if agent is not None:
            agent.wait()
        if holder is not None:
            holder.wait()

    def new_node_name(self, lost: str = "") -> str:
        """A spare's name: the next unused nodeK (a real spare is another machine, under its own name)."""
        node = f"node{self._next_node}"
        self._next_node += 1
        return node

    def _join(self, node: str, why: str) -> None:
        """add-node: the node joins with an empty holder; its agent starts when an attempt runs on it."""
        m = self.members
        if node in m.live or not m.join(node):
            log.warning("injected node join (%s): %s is in the job already or every slot is taken; it stays out",
                        why, node)
            return
        self.lost.discard(node)
        if self.cfg.start_holders:
            self.start_holders([node])
        log.warning("node %s joined the job (%s) with an empty holder; nodes up: %s", node, why, ", ".join(m.live))

    def _reform(self, plan: Plan, *, stop: int | None = None, version: int | None = None) -> None:
        """Run the next attempt as ``plan`` says. The same size: agents for the plan's nodes that have none (a spare
        joins the round the others wait in). Another size: a ``shrink`` / ``grow`` event, the end of attempt ``stop``
        (a grow stops a running one at committed ``version``), then every agent is stopped and new ones start on the
        plan's nodes in a new rendezvous of that many nodes."""
        m = self.members
        if plan.dp == m.dp:
            m.apply(plan)
            for node in plan.nodes:
                if node not in self.agents or self.agents[node].poll() is not None:
                    self.start_agent(node)
            return
        self.events.emit(plan.action, from_dp=m.dp, to_dp=plan.dp, nodes=list(plan.nodes), reason=plan.reason)
        log.warning("%s: %s; agents on %s", plan.action, plan.reason, ", ".join(plan.nodes))
        if stop is not None:
            self.controller.stopped(stop, cause=plan.action, version=version)
        for p in self.agents.values():
            if p.poll() is None:
                _kill_tree(p.pid)
                p.wait()
        self.agents = {}
        self.generation += 1
        m.apply(plan)
        self.sizes.append(plan.dp)
        self.controller.book.world_size = m.world()
        for node in plan.nodes:
            self.start_agent(node)

    def _resize_step(self) -> None:
        """While a lost node's place is empty: wait, shrink or run (:meth:`Membership.plan`); while the job runs
        smaller and a node joined: grow at the attempt's next committed version."""
        m, ctl = self.members, self.controller
        if self._wait is not None:
            nxt, since = self._wait
            self._joins(nxt, None)
            plan = m.plan(time.monotonic() - since)
            if plan.action == WAIT:
                if plan.reason != self._said:
                    (log.error if plan.refused else log.warning)("%s", plan.reason)
                    self._said = plan.reason
                return
            self._wait = None
            self._reform(plan)
            return
        a = ctl.attempt
        grow = m.grow_plan()
        if grow is None or a is None or not ctl.book.is_open(a):
            return
        if self._grow is None or self._grow[0] != a:   # the node joined before this attempt: all its commits count
            self._grow = (a, CommitWatch(self.cfg.run_dir, a, m.world()))
        version = self._grow[1].committed()
        if version is not None:
            log.warning("version %d committed on every rank since a node joined: stopping attempt %d to grow back",
                        version, a)
            self._grow = None
            self._reform(grow, stop=a, version=version)
            self.events.emit("restart", attempt=a + 1)

    def _joins(self, a: int | None, reached: int | None) -> None:
        """add-node faults of attempt ``a`` due at step ``reached`` (None: step 0 only, before it starts)."""
        for f in [] if a is None else for_attempt(parse_faults(self.cfg.inject), a, {FaultKind.ADD_NODE}):
            key = ("join", a, str(f))
            if key not in self._injected and (f.step == 0 if reached is None else f.step <= reached):
                self._injected.add(key)
                if self.members.dp < self.members.full_dp and reached is not None:
                    # the next commit is one after the node is back, not after its holder started
                    if self._grow is None or self._grow[0] != a:
                        self._grow = (a, CommitWatch(self.cfg.run_dir, a, self.members.world()))
                    self._grow[1].arm()
                self._join(f.target, f"{f}, attempt {a}")

    # ---- the run ---------------------------------------------------------------------------------------
    def _node_fault(self, attempt: int | None):
        if attempt is None:
            return None
        return next(iter(for_attempt(parse_faults(self.cfg.inject), attempt, {FaultKind.KILL_NODE})), None)

    def _holder_faults(self, attempt: int | None) -> list:
        return [] if attempt is None else for_attempt(parse_faults(self.cfg.inject), attempt, {FaultKind.KILL_HOLDER})

    def kill_holder(self, fault, attempt: int) -> None:
        """kill-holder: the node's holder alone dies (SIGKILL); its workers run on and its first rank starts a
        new one. No incident: the attempt goes on."""
        from ..holder.paths import HolderPaths
        from .holders import kill_serving_holder
        kill_serving_holder(HolderPaths(self.cfg.holder_dir, self.cfg.job_id, fault.target))
        holder = self.holders.get(fault.target)
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        self.events.emit("holder_killed", node=fault.target, fault=str(fault), attempt=attempt)
        log.warning("injected holder kill: %s at step %d of attempt %d (its workers run on)", fault.target,
                    fault.step, attempt)

    def _fatal_of(self, a: int | None) -> str:
        """The description of the error that ended attempt ``a`` if no restart can fix it (a ConfigError /
        RestoreError: every restart would end the same way), reported to the controller; else ""."""
        records = read_fatal(self.cfg.run_dir, a) if a is not None else []
        if not records:
            return ""
        fatal = describe_fatal(records)
        log.error("attempt %s failed with %s", a, fatal)
        ctl = self.controller
        ctl.book.max_restarts = -1   # no "restart" event: there is none
        r = records[0]
        ctl.report(Evidence(t=float(r.get("t") or time.time()), cause="fatal_error", rank=r.get("rank"),
                            node=r.get("node")), a)
        return fatal

    def _inject(self, a: int | None, injected: set) -> None:
        """The injected holder kills and node losses of attempt ``a`` whose step the workers reached (once each)."""
        ctl = self.controller
        for hf in self._holder_faults(a):
            if (a, str(hf)) not in injected and ctl.tail.max_iter.get(a, 0) >= hf.step and ctl.book.is_open(a):
                injected.add((a, str(hf)))
                self.kill_holder(hf, a)
        fault = self._node_fault(a)
        if fault is not None and a not in injected and ctl.tail.max_iter.get(a, 0) >= fault.step \
                and ctl.book.is_open(a):
            injected.add(a)
            nodes = fault.target.split("+")
            t_fault = time.time()
            m = self.members
            ran = m.lose([n for n in nodes if n in m.live])
            if ran:
                ctl.report(Evidence(t=t_fault, cause="node_loss", node="+".join(nodes), t_fault=t_fault), a)
            for n in nodes:
                self.kill_node(n)
            log.warning("injected node loss: %s at step %d of attempt %d%s", "+".join(nodes), fault.step, a,
                        "" if ran else " (it ran no rank of the attempt, which goes on)")
            for node in m.take_spares():   # a spare: a fresh node, empty holder; its agent joins the round
                if self.cfg.start_holders:
                    self.start_holders([node])
            if ran:
                self._wait = (a + 1, time.monotonic())
        if a is not None and ctl.book.is_open(a):
            self._joins(a, ctl.tail.max_iter.get(a, 0))

    def _agents_done(self, t0: float) -> bool | None:
        """True when every live agent finished, False when one gave up or the job timed out, None while running."""
        live = {n: p for n, p in self.agents.items() if n not in self.lost}
        codes = {n: p.poll() for n, p in live.items()}
        bad = {n: rc for n, rc in codes.items() if rc not in (None, 0)}
        if bad:
            log.error("agent(s) %s gave up (exit codes %s): the job failed", sorted(bad), bad)
            return False
        if codes and all(rc == 0 for rc in codes.values()):
            return True
        if self.cfg.timeout_s and time.time() - t0 > self.cfg.timeout_s:
            log.error("timeout after %.0f s: killing the job", self.cfg.timeout_s)
            return False
        return None

    def run(self, script: list[str]) -> LaunchResult:
        """Run the job to the end: every agent done, one gave up, the timeout, an error no restart can fix
        (shardsafe.fatal: stops at once, ``LaunchResult.fatal``), or SIGTERM/SIGINT/SIGHUP
        (``LaunchResult.signal``). Agents, workers and holders are stopped in every case."""
        from .signals import SignalStop
        c = self.cfg
        self._script = list(script)
        t0 = self.t_start = time.time()
        self.events.emit("job_start", at=t0, nodes=c.nodes, nproc_per_node=c.nproc_per_node, launcher="torchrun",
                         job_id=c.job_id, cmd=shlex.join(script)[:500])
        ok, fatal = False, ""
        injected = self._injected = set()
        shape = job_shape(nodes=c.nodes, ranks_per_node=c.nproc_per_node, model_parallel=c.model_parallel,
                          global_batch=c.global_batch, micro_batch=c.micro_batch, command=script)
        self.members = Membership([f"node{i}" for i in range(c.nodes)], shape, spares=c.spares,
                                  shrink_after_s=c.shrink_after_s, spare_name=self.new_node_name)
        self.sizes = [shape.dp]
        with SignalStop() as stop:
            try:
                self.controller = Controller(run_dir=c.run_dir, job_id=c.job_id, world_size=c.nodes * c.nproc_per_node,
                                             max_restarts=c.max_restarts, hang_timeout_s=c.hang_timeout_s,
                                             grace_s=c.grace_s, events=self.events)
                from .agentforks import agent_server_ready, launch_agent_server
                # its imports overlap the holders' start
                self.agent_forks = launch_agent_server(c.preload, env=self._agent_env(),
                                                       log_path=os.path.join(c.run_dir, LOG_DIR, "agents_prewarm.log"))
                if c.start_holders and stop.received is None:
                    self.start_holders([f"node{i}" for i in range(c.nodes)])
                self.agent_forks = agent_server_ready(self.agent_forks)
                for i in range(c.nodes):
                    if stop.received is None:
                        self.start_agent(f"node{i}")
                while stop.received is None:
                    time.sleep(0.05)
                    self.controller.poll()
                    a = self.controller.attempt
                    fatal = self._fatal_of(a)
                    if fatal:
                        break
                    self._inject(a, injected)
                    self._resize_step()
                    done = self._agents_done(t0)
                    if done is not None:
                        ok = done
                        break
            finally:
                for node, p in self.agents.items():
                    if p.poll() is None:
                        _kill_tree(p.pid)
                        p.wait()
                if self.agent_forks is not None:
                    self.agent_forks.close()
                ctl = self.controller
                if ctl is not None:
                    ctl.poll()
                    ctl.close()
                    a = ctl.attempt
                    if stop.received is not None and a is not None and ctl.book.is_open(a):
                        ctl.book.attempts[a].ended = True
                        self.events.emit("attempt_end", attempt=a, rc=None, cause="terminated")
                self.stop_holders()
                extra = {"signal": stop.received, "cause": "terminated"} if stop.received is not None else {}
                self.events.emit("job_end", ok=ok, **extra)
                if ctl is not None:
                    ctl.store = None   # stops the store server (rendezvous) with the job
        book = self.controller.book if self.controller is not None else None
        return LaunchResult(ok=ok, attempts=book.n_attempts if book else 0, failures=list(book.failures) if book else [],
                            wall_s=time.time() - t0, nodes=list(self.all_nodes), run_dir=c.run_dir,
                            signal=stop.received, fatal=fatal, data_parallel_sizes=list(self.sizes))
