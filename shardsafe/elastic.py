"""`shardsafe launch`: torch elastic (torchrun) with one holder per node and launcher events for TOR.

Torch elastic restarts workers and admits new nodes; shardsafe does not re-implement that. What it
adds around torchrun:

* **Holders outside the worker group.** One holder per node is started before any worker and is not a
  child of the torchrun agent, so worker restarts (which kill the worker group) never touch it.
* **One attempt number for the whole job.** ``TORCHELASTIC_RESTART_COUNT`` is per agent: the agent
  whose worker failed counts a restart, the others restart for the "membership change" and do not. Fault
  injection, restore and TOR need one number per worker-group generation, so each torchrun agent runs
  in :class:`ShardsafeAgent`, which numbers every completed rendezvous round once (the round's
  group-rank-0 agent draws it from a counter in the control store, the others read it from the round's
  store) and exports it to its workers as ``SHARDSAFE_ATTEMPT``.
* **Launcher events.** Agents publish facts (round started, workers failed/succeeded, hung workers)
  into the control store (the same TCPStore that serves the c10d rendezvous). One
  :class:`Controller` per job turns them into ``attempt_start``, ``failure_detected``,
  ``attempt_end``, ``restart`` (docs/tor.md) exactly once per attempt, whichever agent saw what
  first: evidence of one incident collected during a short grace period is ranked (node loss > hang >
  a rank killed by a signal > a rank exiting with an error) and the event is dated at the first
  evidence.
* **A progress watchdog.** The controller follows ``iteration`` events; an attempt that made no
  progress for ``hang_timeout_s`` is a hang: its workers are SIGKILLed through the agents (torch
  elastic then restarts them) and the failure's ``t_fault`` is the last progress.

Local mode (:class:`ElasticLauncher`, ``shardsafe launch --nodes N --nproc-per-node G``) simulates N
nodes on this host: one holder and one torchrun agent per node (``SHARDSAFE_NODE=nodeI``), c10d
rendezvous on 127.0.0.1 served by the launcher itself (so losing any simulated node never takes the
rendezvous down). ``--inject kill-node:NODE@STEP`` SIGKILLs that node's agent, workers and holder and
a fresh node (agent + empty holder) joins; ``kill-rank`` and ``hang-rank`` happen inside trainers
(shardsafe.faults). Under SLURM the scripts in scripts/slurm start holders and agents with srun and
run ``shardsafe control serve`` on the batch host (docs/slurm.md).

Rank placement: torch elastic's rendezvous numbers nodes afresh every round, so after a node is
replaced a rank can land on another node than its snapshot; restore moves it (shardsafe.placement).

Nothing here imports torch at module level: the CLI helpers (``notify``, markers) stay fast.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional

from .fatal import describe as describe_fatal, read_fatal
from .faults import NODE_FAULTS, FaultKind, for_attempt, parse as parse_faults

log = logging.getLogger("shardsafe.elastic")

CONTROL_DIR = "control"     # RUN_DIR/control: notifications from scripts to the controller
MARKER_DIR = "markers"      # RUN_DIR/markers/rank{R}.done: written by a rank that finished
LOG_DIR = "logs"

# Evidence ranking: the most specific explanation of an incident wins.
PRIORITY = {"fatal_error": 5, "node_loss": 4, "hang": 3, "rank_signal": 2, "rank_exit": 1, "membership_change": 0}


class LaunchError(RuntimeError):
    """The launch cannot start or was configured wrongly; the message says what to change."""


EXIT_FATAL = 3
"""`shardsafe launch` exit code when a worker died of an error no restart fixes (shardsafe.fatal); 2 is a
launcher usage error (LaunchError), 1 a job that failed after its restarts, 128+N a signal."""


# ---------------------------------------------------------------------------------------------------------------
# Markers and notifications (plain files: usable from bash, no torch import)
# ---------------------------------------------------------------------------------------------------------------

def _atomic_write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def mark_rank_done(run_dir: str | None = None, rank: int | None = None, **info: Any) -> Optional[str]:
    """Write ``RUN_DIR/markers/rank{R}.done`` (JSON: rank, node, attempt, t). Call it as the very last
    thing a rank does after finishing: a launcher must not take the exit status of ``srun`` as proof
    that every rank finished (a rank on a crashed node may never report one). No-op without a run dir."""
    run_dir = run_dir if run_dir is not None else os.environ.get("SHARDSAFE_RUN_DIR", "")
    if not run_dir:
        return None
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    path = os.path.join(run_dir, MARKER_DIR, f"rank{rank}.done")
    _atomic_write(path, {"rank": rank, "node": os.environ.get("SHARDSAFE_NODE"),
                         "attempt": os.environ.get("SHARDSAFE_ATTEMPT"), "t": time.time(), **info})
    return path


def done_ranks(run_dir: str) -> set[int]:
    d = os.path.join(run_dir, MARKER_DIR)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return set()
    return {int(n[4:-5]) for n in names if n.startswith("rank") and n.endswith(".done") and n[4:-5].isdigit()}


def notify(run_dir: str, what: str, **fields: Any) -> str:
    """Leave a notification for the job's controller (``node_lost`` with ``node``; ``job_end`` with ``ok``)."""
    if what not in ("node_lost", "job_end"):
        raise ValueError(f"unknown notification {what!r}: expected node_lost or job_end")
    name = f"{what}.{time.time_ns()}.{os.getpid()}.json"
    path = os.path.join(run_dir, CONTROL_DIR, name)
    _atomic_write(path, {"what": what, "t": time.time(), **fields})
    return path


# ---------------------------------------------------------------------------------------------------------------
# Incident book: launcher events from agents' facts (pure: unit-tested with explicit times)
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Evidence:
    t: float                 # when it happened / was seen (the reporter's clock)
    cause: str               # key of PRIORITY
    rank: int | None = None
    node: str | None = None
    rc: int | None = None
    t_fault: float | None = None
    arrived: float = 0.0     # when the controller learnt it (its clock)


@dataclass
class _AttemptState:
    attempt: int
    started: float
    nodes: set[str] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    evidence: list[Evidence] = field(default_factory=list)
    hung: set[int] = field(default_factory=set)
    decided: bool = False
    ended: bool = False


Emit = tuple[str, float, dict]   # (kind, at, fields)


class IncidentBook:
    """Turns facts from many reporters into one event stream per attempt (see the module docstring).

    Args:
        world_size: ranks of a complete attempt (an attempt ends successfully when all are done).
        max_restarts: failures after which no ``restart`` is announced.
        grace_s: how long evidence of an incident is collected before it is reported.
    """

    def __init__(self, *, world_size: int, max_restarts: int, grace_s: float = 1.0):
        self.world_size, self.max_restarts, self.grace_s = world_size, max_restarts, grace_s
        self.attempts: dict[int, _AttemptState] = {}
        self.failures: list[dict[str, Any]] = []
        self.current: int | None = None

    # ---- inputs ------------------------------------------------------------------------------------------
    def started(self, attempt: int, *, node: str, ranks: Iterable[int], t: float, now: float) -> list[Emit]:
        out: list[Emit] = []
        st = self.attempts.get(attempt)
        if st is None:
            # A new generation: the previous ones are over. Report what is pending now, and a restart
            # nobody explained (e.g. torch elastic re-forming the group for a new node) as such.
            for prev in sorted(a for a in self.attempts if a < attempt):
                p = self.attempts[prev]
                if not p.decided and not p.ended:
                    if not p.evidence:
                        p.evidence.append(Evidence(t=t, cause="membership_change", arrived=now))
                    out += self._decide(p)
            st = self.attempts[attempt] = _AttemptState(attempt, t)
            self.current = attempt if self.current is None else max(self.current, attempt)
            out.append(("attempt_start", t, {"attempt": attempt}))
        st.started = min(st.started, t)
        st.nodes.add(node)
        st.ranks.update(int(r) for r in ranks)
        return out

    def evidence(self, ev: Evidence, attempt: int | None = None, *, now: float) -> list[Emit]:
        a = self.current if attempt is None else attempt
        st = self.attempts.get(a) if a is not None else None
        if st is None or st.decided or st.ended:
            return []
        ev.arrived = now
        st.evidence.append(ev)
        return []

    def hung(self, attempt: int, ranks: Iterable[int]) -> None:
        st = self.attempts.get(attempt)
        if st is not None:
            st.hung.update(int(r) for r in ranks)

    def done(self, attempt: int, *, ranks: Iterable[int], t: float) -> list[Emit]:
        st = self.attempts.get(attempt)
        if st is None or st.decided or st.ended:
            return []
        st.done.update(int(r) for r in ranks)
        if len(st.done) >= self.world_size:
            st.ended = True
            return [("attempt_end", t, {"attempt": attempt, "rc": 0, "cause": "finished"})]
        return []

    def tick(self, now: float) -> list[Emit]:
        out: list[Emit] = []
        for a in sorted(self.attempts):
            st = self.attempts[a]
            if not st.decided and not st.ended and st.evidence and now - min(e.arrived for e in st.evidence) >= self.grace_s:
                out += self._decide(st)
        return out

    def close(self) -> list[Emit]:
        """Report whatever is pending (the job is ending)."""
        out: list[Emit] = []
        for a in sorted(self.attempts):
            st = self.attempts[a]
            if not st.decided and not st.ended and st.evidence:
                out += self._decide(st)
        return out

    # ---- queries -----------------------------------------------------------------------------------------
    def is_open(self, attempt: int | None) -> bool:
        st = self.attempts.get(attempt) if attempt is not None else None
        return st is not None and not st.decided and not st.ended and not st.evidence

    @property
    def n_attempts(self) -> int:
        return len(self.attempts)

    # ---- decision ----------------------------------------------------------------------------------------
    def _decide(self, st: _AttemptState) -> list[Emit]:
        st.decided = True
        best = max(st.evidence, key=lambda e: (PRIORITY.get(e.cause, 0), -e.t))
        at = min(e.t for e in st.evidence)
        cause = "rank_exit" if best.cause == "rank_signal" else best.cause
        rank = best.rank
        if best.cause == "hang" and rank is None and st.hung:
            rank = min(st.hung)
        f: dict[str, Any] = {"attempt": st.attempt, "cause": cause, "rank": rank, "node": best.node}
        if best.rc is not None:
            f["rc"] = best.rc
        if best.t_fault is not None:
            f["t_fault"] = min(best.t_fault, at)
        self.failures.append(dict(f, t=at))
        out: list[Emit] = [("failure_detected", at, f),
                           ("attempt_end", at, {"attempt": st.attempt, "rc": best.rc, "cause": cause})]
        if len(self.failures) <= self.max_restarts:
            out.append(("restart", at, {"attempt": st.attempt + 1}))
        return out


def exit_evidence(exits: dict, *, node: str | None, t: float) -> list[Evidence]:
    """Evidence from workers' exit codes (torch elastic: negative = killed by that signal)."""
    out = []
    for r, rc in exits.items():
        rc = int(rc) if rc is not None else None
        out.append(Evidence(t=t, cause="rank_signal" if rc is not None and rc < 0 else "rank_exit",
                            rank=int(r), node=node, rc=rc))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Progress from the event log
# ---------------------------------------------------------------------------------------------------------------

class ProgressTail:
    """Follows ``RUN_DIR/events.jsonl`` incrementally: per attempt, the highest iteration and when the
    latest ``iteration`` event was written."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, "events.jsonl")
        self.pos = 0
        self.max_iter: dict[int, int] = {}
        self.last_t: dict[int, float] = {}

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self.pos += end
        for line in data[:end].splitlines():
            if b'"iteration"' not in line:
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("kind") != "iteration" or not isinstance(ev.get("attempt"), int):
                continue
            a = ev["attempt"]
            self.max_iter[a] = max(self.max_iter.get(a, 0), int(ev.get("iteration") or 0))
            self.last_t[a] = max(self.last_t.get(a, 0.0), float(ev.get("t") or 0.0))


# ---------------------------------------------------------------------------------------------------------------
# Control store keys and the agent <-> controller protocol (JSON values in a TCPStore)
# ---------------------------------------------------------------------------------------------------------------

class Keys:
    def __init__(self, job_id: str):
        self.p = f"shardsafe/{job_id}"

    @property
    def rounds(self) -> str:
        return f"{self.p}/rounds"

    @property
    def base(self) -> str:
        return f"{self.p}/attempt_base"

    @property
    def n_facts(self) -> str:
        return f"{self.p}/facts"

    def fact(self, i: int) -> str:
        return f"{self.p}/fact/{i}"

    def kill(self, attempt: int) -> str:
        return f"{self.p}/kill/{attempt}"

    ROUND_ATTEMPT = "shardsafe/attempt"   # in each rendezvous round's own (prefixed) store


def _store_client(endpoint: str, timeout_s: float = 60.0):
    from torch.distributed import TCPStore
    host, port = split_endpoint(endpoint)
    try:
        return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, TimeoutError) as e:   # DistNetworkError & co.
        raise LaunchError(f"cannot reach the job's controller at {endpoint} ({str(e).splitlines()[0]}): is "
                          "`shardsafe control serve` (or `shardsafe launch`) running there?") from None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise LaunchError(f"endpoint {endpoint!r}: expected HOST:PORT")
    return host, int(port)


def publish(store, keys: Keys, fact: dict) -> None:
    i = store.add(keys.n_facts, 1)
    store.set(keys.fact(i), json.dumps(fact))


# ---------------------------------------------------------------------------------------------------------------
# Controller: one per job, hosts the control/rendezvous store, emits the launcher events
# ---------------------------------------------------------------------------------------------------------------

class _NoEvents:
    def emit(self, kind: str, **f: Any) -> bool:
        return False


def attempt_base_from_log(run_dir: str) -> int:
    """1 + the highest attempt any earlier allocation of this run directory logged (0 for a new run):
    a requeued job continues the numbering, so its attempts never merge with the earlier ones."""
    try:
        from .tor import read_events
        evs = read_events(run_dir)
    except (FileNotFoundError, OSError):
        return 0
    seen = [e["attempt"] for e in evs if isinstance(e.get("attempt"), int) and not isinstance(e.get("attempt"), bool)]
    return max(seen) + 1 if seen else 0


class Controller:
    """Hosts the TCPStore that serves the c10d rendezvous and the agents' facts; emits launcher events.

    Args:
        run_dir: the run directory (events.jsonl, control/ notifications).
        job_id: scopes the store keys (the rendezvous id).
        world_size: ranks of a complete attempt.
        host, port: where to serve the store (port 0: any free port; see :attr:`endpoint`).
        max_restarts: restarts before the job gives up (for the ``restart`` events).
        hang_timeout_s: an attempt with no ``iteration`` event for this long is hung (0: no watchdog).
        grace_s: how long evidence of one incident is collected before it is reported.
        attempt_base: first attempt number (a requeued job continues the previous numbering).
        events: the launcher's EventLog (default: one on run_dir).
    """

    def __init__(self, *, run_dir: str, job_id: str, world_size: int, host: str = "127.0.0.1", port: int = 0,
                 max_restarts: int = 3, hang_timeout_s: float = 600.0, grace_s: float = 1.0,
                 attempt_base: int = 0, events=None):
        from torch.distributed import TCPStore
        self.run_dir, self.job_id = run_dir, job_id
        self.keys = Keys(job_id)
        self.store = TCPStore(host, port, world_size=None, is_master=True, timeout=timedelta(seconds=60),
                              wait_for_workers=False, multi_tenant=True)
        self.host, self.port = host, int(self.store.port)
        self.store.set(self.keys.base, str(attempt_base))
        self.attempt_base = attempt_base
        if events is None:
            from .tor import EventLog
            events = EventLog(run_dir, source="launcher")
        self.events = events
        self.book = IncidentBook(world_size=world_size, max_restarts=max_restarts, grace_s=grace_s)
        self.tail = ProgressTail(run_dir)
        self.hang_timeout_s = hang_timeout_s
        self._facts_seen = 0
        self._pending: set[int] = set()
        self._notes_seen: set[str] = set()
        self._killed: set[int] = set()
        self._markers: dict[str, str] = {}   # marker file -> attempt it was written in
        self.job_end_request: Optional[dict] = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def attempt(self) -> int | None:
        return self.book.current

    def _emit(self, emits: Iterable[Emit]) -> None:
        for kind, at, f in emits:
            self.events.emit(kind, at=at, **f)
            if kind == "failure_detected":
                log.warning("attempt %s failed: %s%s%s", f["attempt"], f["cause"],
                            f" of rank {f['rank']}" if f.get("rank") is not None else "",
                            f" on {f['node']}" if f.get("node") else "")

    # ---- inputs ------------------------------------------------------------------------------------------
    def report(self, ev: Evidence, attempt: int | None = None) -> None:
        """Evidence from the launcher itself (an injected node loss, a script's notification)."""
        self._emit(self.book.evidence(ev, attempt, now=time.time()))

    def kill_attempt(self, attempt: int) -> None:
        """Ask every agent to SIGKILL its workers of ``attempt`` (torch elastic then restarts them)."""
        if attempt not in self._killed:
            self._killed.add(attempt)
            self.store.set(self.keys.kill(attempt), "1")

    def _read_facts(self, now: float) -> None:
        n = self.store.add(self.keys.n_facts, 0)
        self._pending.update(range(self._facts_seen + 1, n + 1))
        self._facts_seen = max(self._facts_seen, n)
        for i in sorted(self._pending):
            key = self.keys.fact(i)
            if not self.store.check([key]):
                continue   # published counter first, value a moment later
            self._pending.discard(i)
            try:
                fact = json.loads(self.store.get(key))
            except ValueError:
                continue
            self._apply(fact, now)

    def _apply(self, fact: dict, now: float) -> None:
        kind, a, t = fact.get("type"), fact.get("attempt"), float(fact.get("t") or now)
        if kind == "start":
            self._emit(self.book.started(a, node=fact.get("node"), ranks=fact.get("ranks", []), t=t, now=now))
        elif kind == "fail":
            for ev in exit_evidence(fact.get("exits", {}), node=fact.get("node"), t=t):
                self._emit(self.book.evidence(ev, a, now=now))
        elif kind == "done":
            self._emit(self.book.done(a, ranks=fact.get("ranks", []), t=t))
        elif kind == "hung":
            self.book.hung(a, fact.get("ranks", []))

    def _read_notes(self, now: float) -> None:
        d = os.path.join(self.run_dir, CONTROL_DIR)
        try:
            names = sorted(os.listdir(d))
        except FileNotFoundError:
            return
        for name in names:
            if not name.endswith(".json") or name in self._notes_seen:
                continue
            self._notes_seen.add(name)
            try:
                with open(os.path.join(d, name)) as f:
                    note = json.load(f)
            except (OSError, ValueError):
                continue
            if note.get("what") == "node_lost":
                self.report(Evidence(t=float(note.get("t") or now), cause="node_loss", node=note.get("node"),
                                     t_fault=note.get("t_fault")))
            elif note.get("what") == "job_end":
                self.job_end_request = note

    def _finishing(self, attempt: int) -> bool:
        """Some rank of ``attempt`` wrote its completion marker: training is over, ranks are exiting."""
        d = os.path.join(self.run_dir, MARKER_DIR)
        try:
            names = [n for n in os.listdir(d) if n.endswith(".done") and n not in self._markers]
        except FileNotFoundError:
            names = []
        for n in names:
            try:
                with open(os.path.join(d, n)) as f:
                    self._markers[n] = str(json.load(f).get("attempt"))
            except (OSError, ValueError):
                pass
        return str(attempt) in self._markers.values()

    def _watchdog(self, now: float) -> None:
        a = self.book.current
        if not self.hang_timeout_s or a is None or not self.book.is_open(a):
            return
        last = self.tail.last_t.get(a)
        st = self.book.attempts[a]
        if last is None or st.done or now - last <= self.hang_timeout_s or self._finishing(a):
            return   # not iterating yet (startup has its own timeouts), progressing, or finishing
        log.warning("attempt %d made no progress for %.1f s (last iteration %d): hang; killing its workers",
                    a, now - last, self.tail.max_iter.get(a, 0))
        self.report(Evidence(t=now, cause="hang", t_fault=last), a)
        self.kill_attempt(a)

    def poll(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._read_facts(now)
        self.tail.poll()
        self._read_notes(now)
        self._watchdog(now)
        self._emit(self.book.tick(now))

    def close(self) -> None:
        self._emit(self.book.close())


# ---------------------------------------------------------------------------------------------------------------
# The agent: torchrun in this process, with rounds numbered job-wide and facts published
# ---------------------------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class AgentOptions:
    node: str
    """This node's name: SHARDSAFE_NODE of its workers, the key of its holder."""
    control: str
    """HOST:PORT of the job's control store; also the c10d rendezvous endpoint."""
    nnodes: str
    """torchrun --nnodes (N or MIN:MAX)."""
    nproc_per_node: int = 1
    job_id: str = ""
    run_dir: str = ""
    holder_dir: str = ""
    inject: str = ""
    max_restarts: int = 3
    local_addr: str = ""
    monitor_interval_s: float = 0.1
    keep_alive_s: int = 2
    keep_alive_misses: int = 3
    join_timeout_s: float = 600.0
    job_start_t: float | None = None
    torchrun_args: list[str] = field(default_factory=list)
    preload: list[str] = field(default_factory=list)
    """Modules this node's fork server imports once; workers are forked from it (shardsafe.prewarm)."""

    def torchrun_argv(self, script: list[str]) -> list[str]:
        conf = (f"is_host=false,join_timeout={int(self.join_timeout_s)},keep_alive_interval={int(self.keep_alive_s)},"
                f"keep_alive_max_attempt={int(self.keep_alive_misses)},read_timeout=60")
        argv = ["--nnodes", str(self.nnodes), "--nproc-per-node", str(self.nproc_per_node),
                "--max-restarts", str(self.max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", self.control,
                "--rdzv-id", self.job_id, "--rdzv-conf", conf, "--monitor-interval", str(self.monitor_interval_s)]
        if self.local_addr:
            argv += ["--local-addr", self.local_addr]
        return argv + list(self.torchrun_args) + list(script)

    def worker_env(self) -> dict[str, str]:
        env = {"SHARDSAFE_NODE": self.node, "SHARDSAFE_JOB_ID": self.job_id,
               # Each round's rank-0 *worker* hosts the workers' store: an agent-hosted store would stay
               # cached in the other agents after that agent's node is lost (torch 2.x).
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        if self.run_dir:
            env["SHARDSAFE_RUN_DIR"] = self.run_dir
        if self.holder_dir:
            env["SHARDSAFE_HOLDER_DIR"] = self.holder_dir
        if self.inject:
            env["SHARDSAFE_INJECT"] = self.inject
        if self.job_start_t is not None:
            env["SHARDSAFE_JOB_START_T"] = repr(self.job_start_t)
        return env


class _AgentHooks:
    """What the agent adds to torch elastic: job-wide attempt numbers, facts, kill commands."""

    def __init__(self, opts: AgentOptions):
        self.opts = opts
        self.keys = Keys(opts.job_id)
        self.store = _store_client(opts.control)
        self.attempt: int | None = None
        self.reported: set[tuple[int, str]] = set()
        self.spare_pids: set[int] = set()   # descendants that are not workers (the fork server): never killed
        self.worker_group = None
        self.fatal = ""          # set when a worker of this job died of an error no restart fixes
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watch = threading.Thread(target=self._kill_loop, name="shardsafe-kill-watch", daemon=True)
        self._watch.start()

    def close(self) -> None:
        """Stop the kill watcher and drop the store clients while the interpreter is fully alive: a
        daemon thread still inside a TCPStore call at interpreter teardown aborts the process
        ("terminate called without an active exception"), which would turn a finished job's agent
        exit code into a failure."""
        self._stop.set()
        self._watch.join(timeout=5)
        self.store = None

    def _publish(self, fact: dict) -> None:
        with self._lock:
            try:
                publish(self.store, self.keys, {"node": self.opts.node, "t": time.time(), **fact})
            except Exception as e:  # noqa: BLE001 - accounting never stops training
                log.warning("[agent %s] cannot publish %s to the controller: %s", self.opts.node, fact.get("type"), e)

    def on_rendezvous(self, worker_group) -> None:
        st = worker_group.store
        with self._lock:
            if worker_group.group_rank == 0:
                n = self.store.add(self.keys.rounds, 1) - 1
                base = int(self.store.get(self.keys.base)) if self.store.check([self.keys.base]) else 0
                st.set(Keys.ROUND_ATTEMPT, str(base + n))
            attempt = int(st.get(Keys.ROUND_ATTEMPT))
        self.attempt = attempt
        self.worker_group = worker_group
        os.environ["SHARDSAFE_ATTEMPT"] = str(attempt)   # workers inherit the agent's environment
        ranks = [w.global_rank for w in worker_group.workers]
        log.info("[agent %s] attempt %d: group rank %d, ranks %s", self.opts.node, attempt, worker_group.group_rank, ranks)
        self._publish({"type": "start", "attempt": attempt, "group_rank": worker_group.group_rank, "ranks": ranks})

    def on_monitor(self, worker_group, result) -> None:
        from torch.distributed.elastic.agent.server.api import WorkerState
        a = self.attempt
        if a is None:
            return
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and (a, "fail") not in self.reported:
            self.reported.add((a, "fail"))
            exits = {str(r): f.exitcode for r, f in (result.failures or {}).items()}
            self._publish({"type": "fail", "attempt": a, "exits": exits})
            records = read_fatal(self.opts.run_dir, a) if self.opts.run_dir else []
            if records:
                self.fatal = describe_fatal(records)
        elif result.state == WorkerState.SUCCEEDED and (a, "done") not in self.reported:
            self.reported.add((a, "done"))
            ranks = [w.global_rank for w in worker_group.workers]
            if self.opts.run_dir:   # every local worker exited 0: their completion markers (scripts may write richer ones)
                have = done_ranks(self.opts.run_dir)
                for r in ranks:
                    if r not in have:
                        mark_rank_done(self.opts.run_dir, r, by="agent", node=self.opts.node)
            self._publish({"type": "done", "attempt": a, "ranks": ranks})

    def _kill_loop(self) -> None:
        store = None
        try:
            self._watch_kills(store)
        finally:
            store = None

    def _watch_kills(self, store: Any) -> None:
        while not self._stop.wait(0.25):
            a = self.attempt
            if a is None or (a, "kill") in self.reported:
                continue
            try:
                store = store or _store_client(self.opts.control)
                if not store.check([self.keys.kill(a)]):
                    continue
            except Exception:  # noqa: BLE001 - the controller may be gone at the very end
                store = None
                continue
            self.reported.add((a, "kill"))
            self._kill_workers(a)

    def _kill_workers(self, attempt: int) -> None:
        import psutil
        procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in self.spare_pids]
        # A forked worker's /proc/PID/environ is the fork server's (it never exec'd): ranks come from the
        # worker group (worker.id is the pid torch elastic started), the environment is the fallback.
        by_pid = {w.id: w.global_rank for w in getattr(self.worker_group, "workers", []) or [] if w.id is not None}
        hung = []
        for p in procs:
            try:
                if p.status() == psutil.STATUS_STOPPED:
                    r = by_pid[p.pid] if p.pid in by_pid else p.environ().get("RANK")
                    if r is not None and str(r).isdigit():
                        hung.append(int(r))
            except (psutil.Error, OSError):
                pass
        if hung:
            self._publish({"type": "hung", "attempt": attempt, "ranks": sorted(hung)})
        log.warning("[agent %s] controller: attempt %d is hung%s; SIGKILLing %d worker process(es)", self.opts.node,
                    attempt, f" (stopped ranks {sorted(hung)})" if hung else "", len(procs))
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass


def run_agent(opts: AgentOptions, script: list[str]) -> int:
    """Run torchrun's agent in this process with shardsafe's hooks; returns its exit code."""
    os.environ.update(opts.worker_env())
    import torch.distributed.launcher.api as launcher_api
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    hooks = _AgentHooks(opts)
    forks = _start_fork_server(opts, hooks) if opts.preload else None

    class ShardsafeAgent(LocalElasticAgent):
        """LocalElasticAgent + job-wide attempt numbers and facts for the controller."""

        def _rendezvous(self, worker_group) -> None:
            super()._rendezvous(worker_group)
            hooks.on_rendezvous(worker_group)

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            hooks.on_monitor(worker_group, result)
            if hooks.fatal and self._remaining_restarts > 0:
                # A ConfigError / RestoreError (shardsafe.fatal) comes back on every restart: stop now.
                log.error("[agent %s] %s", opts.node, hooks.fatal)
                self._remaining_restarts = 0
            return result

    launcher_api.LocalElasticAgent = ShardsafeAgent   # what torchrun's launch_agent instantiates
    argv = opts.torchrun_argv(script)
    log.info("[agent %s] torchrun %s", opts.node, shlex.join(argv))
    try:
        torchrun.main(argv)
        return 0
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    except Exception as e:  # noqa: BLE001 - ChildFailedError & co.: torchrun already logged the details
        log.error("[agent %s] torchrun ended with %s: %s", opts.node, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return 1
    finally:
        hooks.close()
        if forks is not None:
            forks.close()


def _start_fork_server(opts: AgentOptions, hooks: _AgentHooks):
    """This node's fork server (shardsafe.prewarm), plugged into torch elastic's worker start: its
    ``get_subprocess_handler`` hands out handlers whose ``_popen`` forks from the server when it can and
    falls back to torch's own Popen when it cannot (the reason is logged once). None if it cannot start."""
    from .prewarm import ForkServer, PrewarmError
    try:
        from torch.distributed.elastic.multiprocessing import api as mp_api
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler
    except ImportError as e:
        log.warning("[agent %s] this torch has no elastic subprocess handler to fork from (%s); workers start cold",
                    opts.node, e)
        return None
    if not callable(getattr(mp_api, "get_subprocess_handler", None)) or not hasattr(SubprocessHandler, "_popen"):
        log.warning("[agent %s] torch %s starts workers differently than shardsafe.prewarm knows; workers start cold",
                    opts.node, getattr(sys.modules.get("torch"), "__version__", "?"))
        return None
    if opts.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")   # torchrun sets it for its workers; import with it
    try:
        forks = ForkServer(opts.preload, env=dict(os.environ)).start()
    except PrewarmError as e:
        log.warning("[agent %s] %s; workers start cold", opts.node, e)
        return None
    hooks.spare_pids.add(forks.proc.pid)

    class ForkedHandler(SubprocessHandler):
        def _popen(self, args, env):
            proc = forks.fork_or_cold(args, env=env, stdout=self._stdout.fileno() if self._stdout else None,
                                      stderr=self._stderr.fileno() if self._stderr else None,
                                      who=f"[agent {opts.node}] workers")
            return proc if proc is not None else super()._popen(args, env)

    mp_api.get_subprocess_handler = lambda **kw: ForkedHandler(**kw)
    log.info("[agent %s] workers are forked from the fork server (pid %d, preloaded %s in %.2f s)", opts.node,
             forks.proc.pid, ",".join(opts.preload), forks.ready_s)
    return forks


# ---------------------------------------------------------------------------------------------------------------
# Local mode: N simulated nodes on this host
# ---------------------------------------------------------------------------------------------------------------

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
    start_holders: bool = True
    """Start one holder per node before the agents (else trainers start detached ones themselves)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for agents and workers."""
    timeout_s: float = 0.0
    """Give up (and kill everything) after this long (0 = never)."""
    preload: tuple[str, ...] = ()
    """Modules each node's fork server imports once; its workers are forked from it instead of importing them
    again at every start and restart (shardsafe.prewarm). Empty: torch elastic starts workers cold."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nproc_per_node < 1:
            raise LaunchError(f"need nodes >= 1 and nproc_per_node >= 1, got {self.nodes} and {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise LaunchError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.keep_alive_s < 1 or self.keep_alive_misses < 1:
            raise LaunchError("keep_alive_s and keep_alive_misses must be >= 1 (torch's c10d rendezvous takes whole seconds)")
        from .launch import budget_problem
        problem = budget_problem(self.memory_budget_gb)
        if problem:
            raise LaunchError(problem)
        for name, flag in (("hang_timeout_s", "--hang-timeout"), ("grace_s", "--grace"), ("timeout_s", "--timeout")):
            v = getattr(self, name)
            if not v >= 0:
                raise LaunchError(f"{flag} must be >= 0 seconds (0 = off), got {v!r}")
        if not self.join_timeout_s > 0:
            raise LaunchError(f"join_timeout_s must be > 0 seconds, got {self.join_timeout_s!r}")
        faults = parse_faults(self.inject)   # fail fast on a malformed spec
        for f in faults:
            if f.kind in NODE_FAULTS:
                for n in f.target.split("+"):
                    if not (n.startswith("node") and n[4:].isdigit()):
                        raise LaunchError(f"{f.kind.value} target {n!r}: local nodes are named node0..node{self.nodes - 1}")
        if not self.job_id:
            self.job_id = f"launch-{uuid.uuid4().hex[:8]}"
        if not self.holder_dir:
            from .config import default_holder_dir
            self.holder_dir = default_holder_dir()


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
        from .tor import EventLog
        self.events = EventLog(cfg.run_dir, source="launcher")
        self.holders: dict[str, subprocess.Popen] = {}
        self.agents: dict[str, subprocess.Popen] = {}
        self.lost: set[str] = set()
        self.all_nodes: list[str] = []
        self._next_node = cfg.nodes
        self.controller: Controller | None = None
        self.t_start = time.time()
        self.instance = f"{cfg.job_id}.{os.getpid()}.{uuid.uuid4().hex[:8]}"   # this run of the job (shardsafe.jobid)

    # ---- holders ---------------------------------------------------------------------------------------
    def start_holders(self, nodes: list[str]) -> None:
        """Start one holder per node (in parallel) and wait until each serves its socket."""
        from .holder.client import holder_command
        from .holder.paths import HolderPaths
        from .launch import holder_env, holder_failure, holder_running
        started = {}
        for node in nodes:
            p = HolderPaths(self.cfg.holder_dir, self.cfg.job_id, node)
            p.ensure_dir()
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
        from .holder.client import stop_holders
        from .holder.paths import HolderPaths
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
        c, ctl = self.cfg, self.controller
        cmd = [sys.executable, "-m", "shardsafe.elastic", "agent", "--node", node, "--control", ctl.endpoint,
               "--nnodes", f"{c.nodes}:{c.nodes}", "--nproc-per-node", str(c.nproc_per_node),
               "--job-id", c.job_id, "--run-dir", c.run_dir, "--holder-dir", c.holder_dir,
               "--max-restarts", str(c.max_restarts), "--monitor-interval", str(c.monitor_interval_s),
               "--keep-alive-s", str(c.keep_alive_s), "--keep-alive-misses", str(c.keep_alive_misses),
               "--join-timeout-s", str(c.join_timeout_s), "--job-start-t", repr(self.t_start)]
        if c.inject:
            cmd += ["--inject", c.inject]
        if c.preload:
            cmd += ["--preload", ",".join(c.preload)]
        if self.node_addr(node):
            cmd += ["--local-addr", self.node_addr(node)]
        from .launch import holder_budget_env
        env = {**os.environ, **c.env, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "SHARDSAFE_INSTANCE": self.instance,
               **(holder_budget_env(c.memory_budget_gb) if c.start_holders else {})}
        env.pop("SHARDSAFE_ATTEMPT", None)   # the agent numbers attempts
        logf = open(os.path.join(c.run_dir, LOG_DIR, f"agent_{node}.log"), "ab")
        self.agents[node] = subprocess.Popen(cmd + ["--", *self._script], stdin=subprocess.DEVNULL, stdout=logf,
                                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
        logf.close()
        self.all_nodes.append(node)

    def kill_node(self, node: str) -> None:
        """Node loss: SIGKILL the node's agent, its workers and its holder (its memory dies with it)."""
        self.lost.add(node)
        agent = self.agents.get(node)
        if agent is not None:
            _kill_tree(agent.pid)
        from .holder.paths import HolderPaths
        from .launch import kill_serving_holder
        kill_serving_holder(HolderPaths(self.cfg.holder_dir, self.cfg.job_id, node))   # also one a rank started
        holder = self.holders.pop(node, None)
        if holder is not None:
            holder.kill()
        if agent is not None:
            agent.wait()
        if holder is not None:
            holder.wait()

    def replace_node(self) -> str:
        """A fresh node joins: an empty holder and a new agent."""
        node = f"node{self._next_node}"
        self._next_node += 1
        if self.cfg.start_holders:
            self.start_holders([node])
        self.start_agent(node)
        return node

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
        from .holder.paths import HolderPaths
        from .launch import kill_serving_holder
        kill_serving_holder(HolderPaths(self.cfg.holder_dir, self.cfg.job_id, fault.target))
        holder = self.holders.get(fault.target)
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        self.events.emit("holder_killed", node=fault.target, fault=str(fault), attempt=attempt)
        log.warning("injected holder kill: %s at step %d of attempt %d (its workers run on)", fault.target,
                    fault.step, attempt)

    def run(self, script: list[str]) -> LaunchResult:
        """Run the job to the end: every agent done, one gave up, the timeout, an error no restart can fix
        (shardsafe.fatal: stops at once, ``LaunchResult.fatal``), or SIGTERM/SIGINT/SIGHUP
        (``LaunchResult.signal``). Agents, workers and holders are stopped in every case."""
        from .launch import SignalStop
        c = self.cfg
        self._script = list(script)
        t0 = self.t_start = time.time()
        self.events.emit("job_start", at=t0, nodes=c.nodes, nproc_per_node=c.nproc_per_node, launcher="torchrun",
                         job_id=c.job_id, cmd=shlex.join(script)[:500])
        ok, injected, fatal = False, set(), ""
        with SignalStop() as stop:
            try:
                self.controller = Controller(run_dir=c.run_dir, job_id=c.job_id, world_size=c.nodes * c.nproc_per_node,
                                             max_restarts=c.max_restarts, hang_timeout_s=c.hang_timeout_s,
                                             grace_s=c.grace_s, events=self.events)
                if c.start_holders and stop.received is None:
                    self.start_holders([f"node{i}" for i in range(c.nodes)])
                for i in range(c.nodes):
                    if stop.received is None:
                        self.start_agent(f"node{i}")
                ctl = self.controller
                while stop.received is None:
                    time.sleep(0.05)
                    ctl.poll()
                    a = ctl.attempt
                    records = read_fatal(c.run_dir, a) if a is not None else []
                    if records:
                        # A ConfigError / RestoreError ended a worker: every restart would end the same way.
                        fatal = describe_fatal(records)
                        log.error("attempt %s failed with %s", a, fatal)
                        ctl.book.max_restarts = -1   # no "restart" event: there is none
                        r = records[0]
                        ctl.report(Evidence(t=float(r.get("t") or time.time()), cause="fatal_error", rank=r.get("rank"),
                                            node=r.get("node")), a)
                        break
                    for hf in self._holder_faults(a):
                        if (a, str(hf)) not in injected and ctl.tail.max_iter.get(a, 0) >= hf.step \
                                and ctl.book.is_open(a):
                            injected.add((a, str(hf)))
                            self.kill_holder(hf, a)
                    fault = self._node_fault(a)
                    if fault is not None and a not in injected and ctl.tail.max_iter.get(a, 0) >= fault.step \
                            and ctl.book.is_open(a):
                        injected.add(a)
                        nodes = fault.target.split("+")
                        t_fault = time.time()
                        ctl.report(Evidence(t=t_fault, cause="node_loss", node="+".join(nodes), t_fault=t_fault), a)
                        for n in nodes:
                            self.kill_node(n)
                        log.warning("injected node loss: %s at step %d of attempt %d", "+".join(nodes), fault.step, a)
                        for _ in nodes:
                            self.replace_node()
                    live = {n: p for n, p in self.agents.items() if n not in self.lost}
                    codes = {n: p.poll() for n, p in live.items()}
                    bad = {n: rc for n, rc in codes.items() if rc not in (None, 0)}
                    if bad:
                        log.error("agent(s) %s gave up (exit codes %s): the job failed", sorted(bad), bad)
                        break
                    if codes and all(rc == 0 for rc in codes.values()):
                        ok = True
                        break
                    if c.timeout_s and time.time() - t0 > c.timeout_s:
                        log.error("timeout after %.0f s: killing the job", c.timeout_s)
                        break
            finally:
                for node, p in self.agents.items():
                    if p.poll() is None:
                        _kill_tree(p.pid)
                        p.wait()
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
                            signal=stop.received, fatal=fatal)


# ---------------------------------------------------------------------------------------------------------------
# CLI: shardsafe launch | agent | control
# ---------------------------------------------------------------------------------------------------------------

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
                        preload=_preload_list(a.preload))
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
                        local_addr=a.local_addr, monitor_interval_s=a.monitor_interval, keep_alive_s=a.keep_alive_s,
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
    from .tor import EventLog
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
    """``python -m shardsafe.elastic launch|agent|control ...``: the same commands without importing the
    rest of the CLI (fast enough to call from a SLURM script's polling loop)."""
    p = argparse.ArgumentParser(prog="python -m shardsafe.elastic")
    register_cli(p.add_subparsers(dest="cmd", required=True))
    a = p.parse_args(argv)
    return int(a.func(a) or 0)


if __name__ == "__main__":
    sys.exit(main())
