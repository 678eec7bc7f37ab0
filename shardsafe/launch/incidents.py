"""The incident book: one launcher event stream per attempt from the facts of many reporters.

Agents publish facts (round started, workers failed/succeeded, hung workers) and the launcher adds its own
(an injected node loss, a script's notification); several of them describe one incident, seen by different
reporters in a different order. :class:`IncidentBook` turns them into ``attempt_start``,
``failure_detected``, ``attempt_end``, ``restart`` (docs/tor.md) exactly once per attempt, whichever
reporter saw what first: evidence of one incident collected during a short grace period is ranked
(:data:`PRIORITY`: node loss > hang > a rank killed by a signal > a rank exiting with an error) and the event
is dated at the first evidence.

Pure (no store, no clock, no files): the unit tests drive it with explicit times; :mod:`.controller` feeds it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

# Evidence ranking: the most specific explanation of an incident wins.
PRIORITY = {"fatal_error": 5, "node_loss": 4, "hang": 3, "rank_signal": 2, "rank_exit": 1, "membership_change": 0}

HANG_NAMING_S = 10.0
"""How much longer than the grace period a hang waits for every node's report of its stopped workers (the agents
scan them when they kill the attempt; a loaded node reports late). Past it the hang is reported unnamed."""


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
    scanned: set[str] = field(default_factory=set)   # nodes whose agents reported their stopped workers
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

    def hung(self, attempt: int, ranks: Iterable[int], node: str | None = None) -> None:
        """A node's agent killed ``attempt``'s workers and found ``ranks`` stopped (possibly none)."""
        st = self.attempts.get(attempt)
        if st is not None:
            st.hung.update(int(r) for r in ranks)
            if node is not None:
                st.scanned.add(node)

    def done(self, attempt: int, *, ranks: Iterable[int], t: float) -> list[Emit]:
        st = self.attempts.get(attempt)
        if st is None or st.decided or st.ended:
            return []
        st.done.update(int(r) for r in ranks)
        if len(st.done) >= self.world_size:
            st.ended = True
            return [("attempt_end", t, {"attempt": attempt, "rc": 0, "cause": "finished"})]
        return []

    def stopped(self, attempt: int, *, t: float, cause: str, **fields: Any) -> list[Emit]:
        """The launcher stopped ``attempt`` on purpose (to re-form the job at another size, docs/tor.md): it ends
        without a failure, and nothing its workers' deaths report afterwards counts against it."""
        st = self.attempts.get(attempt)
        if st is None or st.decided or st.ended:
            return []
        st.ended = True
        return [("attempt_end", t, {"attempt": attempt, "rc": None, "cause": cause, **fields})]

    def tick(self, now: float) -> list[Emit]:
        out: list[Emit] = []
        for a in sorted(self.attempts):
            st = self.attempts[a]
            if st.decided or st.ended or not st.evidence:
                continue
            waited = now - min(e.arrived for e in st.evidence)
            if waited >= self.grace_s and not (self._naming_hang(st) and waited < self.grace_s + HANG_NAMING_S):
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
    @staticmethod
    def _best(st: _AttemptState) -> Evidence:
        return max(st.evidence, key=lambda e: (PRIORITY.get(e.cause, 0), -e.t))

    def _naming_hang(self, st: _AttemptState) -> bool:
        """A hang not yet named while a node of the attempt has not reported its stopped workers."""
        best = self._best(st)
        return best.cause == "hang" and best.rank is None and not st.hung and not st.nodes <= st.scanned

    def _decide(self, st: _AttemptState) -> list[Emit]:
        st.decided = True
        best = self._best(st)
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
