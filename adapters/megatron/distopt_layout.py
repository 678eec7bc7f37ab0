"""megatron-core's DistributedOptimizer partitioning at any data-parallel size (the rules shardsafe re-partitions by).

Where a rank's share lives (megatron-core 0.16/0.17, read from its source):

* ``_ParamAndGradBuffer.__init__`` (distributed/param_and_grad_buffer.py): per DDP model chunk and
  (param dtype, grad dtype) one flat buffer. Its parameters are laid out in *reverse* module order, each start
  padded to a multiple of 64 elements; a bucket closes once it holds ``bucket_size`` elements (none: one bucket),
  and before and after a parameter marked ``shared_embedding`` (its own bucket). Every bucket's end is padded to a
  multiple of lcm(D, 128) (lcm(D, 128, 2^16) with ``pad_buckets_for_high_nccl_busbw``), so the padding, and with it
  every later bucket's offset, depends on D; a parameter's offset *inside* its bucket does not (bucket offsets are
  multiples of 128).
* ``DistributedOptimizer._build_model_gbuf_range`` (optimizer/distrib_optimizer.py): each bucket is cut into D equal
  slices; rank r owns slice r, i.e. the elements of the parameters (and padding) lying in it.
* ``_build_optimizer_group_ranges`` / ``_build_model_and_main_param_groups``: the inner optimizer's group g on rank r
  holds the parameters of g that rank r owns a piece of, in buffer, bucket and offset order, fp32 model parameters
  first, then the 16-bit ones (whose fp32 main copies are the shards); each shard is one contiguous range of its
  parameter's flattened elements.

DDP picks ``bucket_size = max(40_000_000, 1_000_000 * D)`` when none is configured (with overlap_grad_reduce), so at
D > 40 the bucket boundaries move with D too: a recorded size equal to that default is taken as the default and
recomputed at D' (``bucket_size_at``). Everything is checked against the layout the snapshot itself recorded at D
(:func:`check_record`), so a megatron-core that cuts differently is refused, not misread.

:func:`record` reads the live layout for ``MegatronStateAdapter.capture`` (meta ``optimizers[i]["distopt"]``);
the rest is pure arithmetic on that record (tests/unit/test_megatron_reshard_layout.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from shardsafe.snapshot.reshard import ReshardError

PARAM_ALIGN = 64             # _pad_start_of_param_if_needed: 128-byte aligned starts of >= 16-bit values
BUCKET_ALIGN = 128           # _pad_end_of_bucket_if_needed: 256-byte aligned bucket starts
HIGH_BUSBW_ALIGN = 2 ** 16   # ... with pad_buckets_for_high_nccl_busbw
DEFAULT_BUCKET_MIN, DEFAULT_BUCKET_PER_RANK = 40_000_000, 1_000_000   # DistributedDataParallel.__init__
FP16_DTYPES = ("torch.float16", "torch.bfloat16")   # Megatron's 'torch.cuda.HalfTensor' / 'BFloat16Tensor'


class LayoutError(ReshardError):
    """A recorded DistributedOptimizer layout is not what megatron-core's rules give."""


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


@dataclass(frozen=True)
class Bucket:
    """One bucket of a buffer: [offset, offset + numel) padded, ``numel_unpadded`` before its end padding, and its
    parameters (indices into the buffer's parameter list) in offset order."""
    offset: int
    numel: int
    numel_unpadded: int
    params: tuple[int, ...]


@dataclass(frozen=True)
class BufferLayout:
    """One buffer at one data-parallel size: each parameter's start (by its index in the buffer's ``params`` list,
    i.e. module order) and the buckets."""
    world: int
    starts: tuple[int, ...]
    buckets: tuple[Bucket, ...]

    @property
    def numel(self) -> int:
        return self.buckets[-1].offset + self.buckets[-1].numel if self.buckets else 0


def default_bucket_size(world: int) -> int:
    return max(DEFAULT_BUCKET_MIN, DEFAULT_BUCKET_PER_RANK * world)


def bucket_size_at(recorded: Optional[int], world: int, new_world: int) -> Optional[int]:
    """The bucket size a DDP at ``new_world`` ranks has, given the one recorded at ``world``: unchanged, unless it
    is DDP's own default for ``world`` (then the default for ``new_world``)."""
    if recorded is not None and recorded == default_bucket_size(world):
        return default_bucket_size(new_world)
    return recorded


def buffer_layout(numels: Sequence[int], own_bucket: Sequence[bool], world: int, bucket_size: Optional[int],
                  high_busbw: bool = False) -> BufferLayout:
    """``_ParamAndGradBuffer``'s layout (use_distributed_optimizer=True) of parameters with ``numels`` (module
    order) at ``world`` data-parallel ranks; ``own_bucket[i]``: parameter i is a ``shared_embedding``."""
    divisor = math.lcm(world, BUCKET_ALIGN, HIGH_BUSBW_ALIGN) if high_busbw else math.lcm(world, BUCKET_ALIGN)
    starts = [0] * len(numels)
    buckets: list[Bucket] = []
    bucket_start = param_start = param_end = 0
    members: list[int] = []

    def close(end_unpadded: int) -> int:
        nonlocal bucket_start, members
        end = _pad(end_unpadded, divisor)
        buckets.append(Bucket(bucket_start, end - bucket_start, end_unpadded - bucket_start, tuple(members)))
        bucket_start, members = end, []
        return end

    for i in reversed(range(len(numels))):   # reverse module order: roughly the order backprop produces grads
        param_start = _pad(param_start, PARAM_ALIGN)
        if own_bucket[i] and members:
            param_start = close(param_start)
        param_end = param_start + int(numels[i])
        starts[i] = param_start
        members.append(i)
        if (bucket_size is not None and param_end - bucket_start >= bucket_size) or own_bucket[i]:
            param_start = close(param_end)
        else:
            param_start = param_end
    if members:
        close(param_end)
    return BufferLayout(world, tuple(starts), tuple(buckets))


def shard_pieces(layout: BufferLayout, numels: Sequence[int], rank: int) -> list[tuple[int, int, int]]:
    """(parameter index, first element, end element) of every parameter piece rank ``rank`` owns in this buffer,
    in Megatron's order (bucket, then offset): each bucket's slice ``rank`` of D equal slices."""
    out = []
    for b in layout.buckets:
        if b.numel % layout.world:
            raise LayoutError(f"a bucket of {b.numel} elements does not split into {layout.world} equal slices")
        size = b.numel // layout.world
        lo, hi = b.offset + rank * size, b.offset + (rank + 1) * size
        for i in b.params:
            s, e = layout.starts[i], layout.starts[i] + int(numels[i])
            if max(s, lo) < min(e, hi):
                out.append((i, max(s, lo) - s, min(e, hi) - s))
    return out


# ---- the record a snapshot carries, and the layout it implies at any size ----------------------------------

def record(leaf: Any, model_chunks: Sequence[Any], names: Mapping[int, str]) -> dict[str, Any]:
    """What re-partitioning needs of a live DistributedOptimizer: per buffer its dtypes, bucket size, padding
    option and parameters (adapter name, numel, own bucket) in module order, plus the layout this rank sees at D
    (starts, buckets) to check the rules against. JSON-able; the same on every data-parallel rank but ``dp_rank``."""
    ddp = getattr(leaf, "ddp_config", None)
    group = leaf.data_parallel_group
    out: dict[str, Any] = {"dp_size": int(group.size()), "dp_rank": int(group.rank()),
                           "instances": int(getattr(ddp, "num_distributed_optimizer_instances", 1) or 1),
                           "buffers": []}
    for buf in leaf.buffers:
        chunk = next((c for c in model_chunks if any(b is buf for b in getattr(c, "buffers", ()))), None)
        expert = chunk is None
        bucket_size = getattr(chunk, "bucket_size", None) if chunk is not None else None
        out["buffers"].append({
            "param_dtype": str(buf.param_dtype), "grad_dtype": str(buf.grad_dtype), "expert": expert,
            "bucket_size": None if bucket_size is None else int(bucket_size),
            "high_busbw": bool(getattr(ddp, "pad_buckets_for_high_nccl_busbw", False)),
            "params": [[names.get(id(p)), int(p.numel()), bool(getattr(p, "shared_embedding", False))]
                       for p in buf.params],
            "starts": [int(buf.param_index_map[p][0]) for p in buf.params],
            "buckets": [[int(b.offset), int(b.grad_data.numel()), int(b.numel_unpadded)] for b in buf.buckets]})
    return out


def layout_of(buf: Mapping[str, Any], world: int, new_world: Optional[int] = None) -> BufferLayout:
    """The recorded buffer's layout at ``new_world`` ranks (default: at the recorded ``world``)."""
    to = world if new_world is None else new_world
    params = buf["params"]
    return buffer_layout([p[1] for p in params], [bool(p[2]) for p in params], to,
                         bucket_size_at(buf.get("bucket_size"), world, to), bool(buf.get("high_busbw")))


def check_record(rec: Mapping[str, Any]) -> None:
    """The rules reproduce the recorded layout at its own size; raises LayoutError naming the first difference."""
    world = int(rec["dp_size"])
    for bi, buf in enumerate(rec["buffers"]):
        lay = layout_of(buf, world)
        got_buckets = [[b.offset, b.numel, b.numel_unpadded] for b in lay.buckets]
        if list(lay.starts) != list(buf["starts"]) or got_buckets != [list(b) for b in buf["buckets"]]:
            diff = next((f"parameter {buf['params'][i][0]} starts at {s} (recorded {r})"
                         for i, (s, r) in enumerate(zip(lay.starts, buf["starts"])) if s != r),
                        f"buckets {got_buckets[:4]} (recorded {buf['buckets'][:4]})")
            raise LayoutError(f"buffer {bi} ({buf['param_dtype']}): megatron-core's rules as shardsafe reads them give "
                              f"{diff} at data-parallel size {world}: this megatron-core lays out its buffers "
                              "differently (tested: 0.16.1, 0.17.1)")


def rank_order(rec: Mapping[str, Any], group_of: Mapping[str, int], n_groups: int, world: int,
               rank: int) -> list[list[tuple[str, int, int]]]:
    """The inner optimizer's parameters on ``rank`` at ``world`` ranks: per group, (name, first, end) of each shard
    in ``param_groups[g]["params"]`` order (fp32 model parameters first, then the 16-bit ones, each in buffer,
    bucket and offset order). ``group_of``: every parameter's group (the same at every size)."""
    fp32: list[list[tuple[str, int, int]]] = [[] for _ in range(n_groups)]
    fp16: list[list[tuple[str, int, int]]] = [[] for _ in range(n_groups)]
    src_world = int(rec["dp_size"])
    for buf in rec["buffers"]:
        lay = layout_of(buf, src_world, world)
        numels = [p[1] for p in buf["params"]]
        into = fp16 if buf["param_dtype"] in FP16_DTYPES else fp32
        for i, a, b in shard_pieces(lay, numels, rank):
            name = buf["params"][i][0]
            if name not in group_of:
                raise LayoutError(f"parameter {name} is in no optimizer group of any snapshot: the snapshots do not "
                                  "cover the whole data-parallel group")
            into[group_of[name]].append((name, a, b))
    return [a + b for a, b in zip(fp32, fp16)]
