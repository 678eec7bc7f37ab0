"""TOR of one run from its event log: attempts, failures, a sweep of phases, and a breakdown that sums exactly.

:func:`compute_tor` turns the events of ``RUN_DIR/events.jsonl`` into a :class:`TorReport`: TOR, a breakdown
of ``T_obs - T_opt`` by cause that sums exactly, and the first-order TOR model (predicted TOR for the observed
MTBF, Young's optimal snapshot interval, and what a disk-checkpoint baseline would reach at its own optimal
interval). docs/tor.md is the specification of every definition used here; keep the two in step.

The steps, one function each: order and check the events (:func:`_ordered_events`), the job span
(:func:`_job_span`), failures and attempts (:func:`_collect_failures`, :func:`_collect_runs`,
:func:`_assign_failures`, :func:`_settle_runs`), which executions were kept (:func:`_keep_limits`), the phase
sweep (:func:`_transitions`, :func:`_segments`), the ideal iteration time (:func:`_ideal_iteration`), the
sums (:func:`_tally`), the per-attempt summaries (:func:`_attempt_summaries`) and the model
(:func:`_build_model`).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ._checks import _is_num
from .errors import TorError
from .attempts import _median, _Run, _assign_failures, _collect_failures, _collect_runs
from .degraded import assign_sizes, collect_resizes, degraded_report
from .events import EVENT_KINDS, TIERS, _num_field
from .model import predict_tor, young_interval
from .records import CATEGORIES, RECOVERY_PARTS, Attempt, Failure, Segment, TorModel, TorOptions, TorReport

__all__ = ["compute_tor"]


class _Acc:
    """Sums seconds per category; every second of [T0, T1] is added exactly once."""

    def __init__(self) -> None:
        self.parts: dict[str, list[float]] = {c: [] for c in CATEGORIES}

    def add(self, cat: str, seconds: float) -> None:
        self.parts[cat].append(seconds)

    def total(self, cat: str) -> float:
        return math.fsum(self.parts[cat])



def compute_tor(events: Iterable[Mapping[str, Any]], *, ideal_iteration_s: float | None = None,
                ckpt_save_s: float | None = None, ckpt_load_s: float | None = None, mtbf_s: float | None = None,
                snapshot_interval: int | None = None) -> TorReport:
    """TOR of a run from its events (any order; see docs/tor.md for every definition used here).

    Keyword arguments are those of :class:`TorOptions` (checked there). Raises :class:`TorError` when the
    events hold no time span at all.
    """
    opts = TorOptions(ideal_iteration_s=ideal_iteration_s, ckpt_save_s=ckpt_save_s, ckpt_load_s=ckpt_load_s,
                      mtbf_s=mtbf_s, snapshot_interval=snapshot_interval)
    warnings: list[str] = []
    evs = _ordered_events(events, warnings)
    t0, t1, ok = _job_span(evs, warnings)
    t_obs = max(0.0, t1 - t0)

    # Attempts, failures, and which executions of an iteration the job finally kept.
    failures = _collect_failures(evs, warnings)
    runs = _collect_runs(evs, failures)
    # Sizes before failures: an attempt the launcher stopped to grow back did not fail.
    resizes = collect_resizes(evs, warnings)
    full_dp = assign_sizes(runs, resizes)
    failures = _assign_failures(runs, failures, evs, warnings)
    if not runs:
        warnings.append("no trainer events: nothing was trained, so T_opt = 0")
    _settle_runs(runs, warnings)
    limits = _keep_limits(runs)

    # Phases: a sweep over state changes, so each second gets exactly one label.
    trans, train_end = _transitions(runs, failures, t0, warnings)
    segments = _segments(trans, runs, t0, t1)
    ideal, ideal_source, full_median, full_source = _ideal_iteration(opts, runs, limits, full_dp, warnings)
    tally = _tally(segments, runs, limits, ideal, warnings)
    degraded = degraded_report(runs, resizes, full_dp, segments, failures, tally.kept_by_run, full_median,
                               full_source, warnings)
    if ideal is not None and degraded.lost_s:
        # The iterations' excess over the ideal is slowdown; the part the reduced size explains is degraded.
        tally.acc.add("degraded", degraded.lost_s)
        tally.acc.add("slowdown", -degraded.lost_s)

    breakdown = tally.breakdown(t_obs, warnings)
    tor = tally.t_opt / t_obs if t_obs > 0 else None
    if tor is not None and tor > 1.0:
        warnings.append(f"TOR {tor:.3f} > 1: iterations ran faster than the ideal iteration time; check it")
    attempts = _attempt_summaries(runs, limits, tally.used_iter, train_end)
    model = _build_model(evs=evs, opts=opts, runs=runs, failures=failures, segments=segments, t_obs=t_obs,
                         ideal=ideal, slowdown=breakdown["slowdown"], degraded=breakdown["degraded"])
    return TorReport(
        tor=tor, t_obs=t_obs, t_opt=tally.t_opt, t_start=t0, t_end=t1, ok=ok, iterations=tally.n_iter,
        first_iteration=tally.first_it, last_iteration=tally.last_it, ideal_iteration_s=ideal,
        ideal_source=ideal_source, breakdown=breakdown, failures=failures, attempts=attempts, segments=segments,
        lost_spans=tally.lost_spans, snapshots=sum(len(r.snaps) for r in runs),
        snapshots_skipped=sum(len(r.skipped) for r in runs),
        flushes=sum(1 for e in evs if e["kind"] == "flush"), model=model, warnings=warnings, degraded=degraded,
        by_class=_by_class(runs, failures, segments, tally.lost_at))


def _ordered_events(events: Iterable[Mapping[str, Any]], warnings: list[str]) -> list[dict[str, Any]]:
    """The events that are events (numeric t, string kind), sorted by time; TorError when there are none."""
    evs = sorted((dict(e) for e in events if _is_num(e.get("t")) and isinstance(e.get("kind"), str)),
                 key=lambda e: e["t"])
    if not evs:
        raise TorError("no events: expected JSON lines with a numeric 't' and a 'kind' (docs/tor.md); "
                       "did the launcher and trainers get the run directory?")
    unknown = sorted({e["kind"] for e in evs} - set(EVENT_KINDS))
    if unknown:
        warnings.append(f"ignored unknown event kinds: {', '.join(unknown)}")
    return evs


def _job_span(evs: list[dict[str, Any]], warnings: list[str]) -> tuple[float, float, bool | None]:
    """T0 (job_start, else the first event), T1 (the last job_end, else the last event) and the job's ok."""
    starts = [e["t"] for e in evs if e["kind"] == "job_start"]
    ends = [e for e in evs if e["kind"] == "job_end"]
    t0 = min(starts) if starts else evs[0]["t"]
    t1 = max(e["t"] for e in ends) if ends else evs[-1]["t"]
    if not starts:
        warnings.append("no job_start event: T_obs starts at the first event")
    if not ends:
        warnings.append("no job_end event (job still running, or its launcher died): T_obs ends at the last event")
    ok = bool(ends[-1].get("ok")) if ends and "ok" in ends[-1] else None
    return t0, t1, ok


def _settle_runs(runs: list[_Run], warnings: list[str]) -> None:
    """Set each attempt's resume iteration and end (its earliest fault, else its last event)."""
    for r in runs:
        # Where the attempt resumed: its first executed iteration is ground truth; train_ready says the same
        # when its emitter follows the format, and is all there is when the attempt died before iterating.
        if r.iters:
            r.resume = min(r.iters)
            if r.train_ready_iteration is not None and r.train_ready_iteration != r.resume:
                warnings.append(f"attempt {r.key}: train_ready.iteration is {r.train_ready_iteration} but its first "
                                f"iteration event is {r.resume}; train_ready must name the first iteration about "
                                "to run (using the iteration events)")
        elif r.train_ready_iteration is not None:
            r.resume = r.train_ready_iteration
        elif r.restore_version is not None and r.restore_tier not in (None, "none"):
            r.resume = r.restore_version + 1
        if r.failed:
            r.end = max(r.start, min(f.t_fault if f.t_fault is not None else f.t_detect for f in r.failures))
        else:
            r.end = r.last_t


def _keep_limits(runs: list[_Run]) -> list[float]:
    """Per attempt, the first iteration number a later attempt re-executed: an execution of iteration i in
    attempt a is kept iff i < limits[a] (a later attempt resumed at or before i, so this one's work was lost)."""
    limits: list[float] = []
    nxt = math.inf
    for r in reversed(runs):
        limits.append(nxt)
        if r.resume is not None:
            nxt = min(nxt, r.resume)
    limits.reverse()
    return limits


# (t, order at equal t, label, run index). At equal t the higher order wins: faults beat everything.
_Trans = tuple[float, int, str, "int | None"]


def _transitions(runs: list[_Run], failures: list[Failure], t0: float,
                 warnings: list[str]) -> tuple[list[_Trans], dict[int, float]]:
    """Every state change of the job, sorted; and per clean attempt, when its training ended."""
    trans: list[_Trans] = [(t0, 0, "startup", None)]
    train_end: dict[int, float] = {}
    for i, r in enumerate(runs):
        _attempt_transitions(i, r, runs, trans, train_end, warnings)
    for f in failures:
        # A fault sorts last at its instant (it beats another failure's detection at the same time); a fault
        # detected at the instant it happened has no detection phase, so its own restart must not be overridden.
        if f.t_fault is not None and f.t_fault < f.t_detect:
            trans.append((f.t_fault, 7, "detection", None))
        restarted = any(r.start > f.t_detect for r in runs)
        trans.append((f.t_detect, 6, "restart" if restarted else "shutdown", None))
    trans.sort(key=lambda x: (x[0], x[1]))
    return trans, train_end


def _attempt_transitions(i: int, r: _Run, runs: list[_Run], trans: list[_Trans], train_end: dict[int, float],
                         warnings: list[str]) -> None:
    """One attempt's state changes: startup, its restore (by tier), training, and shutdown if it did not fail."""
    def add(t: float, order: int, label: str) -> None:
        if r.failed and t >= r.end:  # the attempt was already dead
            return
        trans.append((t, order, label, i))

    cursor = r.start
    add(cursor, 1, "startup")
    if r.restore_end is not None and r.restore_tier in TIERS:
        rs = r.restore_end - r.restore_seconds if r.restore_seconds is not None else r.restore_start
        rs = max(cursor, rs if rs is not None else cursor)
        add(rs, 2, "restore_" + r.restore_tier)
        cursor = max(rs, r.restore_end)
        add(cursor, 3, "startup")
    elif r.restore_end is not None and r.restore_tier != "none":
        warnings.append(f"attempt {r.key}: restore_end tier {r.restore_tier!r} is not one of "
                        f"{', '.join(TIERS)} or 'none'; its time is counted as other")
        rs = r.restore_end - (r.restore_seconds or 0.0)
        add(max(cursor, rs), 2, "other")
        cursor = max(cursor, r.restore_end)
        add(cursor, 3, "startup")
    elif r.restore_start is not None and r.restore_end is None and r.failed:
        # Killed during restore: charge the tier it was trying, else the tier the next restore used.
        tier = r.restore_start_tier or next((q.restore_tier for q in runs[i + 1:] if q.restore_tier in TIERS), None)
        cursor = max(cursor, r.restore_start)
        add(cursor, 2, "restore_" + tier if tier else "restart")
    tr = r.train_ready
    if tr is None and r.iters:
        tr = min(t - s for t, s in r.iters.values())
    if tr is not None:
        tr = max(tr, cursor)
        add(tr, 4, "training")
        if not r.failed:
            te = max([tr] + [t for t, _ in r.iters.values()] + [v[0] for v in r.snaps.values()])
            train_end[i] = te
            # Stopped to re-form at another size: the job restarts (a grow costs a restart and a restore).
            add(te, 5, "restart" if r.resized_end else "shutdown")
    elif not r.failed:
        add(max(cursor, r.last_t), 5, "restart" if r.resized_end else "shutdown")


def _segments(trans: list[_Trans], runs: list[_Run], t0: float, t1: float) -> list[Segment]:
    """The transitions as labelled stretches of [t0, t1]; adjacent stretches with one label and attempt merge."""
    segments: list[Segment] = []
    for k, (t, _, label, ri) in enumerate(trans):
        a = min(max(t, t0), t1)
        b = min(max(trans[k + 1][0] if k + 1 < len(trans) else t1, t0), t1)
        if b <= a:
            continue
        key = runs[ri].key if ri is not None else None
        if segments and segments[-1].label == label and segments[-1].attempt == key and segments[-1].t1 == a:
            segments[-1] = Segment(segments[-1].t0, b, label, key)
        else:
            segments.append(Segment(a, b, label, key))
    return segments


def _ideal_iteration(opts: TorOptions, runs: list[_Run], limits: list[float], full_dp: int | None,
                     warnings: list[str]) -> tuple[float | None, str, float | None, str]:
    """The ideal seconds per iteration and where it came from (docs/tor.md: T_opt); the median seconds of a
    full-size iteration (what a reduced-size one is compared with; the ideal itself unless it was given) and
    where that came from.
    Attempts at a reduced data-parallel size take longer per iteration and never count towards it."""
    full = [(i, r) for i, r in enumerate(runs) if not r.reduced]
    measured = _median([s for _, r in full if not r.failed for _, s in r.iters.values()])
    source = "median of iteration.seconds over attempts without failures"
    if measured is None:
        measured = _median([s for i, r in full for it, (_, s) in r.iters.items() if it < limits[i]])
        which = "every full-size attempt" if full_dp is not None else "every attempt"
        source = f"median of iteration.seconds over kept iterations ({which} failed)"
        if measured is not None and opts.ideal_iteration_s is None:
            warnings.append(f"{which} failed: the ideal iteration time is the median of their kept "
                            "iterations; pass --ideal-iteration-s for a firmer T_opt")
    if measured is None and full_dp is not None:
        # Nothing ran at full size: assume an iteration at D' takes D/D' of one at D (same batch, fewer ranks).
        measured = _median([s * r.dp / full_dp for r in runs if r.reduced for _, s in r.iters.values()])
        source = "median of iteration.seconds x D'/D at reduced size (no full-size iteration; scaling assumed)"
        if measured is not None and opts.ideal_iteration_s is None:
            warnings.append("no iteration ran at the full data-parallel size: the ideal iteration time assumes a "
                            "reduced-size iteration takes D/D' of a full-size one; pass --ideal-iteration-s")
    if opts.ideal_iteration_s is not None:
        if measured is None:
            return opts.ideal_iteration_s, "argument", opts.ideal_iteration_s, "argument (none measured)"
        return opts.ideal_iteration_s, "argument", measured, source
    if measured is None:
        return None, "none (no iterations)", None, ""
    if measured <= 0:
        warnings.append(f"median iteration time is {measured} s; pass --ideal-iteration-s")
        return None, "none (non-positive iteration times)", None, ""
    return measured, source, measured, source


@dataclass
class _Tally:
    """The sums of the segments: the breakdown's parts and the kept work."""

    acc: _Acc
    lost_spans: list[tuple[float, float]]
    used_iter: set[tuple[int, int]]
    kept_by_run: dict[int, int] = field(default_factory=dict)
    lost_at: list[tuple[float, float]] = field(default_factory=list)
    """(end of a failed training segment, its lost_progress seconds): a lost span holds the stall of a kept
    snapshot too, which is snapshot_stall, so the per-class breakdown reads the lost seconds from here."""
    n_iter: int = 0
    first_it: int | None = None
    last_it: int | None = None
    t_opt: float = 0.0

    def breakdown(self, t_obs: float, warnings: list[str]) -> dict[str, float]:
        out = {c: self.acc.total(c) for c in CATEGORIES if c != "other"}
        # `other` is the exact remainder, so the breakdown sums to T_obs - T_opt; the accumulated gaps explain it.
        out["other"] = (t_obs - self.t_opt) - math.fsum(out.values())
        if t_obs > 0 and abs(out["other"]) > 0.05 * t_obs:
            warnings.append(f"other is {out['other']:.3f} s ({100 * out['other'] / t_obs:.1f}% of T_obs): "
                            "time the events do not explain (gaps between iterations, missing events)")
        return out


def _tally(segments: list[Segment], runs: list[_Run], limits: list[float], ideal: float | None,
           warnings: list[str]) -> _Tally:
    """Sum the labels; split each attempt's training time into kept work, stalls and lost work."""
    tally = _Tally(acc=_Acc(), lost_spans=[], used_iter=set())
    kept_numbers: set[int] = set()
    productive: list[float] = []
    n_kept_exec = 0
    for seg in segments:
        if seg.label != "training":
            tally.acc.add(seg.label, seg.t1 - seg.t0)
            continue
        i = next(j for j, r in enumerate(runs) if r.key == seg.attempt)
        work, keep = _tally_training(seg, i, runs[i], limits[i], tally)
        productive.append(work)
        n_kept_exec += len(keep)
        tally.kept_by_run[i] = tally.kept_by_run.get(i, 0) + len(keep)
        kept_numbers.update(keep)
    outside = sum(len(r.iters) for r in runs) - len(tally.used_iter)
    if outside:
        warnings.append(f"{outside} iteration event(s) fell outside their attempt's training phase "
                        "(after its failure, or before train_ready) and were not counted")
    if kept_numbers:
        tally.first_it = min([r.resume for r in runs if r.resume is not None][:1] + [min(kept_numbers)])
        tally.last_it = max(kept_numbers)
        tally.n_iter = tally.last_it - tally.first_it + 1
        if tally.n_iter > len(kept_numbers):
            warnings.append(f"{tally.n_iter - len(kept_numbers)} kept iteration(s) between {tally.first_it} and "
                            f"{tally.last_it} have no iteration event; T_opt counts them, their time shows up in "
                            "other")
    tally.t_opt = tally.n_iter * ideal if ideal is not None else 0.0
    if ideal is not None:
        tally.acc.add("slowdown", math.fsum(productive) - n_kept_exec * ideal)
    else:
        tally.acc.add("other", math.fsum(productive))
    return tally


def _tally_training(seg: Segment, i: int, r: _Run, limit: float, tally: _Tally) -> tuple[float, list[int]]:
    """One training segment of attempt i: adds its stalls, lost progress and unexplained gaps to the tally;
    returns the kept work (seconds) and the kept iteration numbers."""
    a, b = seg.t0, seg.t1
    execs = [(t, it, s) for it, (t, s) in r.iters.items() if a <= t <= b and (i, it) not in tally.used_iter]
    tally.used_iter.update((i, it) for _, it, _ in execs)
    keep = [x for x in execs if x[1] < limit]
    lose = [x for x in execs if not x[1] < limit]
    # A failed attempt keeps its work only up to its last kept iteration; everything after it is lost.
    t_last = max((t for t, _, _ in keep), default=a) if r.failed else b
    snaps = [(t, v, st) for v, (t, st, _) in r.snaps.items() if a <= t <= b]
    stall_kept_early = math.fsum(st for t, v, st in snaps if v < limit and t <= t_last)
    stall_kept_late = math.fsum(st for t, v, st in snaps if v < limit and t > t_last)
    lost_early = math.fsum(s for t, _, s in lose if t <= t_last) + \
        math.fsum(st for t, v, st in snaps if not v < limit and t <= t_last)
    work = math.fsum(s for _, _, s in keep)
    tally.acc.add("snapshot_stall", stall_kept_early + stall_kept_late)
    lost = lost_early + (b - t_last) - stall_kept_late
    tally.acc.add("lost_progress", lost)
    tally.lost_at.append((b, lost))
    tally.acc.add("other", (t_last - a) - work - stall_kept_early - lost_early)
    if b > t_last:
        tally.lost_spans.append((t_last, b))
    return work, [it for _, it, _ in keep]


def _attempt_summaries(runs: list[_Run], limits: list[float], used_iter: set[tuple[int, int]],
                       train_end: dict[int, float]) -> list[Attempt]:
    attempts: list[Attempt] = []
    for i, r in enumerate(runs):
        def kept(it: int, i: int = i) -> bool:
            return it < limits[i]
        its = sorted(r.iters)
        kept_its = [it for it in its if kept(it) and (i, it) in used_iter]
        marks = sorted((t, v, st, kept(v)) for v, (t, st, _) in r.snaps.items())
        attempts.append(Attempt(
            key=r.key, start=r.start, end=r.end if r.failed else max(r.last_t, train_end.get(i, r.last_t)),
            failed=r.failed, restore_tier=r.restore_tier, restore_version=r.restore_version,
            restore_seconds=r.restore_seconds, resume_iteration=r.resume,
            first_iteration=its[0] if its else None, last_iteration=its[-1] if its else None,
            kept_iterations=len(kept_its), lost_iterations=len(its) - len(kept_its), snapshots=len(r.snaps),
            snapshots_skipped=len(r.skipped), data_parallel=r.dp,
            progress=sorted((r.iters[it][0], it, kept(it) and (i, it) in used_iter) for it in its),
            snapshot_marks=marks))
    return attempts


# ---------------------------------------------------------------------------------------------------------------
# The model's inputs, measured from the run (docs/tor.md, "Inputs, measured from the run")
# ---------------------------------------------------------------------------------------------------------------

def _build_model(*, evs: list[dict[str, Any]], opts: TorOptions, runs: list[_Run], failures: list[Failure],
                 segments: list[Segment], t_obs: float, ideal: float | None, slowdown: float,
                 degraded: float) -> TorModel:
    notes: list[str] = []
    n = len(failures)
    if opts.mtbf_s is not None:
        mtbf, mtbf_source = opts.mtbf_s, "argument"
    elif n and t_obs > 0:
        mtbf, mtbf_source = t_obs / n, "observed"
    else:
        mtbf, mtbf_source = None, "none (no failures)"
        notes.append("no failures: the failure term is 0 and there is no optimal interval; pass --mtbf-s to size one")
    interval_it, interval_s, cost, copy = _snapshot_cadence(runs, opts, ideal, notes)
    fixed, recovery = _recovery_costs(segments, failures, notes)
    rec_total = math.fsum(recovery.values())
    fixed_frac = fixed / t_obs if t_obs > 0 else 0.0
    slow_frac = slowdown / t_obs if t_obs > 0 else 0.0
    degraded_frac = degraded / t_obs if t_obs > 0 else 0.0

    def model(tau: float, c: float, rec: float) -> float:
        return predict_tor(interval_s=tau, snapshot_cost_s=c, mtbf_s=mtbf, recovery_s=rec,
                           fixed_fraction=fixed_frac, slowdown_fraction=slow_frac, degraded_fraction=degraded_frac)

    predicted = model(interval_s, cost, rec_total) if interval_s and cost is not None else None
    opt_s = opt_it = at_opt = None
    if mtbf is not None and cost is not None:
        opt_s = young_interval(cost, mtbf)
        opt_it = _to_iters(opt_s, ideal)
        # A snapshot cannot be taken more often than once per iteration.
        tau_opt = max(opt_s, ideal or 0.0)
        at_opt = model(tau_opt, cost, rec_total) if tau_opt > 0 else None

    save, load, source = _baseline_costs(evs, opts)
    b_s = b_it = b_tor = None
    if save is None or load is None:
        notes.append("no disk-checkpoint baseline: emit baseline_checkpoint{save_s, load_s} or pass "
                     "--ckpt-save-s and --ckpt-load-s")
    elif mtbf is None:
        notes.append("baseline TOR needs an MTBF: no failures observed; pass --mtbf-s")
    else:
        # Same model, same detection/restart/startup per failure; the restore is the disk load instead.
        b_rec = rec_total - recovery["restore"] + load
        b_s = young_interval(save, mtbf)
        b_it = _to_iters(b_s, ideal)
        b_tau = max(b_s, ideal or 0.0)
        b_tor = model(b_tau, save, b_rec) if b_tau > 0 else None
    return TorModel(
        mtbf_s=mtbf, mtbf_source=mtbf_source, n_failures=n, snapshot_interval_iterations=interval_it,
        snapshot_interval_s=interval_s, snapshot_cost_s=cost, snapshot_copy_s=copy, recovery_s=recovery,
        fixed_s=fixed, slowdown_fraction=slow_frac, degraded_fraction=degraded_frac, predicted_tor=predicted,
        optimal_interval_s=opt_s, optimal_interval_iterations=opt_it, predicted_tor_at_optimal=at_opt,
        baseline_save_s=save, baseline_load_s=load, baseline_source=source, baseline_interval_s=b_s,
        baseline_interval_iterations=b_it, baseline_tor=b_tor, notes=notes)


def _to_iters(seconds: float, ideal: float | None) -> int | None:
    return max(1, int(math.floor(seconds / ideal + 0.5))) if ideal else None


def _snapshot_cadence(runs: list[_Run], opts: TorOptions, ideal: float | None,
                      notes: list[str]) -> tuple[int | None, float | None, float | None, float | None]:
    """(interval in iterations, in seconds, mean stall C, mean async copy) of the run's snapshots."""
    # Snapshot cadence: the gap between consecutive (attempted) snapshot versions of an attempt.
    gaps = []
    for r in runs:
        vs = sorted(set(r.snaps) | set(r.skipped))
        gaps += [b - a for a, b in zip(vs, vs[1:]) if b > a]
    interval_it = opts.snapshot_interval or (int(round(statistics.median(gaps))) if gaps else None)
    interval_s = interval_it * ideal if interval_it and ideal else None
    stalls = [st for r in runs for _, st, _ in r.snaps.values()]
    copies = [cp for r in runs for _, _, cp in r.snaps.values()]
    cost = math.fsum(stalls) / len(stalls) if stalls else None
    copy = math.fsum(copies) / len(copies) if copies else None
    if interval_s is None:
        notes.append("snapshot interval unknown (fewer than two snapshots in an attempt): pass --snapshot-interval")
    if cost is None:
        notes.append("no snapshot events: snapshot cost unknown")
    return interval_it, interval_s, cost, copy


def _recovery_costs(segments: list[Segment], failures: list[Failure],
                    notes: list[str]) -> tuple[float, dict[str, float]]:
    """One-time seconds f*T_obs, and the recovery seconds per failure by phase (detection, restart, startup,
    restore)."""
    # One-time costs happen before the first fault (first startup, a restore from a previous job) or at the end;
    # every recovery cost after the first fault recurs per failure.
    n = len(failures)
    first_fault = min((f.t_fault if f.t_fault is not None else f.t_detect for f in failures), default=math.inf)
    fixed = 0.0
    recurring = {"detection": 0.0, "restart": 0.0, "startup": 0.0, "restore": 0.0}
    for s in segments:
        d = s.t1 - s.t0
        cat = "restore" if s.label.startswith("restore_") else s.label
        if s.label == "shutdown" or (s.t1 <= first_fault and cat in ("startup", "restore")):
            fixed += d
        elif cat in recurring:
            recurring[cat] += d
    if not n:
        notes.append("no failures: per-failure recovery (detection, restart, startup, restore) unknown, taken as 0")
    return fixed, {k: (v / n if n else 0.0) for k, v in recurring.items()}


def _baseline_costs(evs: list[dict[str, Any]], opts: TorOptions) -> tuple[float | None, float | None, str | None]:
    """Disk checkpoint save and load seconds (arguments over baseline_checkpoint events) and their source."""
    bench = [e for e in evs if e["kind"] == "baseline_checkpoint"]
    ev_save = _median([v for e in bench if (v := _num_field(e, "save_s")) is not None])
    ev_load = _median([v for e in bench if (v := _num_field(e, "load_s")) is not None])
    save = opts.ckpt_save_s if opts.ckpt_save_s is not None else ev_save
    load = opts.ckpt_load_s if opts.ckpt_load_s is not None else ev_load
    sources = []
    if (opts.ckpt_save_s is None and ev_save is not None) or (opts.ckpt_load_s is None and ev_load is not None):
        sources.append("events")
    if opts.ckpt_save_s is not None or opts.ckpt_load_s is not None:
        sources.append("arguments")
    return save, load, "+".join(sources) or None


# ---------------------------------------------------------------------------------------------------------------
# The run's own failures by class (the tier that recovered them)
# ---------------------------------------------------------------------------------------------------------------

def _by_class(runs: list[_Run], failures: list[Failure], segments: list[Segment],
              lost_at: list[tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Each failure's recovery window runs from its fault (else its detection) to the next attempt's
    train_ready, cut short by the next failure (a failure during a recovery takes the rest of it over). Its
    class is the tier of the restore that ended the window: memory (a process failure), parity (a node loss),
    persistent (beyond m), none (no later attempt trained). The phases inside the window are summed by
    label; its lost progress is that of the training segment that ends at its fault (a failure during a
    recovery loses none). The parts of all failures add up to the breakdown's detection, restart, restore and
    lost progress after the first fault (startup too, less the one-time startup before it)."""
    fails = sorted(failures, key=lambda f: f.t_fault if f.t_fault is not None else f.t_detect)
    starts = [(f.t_fault if f.t_fault is not None else f.t_detect) for f in fails]
    sums: dict[str, dict[str, float]] = {}
    for k, f in enumerate(fails):
        t_f = starts[k]
        nxt = next((r for r in runs if r.start > f.t_detect), None)
        end = nxt.train_ready if nxt is not None and nxt.train_ready is not None else None
        tier = "none"
        if nxt is not None:
            tier = nxt.restore_tier if nxt.restore_tier in TIERS else (nxt.restore_start_tier or "none")
        if end is None:
            end = nxt.end if nxt is not None else t_f
        if k + 1 < len(fails):
            end = min(end, starts[k + 1])
        parts = dict.fromkeys(RECOVERY_PARTS, 0.0)
        for s in segments:
            d = min(s.t1, end) - max(s.t0, t_f)
            if d <= 0:
                continue
            cat = "restore" if s.label.startswith("restore_") else s.label
            if cat in parts:
                parts[cat] += d
        parts["lost_progress"] = math.fsum(v for b, v in lost_at if abs(b - t_f) <= 1e-6)
        acc = sums.setdefault(tier, {"failures": 0.0, **dict.fromkeys(RECOVERY_PARTS, 0.0)})
        acc["failures"] += 1
        for p, v in parts.items():
            acc[p] += v
    out = {}
    for tier, acc in sums.items():
        n = acc["failures"]
        means = {p: acc[p] / n for p in RECOVERY_PARTS}
        out[tier] = {"failures": int(n), **means, "seconds": math.fsum(means.values())}
    return out
