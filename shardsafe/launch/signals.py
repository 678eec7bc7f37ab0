"""SIGTERM, SIGINT and SIGHUP as a flag both launchers poll, so that they stop their trainers and holders.

Holders live in their own session: no terminal or process-group signal reaches them, so a launcher that died
of the signal would leave them (and its trainers) running.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)


class SignalStop:
    """Turn SIGTERM, SIGINT and SIGHUP (``kill``, Ctrl-C, ``scancel`` of a local run, a closed terminal)
    into a flag the launcher's loop polls, so that it stops its trainers and holders itself instead of
    dying and leaving them running (holders live in their own session: no terminal or process-group
    signal reaches them). Handlers are installed only in the main thread and restored on exit.
    ``exit_code`` is the shell's convention, 128 + the signal."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: int | None = None
        self._prev: dict[int, Any] = {}

    def _on(self, signum: int, _frame: Any) -> None:
        if self.received is None:
            self.received = signum
            log.warning("received %s: stopping the trainers and holders of this job", signal.Signals(signum).name)

    def __enter__(self) -> "SignalStop":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._prev[sig] = signal.signal(sig, self._on)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, prev in self._prev.items():
            signal.signal(sig, prev)
        self._prev.clear()

    @property
    def exit_code(self) -> int | None:
        return None if self.received is None else 128 + self.received
