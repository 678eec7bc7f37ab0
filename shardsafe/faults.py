"""Deterministic fault injection for demos and tests (real SIGKILL/SIGSTOP, at seeded points).

Spec: ``SHARDSAFE_INJECT="kill-rank:1@30;kill-copy:0@55"``. Entry j (``;``-separated) applies to restart
attempt j (attempt = SHARDSAFE_ATTEMPT or torch elastic's TORCHELASTIC_RESTART_COUNT), so one job can take
several successive failures; an entry may join faults that do not end the attempt to the one that does with
``&`` (``kill-flush:node1@6&kill-node:node0+node1@9``: the attempt survives the first, the second ends it).
Kinds handled inside trainers (R: a rank, or ``R:engineK`` for the process's protected engine of ordinal K >= 1,
shardsafe.runtime.engine_scope: ``kill-rank:1:engine1@4`` kills rank 1 at step 4 of its second engine, e.g. in
HF's second ``train()``):
  kill-rank:R@S   SIGKILL rank R at the start of optimizer step S (after its backward pass)
  kill-copy:R@S   SIGKILL rank R halfway through copying snapshot version S (a torn write)
  hang-rank:R@S   SIGSTOP rank R at the start of optimizer step S (detected by the launcher's timeout)
  kill-node:N@S   handled by the launcher (kills node N's trainers and holder at step S)
  kill-holder:N@S handled by the launcher: SIGKILLs node N's holder alone once step S is done; its trainers
                  run on (the node's first rank starts a new holder, snapshots resume)
  add-node:N@S    handled by the launcher: node N (lost earlier: a repaired node, or a spare arriving late) joins
                  the job, with a fresh empty holder, once step S of the attempt is done; ``@0``: before the
                  attempt starts (while the launcher waits for a node after the previous attempt lost one). A job
                  running at a smaller data-parallel size grows back at its next committed version
                  (shardsafe.launch.resize)
  kill-flush:N@S  handled by node N's holder: it SIGKILLs itself halfway through writing snapshot version S
                  to the persistent tier (a torn flush); in whichever attempt flushes S (holders outlive
                  attempts), once per holder process
Phases of the snapshot's background work (S = the snapshot version):
  kill-parity-before:R@S  SIGKILL rank R as its parity exchange of version S starts (data sealed)
  kill-parity-block:R@S   ... after the first block of stripes has arrived (mid-exchange)
  kill-parity-after:R@S   ... after its parity shares are sealed, before the commit vote
  kill-commit:R@S         ... after the commit vote agreed on version S, before its holder commits it
  stall-vote:R@S          rank R's snapshot worker sleeps SHARDSAFE_INJECT_STALL_S seconds (default 10) right before
                          the commit vote of version S: a rank slower than timeout_s, the others' vote times out
Phases of a restore (S = the version being restored, 0 = whichever), at the same size or re-partitioned to another:
  kill-restore-rebuild:R@S  SIGKILL rank R in a parity rebuild, after the stripes arrived, before the seal (a
                            re-partition: once it decoded the lost sources it rebuilds, before the rebuild vote)
  kill-restore-verify:R@S   ... after its copy verified, before the vote (a re-partition: every source's)
  kill-restore-apply:R@S    ... halfway through writing the snapshot into the live tensors (a re-partition: its
                            flat tensors)
"""
from __future__ import annotations

import enum
import os
import signal
import time
from dataclasses import dataclass

from . import env
from .errors import ConfigError


class FaultKind(enum.Enum):
    KILL_RANK = "kill-rank"
    KILL_COPY = "kill-copy"
    HANG_RANK = "hang-rank"
    KILL_NODE = "kill-node"
    KILL_HOLDER = "kill-holder"
    ADD_NODE = "add-node"
    KILL_FLUSH = "kill-flush"
    KILL_PARITY_BEFORE = "kill-parity-before"
    KILL_PARITY_BLOCK = "kill-parity-block"
    KILL_PARITY_AFTER = "kill-parity-after"
    KILL_COMMIT = "kill-commit"
    STALL_VOTE = "stall-vote"
    KILL_RESTORE_REBUILD = "kill-restore-rebuild"
    KILL_RESTORE_VERIFY = "kill-restore-verify"
    KILL_RESTORE_APPLY = "kill-restore-apply"


# The named phases the runtime's layers report (on_phase(name, version)); the fault that fires at each.
PHASE_PARITY_BEFORE, PHASE_PARITY_BLOCK, PHASE_PARITY_AFTER = "parity-before", "parity-block", "parity-after"
PHASE_VOTE, PHASE_COMMIT = "vote", "commit"
PHASE_RESTORE_REBUILD, PHASE_RESTORE_VERIFY, PHASE_RESTORE_APPLY = "restore-rebuild", "restore-verify", "restore-apply"
PHASES = {PHASE_PARITY_BEFORE: FaultKind.KILL_PARITY_BEFORE, PHASE_PARITY_BLOCK: FaultKind.KILL_PARITY_BLOCK,
          PHASE_PARITY_AFTER: FaultKind.KILL_PARITY_AFTER, PHASE_COMMIT: FaultKind.KILL_COMMIT,
          PHASE_VOTE: FaultKind.STALL_VOTE, PHASE_RESTORE_REBUILD: FaultKind.KILL_RESTORE_REBUILD,
          PHASE_RESTORE_VERIFY: FaultKind.KILL_RESTORE_VERIFY, PHASE_RESTORE_APPLY: FaultKind.KILL_RESTORE_APPLY}
_ANY_VERSION = {FaultKind.KILL_RESTORE_REBUILD, FaultKind.KILL_RESTORE_VERIFY, FaultKind.KILL_RESTORE_APPLY}
# Faults whose target is a node (done by a launcher or a holder), not a rank.
NODE_FAULTS = {FaultKind.KILL_NODE, FaultKind.KILL_HOLDER, FaultKind.KILL_FLUSH, FaultKind.ADD_NODE}


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    target: str     # rank number or node name
    step: int
    attempt: int = 0   # the attempt it applies to (its entry's index in the spec)

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.target}@{self.step}"


def parse(spec: str) -> list[Fault]:
    """Every fault of ``spec``, each with the attempt it applies to."""
    out = []
    for attempt, entry in enumerate(e for e in (x.strip() for x in spec.replace(",", ";").split(";")) if e):
        for part in filter(None, (p.strip() for p in entry.split("&"))):
            try:
                kind, rest = part.split(":", 1)
                target, step = rest.rsplit("@", 1)
                out.append(Fault(FaultKind(kind), target, int(step), attempt))
            except ValueError:
                raise ConfigError(f"bad fault spec {part!r}: expected KIND:TARGET@STEP with KIND in "
                                 f"{[k.value for k in FaultKind]}, e.g. kill-rank:1@30 (entries for successive "
                                 "attempts separated by ';', faults of one attempt joined by '&')") from None
    return out


def for_attempt(faults: list[Fault], attempt: int, kinds=None) -> list[Fault]:
    """The faults of ``attempt`` (of ``kinds``, if given), in spec order."""
    return [f for f in faults if f.attempt == attempt and (kinds is None or f.kind in kinds)]


def current_attempt() -> int:
    return env.attempt()


def _record(kind: str, rank: int, step: int) -> None:
    """Leave the true fault time for TOR's detection accounting before dying."""
    run_dir = env.get(env.RUN_DIR)
    if run_dir:
        try:
            from shardsafe.tor.events import EventLog
            EventLog(run_dir, source="trainer", rank=rank, attempt=current_attempt()).emit(
                "fault_injected", fault=kind, step=step, t_fault=time.time())
        except Exception:   # accounting: the fault is injected whether or not its event is written
            pass


class Injector:
    """The faults (if any) this rank's engine ``scope`` ("" the process's first) must suffer in this attempt."""

    def __init__(self, rank: int, spec: str | None = None, attempt: int | None = None, *, scope: str = ""):
        faults = parse(env.get(env.INJECT) if spec is None else spec)
        attempt = current_attempt() if attempt is None else attempt
        self.rank = rank
        target = f"{rank}:{scope}" if scope else str(rank)
        self.faults = [f for f in for_attempt(faults, attempt) if f.kind not in NODE_FAULTS and f.target == target]

    @property
    def fault(self) -> "Fault | None":
        """The first of them (most attempts have one)."""
        return self.faults[0] if self.faults else None

    def before_step(self, step: int) -> None:
        for f in self.faults:
            if f.step != step:
                continue
            if f.kind == FaultKind.KILL_RANK:
                _record(str(f), self.rank, step)
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == FaultKind.HANG_RANK:
                _record(str(f), self.rank, step)
                os.kill(os.getpid(), signal.SIGSTOP)

    def phase(self, name: str, version: int) -> None:
        """Called by the snapshot pipeline, the parity exchange and the restore at their named phases."""
        for f in self.faults:
            if f.kind is not PHASES.get(name) or not (f.step == version or (f.step == 0 and f.kind in _ANY_VERSION)):
                continue
            if f.kind is FaultKind.STALL_VOTE:   # slow, not dead: the attempt goes on
                time.sleep(float(env.get(env.INJECT_STALL_S, default="10")))
                continue
            _record(str(f), self.rank, version)
            os.kill(os.getpid(), signal.SIGKILL)

    def copy_progress(self, version: int, fraction: float) -> None:
        for f in self.faults:
            if f.kind == FaultKind.KILL_COPY and f.step == version and fraction >= 0.5:
                _record(str(f), self.rank, version)
                os.kill(os.getpid(), signal.SIGKILL)


def flush_fault(node: str, spec: str | None = None) -> "Fault | None":
    """The kill-flush fault for this node's holder, if any (attempt-independent: holders outlive attempts)."""
    faults = parse(env.get(env.INJECT) if spec is None else spec)
    return next((f for f in faults if f.kind == FaultKind.KILL_FLUSH and f.target == node), None)


def kill_self_in_flush(fault: "Fault", run_dir: str, version: int) -> None:
    """A holder's flush reached the fault's point: record it for TOR and die as a crashed host would."""
    if run_dir:
        try:
            from shardsafe.tor.events import EventLog
            EventLog(run_dir, source="holder", node=fault.target).emit(
                "holder_killed", fault=str(fault), version=version)
        except Exception:   # accounting: the fault is injected whether or not its event is written
            pass
    os.kill(os.getpid(), signal.SIGKILL)
