"""The few collectives every layer uses: the min-vote and the all-gathers of ints and of JSON.

They run on shardsafe's own gloo groups (never the training communicator) and carry plain int64 tensors or
UTF-8 JSON bytes: no pickle, unlike torch's ``*_object`` collectives, whose receivers unpickle what peers
send. Every rank of ``group`` must make the same calls in the same order. With one rank (or no process
group) they return the local answer without touching torch.distributed.

``group`` is a :class:`shardsafe.hierarchy.Hierarchy` on every path of a running job (node-local groups, then
the node leaders: O(log nodes) rounds), or a torch process group (a ring: 2(N-1) steps), which tests and the
benches' ring baseline use.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Sequence

__all__ = ["min_reduce", "all_true", "gather_ints", "gather_json", "lazy_gloo_env", "mesh_advice"]

# gloo connects every pair of a group's ranks when the group is created (a full mesh: N - 1 connections and store
# lookups per rank, N^2 lookups on the job's one store, at every start and restart); with TORCH_GLOO_LAZY_INIT=1,
# which torch reads when it creates a gloo group, a pair connects on its first use, and the ring collectives below
# use two neighbours per rank, so a world-wide group's set-up grows with N instead of N^2 (bench/RESULTS.md,
# "Collectives and process groups").
LAZY_GLOO = "TORCH_GLOO_LAZY_INIT"
MESH_ADVICE_RANKS = 512   # from here on, a full mesh at every restart is worth a line in the log


def lazy_gloo_env(env: Mapping[str, str]) -> dict[str, str]:
    """What shardsafe's launchers add to their trainers' environment: lazy gloo connections unless ``env`` (the
    user's) says otherwise. It applies to every gloo group of the trainer (the program's own too: they connect on
    first use instead of at creation; what they compute is unchanged); torch versions without it ignore it."""
    return {LAZY_GLOO: env.get(LAZY_GLOO, "1")}


def mesh_advice(world_size: int, env: Mapping[str, str]) -> Optional[str]:
    """A warning for rank 0 when shardsafe's world-wide gloo group is about to connect as a full mesh at a size
    where that costs the restart (None: lazy, or small)."""
    if world_size < MESH_ADVICE_RANKS or env.get(LAZY_GLOO, "0").strip().lower() in ("1", "true", "yes", "on"):
        return None
    return (f"shardsafe's gloo group (votes and restore agreement) connects all {world_size} ranks pairwise at every "
            f"start and restart ({world_size - 1} connections per rank, about {world_size * world_size:,} lookups on "
            f"the job's store); export {LAZY_GLOO}=1 in the trainers' environment (shardsafe launch and the sbatch "
            "scripts do) so that pairs connect on first use")


def _hierarchical(group: Any) -> bool:
    return hasattr(group, "gather_bytes") and hasattr(group, "min_reduce")


def _size(group: Any, world_size: Optional[int]) -> int:
    if _hierarchical(group):
        return group.world
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
    if _hierarchical(group):
        return group.min_reduce(values)
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
    if _hierarchical(group):
        if hasattr(group, "gather_ints"):   # fixed-size messages (shardsafe.hierarchy.allgather_ints_algo)
            return group.gather_ints(values)
        import struct
        blobs = group.gather_bytes(struct.pack(f"<{len(values)}q", *[int(v) for v in values]))
        return [list(struct.unpack(f"<{len(b) // 8}q", b)) for b in blobs]
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
    if _hierarchical(group):
        return [json.loads(b) for b in group.gather_bytes(json.dumps(obj, separators=(",", ":")).encode())]
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
