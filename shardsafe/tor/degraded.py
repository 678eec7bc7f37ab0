"""Attempts at a reduced data-parallel size: the launcher's shrink and grow events, each attempt's size, and the
throughput lost while degraded (docs/tor.md, "Continuing at a smaller data-parallel size").

A job that lost a node with no spare to take its place may continue at D' < D data-parallel ranks with the same
global batch (gradient accumulation grows by D/D'), and grow back to D when a node returns. Every iteration is
the same work at either size, so T_opt stays N x t_iter at full size; an iteration at D' takes longer, and that
extra time is the breakdown's ``degraded``, measured: kept executions at D' x (median seconds at D' - median
seconds at D). What the median does not explain (warm-up, fail-slow at D') stays ``slowdown``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from .attempts import _median, _Run
from .events import _check_resize
from .records import Degraded, DegradedPeriod, Failure, Segment

__all__ = ["Resize", "collect_resizes", "assign_sizes", "degraded_report"]


@dataclass(frozen=True)
class Resize:
    """One ``shrink`` or ``grow`` event: attempts that start at or after ``t`` run at ``to_dp``."""

    t: float
    kind: str
    from_dp: int
    to_dp: int


def collect_resizes(evs: list[dict[str, Any]], warnings: list[str]) -> list[Resize]:
    """The shrink and grow events in time order; malformed ones are dropped with a warning that says why."""
    out: list[Resize] = []
    for e in evs:
        kind = e["kind"]
        if kind not in ("shrink", "grow"):
            continue
        problems = _check_resize(kind, e)
        if problems:
            warnings.append(f"{kind} at t={e['t']:.3f} ignored: {problems[0]}")
            continue
        out.append(Resize(t=float(e["t"]), kind=kind, from_dp=e["from_dp"], to_dp=e["to_dp"]))
    for a, b in zip(out, out[1:]):
        if b.from_dp != a.to_dp:
            warnings.append(f"{b.kind} at t={b.t:.3f} starts from data-parallel size {b.from_dp}, but the {a.kind} "
                            f"before it went to {a.to_dp}; attempts are sized by each event's to_dp")
    return out


def assign_sizes(runs: list[_Run], resizes: Sequence[Resize]) -> int | None:
    """Set each attempt's data-parallel size (the ``to_dp`` of the last resize at or before its start, else the
    first resize's ``from_dp``) and whether a grow ended it; returns the full size D (the largest size seen), None
    when the job never changed size. A shrink follows a lost node, so the attempt before it failed (reported or
    inferred as any other); a grow stops a healthy attempt on purpose."""
    if not resizes:
        return None
    full = max(max(c.from_dp, c.to_dp) for c in resizes)
    for i, r in enumerate(runs):
        before = [c for c in resizes if c.t <= r.start]
        r.dp = before[-1].to_dp if before else resizes[0].from_dp
        r.reduced = r.dp < full
        nxt = runs[i + 1].start if i + 1 < len(runs) else None
        r.resized_end = nxt is not None and any(c.kind == "grow" and r.start < c.t <= nxt for c in resizes)
    return full


def degraded_report(runs: list[_Run], resizes: Sequence[Resize], full: int | None, segments: list[Segment],
                    failures: Sequence[Failure], kept_by_run: dict[int, int], full_median: float | None,
                    full_source: str, warnings: list[str]) -> Degraded:
    """The degraded periods and the seconds they lost (the breakdown's ``degraded``).

    ``kept_by_run``: kept executions per attempt index; ``full_median``: the median seconds of a full-size
    iteration (the ideal's own median, or what stands in for it)."""
    deg = Degraded(full_data_parallel=full, shrinks=sum(c.kind == "shrink" for c in resizes),
                   grows=sum(c.kind == "grow" for c in resizes), full_iteration_s=full_median,
                   full_iteration_source=full_source)
    if full is None:
        return deg
    by_size: dict[int, list[float]] = {}
    for r in runs:
        if r.dp is not None:
            by_size.setdefault(r.dp, []).extend(s for _, s in r.iters.values())
    medians = {d: _median(xs) for d, xs in by_size.items()}
    for i, r in enumerate(runs):
        if not r.reduced:
            continue
        spans = [(s.t0, s.t1) for s in segments if s.label == "training" and s.attempt == r.key]
        med = medians.get(r.dp)
        n = kept_by_run.get(i, 0)
        lost = n * (med - full_median) if (n and med is not None and full_median is not None) else 0.0
        deg.periods.append(DegradedPeriod(
            attempt=r.key, data_parallel=r.dp, full_data_parallel=full,
            t0=min((a for a, _ in spans), default=r.start), t1=max((b for _, b in spans), default=r.start),
            wall_s=math.fsum(b - a for a, b in spans), kept_iterations=n, iteration_s=med, lost_s=lost))
    # For the projection: the restore of an attempt that started at a new size (it re-partitioned the state), and
    # the launcher's wait for a spare between a detection and the shrink that followed it (part of `restart`).
    for prev, r in zip(runs, runs[1:]):
        if prev.dp != r.dp and r.restore_seconds is not None and r.restore_tier not in (None, "none"):
            deg.resize_restore_s.append(r.restore_seconds)
    for c in resizes:
        if c.kind == "shrink":
            before = [f.t_detect for f in failures if f.t_detect <= c.t]
            if before:
                deg.shrink_waits_s.append(c.t - max(before))
    if deg.periods and full_median is None:
        warnings.append("no full-size iteration time to compare the reduced-size iterations with: degraded is 0 "
                        "and their time stays in slowdown; pass --ideal-iteration-s")
    return deg
