"""Where ``shardsafe tor project`` gets its numbers: rate files, cost files (a bench JSON), and a run's own events.

Every reader returns plain values and says where they came from; :mod:`.cli` layers them (defaults, then a
profile or a file, then ``--from RUN_DIR``, then flags, each overriding the one before).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from ._checks import _is_num
from .classes import Costs, Rates
from .events import EVENTS_FILE, TIERS, read_events
from .records import TorReport
from .errors import TorError

__all__ = ["load_mapping", "rates_from_file", "costs_from_mapping", "costs_from_report", "resolve_run_dir",
           "measured_costs", "PART_FIELD"]

# A recovery part of the run report (RECOVERY_PARTS) -> the Costs field it measures.
PART_FIELD = {"detection": "detect_s", "restart": "restart_s", "startup": "startup_s"}
# Keys of bench/snapshot_bench.py's JSON -> (Costs field, factor to seconds). The bench measures one small
# model on one host: its numbers are the per-rank costs of that state size, not a cluster's.
_BENCH_KEYS = {"stall_ms_median": ("snapshot_stall_s", 1e-3), "restore_s": ("restore_memory_s", 1.0),
               "save_durable_s": ("disk_save_s", 1.0), "load_cold_s": ("disk_load_s", 1.0)}


def load_mapping(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """A JSON object (``.json``) or YAML mapping (``.yaml``/``.yml``, needs PyYAML) from ``path``."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TorError(f"{what} {p}: cannot read it ({e.strerror or e}); pass an existing JSON or YAML file") from None
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml  # optional: JSON needs nothing
        except ImportError:
            raise TorError(f"{what} {p}: reading YAML needs PyYAML (pip install pyyaml); or write the same "
                             "keys as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise TorError(f"{what} {p}: not valid YAML ({e})") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise TorError(f"{what} {p}: not valid JSON ({e}); YAML files need a .yaml suffix") from None
    if not isinstance(data, dict):
        raise TorError(f"{what} {p}: expected a mapping (a JSON object), got {type(data).__name__}")
    return data


def rates_from_file(path: str | os.PathLike) -> Rates:
    """Rates from ``{"process": r, "node": r, "rack": r, "slow": r}`` (per node-hour; or ``"per": "gpu-hour"``
    with ``"gpus_per_node"``), see :meth:`Rates.from_mapping`."""
    return Rates.from_mapping(load_mapping(path, "--rates"), source=f"file {path}")


def costs_from_mapping(data: Mapping[str, Any], source: str) -> dict[str, float]:
    """Cost overrides from a mapping: either :class:`Costs` field names in seconds (``detect_s``, ...), or the
    JSON of ``bench/snapshot_bench.py`` (``stall_ms_median``, ``restore_s``, ``save_durable_s``,
    ``load_cold_s``). Unknown keys are an error in the first form (a typo would silently keep a default)."""
    names = set(Costs.field_names())
    if names & set(data):
        unknown = sorted(set(data) - names - {"source"})
        if unknown:
            raise TorError(f"costs {source}: unknown key(s) {unknown}; expected Costs fields "
                             f"{', '.join(sorted(names))} (seconds; repair_h in hours, slowdown a fraction)")
        out = {k: data[k] for k in data if k in names}
    elif set(_BENCH_KEYS) & set(data):
        out = {f: data[k] * scale for k, (f, scale) in _BENCH_KEYS.items() if k in data and _is_num(data[k])}
    else:
        raise TorError(f"costs {source}: none of the expected keys; expected Costs fields ({', '.join(sorted(names))}) "
                         f"or a bench/snapshot_bench.py JSON ({', '.join(_BENCH_KEYS)})")
    for k, v in out.items():
        if not _is_num(v):
            raise TorError(f"costs {source}: {k}={v!r}; expected a finite number")
    return {k: float(v) for k, v in out.items()}


def resolve_run_dir(path: str | os.PathLike) -> Path:
    """The directory (or file) holding the run's events. ``shardsafe demo --run-dir D`` keeps two runs, D/reference
    (no failures, no shardsafe) and D/run (the protected one): given D, this is D/run."""
    p = Path(path)
    if p.is_file() or (p / EVENTS_FILE).is_file():
        return p
    if (p / "run" / EVENTS_FILE).is_file():
        return p / "run"
    return p  # read_events says what is missing


def costs_from_report(report: TorReport) -> dict[str, float]:
    """The costs a run measured, as :class:`Costs` fields: the per-failure detection, restart and startup
    (failure-weighted means over the recovered classes of ``report.by_class``), each tier's restore, the stall per
    snapshot, and the disk baseline's save and load when the run has them; when it shrank, the launcher's wait
    before shrinking (taken out of the restart) and the restore at a new size. Costs the run did not see (a tier
    no failure used) are absent: the caller keeps its defaults or flags for those."""
    out: dict[str, float] = {}
    rec = {t: d for t, d in report.by_class.items() if t in TIERS}
    n = sum(d["failures"] for d in rec.values())
    deg = report.degraded
    if n:
        for part, f in PART_FIELD.items():
            out[f] = math.fsum(d[part] * d["failures"] for d in rec.values()) / n
        # A shrink's restart held the launcher's wait for a spare, which the projection charges on its own.
        out["restart_s"] = max(0.0, out["restart_s"] - math.fsum(deg.shrink_waits_s) / n)
    for tier, d in rec.items():
        out[f"restore_{tier}_s"] = d["restore"]
    if deg.shrink_waits_s:
        # The run did shrink: a wait measured as 0 (events in the same instant) must not read as "never shrinks".
        out["shrink_after_s"] = max(1e-3, math.fsum(deg.shrink_waits_s) / len(deg.shrink_waits_s))
    if deg.resize_restore_s:
        out["reshard_restore_s"] = math.fsum(deg.resize_restore_s) / len(deg.resize_restore_s)
    m = report.model
    if m.snapshot_cost_s is not None:
        out["snapshot_stall_s"] = m.snapshot_cost_s
    if m.baseline_save_s is not None:
        out["disk_save_s"] = m.baseline_save_s
    if m.baseline_load_s is not None:
        out["disk_load_s"] = m.baseline_load_s
    return out


def measured_costs(run_dir: str | os.PathLike) -> tuple[dict[str, float], TorReport, Path]:
    """``costs_from_report`` of the run in ``run_dir`` (a demo's ``--run-dir`` too); also the report and the
    directory read."""
    from .accounting import compute_tor  # the accounting only when a run is read

    where = resolve_run_dir(run_dir)
    report = compute_tor(read_events(where))
    return costs_from_report(report), report, where
