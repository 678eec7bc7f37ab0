"""Running TOR in the trainer: cumulative and windowed TOR logged as ``running_tor`` events (docs/tor.md)."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable

from ._checks import _is_num, _pos
from .events import ENV_JOB_START, EventLog, _int_field
from .. import env as shardsafe_env
from .errors import TorError

__all__ = ["RunningTor"]


def _scan_log_head(path: Path | None) -> tuple[float | None, int | None]:
    """job_start time (else the first event's) and the job's first iteration (first train_ready), reading only
    as far as needed: both sit near the top of the log. None for a process without a log (NullEventLog)."""
    t_start = first_t = first_it = None
    if path is None:
        return None, None
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
            raise TorError(f"RunningTor(every={every!r}): expected an int >= 1 (iterations between log lines)")
        _pos("ideal_iteration_s", ideal_iteration_s)
        self.log, self.every, self.ideal, self.clock = log, every, ideal_iteration_s, clock
        if job_start_t is None:
            start = shardsafe_env.get(ENV_JOB_START)
            try:
                job_start_t = float(start) if start else None
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
