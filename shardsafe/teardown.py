"""The shardsafe runtimes alive in this process, closed before torch.distributed's teardown.

A program that knows nothing of shardsafe (automatic activation) ends with ``torch.distributed.destroy_process_group()``
while the last snapshot's commit vote may still run on shardsafe's own gloo groups in the background: destroying a
group under a running collective aborts the process ("terminate called without an active exception"). So the
teardown first closes these runtimes (the vote finishes, the worker stops), and an exit without any teardown closes
them too. A restart in place (shardsafe.inplace) abandons them instead.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["guard", "forget", "live_runtimes"]

_LIVE: "set[Any]" = set()


def live_runtimes() -> "list[Any]":
    """The runtimes of this process not yet closed (shardsafe.runtime.Runtime)."""
    return list(_LIVE)


def forget(rt: Any) -> None:
    """``rt`` is closed or abandoned: the teardown no longer closes it."""
    _LIVE.discard(rt)


def guard(rt: Any) -> None:
    """Close ``rt`` (anything with ``close()`` and ``rank``) before the program tears torch.distributed down or
    exits, unless it is closed first."""
    import atexit
    import functools
    import torch.distributed as dist
    _LIVE.add(rt)
    if getattr(dist.destroy_process_group, "__shardsafe_guard__", False):
        return
    original = dist.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        group = args[0] if args else kwargs.get("group")
        if group is None:   # the whole of torch.distributed: shardsafe's groups go with it
            for live in list(_LIVE):
                try:
                    live.close()
                except Exception as e:  # noqa: BLE001 - the program's own teardown must go on
                    log.warning("[rank %d] closing shardsafe before destroy_process_group: %s", live.rank, e)
        return original(*args, **kwargs)

    destroy_process_group.__shardsafe_guard__ = True
    dist.destroy_process_group = destroy_process_group
    atexit.register(lambda: [live.close() for live in list(_LIVE)])
