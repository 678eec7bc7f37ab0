"""The TOR package's one error type, apart so that the event-log contract and the accounting share it."""
from __future__ import annotations

from ..errors import ShardsafeError


class TorError(ValueError, ShardsafeError):
    """The event log cannot be turned into a TOR report; the message says what was expected and what to do."""
