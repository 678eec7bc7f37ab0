"""How shardsafe's control-plane costs grow with the job's rank count, and the costs that growth gives at scale.

bench/control_plane_bench.py measures, at several rank counts N of one job, what a failure and a snapshot cost
(detection, re-rendezvous, trainer start, restore, the commit vote). ``shardsafe tor project --from-bench FILE``
fits each of them as a function of N and evaluates the fit at the projected job's rank count (one rank per GPU).
Two forms are fitted to every cost:

    power:  y = a * N**b          least squares of log y on log N; b is the growth exponent (0 flat, 1 linear)
    log:    y = a + b * log2(N)   least squares of y on log2 N; b is seconds per doubling (O(log N))

and the one with the smaller relative RMS error is used, unless one is asked for. With three or four rank counts
either form fits closely; the exponent and the slope are what to read. Measured on one host, the absolute values
are that host's (there, the hops of a collective are process switches): the fit says how a cost grows, and a
projection far beyond the measured N says what that growth alone would give.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ._checks import _is_num
from .errors import TorError

__all__ = ["FORMS", "BENCH_COSTS", "VOTE_SERIES", "RING_SERIES", "Fit", "fit", "fit_power", "fit_log", "load_bench",
           "is_bench_file", "BenchGrowth"]

FORMS = ("best", "power", "log")
POOR_FIT = 0.25   # relative RMS error beyond which a fit is flagged

# The bench's per-N series (top-level keys of its --json) -> (the Costs field it gives, what it is).
BENCH_COSTS: dict[str, tuple[str, str]] = {
    "detect_s": ("detect_s", "SIGKILL -> the launcher's failure_detected"),
    "rendezvous_s": ("restart_s", "failure_detected -> the new rendezvous round's attempt_start"),
    "startup_s": ("startup_s", "attempt_start -> the last rank's train_ready, restore excluded"),
    "restore_s": ("restore_memory_s", "the last rank's restore from its holder (votes, verify, apply)"),
}
# The commit vote, added to snapshot_stall_s (BenchGrowth.costs): the first of these the bench has. The last rank
# in waits for no other rank, so its vote_s is the collective alone; the median over every rank also holds each
# rank's wait for the slowest one to finish its own snapshot work, which on one host is the host's contention.
VOTE_SERIES: dict[str, str] = {
    "vote_tree_last_s": "commit vote per snapshot, hierarchical: the last rank in (the collective alone)",
    "vote_tree_s": "commit vote per snapshot, hierarchical: median over ranks (with the wait for the slowest)",
}
# Fitted and shown beside them, used for nothing: gloo's ring all-reduce, the bench's baseline for the hierarchy.
RING_SERIES: dict[str, str] = {
    "vote_ring_last_s": "commit vote per snapshot, gloo's ring (the old design): the last rank in",
    "vote_ring_s": "commit vote per snapshot, gloo's ring (the old design): median over ranks",
}


@dataclass(frozen=True)
class Fit:
    """One fitted growth law ``y(N)``; ``rel_rmse`` is its relative RMS error at the measured points."""

    form: str
    a: float
    b: float
    rel_rmse: float
    ns: tuple[int, ...]
    ys: tuple[float, ...]

    def __call__(self, n: float) -> float:
        if self.form == "power":
            return self.a * n ** self.b
        return max(0.0, self.a + self.b * math.log2(n))

    def describe(self) -> str:
        if self.form == "power":
            return f"{self.a:.4g} * N^{self.b:.3f}"
        a = 0.0 if abs(self.a) < 1e-9 * max(1.0, abs(self.b)) else self.a   # least squares' rounding noise
        return f"{a:.4g} {'+' if self.b >= 0 else '-'} {abs(self.b):.4g} * log2(N)"

    def as_dict(self) -> dict[str, Any]:
        return {"form": self.form, "a": self.a, "b": self.b, "rel_rmse": self.rel_rmse, "law": self.describe(),
                "ranks": list(self.ns), "measured": list(self.ys)}


def _check(ns: Sequence[float], ys: Sequence[float], what: str) -> None:
    if len(ns) != len(ys) or len(ns) < 2:
        raise TorError(f"{what}: expected one value per rank count and at least two rank counts; got ranks {list(ns)} "
                       f"and values {list(ys)}")
    if len(set(ns)) < 2 or any(not _is_num(n) or n < 1 for n in ns):
        raise TorError(f"{what}: expected at least two different rank counts >= 1; got {list(ns)}")
    if any(not _is_num(y) or y < 0 for y in ys):
        raise TorError(f"{what}: expected finite values >= 0 (seconds); got {list(ys)}")


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    mx, my = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    b = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def _rel_rmse(f: Fit) -> float:
    errs = [(f(n) - y) / y if y > 0 else (0.0 if f(n) == 0 else 1.0) for n, y in zip(f.ns, f.ys)]
    return math.sqrt(math.fsum(e * e for e in errs) / len(errs))


def fit_power(ns: Sequence[float], ys: Sequence[float], what: str = "fit") -> Fit:
    """``y = a * N**b`` by least squares in log-log space (every y > 0)."""
    _check(ns, ys, what)
    if any(y <= 0 for y in ys):
        raise TorError(f"{what}: a power law needs every value > 0; got {list(ys)} (use the log form)")
    la, b = _least_squares([math.log(n) for n in ns], [math.log(y) for y in ys])
    f = Fit("power", math.exp(la), b, 0.0, tuple(int(n) for n in ns), tuple(float(y) for y in ys))
    return Fit(f.form, f.a, f.b, _rel_rmse(f), f.ns, f.ys)


def fit_log(ns: Sequence[float], ys: Sequence[float], what: str = "fit") -> Fit:
    """``y = a + b * log2(N)`` by least squares."""
    _check(ns, ys, what)
    a, b = _least_squares([math.log2(n) for n in ns], list(ys))
    f = Fit("log", a, b, 0.0, tuple(int(n) for n in ns), tuple(float(y) for y in ys))
    return Fit(f.form, f.a, f.b, _rel_rmse(f), f.ns, f.ys)


def fit(ns: Sequence[float], ys: Sequence[float], form: str = "best", what: str = "fit") -> Fit:
    """The ``form`` fit ("power", "log"), or for "best" the one with the smaller relative RMS error (the log form
    where a value is 0, which a power law cannot pass through)."""
    if form not in FORMS:
        raise TorError(f"{what}: fit form {form!r}; expected one of {', '.join(FORMS)}")
    if form == "log" or (form == "best" and any(_is_num(y) and y <= 0 for y in ys)):
        return fit_log(ns, ys, what)
    if form == "power":
        return fit_power(ns, ys, what)
    p, lg = fit_power(ns, ys, what), fit_log(ns, ys, what)
    return p if p.rel_rmse <= lg.rel_rmse else lg


def load_bench(path: str | os.PathLike) -> dict[str, Any]:
    """The bench's JSON object: the file's last line that is a JSON object with ``ranks`` (the bench prints its
    table first and the object last, so its whole stdout may be saved), or the whole file as one object."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise TorError(f"--from-bench {path}: cannot read it ({e.strerror or e}); pass the file bench/"
                       "control_plane_bench.py --json wrote") from None
    candidates = [text] + [ln for ln in reversed(text.splitlines()) if ln.lstrip().startswith("{")]
    for c in candidates:
        try:
            d = json.loads(c)
        except ValueError:
            continue
        if isinstance(d, dict) and "ranks" in d:
            return d
    raise TorError(f"--from-bench {path}: no JSON object with 'ranks' in it; expected the last line of "
                   "bench/control_plane_bench.py --json")


def is_bench_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a bench JSON (a file whose object has ``ranks``), not a run directory or event log."""
    if not os.path.isfile(path) or os.path.basename(path) == "events.jsonl":
        return False
    try:
        load_bench(path)
        return True
    except TorError:
        return False


class BenchGrowth:
    """The fitted costs of one bench JSON.

    Args:
        data: the bench's JSON object (:func:`load_bench`).
        form: the fit form for every cost (:data:`FORMS`).
        source: where it came from, for the output.
    """

    def __init__(self, data: Mapping[str, Any], *, form: str = "best", source: str = "bench"):
        ranks = data.get("ranks")
        if not isinstance(ranks, list) or len(ranks) < 2:
            raise TorError(f"{source}: 'ranks' must list at least two rank counts; got {ranks!r} (run the bench at "
                           "two or more --ranks, e.g. 4,16,64)")
        self.source, self.form, self.ranks = source, form, [int(n) for n in ranks]
        self.fits: dict[str, Fit] = {}
        self.missing: list[str] = []
        for key in (*BENCH_COSTS, *VOTE_SERIES, *RING_SERIES):
            ys = data.get(key)
            pts = [(n, y) for n, y in zip(self.ranks, ys or []) if _is_num(y)] if isinstance(ys, list) else []
            if len({n for n, _ in pts}) < 2:
                self.missing.append(key)
                continue
            self.fits[key] = fit([n for n, _ in pts], [y for _, y in pts], form, f"{source}: {key}")
        if not set(self.fits) & {*BENCH_COSTS, *VOTE_SERIES}:
            raise TorError(f"{source}: none of {', '.join([*BENCH_COSTS, *VOTE_SERIES])} has values at two rank "
                           "counts; expected bench/control_plane_bench.py --json output")
        self.vote_key = next((k for k in VOTE_SERIES if k in self.fits), None)
        self.missing = [k for k in self.missing if not (k in VOTE_SERIES and self.vote_key)]
        self.machine = data.get("machine")

    def gives(self, key: str) -> str:
        """The Costs field series ``key`` gives ('' for none: the ring baseline, or a vote series not used)."""
        if key in BENCH_COSTS:
            return BENCH_COSTS[key][0]
        return "snapshot_stall_s" if key == self.vote_key else ""

    def costs(self, ranks: int, base_stall_s: float) -> dict[str, float]:
        """The Costs fields the bench measured, at ``ranks`` ranks. The commit vote runs beside training (the
        snapshot pipeline's worker); it is charged on top of ``base_stall_s`` as if it were on the training path,
        an upper bound: it delays training only when it outlasts the time to the next snapshot."""
        out = {field: self.fits[key](ranks) for key, (field, _) in BENCH_COSTS.items() if key in self.fits}
        if self.vote_key is not None:
            out["snapshot_stall_s"] = base_stall_s + self.fits[self.vote_key](ranks)
        return out

    def warnings(self, ranks: int) -> list[str]:
        """What to doubt in the fits taken at ``ranks``: a poor fit, and growth faster than linear carried far
        beyond the data (on one host, where N processes share its cores, contention alone grows that fast)."""
        out, hi = [], max(self.ranks)
        for key, f in self.fits.items():
            if f.rel_rmse > POOR_FIT:
                out.append(f"{key}: neither form fits well ({100 * f.rel_rmse:.0f}% error at the measured points); "
                           "measure more rank counts or pass the cost as a flag")
            if f.form == "power" and f.b > 1 and ranks > 2 * hi:
                out.append(f"{key} grows as N^{f.b:.2f} where it was measured: taken {ranks / hi:.0f}x beyond the "
                           f"largest N it gives {f(ranks):.3g} s; where the ranks shared one host's cores, the "
                           "contention for them grows that fast too (docs/tor.md, 'How the control plane's costs grow "
                           "with the job')")
        return out

    def as_dict(self, ranks: int, base_stall_s: float) -> dict[str, Any]:
        lo, hi = min(self.ranks), max(self.ranks)
        return {"source": self.source, "form": self.form, "ranks_measured": self.ranks, "at_ranks": ranks,
                "extrapolated": not lo <= ranks <= hi, "factor_beyond_measured": ranks / hi if ranks > hi else 1.0,
                "fits": {k: {**f.as_dict(), "at_ranks": f(ranks), "gives": self.gives(k),
                             "what": {**{c: w for c, (_, w) in BENCH_COSTS.items()}, **VOTE_SERIES, **RING_SERIES}[k]}
                         for k, f in self.fits.items()},
                "vote_series": self.vote_key,
                "missing": list(self.missing), "base_stall_s": base_stall_s, "machine": self.machine,
                "warnings": self.warnings(ranks),
                "measured_fields": sorted(self.costs(ranks, base_stall_s))}
