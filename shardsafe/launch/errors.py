"""The launch commands' error and exit codes.

:class:`LaunchError` is a launch that cannot start or was configured wrongly (a bad setting, a missing script,
an unreachable controller); the CLI prints its message, which says what to change, and exits 2 before anything
starts. The other exit codes are documented with :data:`EXIT_FATAL`.
"""
from __future__ import annotations

from ..errors import ShardsafeError


class LaunchError(RuntimeError, ShardsafeError):
    """The launch cannot start or was configured wrongly; the message says what to change."""


EXIT_FATAL = 3
"""`shardsafe launch` exit code when a worker died of an error no restart fixes (shardsafe.fatal); 2 is a
launcher usage error (LaunchError), 1 a job that failed after its restarts, 128+N a signal."""

