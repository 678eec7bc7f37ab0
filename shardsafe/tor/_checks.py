"""Small value checks shared by the event log, the accounting, the model and the projection."""
from __future__ import annotations

import math
from typing import Any

from .errors import TorError


def _is_num(x: Any) -> bool:
    """A finite int or float that is not a bool (JSON fields written by foreign emitters may be anything)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _pos(name: str, v: float | None, *, zero_ok: bool = False) -> None:
    if v is None:
        return
    if not _is_num(v) or v < 0 or (v == 0 and not zero_ok):
        raise TorError(f"{name}={v!r}: expected a finite number {'>= 0' if zero_ok else '> 0'} (seconds)")
