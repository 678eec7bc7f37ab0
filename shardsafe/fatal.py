"""Errors a restart cannot fix, recorded by the trainer that dies of them so launchers stop at once.

A ``ConfigError`` (a setting that cannot be honoured) or a ``RestoreError`` (snapshots exist but none
can be used) fails the same way on every attempt; restarting the job ``max_restarts`` times only hides
the message in a log. A trainer that dies of one leaves ``RUN_DIR/fatal/rank{R}.attempt{A}.json``
(JSON: type, message, rank, node, attempt, t); both launchers look for it when an attempt fails, do not
restart, and print the message (docs/operations.md "Holder lifecycle").

The trainer side is a ``sys.excepthook``, installed where protection starts (the adapters' entry points and the
runtime; importing shardsafe installs nothing): it records exactly the errors that *end the process* — a script that catches
a ``RestoreError`` and carries on deliberately is not stopped. Call :func:`record_fatal` yourself where an
error is handled otherwise (e.g. logged and followed by ``sys.exit``).

Plain files, no torch import: launchers and bash read them.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Optional

from . import env

FATAL_DIR = "fatal"

FATAL_TYPES = ("shardsafe.errors.ConfigError", "shardsafe.snapshot.restore.RestoreError", "shardsafe.jobid.JobConflict",
               "shardsafe.holder.paths.HolderSecurityError")
"""Qualified names of the error classes (or their bases) that no restart can fix (a holder directory of another
user stays one until someone removes it)."""


def is_fatal(exc: BaseException) -> bool:
    """Is ``exc`` (or a base class of it) one of :data:`FATAL_TYPES`? By name: no import of restore/torch."""
    return any(f"{c.__module__}.{c.__qualname__}" in FATAL_TYPES for c in type(exc).__mro__)


def _attempt() -> int:
    try:
        return env.attempt()
    except ValueError:   # not a number: the record says attempt 0 rather than fail to be written
        return 0


def record_fatal(exc: BaseException, run_dir: Optional[str] = None, rank: Optional[int] = None) -> Optional[str]:
    """Write the fatal-error marker for ``exc``; returns its path (None without a run directory).

    Never raises: it runs while the process is dying of another error."""
    run_dir = run_dir if run_dir is not None else env.get(env.RUN_DIR)
    if not run_dir:
        return None
    try:
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        attempt = _attempt()
        d = os.path.join(run_dir, FATAL_DIR)
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, f"rank{rank}.attempt{attempt}.json")
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"type": type(exc).__name__, "message": str(exc), "rank": rank, "attempt": attempt,
                       "node": env.get(env.NODE) or None, "t": time.time()}, f)
        os.replace(tmp, path)
        return path
    except Exception:  # noqa: BLE001 - the original error must still be reported
        return None


def read_fatal(run_dir: str, attempt: Optional[int] = None) -> list[dict[str, Any]]:
    """The fatal-error markers of ``run_dir`` (of one attempt if given), ordered by rank."""
    d = os.path.join(run_dir, FATAL_DIR)
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        if not n.endswith(".json"):
            continue
        try:
            with open(os.path.join(d, n)) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if attempt is None or rec.get("attempt") == attempt:
            out.append(rec)
    return sorted(out, key=lambda r: (r.get("attempt", 0), r.get("rank", 0)))


def describe(records: list[dict[str, Any]]) -> str:
    """One message for the launcher to print: the first rank's error, and which ranks had it."""
    first = records[0]
    ranks = sorted({r.get("rank") for r in records})
    return (f"{first.get('type')} on rank(s) {ranks} in attempt {first.get('attempt')}: {first.get('message')} "
            "-- not restarting: the same error would come back on every attempt; fix the cause and resubmit.")


def install_excepthook() -> None:
    """Record fatal errors that end the process, then hand over to the previous hook (idempotent)."""
    prev = sys.excepthook
    if getattr(prev, "_shardsafe_fatal", False):
        return

    def hook(tp, value, tb):
        if value is not None and is_fatal(value):
            record_fatal(value)
        prev(tp, value, tb)

    hook._shardsafe_fatal = True  # type: ignore[attr-defined]
    sys.excepthook = hook
