"""Whether a rank is protected right now, said loudly whenever it is not.

shardsafe's promise is that a failure costs at most one snapshot interval. That holds only while versions keep
committing. :class:`Protection` is each rank's account of it: the newest committed version, its age in steps,
and, when the promise does not hold, why (:class:`Cause`). A lapse is

* known at start: no holder could be reached, or the holder's budget cannot keep two versions of every rank of
  the node (the second version would never commit, and a crash much later would restore the first one);
* or seen in training: no version committed for ``max(3, 2 * interval)`` steps, with the causes the snapshot
  pipeline and the commit vote reported (a snapshot failed on this or another rank, parity was not stored, the
  agreement group failed and is being rebuilt).

Rank 0 says so at WARNING level with the cause and what to do, when protection lapses and again every
``warn_interval_s`` while it lasts (every rank says its own local cause once per lapse); each lapse and each
recovery is a TOR event (``protection_lapsed`` / ``protection_restored``). With ``on_unprotected: fail`` the
lapse raises :class:`UnprotectedError` in the training loop, so that the job ends and its scheduler restarts it.
"""
from __future__ import annotations

import enum
import logging
import time
from typing import Any, Callable, Iterable

from .errors import ConfigError, ShardsafeError

log = logging.getLogger(__name__)

ON_UNPROTECTED = ("warn", "fail")


class UnprotectedError(RuntimeError, ShardsafeError):
    """Protection lapsed and the config says ``on_unprotected: fail``."""


class Cause(str, enum.Enum):
    NO_HOLDER = "no_holder"
    BUDGET = "budget"
    VOTE = "vote"
    PARITY = "parity"
    SNAPSHOT = "snapshot"
    STALE = "stale"

    @property
    def fix(self) -> str:
        return _FIXES[self]


_FIXES = {
    Cause.NO_HOLDER: "start a holder for the node (shardsafe launch and the sbatch scripts do; a trainer starts one "
                     "itself unless start_holder is false), or check the holder directory and its log",
    Cause.BUDGET: "raise memory_budget_gb (--memory-budget-gb) to what the message names: every rank keeps two "
                  "versions (and their parity) in its node's holder",
    Cause.VOTE: "the commit vote's group failed (a peer slower than timeout_s, a network error); it is rebuilt at the "
                "next snapshot; if this repeats, raise timeout_s or look for a hung rank",
    Cause.PARITY: "parity could not be stored on a member of a parity group (its holder's budget, a lost peer): "
                  "see that rank's log",
    Cause.SNAPSHOT: "a rank's snapshot failed: its log says why",
    Cause.STALE: "another rank could not complete its snapshots: the ranks' logs say why",
}

# The bit of each cause in the commit vote (shardsafe/snapshot/pipeline.py): every rank learns every rank's causes.
CAUSE_BITS = {c: 1 << i for i, c in enumerate(Cause)}


def causes_to_bits(causes: Iterable[Cause]) -> int:
    bits = 0
    for c in causes:
        bits |= CAUSE_BITS[c]
    return bits


def bits_to_causes(bits: int) -> set[Cause]:
    return {c for c, b in CAUSE_BITS.items() if bits & b}


def stale_after(interval: int) -> int:
    """Steps without a commit after which a rank is unprotected."""
    return max(3, 2 * interval)


class Protection:
    """One rank's protection state.

    Args:
        rank: global rank (rank 0 speaks for the job).
        interval: the snapshot interval in steps.
        on_unprotected: "warn" (log and record) or "fail" (raise :class:`UnprotectedError` at the lapse).
        emit: the TOR event log's ``emit(kind, **fields)``.
        warn_interval_s: how often rank 0 repeats the warning while a lapse lasts.
        clock: seconds (monotonic); tests pass their own.
    """

    def __init__(self, *, rank: int, interval: int, on_unprotected: str = "warn",
                 emit: Callable[..., Any] = lambda kind, **f: None, warn_interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        if on_unprotected not in ON_UNPROTECTED:
            raise ConfigError(f"shardsafe.on_unprotected must be one of {ON_UNPROTECTED}; got {on_unprotected!r}")
        self.rank, self.interval, self.on_unprotected = rank, interval, on_unprotected
        self.emit, self.warn_interval_s, self.clock = emit, warn_interval_s, clock
        self.committed = -1          # newest version committed everywhere (or restored)
        # The step before the first one this attempt ran: the age counts from it until something commits after it
        # (a program that loads a newer disk checkpoint after the restore starts far past the restored version).
        self.start_step = -1
        self.step = 0
        self.standing: dict[Cause, str] = {}   # causes that hold until something changes (no holder, budget)
        self.until_commit: dict[Cause, str] = {}   # causes another rank had at start: they hold until a commit
        self.everywhere: dict[Cause, str] = {}     # every rank's standing causes, as the newest commit vote said
        self.recent: dict[Cause, str] = {}     # causes the newest snapshots reported (cleared by a commit)
        self.lapsed = False
        self.lapses = 0
        self._last_warn = float("-inf")
        self._said_local: set[Cause] = set()

    # ---- what the runtime tells it ------------------------------------------------------------------------
    def started(self, committed: int) -> None:
        """The restore put back ``committed`` (-1: nothing): it counts as committed."""
        self.committed = committed

    def stand(self, cause: Cause, detail: str) -> None:
        """A cause that lasts until :meth:`clear` (known at start, or a holder gone)."""
        self.standing[cause] = detail

    def clear(self, cause: Cause) -> None:
        self.standing.pop(cause, None)

    def stand_until_commit(self, cause: Cause, detail: str) -> None:
        """A cause another rank has (learned at start): it holds until a version commits everywhere."""
        self.until_commit[cause] = detail

    def report(self, causes: dict[Cause, str], everywhere: dict[Cause, str] | None = None) -> None:
        """Causes the snapshot pipeline saw since the last call (this rank's failures, other ranks' via the vote),
        and every rank's standing causes as its newest vote said (None: no vote since)."""
        self.recent.update(causes)
        if everywhere is not None:
            self.everywhere = dict(everywhere)

    # ---- the state ---------------------------------------------------------------------------------------
    @property
    def age(self) -> int:
        """Steps since the newest committed version (or since the start, before any commit)."""
        if self.start_step < 0:   # no step yet
            return 0
        return self.step - max(self.committed, self.start_step, 0)

    @property
    def protected(self) -> bool:
        return (not self.standing and not self.until_commit and not self.everywhere
                and self.age <= stale_after(self.interval))

    def causes(self) -> dict[Cause, str]:
        out = {**self.until_commit, **self.everywhere, **self.standing}
        if self.age > stale_after(self.interval):
            out.update(self.recent)
            if not self.recent:
                out[Cause.STALE] = (f"no version committed for {self.age} steps (since "
                                    + (f"version {self.committed}" if self.committed >= self.start_step else
                                       f"this attempt started after step {max(self.start_step, 0)}") + ")")
        return out

    def describe(self) -> str:
        """One line for banners and ``shardsafe status``."""
        if self.protected:
            if self.committed >= 0:
                return f"protected (newest committed version {self.committed}, {self.age} step(s) old)"
            return "protected (no version committed yet: the first snapshot commits after the next step)"
        causes = self.causes()
        return "NOT protected: " + "; ".join(f"{c.value}: {d}" for c, d in causes.items())

    def state(self) -> dict[str, Any]:
        """The JSON-able state (``shardsafe status``, the TOR events)."""
        return {"protected": self.protected, "committed": self.committed, "age_steps": self.age, "step": self.step,
                "causes": {c.value: d for c, d in self.causes().items()}, "lapses": self.lapses}

    # ---- every step ----------------------------------------------------------------------------------------
    def observe(self, step: int, committed: int) -> None:
        """After the optimizer step ``step`` (training thread): update, say a lapse or a recovery.

        Raises:
            UnprotectedError: protection lapsed now and ``on_unprotected`` is "fail".
        """
        if self.start_step < 0:
            self.start_step = step - 1
        self.step = step
        if committed > self.committed:
            self.committed = committed
            self.recent.clear()
            self.until_commit.clear()
        now = self.clock()
        if self.protected:
            if self.lapsed:
                self.lapsed = False
                self._said_local.clear()
                self.emit("protection_restored", version=self.committed, step=step)
                if self.rank == 0:
                    log.warning("[rank 0] shardsafe: protection is back: version %d committed at step %d",
                                self.committed, step)
            return
        causes = self.causes()
        if not self.lapsed:
            self.lapsed = True
            self.lapses += 1
            self._last_warn = float("-inf")
            self.emit("protection_lapsed", step=step, committed=self.committed,
                      cause=",".join(c.value for c in causes), detail="; ".join(causes.values())[:1000])
        for c, d in causes.items():   # every rank says its own cause once per lapse
            if c not in self._said_local and c is not Cause.STALE and self.rank != 0:
                self._said_local.add(c)
                log.warning("[rank %d] shardsafe: this rank is NOT protected (%s: %s); %s", self.rank, c.value, d,
                            c.fix)
        if self.rank == 0 and now - self._last_warn >= self.warn_interval_s:
            self._last_warn = now
            log.warning("[rank 0] shardsafe: training is NOT protected at step %d: a failure now loses %s. %s",
                        step, f"every step since version {self.committed}" if self.committed >= 0 else
                        "everything since the start", " | ".join(f"{c.value}: {d} -> {c.fix}" for c, d in
                                                                  causes.items()))
        if self.on_unprotected == "fail":
            if Cause.BUDGET in causes:   # a restart would meet the same budget: stop instead
                raise ConfigError(f"shardsafe: {causes[Cause.BUDGET]}; on_unprotected is \"fail\", so the run does "
                                  "not go on unprotected.")
            raise UnprotectedError(
                f"shardsafe: training is not protected at step {step} ("
                + "; ".join(f"{c.value}: {d}" for c, d in causes.items())
                + ") and on_unprotected is \"fail\": ending the run so that its scheduler restarts it. Set "
                  "on_unprotected to \"warn\" to train on unprotected.")

    def startup_check(self) -> str:
        """At initialize, before the first step: raise for ``fail`` when a standing cause is known already;
        returns the banner's description."""
        causes = {**self.until_commit, **self.standing}
        if causes and self.on_unprotected == "fail":
            raise UnprotectedError(
                "shardsafe: this run cannot be protected (" + "; ".join(f"{c.value}: {d}" for c, d in causes.items())
                + ") and on_unprotected is \"fail\". " + " ".join(c.fix for c in causes))
        return self.describe()


def budget_problem(needs: list[int], budgets: list[int], used_elsewhere: list[int], nodes: list[str]) -> str | None:
    """Whether every node's holder can keep what its ranks need (two versions of each, with parity), from every
    rank's ``needs`` (bytes), its holder's ``budgets`` (-1: no holder, not checked) and ``used_elsewhere`` (bytes
    its holder keeps for the job's other engines); ``nodes[r]`` is rank r's node. None when all fit, else what
    does not and the number to raise the budget to."""
    per_node: dict[str, list[int]] = {}
    for r, node in enumerate(nodes):
        per_node.setdefault(node, []).append(r)
    worst = None
    for node, ranks in per_node.items():
        budget = max(budgets[r] for r in ranks)
        if budget < 0:
            continue
        total = sum(needs[r] for r in ranks) + max(used_elsewhere[r] for r in ranks)
        if total > budget and (worst is None or total - budget > worst[1] - worst[2]):
            worst = (node, total, budget, len(ranks))
    if worst is None:
        return None
    node, total, budget, n = worst
    gib = 1 << 30
    return (f"the holder of node {node} has a budget of {budget / gib:.3f} GiB, but its {n} rank(s) need "
            f"{total / gib:.3f} GiB to keep two versions each (with parity): the second version would never commit, "
            f"and a crash later would restore the first one. Raise memory_budget_gb (--memory-budget-gb) to at least "
            f"{-(-total * 1000 // gib) / 1000:.3f} GiB")


class Reporter:
    """Leaves a rank's protection state with its holder (``shardsafe status`` reads it there) off the training
    thread. A holder answers its node's ranks one request at a time, and right after a restart every rank of the
    node reports at once, while their first snapshots are being written: on the training thread that round trip
    was the longest part of the first step. Here a thread of its own sends the newest state posted (an older one
    still unsent is replaced), never behind a snapshot that waits for its peers. The thread is started without
    waiting for it to run (``threading.Thread.start`` waits, which on a busy host is a wait for a turn on a core).

    ``send(state)``: the request; a holder that is away is the caller's to swallow (it comes back, the next post
    is sent then). Any other error is logged once and the thread goes on: ``shardsafe status`` must not go stale
    silently."""

    def __init__(self, send: Callable[[dict], None], who: str = ""):
        import threading
        self._send, self._who = send, who
        self._cv = threading.Condition()
        self._state: dict | None = None
        self._closed = self._started = self._warned = False
        self._done = threading.Event()

    def post(self, state: dict) -> None:
        import _thread
        with self._cv:
            if self._closed:
                return
            self._state = state
            if not self._started:
                self._started = True
                _thread.start_new_thread(self._run, ())
            self._cv.notify()

    def close(self, timeout: float = 1.0) -> None:
        """Send what is posted still (within ``timeout``), then stop."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            started = self._started
        if started:
            self._done.wait(timeout)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while self._state is None and not self._closed:
                        self._cv.wait()
                    state, self._state = self._state, None
                if state is None:
                    return
                try:
                    self._send(state)
                except Exception as e:  # noqa: BLE001 - the next state is sent all the same
                    if not self._warned:
                        self._warned = True
                        log.warning("[%s] the protection state could not be left with the holder (%s: %s): "
                                    "`shardsafe status` may show an older state for this rank", self._who,
                                    type(e).__name__, e)
        finally:
            self._done.set()
