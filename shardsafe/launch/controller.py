"""The job's controller: hosts the control/rendezvous store, turns agents' facts into launcher events.

One :class:`Controller` per job serves the TCPStore that is both the c10d rendezvous endpoint and the channel
of the agent <-> controller protocol (:class:`Keys`: JSON facts under a counter, kill commands per attempt).
It reads the agents' facts, the scripts' notifications (:mod:`.markers`) and the event log, and hands them to
the :class:`~.incidents.IncidentBook`, which decides what the launcher events say.

A progress watchdog: the controller follows ``iteration`` events (:class:`ProgressTail`); an attempt that made
no progress for ``hang_timeout_s`` is a hang: its workers are SIGKILLed through the agents (torch elastic then
restarts them) and the failure's ``t_fault`` is the last progress.

Runs inside ``shardsafe launch`` (local mode) or as ``shardsafe control serve`` on a SLURM batch host. torch is
imported only when a store is made.
"""
from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from typing import Iterable, Optional

from ..tor.events import JsonlTail
from .errors import LaunchError
from .incidents import Emit, Evidence, IncidentBook, exit_evidence
from .markers import CONTROL_DIR, MARKER_DIR

log = logging.getLogger(__name__)


class ProgressTail:
    """Follows ``RUN_DIR/events.jsonl`` incrementally: per attempt, the highest iteration and when the
    latest ``iteration`` event was written."""

    def __init__(self, run_dir: str):
        self._tail = JsonlTail(os.path.join(run_dir, "events.jsonl"), contains=b'"iteration"')
        self.path = str(self._tail.path)
        self.max_iter: dict[int, int] = {}
        self.last_t: dict[int, float] = {}

    def poll(self) -> None:
        for ev in self._tail.poll():
            if ev.get("kind") != "iteration" or not isinstance(ev.get("attempt"), int):
                continue
            a = ev["attempt"]
            self.max_iter[a] = max(self.max_iter.get(a, 0), int(ev.get("iteration") or 0))
            self.last_t[a] = max(self.last_t.get(a, 0.0), float(ev.get("t") or 0.0))


# Control store keys and the agent <-> controller protocol (JSON values in a TCPStore)

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

    def failed(self, attempt: int) -> str:
        """Set by the agent whose workers of ``attempt`` failed, read by the others (agent.py: they restart
        theirs at once instead of when that agent re-joins the rendezvous)."""
        return f"{self.p}/failed/{attempt}"

    def inplace_claim(self, attempt: int) -> str:
        """Taken (compare-and-set) by the one agent that restarts ``attempt`` in place (shardsafe.launch.replace)."""
        return f"{self.p}/inplace/{attempt}/claim"

    def inplace(self, attempt: int) -> str:
        """``attempt`` goes on in place: {"attempt": the next one, "ranks": the ranks started again}."""
        return f"{self.p}/inplace/{attempt}"

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


def attempt_base_from_log(run_dir: str) -> int:
    """1 + the highest attempt any earlier allocation of this run directory logged (0 for a new run):
    a requeued job continues the numbering, so its attempts never merge with the earlier ones."""
    try:
        from ..tor import read_events
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
            from ..tor import EventLog
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

    def stopped(self, attempt: int, *, cause: str, **fields) -> None:
        """The launcher stops ``attempt`` on purpose (a grow): its ``attempt_end``, and no failure for it."""
        self._emit(self.book.stopped(attempt, t=time.time(), cause=cause, **fields))

    def resized(self, note: dict, now: float) -> None:
        """A script re-formed the job at another data-parallel size (its agents stopped, new ones start): the
        ``shrink`` / ``grow`` event, dated when the script decided, and the world size a finished attempt needs."""
        a, b, world = note.get("from_dp"), note.get("to_dp"), note.get("world_size")
        if not all(isinstance(v, int) and v >= 1 for v in (a, b, world)) or a == b:
            log.warning("resize notification %s: expected from_dp != to_dp and world_size, whole numbers >= 1; ignored",
                        note)
            return
        self.events.emit("shrink" if b < a else "grow", at=float(note.get("t") or now), from_dp=a, to_dp=b,
                         nodes=note.get("nodes"), reason=note.get("reason"))
        self.book.world_size = world

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
            self.book.hung(a, fact.get("ranks", []), node=fact.get("node"))

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
            elif note.get("what") == "resize":
                self.resized(note, now)

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
