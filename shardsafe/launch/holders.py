"""The launchers' side of the per-node holders: the checks before one starts, its environment, why one did
not start, and the kill of whichever holder serves a node now.

Both launchers start one holder per node outside the restarted worker group, so trainer failures never touch
it; each starts them its own way (:mod:`.local` one node at a time, raising RuntimeError; :mod:`.elastic` all
nodes at once, raising :class:`~.errors.LaunchError`), both with these helpers.
"""
from __future__ import annotations

import os
import signal
import socket

from .. import env as names
from ..holder.paths import HolderPaths


def budget_problem(budget_gb: float) -> str | None:
    """What is wrong with a per-holder memory budget given to a launcher (None: usable). Checked before any
    holder starts, so the message names the setting instead of "holder did not start"."""
    try:
        gb = float(budget_gb)
    except (TypeError, ValueError):
        return f"--memory-budget-gb must be a number of GiB, got {budget_gb!r}"
    if not gb >= 0 or gb == float("inf"):
        return (f"--memory-budget-gb must be >= 0 GiB per holder (0 = half the node's RAM), got {budget_gb!r}; "
                "size it with docs/operations.md \"Memory sizing\"")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    if gb > ram:
        return (f"--memory-budget-gb {gb:g} GiB is more than this node's RAM ({ram:.1f} GiB); a holder can never "
                "use it. Give at most the RAM the snapshots may take (0 = half of it)")
    return None


def holder_failure(node: str, rc: int | None, log_path: str, lines: int = 6) -> str:
    """A holder that did not start: its exit code and the last lines of its log (the reason)."""
    try:
        with open(log_path, errors="replace") as f:
            tail = [ln.rstrip() for ln in f.readlines()[-lines:] if ln.strip()]
    except OSError:
        tail = []
    said = ("; it said:\n    " + "\n    ".join(tail)) if tail else " and logged nothing"
    return f"the holder for {node} did not start (exit {rc}){said}\n(full log: {log_path})"


def holder_running(paths: HolderPaths) -> bool:
    """Does a live holder serve ``paths`` (its socket accepts a connection)? A launcher about to start the
    holders of a job must not find one: that would be another running job with the same id."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(paths.socket)
            return True
        except OSError:
            return False


def kill_serving_holder(paths: HolderPaths) -> None:
    """SIGKILL the holder that serves ``paths`` now, whoever started it (a simulated node loss or holder kill).
    After an earlier holder kill the node's first rank starts the new holder itself, so the launcher's own
    process handle is not the live one; the live one says its pid in the hello."""
    from ..holder.client import HolderClient, HolderUnavailable
    try:
        c = HolderClient(paths, timeout_s=2.0).connect()
    except (HolderUnavailable, OSError):
        return
    pid = c.holder_pid
    c.close()
    if pid > 0 and pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def holder_budget_env(budget_gb: float) -> dict[str, str]:
    """Tells trainers the budget their launcher started the holders with (shardsafe.config checks a
    memory_budget_gb in the job's config against it)."""
    return {names.HOLDER_BUDGET_GB: repr(float(budget_gb))}


def holder_env(inject: str) -> dict[str, str]:
    """A launcher-started holder's environment: the launcher's, plus the fault spec (kill-flush is done by
    the holder itself)."""
    env = dict(os.environ)
    env.pop(names.INJECT, None)
    if inject:
        env[names.INJECT] = inject
    return env
