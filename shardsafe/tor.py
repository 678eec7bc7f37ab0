"""Training Overhead Ratio (TOR) accounting: the run's event log, TOR, where the lost time went, and the TOR model.

TOR = T_opt / T_obs (Lu et al., arXiv 2408.07482): the time an ideal, failure-free, overhead-free system needs
for the work this job finally kept, over the wall time the job took. Every process of a run (launcher, trainers,
holders, benches) appends JSON lines to ``RUN_DIR/events.jsonl`` through :class:`EventLog`; :func:`compute_tor`
turns that log into a :class:`TorReport`: TOR, a breakdown of ``T_obs - T_opt`` by cause that sums exactly,
and the first-order TOR model (predicted TOR for the observed MTBF, Young's optimal snapshot interval, and
what a disk-checkpoint baseline would reach at its own optimal interval). docs/tor.md is the specification
of the event format and of every equation here; keep the two in step.

Writers never raise into training (a warning is logged once); readers tolerate a torn last line.
"""
from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import logging
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

logger = logging.getLogger(__name__)

__all__ = [
    "EVENTS_FILE", "EVENT_KINDS", "SOURCES", "TIERS", "CATEGORIES", "MAX_LINE_BYTES",
    "TorError", "EventLog", "read_events", "check_event",
    "TorOptions", "Failure", "Attempt", "Segment", "TorModel", "TorReport", "compute_tor",
    "young_interval", "predict_tor",
    "report_dict", "report_text", "plot_timeline", "RunningTor", "register_cli", "main",
]

EVENTS_FILE = "events.jsonl"
# One os.write per line, and lines below PIPE_BUF (4 KiB on Linux): appends from many processes never interleave.
MAX_LINE_BYTES = 4096
SOURCES = ("launcher", "trainer", "holder", "bench")
TIERS = ("memory", "parity", "persistent")

# Environment the launcher exports to its children; EventLog and RunningTor fill unset fields from it.
ENV_ATTEMPT = "SHARDSAFE_ATTEMPT"
ENV_NODE = "SHARDSAFE_NODE"
ENV_JOB_START = "SHARDSAFE_JOB_START_T"

# kind -> (usual source, fields the accounting reads). The format is specified in docs/tor.md.
EVENT_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "job_start": ("launcher", ()),
    "job_end": ("launcher", ("ok",)),
    "attempt_start": ("launcher", ("attempt",)),
    "attempt_end": ("launcher", ("attempt", "rc", "cause")),
    "failure_detected": ("launcher", ("cause",)),
    "restart": ("launcher", ("attempt",)),
    "prewarm_ready": ("launcher", ("seconds",)),
    # The fault injector's own record, written by the dying process just before the fault: fills in t_fault of
    # the failure_detected that follows it (the launcher cannot know when a fault really happened).
    "fault_injected": ("trainer", ("fault", "t_fault")),
    "trainer_start": ("trainer", ()),
    "restore_start": ("trainer", ()),
    "restore_end": ("trainer", ("tier", "version", "seconds", "bytes")),
    "train_ready": ("trainer", ("iteration",)),
    "iteration": ("trainer", ("iteration", "seconds")),
    "snapshot": ("trainer", ("version", "stall_s", "copy_s", "bytes")),
    "snapshot_skipped": ("trainer", ("version", "reason")),
    "running_tor": ("trainer", ("tor",)),
    "holder_start": ("holder", ()),
    "holder_stop": ("holder", ()),
    "flush": ("holder", ("version", "seconds", "bytes")),
    "baseline_checkpoint": ("bench", ("save_s", "load_s")),
}
_TRAINER_KINDS = frozenset(k for k, (src, _) in EVENT_KINDS.items() if src == "trainer") - {"fault_injected"}

# Breakdown of T_obs - T_opt, in report order. `shutdown` (after the last kept iteration) is not in the
# issue's list but is real, one-time wall time; without it `other` would not stay small.
CATEGORIES = (
    "startup", "detection", "restart", "restore_memory", "restore_parity", "restore_persistent",
    "lost_progress", "snapshot_stall", "slowdown", "shutdown", "other",
)
_RESTORE_CATS = ("restore_memory", "restore_parity", "restore_persistent")
_TIER_RANK = {"none": 0, "memory": 1, "parity": 2, "persistent": 3}
_RESERVED = ("t", "kind", "source")


class TorError(ValueError):
    """The event log cannot be turned into a TOR report; the message says what was expected and what to do."""


# ---------------------------------------------------------------------------------------------------------------
# Event log
# ---------------------------------------------------------------------------------------------------------------

def _env_int(*names: str) -> int | None:
    for name in names:
        v = os.environ.get(name, "").strip()
        if v.lstrip("-").isdigit():
            return int(v)
    return None


def _json_default(o: Any) -> Any:
    # numpy / torch scalars and paths show up in fields; never let a stray type cost the event.
    item = getattr(o, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=str)
    return str(o)


def _finite(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _dumps(rec: Mapping[str, Any]) -> bytes:
    try:
        s = json.dumps(rec, separators=(",", ":"), default=_json_default, allow_nan=False)
    except ValueError:  # NaN/inf: strict JSON readers (jq, browsers) reject them, so write null
        s = json.dumps(_finite(json.loads(json.dumps(rec, default=_json_default))), separators=(",", ":"))
    return s.encode("utf-8")


class EventLog:
    """Appends TOR events to ``run_dir/events.jsonl``, one JSON object per line.

    Args:
        run_dir: the run directory shared by every process of the job (created on the first event).
        source: role of the emitting process, one of :data:`SOURCES`.
        rank: global rank of a trainer. Default: ``$RANK`` for ``source="trainer"``, else None.
        node: node name. Default: ``$SHARDSAFE_NODE`` (exported by ``shardsafe launch``), else None.
        attempt: restart attempt. Default: ``$SHARDSAFE_ATTEMPT``, else ``$TORCHELASTIC_RESTART_COUNT``, else None.

    Many processes append concurrently: the file is opened with O_APPEND and each line (< 4 KiB; larger events
    drop their biggest fields and list them under ``truncated``) is written with one ``os.write``, so lines never
    interleave on a local or POSIX-append file system (not NFS). :meth:`emit` never raises: an I/O error is
    logged once and the event is dropped, because losing an accounting line must never cost training.
    """

    def __init__(self, run_dir: str | os.PathLike, *, source: str, rank: int | None = None,
                 node: str | int | None = None, attempt: int | None = None) -> None:
        if source not in SOURCES:
            raise ValueError(f"EventLog(source={source!r}): expected one of {', '.join(SOURCES)}; "
                             "pass the role of the emitting process")
        for name, v in (("rank", rank), ("attempt", attempt)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"EventLog({name}={v!r}): expected an int or None, got {type(v).__name__}")
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / EVENTS_FILE
        self.source = source
        self.rank = rank if rank is not None else (_env_int("RANK") if source == "trainer" else None)
        self.node = node if node is not None else (os.environ.get(ENV_NODE) or None)
        self.attempt = attempt if attempt is not None else _env_int(ENV_ATTEMPT, "TORCHELASTIC_RESTART_COUNT")
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"EventLog({str(self.run_dir)!r}, source={self.source!r}, rank={self.rank}, attempt={self.attempt})"

    def _prefix(self) -> str:
        return f"[tor {self.source} rank={self.rank} node={self.node} attempt={self.attempt}]"

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s %s", self._prefix(), msg)

    def emit(self, kind: str, *, at: float | None = None, **fields: Any) -> bool:
        """Append one event ``{t, kind, source, rank, node, attempt, **fields}``; ``fields`` may override
        ``rank``/``node``/``attempt`` (e.g. the failed rank of ``failure_detected``). ``at`` sets ``t`` to an
        earlier ``time.time()`` instead of now: a launcher that reports an incident after collecting evidence
        from several nodes dates it when the first evidence arrived. Returns whether it was written; never
        raises."""
        try:
            data = self._encode(kind, fields, at)
            self._write(data)
            return True
        except Exception as e:  # noqa: BLE001 - an accounting line must never take training down
            self._warn_once("io", f"cannot append to {self.path} ({type(e).__name__}: {e}); TOR events are "
                                  "dropped until it works again. Check that the run directory is writable.")
            return False

    def _encode(self, kind: str, fields: dict[str, Any], at: float | None = None) -> bytes:
        if kind not in EVENT_KINDS:
            self._warn_once(f"kind:{kind}", f"unknown event kind {kind!r}: expected one of "
                                            f"{', '.join(EVENT_KINDS)}; it is written but TOR accounting ignores it")
        t = time.time()
        if at is not None:
            if _is_num(at):
                t = float(at)
            else:
                self._warn_once("at", f"emit(at={at!r}) is not a time.time() float; the event is dated now")
        rec: dict[str, Any] = {"t": t, "kind": kind, "source": self.source,
                               "rank": self.rank, "node": self.node, "attempt": self.attempt}
        for k, v in fields.items():
            if k in _RESERVED:
                self._warn_once(f"reserved:{k}", f"field {k!r} of {kind!r} is reserved by the event format and "
                                                 "was dropped; use another name (t_fault for fault times)")
                continue
            rec[k] = v
        data = _dumps(rec)
        if len(data) + 1 > MAX_LINE_BYTES:
            data = self._shrink(rec, len(data))
        return data + b"\n"

    def _shrink(self, rec: dict[str, Any], size: int) -> bytes:
        # Drop the biggest optional fields first: the accounting needs the small numeric ones.
        core = {"t", "kind", "source", "rank", "node", "attempt"}
        extra = sorted((k for k in rec if k not in core), key=lambda k: len(_dumps({k: rec[k]})), reverse=True)
        dropped: list[str] = []
        small = dict(rec)
        for k in extra:
            del small[k]
            dropped.append(k)
            data = _dumps({**small, "truncated": dropped})
            if len(data) + 1 <= MAX_LINE_BYTES:
                break
        else:
            small = {k: rec[k] for k in ("t", "kind", "source")}
            data = _dumps({**small, "truncated": True})
        self._warn_once(f"big:{rec['kind']}", f"event {rec['kind']!r} was {size} bytes, over the {MAX_LINE_BYTES}-byte "
                                              f"line limit; dropped fields {dropped}. Keep event fields small.")
        return data

    def _write(self, data: bytes) -> None:
        if self._pid != os.getpid():  # forked child: the parent's lock may have been held at fork time
            self._lock = threading.Lock()
            self._pid = os.getpid()
        with self._lock:
            if self._fd is None:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                n = os.write(self._fd, data)
                if n != len(data):
                    # Terminate the torn line so the next event starts on its own line; readers skip the torn one.
                    os.write(self._fd, b"\n")
                    raise OSError(f"short write: {n} of {len(data)} bytes (disk full?)")
            except OSError:
                self._close_locked()  # reopen on the next event: the directory may come back
                raise

    def _close_locked(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _events_path(run_dir: str | os.PathLike) -> Path:
    p = Path(run_dir)
    return p if p.is_file() else p / EVENTS_FILE


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def read_events(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All events of ``run_dir/events.jsonl`` (or of the given file), in file order.

    A torn last line (a writer killed mid-write) is skipped silently; an unreadable line elsewhere is skipped
    with one warning that counts them. Lines without a numeric ``t`` and a string ``kind`` are not events.
    """
    path = _events_path(run_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"no TOR event log at {path}: expected {EVENTS_FILE} in the run directory that "
                                "`shardsafe launch --run-dir` (or EventLog) wrote; pass that directory") from None
    lines = data.split(b"\n")
    events: list[dict[str, Any]] = []
    bad = 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        torn_tail = i == len(lines) - 1  # no newline after it: its writer may have died mid-line
        try:
            ev = json.loads(line)
        except ValueError:
            bad += 0 if torn_tail else 1
            continue
        if isinstance(ev, dict) and _is_num(ev.get("t")) and isinstance(ev.get("kind"), str):
            events.append(ev)
        else:
            bad += 1
    if bad:
        logger.warning("[tor] %s: skipped %d unreadable line(s) (torn writes or foreign content)", path, bad)
    return events


def check_event(ev: Mapping[str, Any]) -> list[str]:
    """Problems with one event against the format of docs/tor.md (empty when it conforms). For emitters' tests."""
    problems = []
    kind = ev.get("kind")
    if not _is_num(ev.get("t")):
        problems.append(f"t={ev.get('t')!r}: expected a time.time() float")
    if kind not in EVENT_KINDS:
        return problems + [f"kind={kind!r}: expected one of {', '.join(EVENT_KINDS)}"]
    if ev.get("source") not in SOURCES:
        problems.append(f"source={ev.get('source')!r}: expected one of {', '.join(SOURCES)}")
    for f in EVENT_KINDS[kind][1]:
        if f not in ev:
            problems.append(f"{kind}: missing field {f!r}")
    if kind == "restore_end" and ev.get("tier") not in (*TIERS, "none"):
        problems.append(f"restore_end tier={ev.get('tier')!r}: expected one of {', '.join((*TIERS, 'none'))}")
    if kind == "failure_detected" and "t_fault" in ev and ev["t_fault"] is not None and not _is_num(ev["t_fault"]):
        problems.append(f"failure_detected t_fault={ev['t_fault']!r}: expected a time.time() float or null")
    return problems


# ---------------------------------------------------------------------------------------------------------------
# Report data
# ---------------------------------------------------------------------------------------------------------------

def _pos(name: str, v: float | None, *, zero_ok: bool = False) -> None:
    if v is None:
        return
    if not _is_num(v) or v < 0 or (v == 0 and not zero_ok):
        raise ValueError(f"{name}={v!r}: expected a finite number {'>= 0' if zero_ok else '> 0'} (seconds)")


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
            raise ValueError(f"snapshot_interval={si!r}: expected an int >= 1 (iterations between snapshots)")


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
    # For the plot only (not in report_dict): (t, iteration, kept) and (t, version, stall_s, kept).
    progress: list[tuple[float, int, bool]] = field(default_factory=list, repr=False)
    snapshot_marks: list[tuple[float, int, float, bool]] = field(default_factory=list, repr=False)


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


# ---------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------

def young_interval(snapshot_cost_s: float, mtbf_s: float) -> float:
    """Young (1974): the interval minimising expected lost time, tau* = sqrt(2 * C * MTBF), in seconds."""
    _pos("snapshot_cost_s", snapshot_cost_s, zero_ok=True)
    _pos("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * snapshot_cost_s * mtbf_s)


def predict_tor(*, interval_s: float, snapshot_cost_s: float, mtbf_s: float | None, recovery_s: float = 0.0,
                fixed_fraction: float = 0.0, slowdown_fraction: float = 0.0) -> float:
    """TOR = (1 - f - s - (R + tau/2) / M) * tau / (tau + C), clamped at 0 (docs/tor.md, equation (M)).

    Args:
        interval_s: tau, productive seconds between snapshots (interval iterations x ideal iteration time).
        snapshot_cost_s: C, training-loop stall per snapshot.
        mtbf_s: M, mean time between failures; None = no failures (the failure term vanishes).
        recovery_s: R, wall time per failure from the fault to training again (detection + restart + startup
            + restore); lost progress is the model's tau/2, not part of R.
        fixed_fraction: f, one-time costs (first startup, shutdown) over T_obs.
        slowdown_fraction: s, time lost to slow iterations over T_obs (fail-slow; measured, not modelled).
    """
    _pos("interval_s", interval_s)
    _pos("snapshot_cost_s", snapshot_cost_s, zero_ok=True)
    _pos("mtbf_s", mtbf_s)
    _pos("recovery_s", recovery_s, zero_ok=True)
    failure = 0.0 if mtbf_s is None else (recovery_s + interval_s / 2.0) / mtbf_s
    tor = (1.0 - fixed_fraction - slowdown_fraction - failure) * interval_s / (interval_s + snapshot_cost_s)
    return max(0.0, tor)


# ---------------------------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------------------------

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

    @property
    def start(self) -> float:
        return self.trainer_start if self.trainer_start is not None else self.first_t

    @property
    def failed(self) -> bool:
        return bool(self.failures)


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _int_field(ev: Mapping[str, Any], name: str) -> int | None:
    v = ev.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return int(v)


def _num_field(ev: Mapping[str, Any], name: str) -> float | None:
    v = ev.get(name)
    return float(v) if _is_num(v) else None


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
    up to more than the wall time the iterations took (here: 12 ms per 100 ms iteration with 4 ranks), which
    showed up as negative ``other`` and extra ``slowdown``. With one reporting rank the bound never binds
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
        if r.failed:
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
    evs = sorted((dict(e) for e in events if _is_num(e.get("t")) and isinstance(e.get("kind"), str)),
                 key=lambda e: e["t"])
    if not evs:
        raise TorError("no events: expected JSON lines with a numeric 't' and a 'kind' (docs/tor.md); "
                       "did the launcher and trainers get the run directory?")
    unknown = sorted({e["kind"] for e in evs} - set(EVENT_KINDS))
    if unknown:
        warnings.append(f"ignored unknown event kinds: {', '.join(unknown)}")

    # --- job span ---------------------------------------------------------------------------------------------
    starts = [e["t"] for e in evs if e["kind"] == "job_start"]
    ends = [e for e in evs if e["kind"] == "job_end"]
    t0 = min(starts) if starts else evs[0]["t"]
    t1 = max(e["t"] for e in ends) if ends else evs[-1]["t"]
    if not starts:
        warnings.append("no job_start event: T_obs starts at the first event")
    if not ends:
        warnings.append("no job_end event (job still running, or its launcher died): T_obs ends at the last event")
    ok = bool(ends[-1].get("ok")) if ends and "ok" in ends[-1] else None
    t_obs = max(0.0, t1 - t0)

    # --- attempts, failures, and which executions of an iteration the job finally kept ----------------------------
    failures = _collect_failures(evs, warnings)
    runs = _collect_runs(evs, failures)
    failures = _assign_failures(runs, failures, evs, warnings)
    if not runs:
        warnings.append("no trainer events: nothing was trained, so T_opt = 0")
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
    # An execution of iteration i in attempt a is kept unless a later attempt resumed at or before i.
    limits: list[float] = []
    nxt = math.inf
    for r in reversed(runs):
        limits.append(nxt)
        if r.resume is not None:
            nxt = min(nxt, r.resume)
    limits.reverse()

    # --- phases: a sweep over state changes, so each second gets exactly one label ----------------------------
    # (t, order at equal t, label, run index). At equal t the higher order wins: faults beat everything.
    trans: list[tuple[float, int, str, int | None]] = [(t0, 0, "startup", None)]
    train_end: dict[int, float] = {}
    for i, r in enumerate(runs):
        def add(t: float, order: int, label: str, i: int = i, r: _Run = r) -> None:
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
                add(te, 5, "shutdown")
        elif not r.failed:
            add(max(cursor, r.last_t), 5, "shutdown")
    for f in failures:
        # A fault sorts last at its instant (it beats another failure's detection at the same time); a fault
        # detected at the instant it happened has no detection phase, so its own restart must not be overridden.
        if f.t_fault is not None and f.t_fault < f.t_detect:
            trans.append((f.t_fault, 7, "detection", None))
        restarted = any(r.start > f.t_detect for r in runs)
        trans.append((f.t_detect, 6, "restart" if restarted else "shutdown", None))
    trans.sort(key=lambda x: (x[0], x[1]))

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

    # --- the ideal iteration time -------------------------------------------------------------------------------
    def kept(i: int, it: int) -> bool:
        return it < limits[i]

    if opts.ideal_iteration_s is not None:
        ideal, ideal_source = opts.ideal_iteration_s, "argument"
    else:
        clean = [s for r in runs if not r.failed for _, s in r.iters.values()]
        ideal = _median(clean)
        ideal_source = "median of iteration.seconds over attempts without failures"
        if ideal is None:
            ideal = _median([s for i, r in enumerate(runs) for it, (_, s) in r.iters.items() if kept(i, it)])
            ideal_source = "median of iteration.seconds over kept iterations (every attempt failed)"
            if ideal is not None:
                warnings.append("every attempt failed: the ideal iteration time is the median of all kept "
                                "iterations; pass --ideal-iteration-s for a firmer T_opt")
        if ideal is None:
            ideal_source = "none (no iterations)"
        elif ideal <= 0:
            warnings.append(f"median iteration time is {ideal} s; pass --ideal-iteration-s")
            ideal = None
            ideal_source = "none (non-positive iteration times)"

    # --- sum the labels; split each attempt's training time into kept work, stalls, lost work -----------------------
    acc = _Acc()
    lost_spans: list[tuple[float, float]] = []
    kept_numbers: set[int] = set()
    n_kept_exec = 0
    productive: list[float] = []
    used_iter: set[tuple[int, int]] = set()
    for seg in segments:
        if seg.label != "training":
            acc.add(seg.label, seg.t1 - seg.t0)
            continue
        i = next(j for j, r in enumerate(runs) if r.key == seg.attempt)
        r = runs[i]
        a, b = seg.t0, seg.t1
        execs = [(t, it, s) for it, (t, s) in r.iters.items() if a <= t <= b and (i, it) not in used_iter]
        used_iter.update((i, it) for _, it, _ in execs)
        keep = [x for x in execs if kept(i, x[1])]
        lose = [x for x in execs if not kept(i, x[1])]
        # A failed attempt keeps its work only up to its last kept iteration; everything after it is lost.
        t_last = max((t for t, _, _ in keep), default=a) if r.failed else b
        snaps = [(t, v, st) for v, (t, st, _) in r.snaps.items() if a <= t <= b]
        stall_kept_early = math.fsum(st for t, v, st in snaps if kept(i, v) and t <= t_last)
        stall_kept_late = math.fsum(st for t, v, st in snaps if kept(i, v) and t > t_last)
        lost_early = math.fsum(s for t, _, s in lose if t <= t_last) + \
            math.fsum(st for t, v, st in snaps if not kept(i, v) and t <= t_last)
        work = math.fsum(s for _, _, s in keep)
        productive.append(work)
        n_kept_exec += len(keep)
        kept_numbers.update(it for _, it, _ in keep)
        acc.add("snapshot_stall", stall_kept_early + stall_kept_late)
        acc.add("lost_progress", lost_early + (b - t_last) - stall_kept_late)
        acc.add("other", (t_last - a) - work - stall_kept_early - lost_early)
        if b > t_last:
            lost_spans.append((t_last, b))
    outside = sum(len(r.iters) for r in runs) - len(used_iter)
    if outside:
        warnings.append(f"{outside} iteration event(s) fell outside their attempt's training phase "
                        "(after its failure, or before train_ready) and were not counted")

    if kept_numbers:
        first_it = min([r.resume for r in runs if r.resume is not None][:1] + [min(kept_numbers)])
        last_it = max(kept_numbers)
        n_iter = last_it - first_it + 1
        if n_iter > len(kept_numbers):
            warnings.append(f"{n_iter - len(kept_numbers)} kept iteration(s) between {first_it} and {last_it} "
                            "have no iteration event; T_opt counts them, their time shows up in other")
    else:
        first_it = last_it = None
        n_iter = 0
    t_opt = n_iter * ideal if ideal is not None else 0.0
    if ideal is not None:
        acc.add("slowdown", math.fsum(productive) - n_kept_exec * ideal)
    else:
        acc.add("other", math.fsum(productive))

    breakdown = {c: acc.total(c) for c in CATEGORIES if c != "other"}
    # `other` is the exact remainder, so the breakdown sums to T_obs - T_opt; the accumulated gaps explain it.
    breakdown["other"] = (t_obs - t_opt) - math.fsum(breakdown.values())
    if t_obs > 0 and abs(breakdown["other"]) > 0.05 * t_obs:
        warnings.append(f"other is {breakdown['other']:.3f} s ({100 * breakdown['other'] / t_obs:.1f}% of T_obs): "
                        "time the events do not explain (gaps between iterations, missing events)")
    tor = t_opt / t_obs if t_obs > 0 else None
    if tor is not None and tor > 1.0:
        warnings.append(f"TOR {tor:.3f} > 1: iterations ran faster than the ideal iteration time; check it")

    # --- per-attempt summaries -----------------------------------------------------------------------------------
    attempts: list[Attempt] = []
    for i, r in enumerate(runs):
        its = sorted(r.iters)
        kept_its = [it for it in its if kept(i, it) and (i, it) in used_iter]
        marks = sorted((t, v, st, kept(i, v)) for v, (t, st, _) in r.snaps.items())
        attempts.append(Attempt(
            key=r.key, start=r.start, end=r.end if r.failed else max(r.last_t, train_end.get(i, r.last_t)),
            failed=r.failed, restore_tier=r.restore_tier, restore_version=r.restore_version,
            restore_seconds=r.restore_seconds, resume_iteration=r.resume,
            first_iteration=its[0] if its else None, last_iteration=its[-1] if its else None,
            kept_iterations=len(kept_its), lost_iterations=len(its) - len(kept_its), snapshots=len(r.snaps),
            snapshots_skipped=len(r.skipped),
            progress=sorted((r.iters[it][0], it, kept(i, it) and (i, it) in used_iter) for it in its),
            snapshot_marks=marks))

    model = _build_model(evs=evs, opts=opts, runs=runs, failures=failures, segments=segments, t_obs=t_obs,
                         ideal=ideal, slowdown=breakdown["slowdown"], limits=limits)
    return TorReport(
        tor=tor, t_obs=t_obs, t_opt=t_opt, t_start=t0, t_end=t1, ok=ok, iterations=n_iter,
        first_iteration=first_it, last_iteration=last_it, ideal_iteration_s=ideal, ideal_source=ideal_source,
        breakdown=breakdown, failures=failures, attempts=attempts, segments=segments, lost_spans=lost_spans,
        snapshots=sum(len(r.snaps) for r in runs), snapshots_skipped=sum(len(r.skipped) for r in runs),
        flushes=sum(1 for e in evs if e["kind"] == "flush"), model=model, warnings=warnings)


def _build_model(*, evs: list[dict[str, Any]], opts: TorOptions, runs: list[_Run], failures: list[Failure],
                 segments: list[Segment], t_obs: float, ideal: float | None, slowdown: float,
                 limits: list[float]) -> TorModel:
    notes: list[str] = []
    n = len(failures)
    if opts.mtbf_s is not None:
        mtbf, mtbf_source = opts.mtbf_s, "argument"
    elif n and t_obs > 0:
        mtbf, mtbf_source = t_obs / n, "observed"
    else:
        mtbf, mtbf_source = None, "none (no failures)"
        notes.append("no failures: the failure term is 0 and there is no optimal interval; pass --mtbf-s to size one")

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

    # One-time costs happen before the first fault (first startup, a restore from a previous job) or at the end;
    # every recovery cost after the first fault recurs per failure.
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
    recovery = {k: (v / n if n else 0.0) for k, v in recurring.items()}
    if not n:
        notes.append("no failures: per-failure recovery (detection, restart, startup, restore) unknown, taken as 0")
    rec_total = math.fsum(recovery.values())
    fixed_frac = fixed / t_obs if t_obs > 0 else 0.0
    slow_frac = slowdown / t_obs if t_obs > 0 else 0.0

    def model(tau: float, c: float, rec: float) -> float:
        return predict_tor(interval_s=tau, snapshot_cost_s=c, mtbf_s=mtbf, recovery_s=rec,
                           fixed_fraction=fixed_frac, slowdown_fraction=slow_frac)

    def to_iters(seconds: float) -> int | None:
        return max(1, int(math.floor(seconds / ideal + 0.5))) if ideal else None

    predicted = model(interval_s, cost, rec_total) if interval_s and cost is not None else None
    opt_s = opt_it = at_opt = None
    if mtbf is not None and cost is not None:
        opt_s = young_interval(cost, mtbf)
        opt_it = to_iters(opt_s)
        # A snapshot cannot be taken more often than once per iteration.
        tau_opt = max(opt_s, ideal or 0.0)
        at_opt = model(tau_opt, cost, rec_total) if tau_opt > 0 else None

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
    source = "+".join(sources) or None
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
        b_it = to_iters(b_s)
        b_tau = max(b_s, ideal or 0.0)
        b_tor = model(b_tau, save, b_rec) if b_tau > 0 else None
    return TorModel(
        mtbf_s=mtbf, mtbf_source=mtbf_source, n_failures=n, snapshot_interval_iterations=interval_it,
        snapshot_interval_s=interval_s, snapshot_cost_s=cost, snapshot_copy_s=copy, recovery_s=recovery,
        fixed_s=fixed, slowdown_fraction=slow_frac, predicted_tor=predicted, optimal_interval_s=opt_s,
        optimal_interval_iterations=opt_it, predicted_tor_at_optimal=at_opt, baseline_save_s=save,
        baseline_load_s=load, baseline_source=source, baseline_interval_s=b_s, baseline_interval_iterations=b_it,
        baseline_tor=b_tor, notes=notes)


# ---------------------------------------------------------------------------------------------------------------
# Output: JSON, text, plot
# ---------------------------------------------------------------------------------------------------------------

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
                  "fixed_s": _r(m.fixed_s), "slowdown_fraction": _r(m.slowdown_fraction), "notes": list(m.notes)},
        "snapshots": report.snapshots, "snapshots_skipped": report.snapshots_skipped, "flushes": report.flushes,
        "failures": [{"t_fault": rel(f.t_fault), "t_detect": rel(f.t_detect), "cause": f.cause, "rank": f.rank,
                      "node": f.node, "attempt": f.attempt, "synthesized": f.synthesized} for f in report.failures],
        "attempts": [{"attempt": a.key, "start": rel(a.start), "end": rel(a.end), "failed": a.failed,
                      "restore_tier": a.restore_tier, "restore_version": a.restore_version,
                      "restore_seconds": _r(a.restore_seconds), "resume_iteration": a.resume_iteration,
                      "first_iteration": a.first_iteration, "last_iteration": a.last_iteration,
                      "kept_iterations": a.kept_iterations, "lost_iterations": a.lost_iterations,
                      "snapshots": a.snapshots, "snapshots_skipped": a.snapshots_skipped} for a in report.attempts],
        "segments": [[rel(s.t0), rel(s.t1), s.label, s.attempt] for s in report.segments],
        "lost_spans": [[rel(a), rel(b)] for a, b in report.lost_spans],
        "warnings": list(report.warnings),
    }


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
    lines.append("  TOR model (docs/tor.md):  TOR = (1 - f - s - (R + tau/2)/M) * tau/(tau + C)")
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
                 f"s slowdown {100 * m.slowdown_fraction:.2f}%")
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
    for k, a in enumerate(report.attempts):
        color = "#ef9a9a" if a.failed else "#a5d6a7"
        ax.broken_barh([(rel(a.start), max(a.end - a.start, 1e-9))], (lanes["attempts"] - 0.35, 0.7),
                       facecolors=color, edgecolors="black", linewidth=0.6)
        tier = f"\n{a.restore_tier} v{a.restore_version}" if a.restore_tier not in (None, "none") else ""
        ax.text(rel((a.start + a.end) / 2), lanes["attempts"], f"attempt {a.key}{tier}", ha="center", va="center",
                fontsize=7, clip_on=True)
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
    fig.legend(handles=handles, loc="lower center", ncol=7, fontsize=7, frameon=False)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.93, bottom=0.16)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Running TOR in the trainer
# ---------------------------------------------------------------------------------------------------------------

def _scan_log_head(path: Path) -> tuple[float | None, int | None]:
    """job_start time (else the first event's) and the job's first iteration (first train_ready), reading only
    as far as needed: both sit near the top of the log."""
    t_start = first_t = first_it = None
    try:
        with open(path, "rb") as fh:
            for line in fh:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(ev, dict) or not _is_num(ev.get("t")):
                    continue
                first_t = ev["t"] if first_t is None else first_t
                if ev.get("kind") == "job_start" and t_start is None:
                    t_start = ev["t"]
                elif ev.get("kind") == "train_ready" and first_it is None:
                    first_it = _int_field(ev, "iteration")
                if t_start is not None and first_it is not None:
                    break
    except OSError:
        pass
    return (t_start if t_start is not None else first_t), first_it


class RunningTor:
    """Cumulative and windowed TOR while training, logged as ``running_tor`` every ``every`` iterations.

    Call :meth:`update` once per iteration (cheap: no I/O except when logging). TOR here is
    ``(iteration - first_iteration + 1) * ideal / (now - job_start)``; after a rollback the iteration number
    drops, so lost work is not counted. ``window_tor`` covers the iterations since the previous log line.

    Args:
        log: the trainer's EventLog (usually rank 0's).
        every: log every this many iterations.
        ideal_iteration_s: ideal seconds per iteration; default the median of the last 1000 ``seconds`` seen.
        job_start_t: default ``$SHARDSAFE_JOB_START_T``, else the log's job_start (else its first event),
            else this object's creation time (then TOR covers this attempt only).
        first_iteration: the job's first iteration; default the log's first train_ready, else the first update.
        clock: time source, for tests.
    """

    def __init__(self, log: EventLog, *, every: int = 100, ideal_iteration_s: float | None = None,
                 job_start_t: float | None = None, first_iteration: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"RunningTor(every={every!r}): expected an int >= 1 (iterations between log lines)")
        _pos("ideal_iteration_s", ideal_iteration_s)
        self.log, self.every, self.ideal, self.clock = log, every, ideal_iteration_s, clock
        if job_start_t is None:
            env = os.environ.get(ENV_JOB_START, "")
            try:
                job_start_t = float(env) if env else None
            except ValueError:
                job_start_t = None
        if job_start_t is None or first_iteration is None:
            t_log, it_log = _scan_log_head(log.path)
            job_start_t = job_start_t if job_start_t is not None else t_log
            first_iteration = first_iteration if first_iteration is not None else it_log
        self.job_start_t = job_start_t if job_start_t is not None else clock()
        self.first_iteration = first_iteration
        self._recent: list[float] = []
        self._last: tuple[float, int] | None = None
        self._n = 0

    def update(self, iteration: int, seconds: float) -> float | None:
        """Record one finished iteration; every ``every`` calls log ``running_tor`` and return the TOR."""
        try:
            if self.first_iteration is None:
                self.first_iteration = iteration
            if self._last is None:
                self._last = (self.clock() - seconds, iteration - 1)
            self._recent.append(float(seconds))
            if len(self._recent) > 2000:  # bounded memory; the median of the last 1000 is what matters
                del self._recent[:1000]
            self._n += 1
            if self._n % self.every:
                return None
            now = self.clock()
            ideal = self.ideal if self.ideal is not None else statistics.median(self._recent[-1000:])
            done = iteration - self.first_iteration + 1
            elapsed = now - self.job_start_t
            tor = done * ideal / elapsed if elapsed > 0 else None
            lt, lit = self._last
            window = (iteration - lit) * ideal / (now - lt) if now > lt else None
            self._last = (now, iteration)
            self.log.emit("running_tor", tor=tor, window_tor=window, iteration=iteration, ideal_iteration_s=ideal)
            return tor
        except Exception as e:  # noqa: BLE001 - never raise into training
            self.log._warn_once("running", f"running TOR failed ({type(e).__name__}: {e}); not logged")
            return None


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------

def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds, a number > 0") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds, a finite number >= 0")
    return v


def _iterations(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of iterations >= 1") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of iterations >= 1")
    return v


def _cmd_report(args: argparse.Namespace) -> int:
    try:
        events = read_events(args.run_dir)
        report = compute_tor(events, ideal_iteration_s=args.ideal_iteration_s, ckpt_save_s=args.ckpt_save_s,
                             ckpt_load_s=args.ckpt_load_s, mtbf_s=args.mtbf_s,
                             snapshot_interval=args.snapshot_interval)
    except (OSError, ValueError) as e:  # TorError is a ValueError
        print(f"shardsafe tor report: {e}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            out = plot_timeline(events, report, args.plot)
        except (OSError, ImportError) as e:
            print(f"shardsafe tor report: cannot write the plot {args.plot}: {e}", file=sys.stderr)
            return 2
        print(f"timeline written to {out}", file=sys.stderr)  # stderr: --json keeps stdout to one object
    if args.json:
        sys.stdout.write(json.dumps(report_dict(report), allow_nan=False) + "\n")
    else:
        sys.stdout.write(report_text(report))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``tor report RUN_DIR ...`` to a ``shardsafe`` subparsers object; dispatch via ``args.func(args)``."""
    p = subparsers.add_parser("tor", help="Training Overhead Ratio: report, breakdown, model, timeline plot",
                              description="Training Overhead Ratio accounting (docs/tor.md).")
    sub = p.add_subparsers(dest="tor_command", metavar="COMMAND", required=True)
    r = sub.add_parser("report", help="TOR of a run from RUN_DIR/events.jsonl",
                       description="Print TOR, where T_obs - T_opt went, and the TOR model for a run.")
    r.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding events.jsonl (or the file itself)")
    r.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    r.add_argument("--plot", metavar="FILE.png", help="also write a PNG timeline")
    r.add_argument("--ideal-iteration-s", type=_seconds, metavar="S",
                   help="ideal seconds per iteration (default: median over attempts without failures)")
    r.add_argument("--ckpt-save-s", type=_seconds, metavar="S",
                   help="disk checkpoint save time for the baseline (default: baseline_checkpoint events)")
    r.add_argument("--ckpt-load-s", type=_seconds, metavar="S",
                   help="disk checkpoint load time for the baseline (default: baseline_checkpoint events)")
    r.add_argument("--mtbf-s", type=_seconds, metavar="S", help="MTBF for the model (default: observed)")
    r.add_argument("--snapshot-interval", type=_iterations, metavar="N",
                   help="snapshot interval in iterations for the model (default: from snapshot versions)")
    r.set_defaults(func=_cmd_report)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shardsafe.tor report RUN_DIR ...`` (the same as ``shardsafe tor report``)."""
    parser = argparse.ArgumentParser(prog="python -m shardsafe.tor")
    sub = parser.add_subparsers(dest="command", required=True)
    register_cli(sub)
    args = parser.parse_args(["tor", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
