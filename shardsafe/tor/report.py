"""The TOR report as JSON (:func:`report_dict`) and as text (:func:`report_text`); docs/tor.md shows how to read it."""
from __future__ import annotations

import math
from typing import Any

from .records import CATEGORIES, RECOVERY_PARTS, TorReport

__all__ = ["report_dict", "report_text"]


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


def report_dict(report: TorReport) -> dict[str, Any]:
    """The report as one JSON-ready object. Times inside (segments, failures, attempts) are seconds since
    ``t_start``; durations are seconds; ``breakdown`` sums to ``t_obs - t_opt`` up to rounding (1e-6 s)."""
    rel = lambda t: None if t is None else _r(t - report.t_start)  # noqa: E731
    m = report.model
    return {
        "tor": _r(report.tor), "t_obs": _r(report.t_obs), "t_opt": _r(report.t_opt),
        "t_start": report.t_start, "t_end": report.t_end, "ok": report.ok,
        "iterations": report.iterations, "first_iteration": report.first_iteration,
        "last_iteration": report.last_iteration, "ideal_iteration_s": _r(report.ideal_iteration_s),
        "ideal_source": report.ideal_source,
        "breakdown": {k: _r(v) for k, v in report.breakdown.items()},
        "n_failures": len(report.failures), "mtbf": _r(m.mtbf_s), "mtbf_source": m.mtbf_source,
        "predicted_tor": _r(m.predicted_tor),
        "optimal_interval": {"seconds": _r(m.optimal_interval_s), "iterations": m.optimal_interval_iterations,
                             "predicted_tor": _r(m.predicted_tor_at_optimal)},
        "baseline_tor": _r(m.baseline_tor),
        "baseline": {"save_s": _r(m.baseline_save_s), "load_s": _r(m.baseline_load_s), "source": m.baseline_source,
                     "interval_s": _r(m.baseline_interval_s), "interval_iterations": m.baseline_interval_iterations},
        "model": {"snapshot_interval_iterations": m.snapshot_interval_iterations,
                  "snapshot_interval_s": _r(m.snapshot_interval_s), "snapshot_cost_s": _r(m.snapshot_cost_s),
                  "snapshot_copy_s": _r(m.snapshot_copy_s),
                  "recovery_per_failure_s": {k: _r(v) for k, v in m.recovery_s.items()},
                  "fixed_s": _r(m.fixed_s), "slowdown_fraction": _r(m.slowdown_fraction),
                  "degraded_fraction": _r(m.degraded_fraction), "notes": list(m.notes)},
        "snapshots": report.snapshots, "snapshots_skipped": report.snapshots_skipped, "flushes": report.flushes,
        "failures": [{"t_fault": rel(f.t_fault), "t_detect": rel(f.t_detect), "cause": f.cause, "rank": f.rank,
                      "node": f.node, "attempt": f.attempt, "synthesized": f.synthesized} for f in report.failures],
        "attempts": [{"attempt": a.key, "start": rel(a.start), "end": rel(a.end), "failed": a.failed,
                      "restore_tier": a.restore_tier, "restore_version": a.restore_version,
                      "restore_seconds": _r(a.restore_seconds), "resume_iteration": a.resume_iteration,
                      "first_iteration": a.first_iteration, "last_iteration": a.last_iteration,
                      "kept_iterations": a.kept_iterations, "lost_iterations": a.lost_iterations,
                      "snapshots": a.snapshots, "snapshots_skipped": a.snapshots_skipped,
                      "data_parallel": a.data_parallel} for a in report.attempts],
        "degraded": _degraded_dict(report, rel),
        "segments": [[rel(s.t0), rel(s.t1), s.label, s.attempt] for s in report.segments],
        "lost_spans": [[rel(a), rel(b)] for a, b in report.lost_spans],
        "by_class": {t: {k: (v if k == "failures" else _r(v)) for k, v in d.items()}
                     for t, d in report.by_class.items()},
        "warnings": list(report.warnings),
    }


def _degraded_dict(report: TorReport, rel: Any) -> dict[str, Any]:
    d = report.degraded
    full = d.full_iteration_s

    def throughput(p: Any) -> float | None:
        return _r(full / p.iteration_s) if full and p.iteration_s else None

    return {"full_data_parallel": d.full_data_parallel, "shrinks": d.shrinks, "grows": d.grows,
            "wall_s": _r(d.wall_s), "lost_s": _r(d.lost_s), "full_iteration_s": _r(full),
            "full_iteration_source": d.full_iteration_source,
            "resize_restore_s": [_r(x) for x in d.resize_restore_s],
            "shrink_waits_s": [_r(x) for x in d.shrink_waits_s],
            "periods": [{"attempt": p.attempt, "data_parallel": p.data_parallel, "t0": rel(p.t0), "t1": rel(p.t1),
                         "wall_s": _r(p.wall_s), "kept_iterations": p.kept_iterations,
                         "iteration_s": _r(p.iteration_s), "throughput": throughput(p),
                         "throughput_assumed": _r(p.throughput_assumed), "lost_s": _r(p.lost_s)}
                        for p in d.periods]}


def _degraded_lines(report: TorReport) -> list[str]:
    """The attempts at a reduced data-parallel size, what an iteration took there, and what that lost."""
    d = report.degraded
    if d.full_data_parallel is None:
        return []
    lines = [f"  data-parallel size: {d.shrinks} shrink(s), {d.grows} grow(s); full size D = {d.full_data_parallel}"
             f", {_fmt(d.full_iteration_s, ' s', 4)} per iteration ({d.full_iteration_source})"]
    for p in d.periods:
        it = _fmt(p.iteration_s, " s", 4)
        tp = (f"throughput {d.full_iteration_s / p.iteration_s:.3f}" if d.full_iteration_s and p.iteration_s
              else "throughput n/a")
        lines.append(f"    attempt {p.attempt} at D' = {p.data_parallel}: {p.wall_s:.3f} s training, "
                     f"{p.kept_iterations} kept iteration(s) of {it}: {tp} (D'/D {p.throughput_assumed:.3f}), "
                     f"degraded {p.lost_s:.3f} s")
    if d.resize_restore_s:
        lines.append("    restore at a new size (re-partition included): "
                     + ", ".join(f"{x:.3f} s" for x in d.resize_restore_s))
    if d.shrink_waits_s:
        lines.append("    wait for a spare before shrinking (detection to shrink, inside restart): "
                     + ", ".join(f"{x:.3f} s" for x in d.shrink_waits_s))
    return lines + [""]


def _fmt(x: float | None, unit: str = " s", nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}{unit}"


def report_text(report: TorReport) -> str:
    """Human-readable report (the example in docs/tor.md shows how to read it)."""
    m = report.model
    lines = []
    ok = {True: "ok", False: "FAILED", None: "no job_end"}[report.ok]
    lines.append(f"TOR report: {len(report.attempts)} attempt(s), {len(report.failures)} failure(s), job {ok}")
    lines.append(f"  T_obs  {_fmt(report.t_obs):>14}   wall time, job_start -> job_end")
    ideal = _fmt(report.ideal_iteration_s, " s", 4)
    lines.append(f"  T_opt  {_fmt(report.t_opt):>14}   {report.iterations} iterations x {ideal} "
                 f"({report.ideal_source})")
    lines.append(f"  TOR    {_fmt(report.tor, '', 4):>14}   = T_opt / T_obs")
    lines.append("")
    lines.append(f"  T_obs - T_opt = {_fmt(report.t_obs - report.t_opt)}, by cause (sums exactly; docs/tor.md):")
    lines.append(f"    {'cause':<24}{'seconds':>12}{'% of T_obs':>14}")
    for c in CATEGORIES:
        v = report.breakdown[c]
        pct = 100.0 * v / report.t_obs if report.t_obs > 0 else 0.0
        lines.append(f"    {c:<24}{v:>12.3f}{pct:>13.2f}%")
    lines.append("")
    lines.extend(_degraded_lines(report))
    lines.extend(_by_class_lines(report))
    lines.append("  TOR model (docs/tor.md):  TOR = (1 - f - s - g - (R + tau/2)/M) * tau/(tau + C)")
    mt = "n/a" if m.mtbf_s is None else f"{m.mtbf_s:.3f} s ({m.mtbf_source}, {m.n_failures} failure(s))"
    lines.append(f"    M   MTBF                    {mt}")
    tau = (f"{m.snapshot_interval_iterations} it = {_fmt(m.snapshot_interval_s)}"
           if m.snapshot_interval_iterations else "n/a")
    lines.append(f"    tau snapshot interval       {tau}")
    lines.append(f"    C   stall per snapshot      {_fmt(m.snapshot_cost_s, ' s', 4)}"
                 f"  (async copy {_fmt(m.snapshot_copy_s, ' s', 4)})")
    rec = " + ".join(f"{k} {v:.3f}" for k, v in m.recovery_s.items())
    lines.append(f"    R   recovery per failure    {rec} = {math.fsum(m.recovery_s.values()):.3f} s")
    fixed_pct = 100 * m.fixed_s / report.t_obs if report.t_obs else 0.0
    lines.append(f"    f   one-time costs          {m.fixed_s:.3f} s = {fixed_pct:.2f}% of T_obs;  "
                 f"s slowdown {100 * m.slowdown_fraction:.2f}%;  g degraded {100 * m.degraded_fraction:.2f}%")
    obs = _fmt(report.tor, "", 4)
    lines.append(f"    predicted TOR               {_fmt(m.predicted_tor, '', 4)}   (observed {obs})")
    if m.optimal_interval_s is not None:
        lines.append(f"    optimal interval (Young)    sqrt(2 C M) = {_fmt(m.optimal_interval_s)} = "
                     f"{m.optimal_interval_iterations} it -> predicted TOR {_fmt(m.predicted_tor_at_optimal, '', 4)}")
    else:
        lines.append("    optimal interval (Young)    n/a")
    if m.baseline_tor is not None:
        lines.append(f"    disk-checkpoint baseline    save {_fmt(m.baseline_save_s)}, load {_fmt(m.baseline_load_s)}"
                     f" ({m.baseline_source}) -> its optimal interval {_fmt(m.baseline_interval_s)}"
                     f" = {m.baseline_interval_iterations} it -> TOR {_fmt(m.baseline_tor, '', 4)}")
    else:
        lines.append("    disk-checkpoint baseline    n/a")
    for note in m.notes:
        lines.append(f"    note: {note}")
    if report.warnings:
        lines.append("")
        lines.extend(f"  warning: {w}" for w in report.warnings)
    return "\n".join(lines) + "\n"


_CLASS_OF_TIER = {"memory": "process", "parity": "node", "persistent": "beyond m", "none": "not recovered"}


def _by_class_lines(report: TorReport) -> list[str]:
    """The run's failures by the tier that recovered them: the classes ``shardsafe tor project`` uses."""
    if not report.by_class:
        return []
    head = "".join(f"{p:>14}" for p in RECOVERY_PARTS)
    lines = ["  per failure, by the tier that recovered it (mean seconds; `shardsafe tor project --from`):",
             f"    {'tier (class)':<26}{'failures':>9}{head}{'total':>10}"]
    order = ("memory", "parity", "persistent", "none")
    for tier in sorted(report.by_class, key=lambda t: order.index(t) if t in order else len(order)):
        d = report.by_class[tier]
        label = f"{tier} ({_CLASS_OF_TIER.get(tier, '?')})"
        vals = "".join(f"{d[p]:>14.3f}" for p in RECOVERY_PARTS)
        lines.append(f"    {label:<26}{d['failures']:>9d}{vals}{d['seconds']:>10.3f}")
    lines.append("")
    return lines
