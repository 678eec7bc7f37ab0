"""What the TOR accounting produces: the report's records (options, failures, attempts, phases, model, report).

Plain data, no logic beyond checking options: :mod:`.accounting` fills them, :mod:`.report` and :mod:`.plot`
print and draw them. The breakdown categories are here because the report's contract is that
``breakdown`` (seconds by :data:`CATEGORIES`) sums exactly to ``t_obs - t_opt``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._checks import _pos
from .errors import TorError

__all__ = ["CATEGORIES", "RECOVERY_PARTS", "TorOptions", "Failure", "Segment", "Attempt", "DegradedPeriod",
           "Degraded", "TorModel", "TorReport"]

# Breakdown of T_obs - T_opt, in report order. `shutdown` (after the last kept iteration) is real, one-time wall
# time; without it `other` would not stay small. `degraded` is the
# throughput lost while the job ran at a reduced data-parallel size (after a shrink, until it grew back).
CATEGORIES = (
    "startup", "detection", "restart", "restore_memory", "restore_parity", "restore_persistent",
    "lost_progress", "snapshot_stall", "slowdown", "degraded", "shutdown", "other",
)
_RESTORE_CATS = ("restore_memory", "restore_parity", "restore_persistent")
# One failure's cost, as the per-class breakdown of the report and the projection count it.
RECOVERY_PARTS = ("detection", "restart", "startup", "restore", "lost_progress")


@dataclass(kw_only=True)
class TorOptions:
    """What the event log cannot say by itself. All optional; None means "derive it from the events"."""

    ideal_iteration_s: float | None = None
    """Ideal (failure-free, overhead-free) seconds per iteration. Default: median of ``iteration.seconds`` over
    the attempts that did not fail (over every kept iteration when all failed)."""
    ckpt_save_s: float | None = None
    """Blocking save time of a disk checkpoint of the same state, for ``baseline_tor``. Default: median
    ``save_s`` of ``baseline_checkpoint`` events."""
    ckpt_load_s: float | None = None
    """Load time of that disk checkpoint. Default: median ``load_s`` of ``baseline_checkpoint`` events."""
    mtbf_s: float | None = None
    """MTBF for the model, e.g. the production cluster's. Default: observed, T_obs / number of failures."""
    snapshot_interval: int | None = None
    """Snapshot interval in iterations for the model. Default: median gap between snapshot versions."""

    def __post_init__(self) -> None:
        _pos("ideal_iteration_s", self.ideal_iteration_s)
        _pos("ckpt_save_s", self.ckpt_save_s, zero_ok=True)
        _pos("ckpt_load_s", self.ckpt_load_s, zero_ok=True)
        _pos("mtbf_s", self.mtbf_s)
        si = self.snapshot_interval
        if si is not None and (isinstance(si, bool) or not isinstance(si, int) or si < 1):
            raise TorError(f"snapshot_interval={si!r}: expected an int >= 1 (iterations between snapshots)")


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One failure incident. Times are time.time() seconds."""

    t_detect: float
    t_fault: float | None
    cause: str
    rank: int | None = None
    node: Any = None
    attempt: Any = None
    synthesized: bool = False
    """True when no failure_detected event existed and the incident was inferred (attempt ended badly or a
    later attempt started)."""


@dataclass(frozen=True)
class Segment:
    """A stretch of wall time with one phase label (see docs/tor.md); ``training`` is split by sums."""

    t0: float
    t1: float
    label: str
    attempt: Any = None


@dataclass(kw_only=True)
class Attempt:
    """One trainer attempt (a start of the trainer processes), as the trainers' events show it."""

    key: Any
    start: float
    end: float
    failed: bool
    restore_tier: str | None = None
    restore_version: int | None = None
    restore_seconds: float | None = None
    resume_iteration: int | None = None
    first_iteration: int | None = None
    last_iteration: int | None = None
    kept_iterations: int = 0
    lost_iterations: int = 0
    snapshots: int = 0
    snapshots_skipped: int = 0
    data_parallel: int | None = None
    """The data-parallel size it ran at (from the launcher's shrink/grow events); None when the run never
    changed size."""
    # For the plot only (not in report_dict): (t, iteration, kept) and (t, version, stall_s, kept).
    progress: list[tuple[float, int, bool]] = field(default_factory=list, repr=False)
    snapshot_marks: list[tuple[float, int, float, bool]] = field(default_factory=list, repr=False)


@dataclass(kw_only=True)
class DegradedPeriod:
    """One attempt that trained at a reduced data-parallel size (docs/tor.md, "Continuing at a smaller
    data-parallel size"). Times are time.time() seconds."""

    attempt: Any
    data_parallel: int
    full_data_parallel: int
    t0: float
    t1: float
    wall_s: float
    """Seconds of its training phases (the wall time at the reduced size)."""
    kept_iterations: int
    iteration_s: float | None
    """Median seconds of an iteration at this size (every attempt at this size)."""
    lost_s: float
    """Its part of the breakdown's ``degraded``: kept iterations x (iteration_s - full-size iteration_s)."""

    @property
    def throughput_assumed(self) -> float:
        """D'/D: what the projection assumes (the same global batch spread over fewer ranks)."""
        return self.data_parallel / self.full_data_parallel


@dataclass(kw_only=True)
class Degraded:
    """The run's time at reduced data-parallel size; empty (no periods) when it never shrank."""

    full_data_parallel: int | None = None
    shrinks: int = 0
    grows: int = 0
    full_iteration_s: float | None = None
    """Median seconds of a full-size iteration, what a reduced-size iteration is compared with."""
    full_iteration_source: str = ""
    periods: list[DegradedPeriod] = field(default_factory=list)
    resize_restore_s: list[float] = field(default_factory=list)
    """Restore seconds of each attempt that started at a new size (the re-partition included)."""
    shrink_waits_s: list[float] = field(default_factory=list)
    """Per shrink, seconds from the failure's detection to the shrink: the launcher's wait for a spare (inside
    the breakdown's ``restart``)."""

    @property
    def wall_s(self) -> float:
        return sum(p.wall_s for p in self.periods)

    @property
    def lost_s(self) -> float:
        return sum(p.lost_s for p in self.periods)


@dataclass(kw_only=True)
class TorModel:
    """First-order TOR model (docs/tor.md, "The TOR model"); seconds unless named otherwise."""

    mtbf_s: float | None
    mtbf_source: str
    n_failures: int
    snapshot_interval_iterations: int | None
    snapshot_interval_s: float | None
    snapshot_cost_s: float | None
    snapshot_copy_s: float | None
    recovery_s: dict[str, float]
    fixed_s: float
    slowdown_fraction: float
    degraded_fraction: float
    predicted_tor: float | None
    optimal_interval_s: float | None
    optimal_interval_iterations: int | None
    predicted_tor_at_optimal: float | None
    baseline_save_s: float | None
    baseline_load_s: float | None
    baseline_source: str | None
    baseline_interval_s: float | None
    baseline_interval_iterations: int | None
    baseline_tor: float | None
    notes: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class TorReport:
    """TOR of one run. ``breakdown`` (seconds by :data:`CATEGORIES`) sums exactly to ``t_obs - t_opt``."""

    tor: float | None
    t_obs: float
    t_opt: float
    t_start: float
    t_end: float
    ok: bool | None
    iterations: int
    first_iteration: int | None
    last_iteration: int | None
    ideal_iteration_s: float | None
    ideal_source: str
    breakdown: dict[str, float]
    failures: list[Failure]
    attempts: list[Attempt]
    segments: list[Segment]
    lost_spans: list[tuple[float, float]]
    snapshots: int
    snapshots_skipped: int
    flushes: int
    model: TorModel
    warnings: list[str] = field(default_factory=list)
    degraded: Degraded = field(default_factory=Degraded)
    """Shrinks, grows and the attempts that ran at a reduced data-parallel size."""
    by_class: dict[str, dict[str, float]] = field(default_factory=dict)
    """The run's own failures by the tier that recovered them (memory = a process failure, parity = a node
    loss, persistent = beyond m, none = not recovered): ``failures`` and mean seconds per failure of each
    :data:`RECOVERY_PARTS`, and ``seconds`` (their sum). The classes of ``shardsafe tor project``."""

    @property
    def mtbf(self) -> float | None:
        return self.model.mtbf_s

    @property
    def predicted_tor(self) -> float | None:
        return self.model.predicted_tor

    @property
    def optimal_interval(self) -> float | None:
        """Young's optimal snapshot interval in seconds (``model.optimal_interval_iterations`` in iterations)."""
        return self.model.optimal_interval_s

    @property
    def baseline_tor(self) -> float | None:
        return self.model.baseline_tor

