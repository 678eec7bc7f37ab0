"""The TOR timeline plot of one run (matplotlib, imported only when a plot is drawn)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from ._checks import _is_num
from .records import TorReport
from .errors import TorError

__all__ = ["plot_timeline", "plot_sweep"]

_COLORS = {
    "startup": "#9e9e9e", "restart": "#ff9800", "detection": "#e53935", "restore_memory": "#1e88e5",
    "restore_parity": "#8e24aa", "restore_persistent": "#6d4c41", "training": "#43a047", "shutdown": "#bdbdbd",
    "other": "#fdd835",
}


def plot_timeline(events: Iterable[Mapping[str, Any]], report: TorReport, path: str | os.PathLike) -> Path:
    """Write a PNG timeline: attempts, phases (restores by tier), snapshot stalls, holder flushes, failures, lost
    work (shaded), and iteration progress over wall time. Returns the path written."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("plot_timeline needs matplotlib: pip install 'shardsafe[plot]'") from e
    t0 = report.t_start
    rel = lambda t: t - t0  # noqa: E731
    fig = Figure(figsize=(13, 6.5), dpi=110)
    FigureCanvasAgg(fig)
    ax, axp = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1.3, 2.0], "hspace": 0.08})

    lanes = {"attempts": 3.0, "phases": 2.0, "snapshots": 1.0, "holders": 0.0}
    full = report.degraded.full_data_parallel
    for k, a in enumerate(report.attempts):
        reduced = full is not None and a.data_parallel is not None and a.data_parallel < full
        color = "#ef9a9a" if a.failed else ("#90caf9" if reduced else "#a5d6a7")
        ax.broken_barh([(rel(a.start), max(a.end - a.start, 1e-9))], (lanes["attempts"] - 0.35, 0.7),
                       facecolors=color, edgecolors="black", linewidth=0.6)
        tier = f"\n{a.restore_tier} v{a.restore_version}" if a.restore_tier not in (None, "none") else ""
        size = f" (D'={a.data_parallel})" if reduced else ""
        ax.text(rel((a.start + a.end) / 2), lanes["attempts"], f"attempt {a.key}{size}{tier}", ha="center",
                va="center", fontsize=7, clip_on=True)
    for s in report.segments:
        ax.broken_barh([(rel(s.t0), s.t1 - s.t0)], (lanes["phases"] - 0.35, 0.7),
                       facecolors=_COLORS.get(s.label, "#fdd835"), edgecolors="none")
    marks = [(rel(t), st, kept) for a in report.attempts for t, _, st, kept in a.snapshot_marks]
    top = 0.0
    if marks:
        top = max(st for _, st, _ in marks) or 1.0
        for x, st, kept in marks:
            h = 0.15 + 0.55 * (st / top)
            ax.vlines(x, lanes["snapshots"] - 0.35, lanes["snapshots"] - 0.35 + h,
                      colors="#1565c0" if kept else "#9e9e9e", linewidth=1.2)
    flushes = [rel(float(e["t"])) for e in events if e.get("kind") == "flush" and _is_num(e.get("t"))]
    if flushes:
        ax.plot(flushes, [lanes["holders"]] * len(flushes), "|", color="#6d4c41", markersize=8)
    ax.set_yticks(list(lanes.values()), ["attempts", "phases", f"snapshots\n(stall, max {top:.3g} s)",
                                         "holder\nflushes"], fontsize=8)
    ax.set_ylim(-0.6, 3.6)

    for a in report.attempts:
        pts = a.progress
        if not pts:
            continue
        kx = [rel(t) for t, _, k in pts if k]
        ky = [it for _, it, k in pts if k]
        lx = [rel(t) for t, _, k in pts if not k]
        ly = [it for _, it, k in pts if not k]
        axp.plot(kx, ky, ".", color="#2e7d32", markersize=5)
        axp.plot(lx, ly, "x", color="#c62828", markersize=5)
    for x0, x1 in report.lost_spans:
        for axis in (ax, axp):
            axis.axvspan(rel(x0), rel(x1), facecolor="#e53935", alpha=0.15, hatch="///", edgecolor="#e53935",
                         linewidth=0)
    for f in report.failures:
        for axis in (ax, axp):
            axis.axvline(rel(f.t_detect), color="#b71c1c", linewidth=1.2)
            if f.t_fault is not None:
                axis.axvline(rel(f.t_fault), color="#b71c1c", linewidth=1.0, linestyle="--")
        where = f" node {f.node}" if f.node is not None else (f" rank {f.rank}" if f.rank is not None else "")
        ax.text(rel(f.t_detect), 3.55, f"{f.cause}{where}", rotation=0, fontsize=7, color="#b71c1c", ha="left",
                va="top")
    axp.set_xlabel("seconds since job start")
    axp.set_ylabel("iteration")
    axp.grid(True, alpha=0.3)
    ax.set_xlim(0, max(report.t_obs, 1e-6))
    tor = "n/a" if report.tor is None else f"{report.tor:.3f}"
    ax.set_title(f"TOR {tor} = T_opt {report.t_opt:.1f} s / T_obs {report.t_obs:.1f} s;  "
                 f"{len(report.failures)} failure(s), {len(report.attempts)} attempt(s)", fontsize=10)
    handles = [Patch(facecolor=_COLORS[k], label=k.replace("_", " ")) for k in _COLORS if k != "other"]
    handles += [Patch(facecolor="#e53935", alpha=0.15, hatch="///", label="lost work"),
                Patch(facecolor="#2e7d32", label="kept iteration"), Patch(facecolor="#c62828", label="lost iteration"),
                Patch(facecolor="white", edgecolor="#b71c1c", label="fault (--) / detected (|)")]
    if report.degraded.periods:
        handles.append(Patch(facecolor="#90caf9", edgecolor="black", label="attempt at reduced data-parallel size"))
    fig.legend(handles=handles, loc="lower center", ncol=7, fontsize=7, frameon=False)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.93, bottom=0.16)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out



_STRATEGY_STYLE = {"shardsafe": ("#1e88e5", "o", "shardsafe (memory + parity)"),
                   "shardsafe_shrink": ("#00897b", "D", "shardsafe, shrink when no spare is idle"),
                   "memory_only": ("#fb8c00", "s", "memory-only snapshots (no parity)"),
                   "disk": ("#6d4c41", "^", "disk checkpoints")}


def plot_sweep(rows: list[Mapping[str, Any]], path: str | os.PathLike, *, title: str = "",
               simulated: Mapping[str, list[tuple[int, float, float]]] | None = None) -> Path:
    """Write a PNG of TOR versus GPUs (log scale) for each strategy of ``rows`` (``project.sweep``'s rows).

    Each strategy's solid line goes through the values the projection reports: (P), or the simulator's at
    points whose ``points[strategy]["tor_source"]`` is ``"simulated"``; those are drawn with their 95 % CI as
    error bars, and (P) is drawn dashed over the stretch where it was replaced. ``simulated[strategy]`` adds
    further (gpus, tor, ci95) error bars. Returns the path written."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plot_sweep needs matplotlib: pip install 'shardsafe[plot]'") from e
    if not rows:
        raise TorError("plot_sweep: no rows to plot; pass at least one scale")
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    gpus = [r["gpus"] for r in rows]
    any_sim = bool(simulated)
    for s, (color, marker, label) in _STRATEGY_STYLE.items():
        if s not in rows[0]:
            continue
        pts = [(r.get("points") or {}).get(s) or {"tor": r[s]} for r in rows]
        sim = [p.get("tor_source") == "simulated" for p in pts]
        closed = [p.get("tor_closed", p["tor"]) for p in pts]
        if any(sim):
            any_sim = True
            ax.plot(gpus, [p["tor"] for p in pts], color=color, label=f"{label}")
            # (P) dashed on every segment that touches a replaced point; solid (under the line above) elsewhere.
            for i in range(len(rows) - 1):
                if sim[i] or sim[i + 1]:
                    ax.plot(gpus[i:i + 2], closed[i:i + 2], color=color, linestyle="--", linewidth=1.0, alpha=0.8)
            xs = [g for g, f in zip(gpus, sim) if not f]
            ax.plot(xs, [p["tor"] for p, f in zip(pts, sim) if not f], color=color, marker=marker, linestyle="none")
            ax.plot([g for g, f in zip(gpus, sim) if f], [c for c, f in zip(closed, sim) if f], color=color,
                    marker=marker, linestyle="none", fillstyle="none", alpha=0.8)
            ax.errorbar([g for g, f in zip(gpus, sim) if f], [p["tor"] for p, f in zip(pts, sim) if f],
                        yerr=[p["ci95"] for p, f in zip(pts, sim) if f], color=color, fmt="x", capsize=3)
        else:
            ax.plot(gpus, [p["tor"] for p in pts], color=color, marker=marker, label=f"{label}, closed form")
        for g, tor, ci in (simulated or {}).get(s, []):
            ax.errorbar([g], [tor], yerr=[ci], color=color, fmt="x", capsize=3)
    if any_sim:
        ax.plot([], [], "kx", label="simulated (95 % CI): where (P) is off by > 0.01")
        ax.plot([], [], "k--", linewidth=1.0, label="closed form (P) where it was replaced")
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("TOR = T_opt / T_obs")
    ax.set_ylim(0, 1.0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title(title or "TOR versus scale, each strategy at its optimal interval", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
