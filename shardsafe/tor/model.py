"""The first-order TOR model of one run (docs/tor.md, "The TOR model"): equation (M) and Young's interval (Y).

The per-failure-class projection to a whole cluster builds on these in :mod:`.project`.
"""
from __future__ import annotations

import math

from ._checks import _pos
from .records import TorModel

__all__ = ["TorModel", "young_interval", "predict_tor"]


def young_interval(snapshot_cost_s: float, mtbf_s: float) -> float:
    """Young (1974): the interval minimising expected lost time, tau* = sqrt(2 * C * MTBF), in seconds."""
    _pos("snapshot_cost_s", snapshot_cost_s, zero_ok=True)
    _pos("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * snapshot_cost_s * mtbf_s)


def predict_tor(*, interval_s: float, snapshot_cost_s: float, mtbf_s: float | None, recovery_s: float = 0.0,
                fixed_fraction: float = 0.0, slowdown_fraction: float = 0.0,
                degraded_fraction: float = 0.0) -> float:
    """TOR = (1 - f - s - g - (R + tau/2) / M) * tau / (tau + C), clamped at 0 (docs/tor.md, equation (M)).

    Args:
        interval_s: tau, productive seconds between snapshots (interval iterations x ideal iteration time).
        snapshot_cost_s: C, training-loop stall per snapshot.
        mtbf_s: M, mean time between failures; None = no failures (the failure term vanishes).
        recovery_s: R, wall time per failure from the fault to training again (detection + restart + startup
            + restore); lost progress is the model's tau/2, not part of R.
        fixed_fraction: f, one-time costs (first startup, shutdown) over T_obs.
        slowdown_fraction: s, time lost to slow iterations over T_obs (fail-slow; measured, not modelled).
        degraded_fraction: g, throughput lost at a reduced data-parallel size over T_obs (measured, like s).
    """
    _pos("interval_s", interval_s)
    _pos("snapshot_cost_s", snapshot_cost_s, zero_ok=True)
    _pos("mtbf_s", mtbf_s)
    _pos("recovery_s", recovery_s, zero_ok=True)
    failure = 0.0 if mtbf_s is None else (recovery_s + interval_s / 2.0) / mtbf_s
    lost = fixed_fraction + slowdown_fraction + degraded_fraction + failure
    tor = (1.0 - lost) * interval_s / (interval_s + snapshot_cost_s)
    return max(0.0, tor)

