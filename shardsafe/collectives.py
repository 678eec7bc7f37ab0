"""The few collectives every layer uses: the min-vote and the all-gathers of ints and of JSON.

They run on shardsafe's own gloo groups (never the training communicator) and carry plain int64 tensors or
UTF-8 JSON bytes: no pickle, unlike torch's ``*_object`` collectives, whose receivers unpickle what peers
send. Every rank of ``group`` must make the same calls in the same order. With one rank (or no process
group) they return the local answer without touching torch.distributed.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Sequence

__all__ = ["min_reduce", "all_true", "gather_ints", "gather_json"]


def _size(group: Any, world_size: Optional[int]) -> int:
    if world_size is not None:
        return int(world_size)
    import torch.distributed as dist
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def min_reduce(values: Sequence[int], group: Any = None, world_size: Optional[int] = None) -> list[int]:
    """Element-wise minimum of every rank's ``values`` (one length on every rank).

    The vote of every layer is this one call: a flag that is 1 only where every rank says yes, next to
    ``v`` and ``-v`` to check that all voted on the same version (min of both equal to v), or ``-n`` for the
    largest n.
    """
    if _size(group, world_size) == 1:
        return [int(v) for v in values]
    import torch
    import torch.distributed as dist
    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(x) for x in t.tolist()]


def all_true(flag: bool, group: Any = None, world_size: Optional[int] = None) -> bool:
    """True iff ``flag`` is true on every rank."""
    return min_reduce([1 if flag else 0], group, world_size)[0] == 1


def gather_ints(values: Sequence[int], group: Any = None, world_size: Optional[int] = None) -> list[list[int]]:
    """Every rank's ``values`` (one length on every rank), in rank order."""
    n = _size(group, world_size)
    if n == 1:
        return [[int(v) for v in values]]
    import torch
    import torch.distributed as dist
    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    got = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(got, t, group=group)
    return [g.tolist() for g in got]


def gather_json(obj: Any, group: Any = None, world_size: Optional[int] = None) -> list[Any]:
    """Every rank's JSON-serialisable ``obj``, in rank order (lengths first, then one padded all-gather)."""
    n = _size(group, world_size)
    if n == 1:
        return [json.loads(json.dumps(obj))]
    import torch
    import torch.distributed as dist
    blob = json.dumps(obj, separators=(",", ":")).encode()
    lens = [int(x[0]) for x in gather_ints([len(blob)], group, n)]
    buf = torch.zeros(max(lens), dtype=torch.uint8)
    if blob:
        buf[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    outs = [torch.empty(max(lens), dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(outs, buf, group=group)
    return [json.loads(bytes(o[:ln].numpy())) for o, ln in zip(outs, lens)]
