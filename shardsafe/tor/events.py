"""The TOR event log: THE contract every process of a run writes and the accounting reads (docs/tor.md).

Every process of a run (launcher, trainers, holders, benches) appends JSON lines to ``RUN_DIR/events.jsonl``
through :class:`EventLog`; :func:`read_events` reads them back, :class:`JsonlTail` follows the file
incrementally (watchdogs, fault injectors), :class:`NullEventLog` stands in where no run directory was given,
and :func:`check_event` lists an event's deviations from the format, for emitters' tests.

This module imports nothing of the accounting, the report or the plot: the holder daemon and the trainers
import it at process start, so it must stay cheap (stdlib only). Writers never raise into training (a warning
is logged once); readers tolerate a torn last line.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from ._checks import _is_num
from .. import env
from .errors import TorError

# A child of "shardsafe.tor", like the package's other modules: a filter on the package's logger covers them all.
logger = logging.getLogger(__name__)

__all__ = [
    "EVENTS_FILE", "EVENT_KINDS", "SOURCES", "TIERS", "MAX_LINE_BYTES", "ENV_JOB_START",
    "EventLog", "NullEventLog", "JsonlTail", "read_events", "check_event",
]

EVENTS_FILE = "events.jsonl"
# One os.write per line, and lines below PIPE_BUF (4 KiB on Linux): appends from many processes never interleave.
MAX_LINE_BYTES = 4096
SOURCES = ("launcher", "trainer", "holder", "bench")
TIERS = ("memory", "parity", "persistent")

# Environment the launcher exports to its children; EventLog (env.NODE, env.ATTEMPT) and RunningTor (this one)
# fill unset fields from it.
ENV_JOB_START = env.JOB_START_T

# kind -> (usual source, fields the accounting reads). The format is specified in docs/tor.md.
EVENT_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "job_start": ("launcher", ()),
    "job_end": ("launcher", ("ok",)),
    "attempt_start": ("launcher", ("attempt",)),
    "attempt_end": ("launcher", ("attempt", "rc", "cause")),
    "failure_detected": ("launcher", ("cause",)),
    "restart": ("launcher", ("attempt",)),
    "prewarm_ready": ("launcher", ("seconds",)),
    # The job continues at another data-parallel size (docs/tor.md, "Continuing at a smaller data-parallel
    # size"): written by the launcher when it re-forms the job, before the attempt that runs at to_dp starts.
    # Attempts that start after it run at to_dp; a shrink follows a failure, a grow is a planned restart.
    "shrink": ("launcher", ("from_dp", "to_dp")),
    "grow": ("launcher", ("from_dp", "to_dp")),
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
    # The node's first rank found its holder gone (killed) and started a new, empty one: snapshots resume.
    "holder_restarted": ("trainer", ("node",)),
    # A holder SIGKILLed by the fault injector (kill-holder by the launcher, kill-flush by the holder itself):
    # no attempt ends with it, so it is not a fault_injected (that one dates the failure that follows).
    "holder_killed": ("launcher", ("node", "fault")),
    "running_tor": ("trainer", ("tor",)),
    "holder_start": ("holder", ()),
    "holder_stop": ("holder", ()),
    "flush": ("holder", ("version", "seconds", "bytes")),
    "baseline_checkpoint": ("bench", ("save_s", "load_s")),
}
_TRAINER_KINDS = frozenset(k for k, (src, _) in EVENT_KINDS.items() if src == "trainer") - {"fault_injected"}
_RESERVED = ("t", "kind", "source")


def _env_int(*names: str) -> int | None:
    for name in names:
        v = (env.get(name) if name in env.NAMES else os.environ.get(name, "")).strip()
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
            raise TorError(f"EventLog(source={source!r}): expected one of {', '.join(SOURCES)}; "
                             "pass the role of the emitting process")
        for name, v in (("rank", rank), ("attempt", attempt)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"EventLog({name}={v!r}): expected an int or None, got {type(v).__name__}")
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / EVENTS_FILE
        self.source = source
        self.rank = rank if rank is not None else (_env_int("RANK") if source == "trainer" else None)
        self.node = node if node is not None else (env.get(env.NODE) or None)
        self.attempt = attempt if attempt is not None else _env_int(env.ATTEMPT, "TORCHELASTIC_RESTART_COUNT")
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


def _int_field(ev: Mapping[str, Any], name: str) -> int | None:
    v = ev.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return int(v)


def _num_field(ev: Mapping[str, Any], name: str) -> float | None:
    v = ev.get(name)
    return float(v) if _is_num(v) else None


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
    if kind in ("shrink", "grow"):
        problems += _check_resize(kind, ev)
    if kind == "failure_detected" and "t_fault" in ev and ev["t_fault"] is not None and not _is_num(ev["t_fault"]):
        problems.append(f"failure_detected t_fault={ev['t_fault']!r}: expected a time.time() float or null")
    return problems


def _check_resize(kind: str, ev: Mapping[str, Any]) -> list[str]:
    """A shrink goes to a smaller data-parallel size, a grow to a larger one; both sizes are whole ranks."""
    sizes = [ev.get(f) for f in ("from_dp", "to_dp")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes):
        return [f"{kind} from_dp={sizes[0]!r} to_dp={sizes[1]!r}: expected data-parallel sizes, ints >= 1"]
    a, b = sizes
    if (kind == "shrink") != (b < a) or a == b:
        return [f"{kind} from_dp={a} to_dp={b}: expected to_dp {'<' if kind == 'shrink' else '>'} from_dp "
                f"(a {'grow' if kind == 'shrink' else 'shrink'} is the other event kind)"]
    return []


class NullEventLog:
    """An event log that writes nothing, for processes given no run directory (or whose log could not be opened).

    It has :class:`EventLog`'s surface (``emit`` with the same keywords, ``close``, context manager), so callers
    never branch on whether accounting is on. ``emit`` returns False: nothing was written.
    """

    path: Path | None = None
    run_dir: Path | None = None

    def emit(self, kind: str, *, at: float | None = None, **fields: Any) -> bool:
        return False

    def close(self) -> None:
        pass

    def __enter__(self) -> "NullEventLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def __repr__(self) -> str:
        return "NullEventLog()"


class JsonlTail:
    """Follows a JSON-lines file incrementally: each :meth:`poll` returns the events appended since the last one.

    Only whole lines are consumed (a line still being written is read on a later poll), so a writer's
    ``os.write`` of one line is seen whole or not at all. A missing file is "nothing yet" (the run directory
    may not exist until the first event). Lines that are not JSON objects with a numeric ``t`` and a string
    ``kind`` are skipped.

    Args:
        path: the run directory (its ``events.jsonl``) or the file itself.
        contains: a cheap byte prefilter: lines without this substring are not parsed (a watchdog that only
            needs ``iteration`` events passes ``b'"iteration"'``; parsing every line of a busy log costs).
    """

    def __init__(self, path: str | os.PathLike, *, contains: bytes | None = None) -> None:
        p = Path(path)
        self.path = p if p.suffix == ".jsonl" or p.is_file() else p / EVENTS_FILE
        self.pos = 0
        self.contains = contains

    def poll(self, filter: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
        """Events appended since the previous poll (whole lines only), in file order; ``filter`` keeps some."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.pos += end
        out: list[dict[str, Any]] = []
        for line in data[:end].splitlines():
            if self.contains is not None and self.contains not in line:
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and _is_num(ev.get("t")) and isinstance(ev.get("kind"), str):
                if filter is None or filter(ev):
                    out.append(ev)
        return out
