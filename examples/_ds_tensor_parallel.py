"""Megatron-style tensor parallelism for the tiny DeepSpeed GPT (examples/ds_pretrain_gpt.py ``--tp``).

What Megatron-DeepSpeed hands to ``deepspeed.initialize(mpu=...)``, in a few lines: an mpu object with the
tensor-, data- (and pipeline-) parallel groups (Megatron's rank order: tensor innermost), and the MLP of every
block split as Megatron splits it -- a column-parallel first linear layer, a row-parallel second one whose
partial outputs are all-reduced over the tensor-parallel group. The dropout between them runs under the
model-parallel RNG tracker (DeepSpeed's ``deepspeed.checkpointing``, what Megatron-DeepSpeed configures), so
each tensor-parallel rank draws its own mask, as Megatron's tensor-parallel regions do. With a pipeline the mpu
is DeepSpeed's ``PipelineParallelGrid`` over a pipe x data x model topology (``pipeline_grid``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class TensorParallelMpu:
    """Megatron's ``parallel_state`` interface as DeepSpeed reads it (the get_*_parallel_{rank,world_size,group}
    functions). Ranks are laid out tensor innermost, then data: ``rank = dp * tp_size + tp``."""

    def __init__(self, tp_size: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % tp_size:
            raise SystemExit(f"--tp {tp_size} does not divide the world size {world}")
        self.tp_size, self.dp_size = tp_size, world // tp_size
        self.tp_rank, self.dp_rank = rank % tp_size, rank // tp_size
        # Every rank creates every group, in the same order (new_group is collective).
        for d in range(self.dp_size):
            g = dist.new_group([d * tp_size + t for t in range(tp_size)])
            if d == self.dp_rank:
                self.tp_group = g
        for t in range(tp_size):
            g = dist.new_group([d * tp_size + t for d in range(self.dp_size)])
            if t == self.tp_rank:
                self.dp_group = g

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_tensor_model_parallel_group(self):
        return self.tp_group

    # DeepSpeed's name for the tensor-parallel group (engine, ZeRO's gradient-norm reduction)
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_group = get_tensor_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_group(self):
        return self.dp_group


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; the gradient is summed over the tensor-parallel group (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromRegion(torch.autograd.Function):
    """Partial outputs summed over the tensor-parallel group; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class ParallelMLP(nn.Module):
    """``Linear(d, 4d) -> GELU -> dropout -> Linear(4d, d)`` split over ``tp_size`` ranks: this rank keeps rows
    ``[r*4d/tp, (r+1)*4d/tp)`` of the first weight and bias and the same columns of the second weight. Built from
    the full layer so every layout starts from the same weights (Megatron's CPU initialisation)."""

    def __init__(self, full: nn.Sequential, tp_rank: int, tp_size: int, group, dropout: float):
        super().__init__()
        fc1, fc2 = full[0], full[2]
        n = fc1.out_features // tp_size
        lo, hi = tp_rank * n, (tp_rank + 1) * n
        self.w1 = nn.Parameter(fc1.weight.detach()[lo:hi].clone())
        self.b1 = nn.Parameter(fc1.bias.detach()[lo:hi].clone())
        self.w2 = nn.Parameter(fc2.weight.detach()[:, lo:hi].clone())
        self.b2 = nn.Parameter(fc2.bias.detach().clone())   # replicated: added once, after the reduction
        for p in (self.w1, self.b1, self.w2):
            p.tensor_model_parallel = True   # DeepSpeed counts these once per slice in the gradient norm
        self.group, self.p = group, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
        h = F.gelu(F.linear(_CopyToRegion.apply(x, self.group), self.w1, self.b1))
        with get_cuda_rng_tracker().fork():   # this slice's own dropout stream
            h = F.dropout(h, self.p, self.training)
        return _ReduceFromRegion.apply(F.linear(h, self.w2), self.group) + self.b2


def shard_mlps(model: nn.Module, mpu: TensorParallelMpu, dropout: float = 0.1) -> None:
    """Replace every block's MLP by its tensor-parallel slice, in place."""
    for blk in model.blocks:
        blk.mlp = ParallelMLP(blk.mlp, mpu.tp_rank, mpu.tp_size, mpu.tp_group, dropout)


def pipeline_grid(pp: int, tp: int):
    """DeepSpeed's own mpu for pipeline x tensor x data parallelism (what Megatron-DeepSpeed builds): a
    ``PipelineParallelGrid`` over ``PipeModelDataParallelTopology`` (pipe outermost, tensor innermost). Its
    slice group is the tensor-parallel group the blocks' MLPs reduce over."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

    class Grid(PipelineParallelGrid):
        # deepspeed.checkpointing.configure() asks for the tensor-parallel group by Megatron's name, which the
        # grid has under its own (the slice group) only.
        def get_tensor_model_parallel_group(self):
            return self.get_slice_parallel_group()

    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dist.get_world_size() // (pp * tp))
    return topo, Grid(topology=topo)


def seed_model_parallel_rng(mpu, seed: int) -> None:
    """What Megatron-DeepSpeed does at start: DeepSpeed's activation-checkpointing module configured with the
    mpu, and the tracker's model-parallel stream seeded per tensor-parallel rank."""
    import deepspeed
    deepspeed.checkpointing.configure(mpu)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(seed)
