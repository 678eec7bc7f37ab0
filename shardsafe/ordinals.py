"""Ordinals of what every rank builds in the same order on the default process group (runtimes, parity exchanges,
protected engines): the ordinal names the same object on every rank, in the store's keys and the holder's scopes.

A new default group (a restart in place, shardsafe.inplace) numbers from 0 again, as a rank started afresh does:
the survivors and the restarted ranks then agree on every name.
"""
from __future__ import annotations

import itertools

__all__ = ["next_ordinal", "new_process_group"]

_COUNTERS: "dict[str, itertools.count]" = {}


def next_ordinal(kind: str) -> int:
    """The next ordinal of ``kind`` in this process since the default group was made (0, 1, ...)."""
    return next(_COUNTERS.setdefault(kind, itertools.count()))


def new_process_group() -> None:
    """The default process group was made again: every kind numbers from 0."""
    _COUNTERS.clear()
