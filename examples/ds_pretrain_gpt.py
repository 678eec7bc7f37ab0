"""A tiny GPT pretrained with DeepSpeed on CPU (gloo), deterministic; used by the demo, tests and benches.

    torchrun --nproc-per-node 2 examples/ds_pretrain_gpt.py --steps 50 --zero-stage 2 --dtype bf16
    torchrun --nproc-per-node 4 examples/ds_pretrain_gpt.py --pp 2 --zero-stage 1   (PipelineModule, train_batch)
    shardsafe launch --nnodes 2 --nproc-per-node 2 examples/ds_pretrain_gpt.py --steps 50
    shardsafe launch --nnodes 3 --restart in-place examples/ds_pretrain_gpt.py --in-place   (shardsafe.inplace.run)
    (also plain `srun` tasks or `mpirun` with mpi4py: shardsafe.launch.discovery fills in RANK, WORLD_SIZE, ...)

Every sample is a pure function of (seed, its global position): step k consumes positions [k B, (k+1) B) of the
global batch B, micro-batch j of data-parallel rank r the slice at (j D + r) x micro-batch. So the stream continues
exactly from the engine's restored step, and a step reads the same samples at any data-parallel size D that keeps
B (``shardsafe launch`` re-forming the job on fewer nodes, SHARDSAFE_FULL_WORLD_SIZE). Per optimizer step each
rank appends ``{"step", "loss" (float.hex), "attempt"}`` to RUN_DIR/losses_rank{R}.jsonl; at the end it writes its
final rank state (payload + JSON manifest) for bit-exact comparison.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = (self.drop(att.softmax(-1)) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class MoEMLP(nn.Module):
    """A block's MLP as DeepSpeed MoE experts (``deepspeed.moe.layer.MoE``, top-1 gating, expert parallel over
    ``ep_size`` ranks); its load-balancing loss is kept for the model's loss."""

    def __init__(self, mlp: nn.Module, d: int, experts: int, ep_size: int):
        super().__init__()
        from deepspeed.moe.layer import MoE
        self.moe = MoE(hidden_size=d, expert=mlp, num_experts=experts, ep_size=ep_size, k=1)
        self.aux = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.aux, _ = self.moe(x)
        return out


class TinyLlama(nn.Module):
    """A tiny ``transformers`` LlamaForCausalLM behind the example's ``(idx, targets) -> loss`` interface: the model
    DeepSpeed's AutoTP training knows how to shard (``--autotp``; its q/k/v/gate/up projections column-wise,
    o/down row-wise)."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int, dropout: float = 0.1):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
                          attention_dropout=dropout)
        self.lm = LlamaForCausalLM(cfg)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=idx).logits.float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int, dropout: float = 0.1):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.drop = nn.Dropout(dropout)
        # Module state outside the optimizer (like BatchNorm's running stats): a restore must bring it back.
        self.register_buffer("loss_ema", torch.zeros(()))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x)).float()
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        aux = [blk.mlp.aux for blk in self.blocks if isinstance(blk.mlp, MoEMLP)]
        if aux:
            loss = loss + 0.01 * sum(a.float() for a in aux)
        with torch.no_grad():
            self.loss_ema.mul_(0.9).add_(0.1 * loss.detach().to(self.loss_ema.dtype))
        return loss


class TokEmbed(nn.Embedding):
    """Token embedding at GPT-2's init scale (std 0.02): as the tied head its weight sets the logits' scale."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class PosEmbed(nn.Module):
    """Pipeline stage 0 after the (tied) token embedding: positions, then dropout."""

    def __init__(self, seq: int, d: int, dropout: float):
        super().__init__()
        self.pos, self.drop = nn.Embedding(seq, d), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x + self.pos(torch.arange(x.shape[1], device=x.device)))


def _tied_head(embedding: TokEmbed, x: torch.Tensor) -> torch.Tensor:
    """The last stage's copy of the token embedding, used as the output head (Megatron-DeepSpeed's
    ``EmbeddingPipe`` tied across the first and last stage)."""
    return F.linear(x, embedding.weight).float()


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class TPBlock(Block):
    """A block whose MLP is this rank's tensor-parallel slice (pipeline x tensor parallel)."""

    def __init__(self, d: int, heads: int, dropout: float, tp_rank: int, tp_size: int, group):
        super().__init__(d, heads, dropout)
        from _ds_tensor_parallel import ParallelMLP
        self.mlp = ParallelMLP(self.mlp, tp_rank, tp_size, group, dropout)


def pipeline_model(a: argparse.Namespace, grid=None, topology=None):
    """The same GPT as a DeepSpeed ``PipelineModule``: the token embedding is a ``TiedLayerSpec`` on the
    first stage and, as the head, on the last (its gradients are all-reduced between the two stages). With a
    ``grid`` (``--tp``), every block's MLP is split over the grid's tensor-parallel (slice) group."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    if grid is None:
        blocks = [LayerSpec(Block, a.d_model, a.heads, 0.1) for _ in range(a.layers)]
    else:
        tp = (grid.get_slice_parallel_rank(), grid.get_slice_parallel_world_size(), grid.get_slice_parallel_group())
        blocks = [LayerSpec(TPBlock, a.d_model, a.heads, 0.1, *tp) for _ in range(a.layers)]
    layers = [TiedLayerSpec("embed", TokEmbed, a.vocab, a.d_model), LayerSpec(PosEmbed, a.seq, a.d_model, 0.1),
              *blocks, LayerSpec(nn.LayerNorm, a.d_model),
              TiedLayerSpec("embed", TokEmbed, a.vocab, a.d_model, forward_fn=_tied_head)]
    kw = {"topology": topology} if topology is not None else {"num_stages": a.pp}
    return PipelineModule(layers=layers, loss_fn=_lm_loss, partition_method=a.partition_method, **kw)


def batch(seed: int, micro_index: int, dp_rank: int, mb: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch as a function of (seed, micro-batch index, rank): the benches' and ds_plain_gpt.py's data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + micro_index * 4099 + dp_rank)
    tokens = torch.randint(vocab, (mb, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def samples(seed: int, first: int, mb: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``first .. first + mb - 1`` of the global stream, each drawn from its own seed: which rank or
    micro-batch reads a sample does not change it."""
    g = torch.Generator()
    tokens = torch.stack([torch.randint(vocab, (seq + 1,), generator=g.manual_seed(seed * 1_000_003 + first + i))
                          for i in range(mb)])
    return tokens[:, :-1], tokens[:, 1:]


def micro_batch(a: argparse.Namespace, engine, step: int, j: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``j`` of optimizer step ``step`` (0-based) on data-parallel rank ``dp_rank``: global positions,
    so a re-formed job at another data-parallel size (another accumulation, same global batch) reads the same
    samples per step."""
    gas, dp = engine.gradient_accumulation_steps(), engine.dp_world_size
    return samples(a.seed, (step * gas * dp + j * dp + dp_rank) * a.micro_batch, a.micro_batch, a.seq, a.vocab)


def full_world_size(world: int) -> int:
    """The world size the job was configured for: a job the launcher re-formed on fewer nodes runs ``world`` of
    SHARDSAFE_FULL_WORLD_SIZE ranks and keeps the full job's global batch (shardsafe scales the accumulation)."""
    from shardsafe import env
    return int(env.get(env.FULL_WORLD_SIZE) or world)


# The optimizer paths DeepSpeed picks from its config (engine._configure_basic_optimizer): "AdamW" without
# torch_adam is DeepSpeed's FusedAdam (what users get by default), torch_adam is torch.optim.AdamW, AdamW with
# offload_optimizer=cpu is DeepSpeedCPUAdam, and Lion / Adagrad are DeepSpeed's own (CPU builds with offload).
OPTIMIZERS = {
    "torch-adamw": lambda: {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
    "fused-adamw": lambda: {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "fused-adam": lambda: {"type": "Adam", "params": {"lr": 1e-3}},
    "cpu-adam": lambda: {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "lion": lambda: {"type": "Lion", "params": {"lr": 1e-4, "weight_decay": 0.01}},   # CPU Lion: with offload
    "adagrad": lambda: {"type": "Adagrad", "params": {"lr": 1e-2}},
}


def ds_config(a: argparse.Namespace, world: int) -> dict:
    """``world``: the full job's world size (:func:`full_world_size`); the global batch is that job's."""
    cfg = {
        "train_micro_batch_size_per_gpu": a.micro_batch,
        "gradient_accumulation_steps": a.gas,
        "train_batch_size": a.micro_batch * a.gas * (world // (max(a.pp, 1) * a.tp)),   # x data-parallel size
        "optimizer": OPTIMIZERS[a.optimizer](),
        "zero_optimization": {"stage": a.zero_stage},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if a.grad_accum_dtype:   # bf16 + ZeRO-1 + fp32 gradient accumulation: DeepSpeed's BF16_Optimizer
        cfg["data_types"] = {"grad_accum_dtype": a.grad_accum_dtype}
    if a.autotp > 1:   # DeepSpeed's own training tensor parallelism (AutoTP shards the nn.Linear layers)
        cfg["tensor_parallel"] = {"autotp_size": a.autotp}
        del cfg["train_batch_size"]   # DeepSpeed derives it (its check runs before the TP groups exist)
    if a.lr:
        cfg["optimizer"]["params"]["lr"] = a.lr
    if not a.no_scheduler:
        cfg["scheduler"] = {"type": "WarmupLR",
                            "params": {"warmup_min_lr": 0, "warmup_max_lr": a.lr or 1e-3, "warmup_num_steps": 10}}
    if not a.no_clip:
        cfg["gradient_clipping"] = 1.0
    if a.optimizer in ("cpu-adam", "lion"):   # DeepSpeedCPUAdam / DeepSpeedCPULion (FusedLion is CUDA-only)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if a.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif a.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": a.fp16_scale_power,
                       "loss_scale_window": a.fp16_scale_window, "hysteresis": a.fp16_hysteresis}
    if a.zero_stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = a.z3_persistence
    if not a.no_shardsafe:
        block = {"enabled": True, "interval": a.interval}
        if a.budget_gb:
            block["memory_budget_gb"] = a.budget_gb
        if a.shardsafe_json:
            block.update(json.loads(a.shardsafe_json))
        cfg["shardsafe"] = block
    if a.load_universal:   # DeepSpeed's own reshard: a universal checkpoint loaded at this run's size
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def universal_fixups(engine, load_dir: str) -> None:
    """What DeepSpeed's universal-checkpoint load leaves out, put back the way a same-size load_checkpoint has it:
    the module buffers (data-parallel rank 0's module state, which ds_to_universal copies beside zero/) and
    ``micro_steps``, which no checkpoint carries (global_steps x this run's accumulation, as shardsafe's re-partition
    counts it), the CPU Adam kernels' beta powers, and a pipeline stage's own copies of its tied parameters
    (:func:`save_tied_copies`)."""
    import glob
    with open(os.path.join(load_dir, "latest_universal")) as f:
        folder = os.path.join(load_dir, f.read().strip())
    files = sorted(glob.glob(os.path.join(folder, "*model_states.pt")))
    if files:
        module = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
        with torch.no_grad():
            for name, buf in engine.module.named_buffers():
                if name in module:
                    buf.copy_(module[name])
    from deepspeed.runtime.pipe.engine import PipelineEngine
    if isinstance(engine, PipelineEngine):
        # the checkpoint ds_to_universal converted: "<tag>_universal" beside "<tag>"
        n = load_tied_copies(engine, os.path.join(load_dir, os.path.basename(folder).removesuffix("_universal")))
        print(f"[rank {engine.global_rank}] this stage's own copies of {n} tied parameter(s) put back", flush=True)
    else:   # train_batch() never counts micro_steps: it stays 0 there
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    # DeepSpeed's CPU Adam kernels (FusedAdam's CPU build, DeepSpeedCPUAdam) keep beta1^t, beta2^t in C++ as a
    # float32 product chain from the first step; a loaded process would start a new chain with pow(beta, t) and
    # differ in the last bits. An uninterrupted run's chain started at step 1: rebuild that one.
    from shardsafe.adapters.deepspeed.cpu_adam_powers import AdamPowersTracker
    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
    tracker = AdamPowersTracker.for_optimizer(basic)
    steps = [int(st["step"]) for st in basic.state.values() if "step" in st]
    if tracker is not None and steps:
        b1, b2 = basic.param_groups[0]["betas"]
        tracker.restore({"s0": 1, "step": max(steps), "beta1": b1, "beta2": b2})


def _tied_copies_path(folder: str, engine) -> str:
    return os.path.join(folder, f"tied_copies_stage{engine.stage_id}.pt")


def _moment_keys(engine) -> list[str]:
    """The optimizer's per-element state (Adam: exp_avg, exp_avg_sq), the same on every rank."""
    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return sorted({k for st in basic.state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim() == 1})


def save_tied_copies(engine, save_dir: str) -> None:
    """Beside a pipeline's checkpoint: this stage's own copy of each tied parameter (module value, fp32 master,
    optimizer moments). Each stage that shares a tied module updates its own copy, and in DeepSpeed's own training
    the copies drift apart in the last bits (each stage's optimizer sees the parameter at another offset of its
    flat partition); a universal checkpoint keeps one copy per name, so a load_universal alone would make the
    stages equal where the run never had them equal. Collective over the stage's data-parallel group."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    if not isinstance(engine, PipelineEngine):
        return
    keys, out = _moment_keys(engine), {}
    for name, p in engine.module.named_parameters():
        if name.startswith("tied_modules."):
            out[f"{name}/lp"] = p.detach().clone()
            out[f"{name}/fp32"] = safe_get_full_fp32_param(p)
            for k in keys:
                out[f"{name}/{k}"] = safe_get_full_optimizer_state(p, k)
    if out and engine.grid.get_data_parallel_rank() == 0:
        torch.save(out, _tied_copies_path(os.path.join(save_dir, f"global_step{engine.global_steps}"), engine))


def load_tied_copies(engine, folder: str) -> int:
    """Put this stage's own tied copies (:func:`save_tied_copies`, in checkpoint ``folder``) back after a
    load_universal, through DeepSpeed's own setters. Returns how many parameters it set."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    path = _tied_copies_path(folder, engine)
    if not os.path.exists(path):
        return 0
    saved, keys, n = torch.load(path, map_location="cpu", weights_only=True), _moment_keys(engine), 0
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if f"{name}/lp" in saved:
                p.copy_(saved[f"{name}/lp"])
                safe_set_full_fp32_param(p, saved[f"{name}/fp32"])
                for k in keys:
                    safe_set_full_optimizer_state(p, saved[f"{name}/{k}"], k)
                n += 1
    return n


def final_state(engine, schedulers: tuple = ()) -> dict[str, torch.Tensor]:
    """Everything that must match bit for bit: the rank state as shardsafe captures it, the low-precision model
    params, and what the framework itself reports (``fw/``): the module's and the optimizer's ``state_dict()``,
    the engine's counters, its LR scheduler, the loss scale, and the ``schedulers`` the program steps itself (HF's
    Trainer, Lightning), so state the adapter does not capture shows up as a mismatch. Collective under ZeRO-3 (the
    module's parameters are gathered)."""
    from shardsafe.adapters.deepspeed import COUNTERS, DeepSpeedStateAdapter
    from shardsafe.runcheck import flatten_state
    ad = DeepSpeedStateAdapter(engine)
    out = dict(ad.capture().tensors)
    o = engine.optimizer
    lps = getattr(o, "bit16_groups_flat", None) or getattr(o, "bf16_groups_flat", None) or \
        getattr(o, "fp16_partitioned_groups_flat", None) or []
    for i, t in enumerate(lps):
        out[f"lp/{i}"] = t
    z3 = type(o).__name__ == "DeepSpeedZeroOptimizer_Stage3"
    if z3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            out.update(flatten_state("fw/module", engine.module.state_dict()))
    else:
        out.update(flatten_state("fw/module", engine.module.state_dict()))
    out.update(flatten_state("fw/optimizer", o.state_dict()))
    out.update(flatten_state("fw/counters", {k: int(getattr(engine, k)) for k in COUNTERS}))
    sched = engine.lr_scheduler if engine.lr_scheduler is not None else ad.lr_scheduler
    if sched is not None:
        out.update(flatten_state("fw/lr_scheduler", sched.state_dict()))
    for i, s in enumerate(schedulers):
        out.update(flatten_state(f"fw/program_scheduler/{i}", s.state_dict()))
    scale = getattr(o, "loss_scale", None)
    if scale is not None:
        out.update(flatten_state("fw/loss_scale", float(scale)))
    if z3:
        # ZeRO-3 pads every parameter's partition to a multiple of the DP size; DeepSpeed leaves
        # those elements uninitialised, so two plain runs already differ there. They never touch
        # the model: compare the real elements only (group j's flat tensors: opt/*/j/..., lp/j,
        # and the optimizer state_dict's entries under a group index j).
        masks = [_z3_real_elements(params, engine.dp_world_size, engine.global_rank % engine.dp_world_size)
                 for params in o.fp16_groups]
        for name, t in list(out.items()):
            parts = name.split("/")
            if t.dim() != 1:
                continue
            groups = [int(p) for p in (parts[2:3] if parts[0] == "opt" else parts[1:2] if parts[0] == "lp"
                                       else parts[2:] if parts[0] == "fw" and parts[1] == "optimizer" else [])
                      if p.isdigit() and int(p) < len(masks)]
            for j in groups:
                if masks[j].numel() == t.numel():
                    out[name] = t.detach().clone().masked_fill_(~masks[j], 0)
                    break
    return out


def _z3_real_elements(params, dp: int, dp_rank: int) -> torch.Tensor:
    chunks = []
    for p in params:
        part = p.partition_numel()
        real = max(0, min(part, p.ds_numel - dp_rank * part))
        chunks.append(torch.arange(part) < real)
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.bool)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--fp16-scale-power", type=int, default=8, help="fp16: initial loss scale 2**N")
    p.add_argument("--fp16-scale-window", type=int, default=1000, help="fp16: good steps before the scale grows")
    p.add_argument("--fp16-hysteresis", type=int, default=2, help="fp16: overflows tolerated before it shrinks")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--pp", type=int, default=0,
                   help="pipeline stages: a deepspeed.pipe.PipelineModule trained with train_batch() (0 = plain module)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size: a Megatron-style mpu handed to deepspeed.initialize, MLPs split "
                        "column/row-parallel (examples/_ds_tensor_parallel.py)")
    p.add_argument("--grad-accum-dtype", default="", choices=["", "fp32", "bf16"],
                   help="data_types.grad_accum_dtype (fp32 with bf16 and ZeRO-1: DeepSpeed's BF16_Optimizer)")
    p.add_argument("--autotp", type=int, default=1,
                   help="DeepSpeed AutoTP training of a tiny transformers Llama: \"tensor_parallel\": "
                        "{\"autotp_size\": N} in the config")
    p.add_argument("--moe", type=int, default=0,
                   help="experts per block (deepspeed.moe.layer.MoE, expert parallel over min(experts, world) ranks)")
    p.add_argument("--partition-method", default="parameters",
                   help="PipelineModule partition_method (parameters, uniform, type:Block, ...)")
    p.add_argument("--optimizer", default="torch-adamw", choices=sorted(OPTIMIZERS),
                   help="which optimizer path DeepSpeed takes (fused-adamw = DeepSpeed's default FusedAdam)")
    p.add_argument("--no-scheduler", action="store_true", help="no LR scheduler")
    p.add_argument("--lr", type=float, default=0.0, help="peak learning rate (0: the optimizer's default, 1e-3 for AdamW)")
    p.add_argument("--no-clip", action="store_true", help="no gradient clipping")
    p.add_argument("--interval", type=int, default=1, help="shardsafe snapshot interval")
    p.add_argument("--budget-gb", type=float, default=0.0)
    p.add_argument("--shardsafe-json", default="", help="extra keys for the shardsafe block, as JSON")
    p.add_argument("--no-shardsafe", action="store_true", help="plain deepspeed.initialize (the reference run)")
    p.add_argument("--in-place", action="store_true",
                   help="train inside shardsafe.inplace.run: under `shardsafe launch --restart in-place` a rank that "
                        "survives a peer's death goes on in its process, building its engine again")
    p.add_argument("--vocab", type=int, default=512)
    # Width and sequence are sized for the tests on CPU: bf16 matmuls on a CPU without AVX512-BF16 run about 8x slower
    # than fp32 ones, and at width 128 x 32 tokens they were most of the test suite's time.
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--z3-persistence", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--step-sleep", type=float, default=0.0, help="sleep per step (simulate a slower model)")
    p.add_argument("--step-sleep-after", type=int, default=0, help="--step-sleep only in steps after this one")
    p.add_argument("--out", default=os.environ.get("SHARDSAFE_RUN_DIR", ""), help="where losses and final state go")
    p.add_argument("--save-dir", default="", help="plain engine.save_checkpoint here at --save-at (vanilla DeepSpeed)")
    p.add_argument("--save-at", type=int, default=0, help="global step after which --save-dir is written")
    p.add_argument("--save-tied-copies", action="store_true",
                   help="with --save-dir under a pipeline: also each stage's own copy of its tied parameters, which a "
                        "universal checkpoint merges into one and --load-universal puts back (the shrink demo's oracle)")
    p.add_argument("--load", default="", help="plain engine.load_checkpoint from here first (e.g. a `shardsafe export`); "
                                              "{rank} is replaced by the rank (node-local checkpoint directories)")
    p.add_argument("--load-from-attempt", type=int, default=0, help="--load only in restart attempts from this one on")
    p.add_argument("--load-universal", action="store_true",
                   help="--load is a DeepSpeed universal checkpoint (ds_to_universal), loaded at this run's size with "
                        "checkpoint.load_universal (the oracle of `shardsafe demo --shrink`)")
    p.add_argument("--running-tor-every", type=int, default=10,
                   help="rank 0 logs a running TOR every N iterations (0 = off)")
    a = p.parse_args(argv)
    from shardsafe.launch.discovery import discover
    discover()   # torchrun, plain srun tasks or mpirun + mpi4py -> RANK, WORLD_SIZE, MASTER_* for env://
    if os.environ.get("SHARDSAFE_RUN_DIR"):
        from shardsafe.tor import EventLog   # process start, before the slow framework imports
        EventLog(os.environ["SHARDSAFE_RUN_DIR"], source="trainer", rank=int(os.environ.get("RANK", 0)),
                 node=os.environ.get("SHARDSAFE_NODE"),
                 attempt=int(os.environ.get("SHARDSAFE_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
                 ).emit("trainer_start")

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build, no /dev/shm leak
    if a.dtype == "fp16" and os.environ.get("SHARDSAFE_TEST_FORCE_FP16") == "1":
        # TEST-ONLY: DeepSpeed refuses fp16 on this CPU (no mkldnn fp16); its fp16 optimizer and
        # dynamic loss scaler run fine once told otherwise.
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    from shardsafe.adapters.deepspeed import initialize
    from shardsafe.payload.manifest import save_tensors

    pg_timeout_s = float(os.environ.get("SHARDSAFE_PG_TIMEOUT", 30))

    def train() -> int:
        # with --in-place, once per attempt on a rank that restarts in place: everything that holds a process
        # group (the engine, its groups, shardsafe's runtime) is built here
        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=pg_timeout_s))
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        torch.manual_seed(a.seed)
        mpu = grid = topology = None
        if a.tp > 1 or a.pp:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        if a.tp > 1 and a.pp:
            from _ds_tensor_parallel import pipeline_grid
            topology, grid = pipeline_grid(a.pp, a.tp)
        if a.pp:
            model = pipeline_model(a, grid, topology)
        elif a.autotp > 1:
            model = TinyLlama(a.vocab, a.d_model, a.layers, a.heads, a.seq)
        else:
            model = TinyGPT(a.vocab, a.d_model, a.layers, a.heads, a.seq)
        if a.moe:
            if a.pp or a.tp > 1:
                raise SystemExit("--moe with --pp or --tp: not in this example")
            for blk in model.blocks:   # every rank builds all experts from the same weights; MoE keeps its own
                blk.mlp = MoEMLP(blk.mlp, a.d_model, a.moe, min(a.moe, world))
        if a.tp > 1:
            from _ds_tensor_parallel import TensorParallelMpu, seed_model_parallel_rng, shard_mlps
            if not a.pp:
                mpu = TensorParallelMpu(a.tp)
                shard_mlps(model, mpu)
            # the tracker's stream per tensor-parallel rank (the pipeline's grid is the mpu there)
            seed_model_parallel_rng(mpu or grid, a.seed)
        torch.manual_seed(a.seed + 1 + rank)  # per-rank dropout streams: the adapter must keep RNG per rank
        random.seed(a.seed + rank)
        np.random.seed(a.seed + rank)
        engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(),
                                     config=ds_config(a, full_world_size(world)), mpu=mpu)
        print(f"[rank {rank}] {type(engine).__name__} with {type(engine.optimizer).__name__}", flush=True)
        if engine.shardsafe:
            r = engine.shardsafe.restored
            print(f"[rank {rank}] shardsafe: {r.message} (tier {r.tier}, {r.seconds:.3f} s)", flush=True)
        attempt = int(os.environ.get("SHARDSAFE_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
        if a.load and attempt >= a.load_from_attempt:
            # Vanilla DeepSpeed load; an exported snapshot also carries what DeepSpeed's format has no
            # place for (per-rank RNG, micro_steps), put back by apply_client_state.
            from shardsafe.adapters.deepspeed.export import apply_client_state
            path, client = engine.load_checkpoint(a.load.format(rank=rank))
            if path is None:
                raise SystemExit(f"no DeepSpeed checkpoint under {a.load}")
            if a.load_universal:
                universal_fixups(engine, a.load.format(rank=rank))
                print(f"[rank {rank}] loaded universal checkpoint {path} at step {engine.global_steps}", flush=True)
            else:
                print(f"[rank {rank}] loaded {path} at step {engine.global_steps}; shardsafe client state: "
                      f"{apply_client_state(engine, client, path)}", flush=True)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.dtype)
        dp_rank = engine.mpu.get_data_parallel_rank() if engine.mpu else rank
        losses = open(os.path.join(a.out, f"losses_rank{rank}.jsonl"), "a") if a.out else None
        events = engine.shardsafe.runtime.events if engine.shardsafe else None
        if events is not None:
            events.emit("train_ready", iteration=engine.global_steps + 1)
        running = None
        if events is not None and events.path is not None and rank == 0 and a.running_tor_every > 0:
            from shardsafe.tor import RunningTor
            running = RunningTor(events, every=a.running_tor_every)
        runtime = engine.shardsafe.runtime if engine.shardsafe else None
        # DeepSpeed's accumulation, not --gas: a job re-formed at another data-parallel size accumulates more or fewer
        # micro-batches per step (shardsafe scales it to keep the global batch)
        gas = engine.gradient_accumulation_steps()
        while engine.global_steps < a.steps:
            t0 = time.perf_counter()
            stall0 = runtime.stall_total_s if runtime is not None else 0.0
            total = 0.0
            if a.pp:
                # One optimizer step per train_batch(); it pulls `gas` micro-batches on the first and last stage.
                data = iter([micro_batch(a, engine, engine.global_steps, j, dp_rank) for j in range(gas)])
                rec = {"step": engine.global_steps + 1, "attempt": attempt}
                scaler = getattr(engine.optimizer, "loss_scaler", None)
                if a.dtype == "fp16" and scaler is not None:
                    rec["loss_scale"] = float(scaler.cur_scale)   # the scale this step's backward uses
                loss = engine.train_batch(data)
                if losses:   # after the step here: train_batch returns the loss only then
                    losses.write(json.dumps({**rec, "loss": float(loss.item()).hex()}) + "\n")
                    losses.flush()
            for i in range(0 if a.pp else gas):
                x, y = micro_batch(a, engine, engine.global_steps, i, dp_rank)
                loss = engine(x, y) if dtype is None else engine(x, y)
                engine.backward(loss)
                total += loss.item()
                if losses and i == gas - 1:
                    # Logged before the optimizer step: the step's snapshot may commit right after it, and a
                    # kill between that commit and a later write would lose this line for good. A step
                    # replayed after a restore writes its line again (the last one counts).
                    rec = {"step": engine.global_steps + 1, "loss": float(total).hex(), "attempt": attempt}
                    scaler = getattr(engine.optimizer, "loss_scaler", None)
                    if a.dtype == "fp16" and scaler is not None:
                        rec["loss_scale"] = float(scaler.cur_scale)   # the scale this step's backward used
                    losses.write(json.dumps(rec) + "\n")
                    losses.flush()
                engine.step()
            if a.save_dir and engine.global_steps == a.save_at:
                engine.save_checkpoint(a.save_dir)
                if a.save_tied_copies:
                    save_tied_copies(engine, a.save_dir)
            if a.step_sleep and engine.global_steps > a.step_sleep_after:
                time.sleep(a.step_sleep)
            if events is not None:
                # TOR: an iteration's seconds exclude the snapshot stall (the wait for the copy inside
                # engine.step() and the capture after it), which the snapshot events report.
                dt = max(0.0, time.perf_counter() - t0 - (runtime.stall_total_s - stall0))
                events.emit("iteration", iteration=engine.global_steps, seconds=dt)
                if running is not None:
                    running.update(engine.global_steps, dt)
        if engine.shardsafe:
            engine.shardsafe.flush()
        if a.out:
            save_tensors(os.path.join(a.out, f"final_rank{rank}"), final_state(engine))
        if engine.shardsafe:
            engine.shardsafe.close()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        from shardsafe.launch.markers import mark_rank_done
        mark_rank_done(rank=rank)   # RUN_DIR/markers/rank{R}.done: launchers check every rank finished
        return 0

    if a.in_place:
        from shardsafe.inplace import run
        return run(train, backend="gloo", timeout_s=pg_timeout_s)
    return train()


if __name__ == "__main__":
    sys.exit(main())
