"""From events to attempts and failures: trainer events aggregated over ranks, failures deduplicated and assigned.

The job moves at the pace of its slowest rank (docs/tor.md, "Multi-rank aggregation"): per attempt, starts take
the earliest rank, readiness and restore ends the last, an iteration its latest ``t`` and (bounded) largest
``seconds``, a snapshot its largest stall, and the restore tier the most expensive tier any rank used.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from .events import EVENT_KINDS, TIERS, _int_field, _num_field
from .records import Failure


_TRAINER_KINDS = frozenset(k for k, (src, _) in EVENT_KINDS.items() if src == "trainer") - {"fault_injected"}
_TIER_RANK = {"none": 0, "memory": 1, "parity": 2, "persistent": 3}


@dataclass
class _Run:
    """Trainer events of one attempt, aggregated over ranks (the job moves at the pace of its slowest rank)."""

    key: Any
    first_t: float
    last_t: float = 0.0
    trainer_start: float | None = None
    restore_start: float | None = None
    restore_start_tier: str | None = None
    restore_end: float | None = None
    restore_tier: str | None = None
    restore_version: int | None = None
    restore_seconds: float | None = None
    train_ready: float | None = None
    train_ready_iteration: int | None = None
    iters: dict[int, list[float]] = field(default_factory=dict)  # iteration -> [t (latest rank), seconds (max)]
    snaps: dict[int, list[float]] = field(default_factory=dict)  # version -> [t, stall_s, copy_s]
    skipped: list[int] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    end: float = 0.0
    resume: int | None = None
    dp: int | None = None
    """Data-parallel size it ran at (shrink/grow events; None when the job never changed size)."""
    reduced: bool = False
    """It ran below the job's full data-parallel size."""
    resized_end: bool = False
    """The launcher grew the job back while it ran: it stopped on purpose at its next committed version, not a
    failure, unless a failure_detected says otherwise."""

    @property
    def start(self) -> float:
        return self.trainer_start if self.trainer_start is not None else self.first_t

    @property
    def failed(self) -> bool:
        return bool(self.failures)


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _hkey(x: Any) -> Any:
    """A hashable stand-in for a JSON value (a foreign writer may put a list where a number belongs)."""
    return x if x is None or isinstance(x, (bool, int, float, str)) else json.dumps(x, sort_keys=True, default=str)


def _collect_failures(evs: list[dict[str, Any]], warnings: list[str]) -> list[Failure]:
    failures: list[Failure] = []
    seen: set[tuple] = set()
    for e in evs:
        if e["kind"] != "failure_detected":
            continue
        attempt = _hkey(e.get("attempt"))
        key = (attempt, _hkey(e.get("cause")), _hkey(e.get("rank")), _hkey(e.get("node")))
        if attempt is not None:
            # Several launchers (one per node) may report the same incident: same attempt, cause, rank, node.
            if key in seen:
                continue
            seen.add(key)
        t_fault = _num_field(e, "t_fault")
        if t_fault is not None and t_fault > e["t"]:
            warnings.append(f"failure_detected at t={e['t']:.3f} has t_fault {t_fault - e['t']:.3f} s after its "
                            "detection; t_fault ignored (clock skew between the injector and the launcher?)")
            t_fault = None
        failures.append(Failure(t_detect=float(e["t"]), t_fault=t_fault, cause=str(e.get("cause") or "unknown"),
                                rank=e.get("rank"), node=e.get("node"), attempt=attempt))
    # An injected fault belongs to the first detection at or after it; the earliest one since the previous
    # detection is when the job really broke.
    injected = sorted(t for e in evs if e["kind"] == "fault_injected" and (t := _num_field(e, "t_fault")) is not None)
    prev = -math.inf
    for k, f in enumerate(failures):
        if f.t_fault is None:
            cands = [t for t in injected if prev < t <= f.t_detect]
            if cands:
                failures[k] = dataclasses.replace(f, t_fault=cands[0])
        prev = f.t_detect
    return failures


def _collect_runs(evs: list[dict[str, Any]], failures: list[Failure]) -> list[_Run]:
    detect_times = sorted(f.t_detect for f in failures)
    runs: dict[Any, _Run] = {}
    for e in evs:
        kind = e["kind"]
        if kind not in _TRAINER_KINDS:
            continue
        t = float(e["t"])
        key = _hkey(e.get("attempt"))
        if key is None:
            # No attempt number: an attempt is everything between two detected failures.
            key = f"~{bisect.bisect_left(detect_times, t)}"
        r = runs.get(key)
        if r is None:
            r = runs[key] = _Run(key=key, first_t=t, last_t=t)
        r.first_t, r.last_t = min(r.first_t, t), max(r.last_t, t)
        if kind == "trainer_start":
            r.trainer_start = t if r.trainer_start is None else min(r.trainer_start, t)
        elif kind == "restore_start":
            if r.restore_start is None or t < r.restore_start:
                r.restore_start = t
            tier = e.get("tier")
            if tier in TIERS:
                r.restore_start_tier = tier
        elif kind == "restore_end":
            tier = e.get("tier") if isinstance(e.get("tier"), str) else "none"
            # Ranks may restore from different tiers (after a node loss, the lost ranks rebuild from parity):
            # the job's restore is as expensive as its most expensive tier, and ends with its last rank.
            if r.restore_tier is None or _TIER_RANK.get(tier, 4) > _TIER_RANK.get(r.restore_tier, 4):
                r.restore_tier = tier
            v = _int_field(e, "version")
            if v is not None:
                r.restore_version = v if r.restore_version is None else min(r.restore_version, v)
            s = _num_field(e, "seconds")
            if s is not None:
                r.restore_seconds = s if r.restore_seconds is None else max(r.restore_seconds, s)
            r.restore_end = t if r.restore_end is None else max(r.restore_end, t)
        elif kind == "train_ready":
            r.train_ready = t if r.train_ready is None else max(r.train_ready, t)
            it = _int_field(e, "iteration")
            if it is not None:
                r.train_ready_iteration = it if r.train_ready_iteration is None else min(r.train_ready_iteration, it)
        elif kind == "iteration":
            it, s = _int_field(e, "iteration"), _num_field(e, "seconds")
            if it is None or s is None:
                continue
            cur = r.iters.get(it)
            r.iters[it] = [t, s] if cur is None else [max(cur[0], t), max(cur[1], s)]
        elif kind == "snapshot":
            v = _int_field(e, "version")
            if v is None:
                continue
            stall, copy = _num_field(e, "stall_s") or 0.0, _num_field(e, "copy_s") or 0.0
            cur = r.snaps.get(v)
            r.snaps[v] = [t, stall, copy] if cur is None else [max(cur[0], t), max(cur[1], stall), max(cur[2], copy)]
        elif kind == "snapshot_skipped":
            v = _int_field(e, "version")
            if v is not None:
                r.skipped.append(v)
    for r in runs.values():
        _job_iteration_seconds(r)
    return sorted(runs.values(), key=lambda r: r.start)


def _job_iteration_seconds(r: "_Run") -> None:
    """An iteration's seconds for the job: its slowest rank's, but never more than the time between the
    job finishing the previous iteration (or being ready) and finishing this one.

    Ranks that meet in collectives take turns being late: a rank that finished iteration i-1 early starts i
    early and reports the wait for the others as part of i. The largest seconds of every iteration then add
    up to more than the wall time the iterations took (by the ranks' waits for each other), which would show up
    as negative ``other`` and extra ``slowdown``. With one reporting rank the bound never binds
    (the gap to the previous iteration holds its seconds plus any time between iterations)."""
    prev = r.train_ready            # the job is ready when its last rank is: the first iteration starts there
    for k, it in enumerate(sorted(r.iters)):
        t, s = r.iters[it]
        if k > 0:
            prev = r.iters[it - 1][0] if it - 1 in r.iters else None   # no event for it-1: no bound
        if prev is not None and t >= prev:
            r.iters[it][1] = min(s, t - prev)


def _assign_failures(runs: list[_Run], failures: list[Failure], evs: list[dict[str, Any]],
                     warnings: list[str]) -> list[Failure]:
    """Attach each failure to the attempt it ended; infer the failures the launcher did not report."""
    starts = [r.start for r in runs]
    for f in failures:
        idx = max((i for i, s in enumerate(starts) if s <= f.t_detect), default=None)
        if idx is not None:
            runs[idx].failures.append(f)
    attempt_end = {_hkey(e.get("attempt")): e for e in evs
                   if e["kind"] == "attempt_end" and e.get("attempt") is not None}
    inferred = []
    for i, r in enumerate(runs):
        if r.failed or r.resized_end:  # a grow stops the attempt on purpose (rc may be a signal): not a failure
            continue
        ae = attempt_end.get(r.key)
        nxt = runs[i + 1].start if i + 1 < len(runs) else math.inf
        if ae is not None and not (r.start <= ae["t"] < nxt):
            ae = None  # the launcher numbers attempts differently from the trainers: don't trust the match
        rc = ae.get("rc") if ae is not None else None
        bad_rc = rc not in (None, 0)
        if i == len(runs) - 1 and not bad_rc:
            continue
        # An attempt that was followed by another one, or ended with rc != 0, failed even if nobody said so.
        t = float(ae["t"]) if ae is not None else r.last_t
        cause = str(ae.get("cause") or "unknown") if ae is not None else "unknown"
        f = Failure(t_detect=t, t_fault=None, cause=cause, attempt=r.key, synthesized=True)
        r.failures.append(f)
        inferred.append(f)
        warnings.append(f"attempt {r.key}: no failure_detected event, but it "
                        f"{'ended with rc=' + str(rc) if bad_rc else 'was followed by another attempt'}; "
                        f"assumed a failure detected at its {'attempt_end' if ae is not None else 'last event'} "
                        "(the launcher should emit failure_detected)")
    return sorted(failures + inferred, key=lambda f: f.t_detect)
