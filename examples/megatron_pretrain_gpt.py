"""Tiny GPT pretraining with megatron-core (own loop: forward_backward_func + DistributedOptimizer).

Runs on GPUs with NCCL, and on CPU over gloo with the CPU shims (examples/_megatron_cpu_shims.py,
installed automatically when no GPU is present). Mock data, fully deterministic: the tokens of
sample ``s`` depend only on ``--data-seed`` and ``s``, so the data position is the
``consumed_samples`` counter that shardsafe snapshots.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/megatron_pretrain_gpt.py @configs/megatron/tiny_gpt_tp2_dp2.args

``--demo-rollback K`` shows the adapter without the holder runtime: snapshot after step K into CPU
copies, train on, roll back in process, replay, and check every loss is bit-identical.
The functions here (``TinyGPT``, ``Trainer``) are reused by tests/dist/test_megatron_state.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import numpy as np
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@dataclass(kw_only=True)
class TinyGPT:
    """Model, layout and optimizer settings of the tiny run (the data-parallel size is world / (tp*pp))."""
    tp: int = 1
    pp: int = 1
    bf16: bool = False
    distributed_optimizer: bool = True
    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    vocab_size: int = 128
    seq_length: int = 16
    micro_batch_size: int = 2
    num_microbatches: int = 2
    dropout: float = 0.1
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_steps: int = 2
    lr_decay_steps: int = 50
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 1234
    data_seed: int = 4321
    timeout_s: float = 3.0

    def global_batch_size(self, dp: int) -> int:
        return self.micro_batch_size * self.num_microbatches * dp


def initialize_parallel(run: TinyGPT) -> None:
    """parallel_state + seeds, as Megatron-LM's initialize does (seed + 100 * pp rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=run.tp, pipeline_model_parallel_size=run.pp,
                                 # timedelta(minutes=...) accepts fractions: keep gloo sub-groups as short as the
                                 # default group, so a broken test fails in seconds, not 30 minutes
                                 distributed_timeout_minutes=run.timeout_s / 60.0)
    seed = run.seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()


class Trainer:
    """Model chunks + optimizer + scheduler + counters of one rank, and one training step."""

    def __init__(self, run: TinyGPT):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import Float16Module

        self.run = run
        dtype = torch.bfloat16 if run.bf16 else torch.float32
        cfg = TransformerConfig(
            num_layers=run.num_layers, hidden_size=run.hidden_size, num_attention_heads=run.num_attention_heads,
            tensor_model_parallel_size=run.tp, pipeline_model_parallel_size=run.pp, pipeline_dtype=dtype,
            bf16=run.bf16, params_dtype=dtype, use_cpu_initialization=True,
            hidden_dropout=run.dropout, attention_dropout=run.dropout,
            gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
            bias_activation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        )
        model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=run.vocab_size,
                         max_sequence_length=run.seq_length, pre_process=ps.is_pipeline_first_stage(),
                         post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=True)
        if run.bf16:
            model = Float16Module(cfg, model)
        ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=run.distributed_optimizer,
                                                grad_reduce_in_fp32=True)
        model = DDP(cfg, ddp_cfg, model)
        self.model_chunks = [model]
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=run.lr, min_lr=run.min_lr, weight_decay=run.weight_decay,
                            bf16=run.bf16, params_dtype=dtype, clip_grad=run.clip_grad,
                            use_distributed_optimizer=run.distributed_optimizer),
            self.model_chunks)
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.gbs = run.global_batch_size(self.dp)
        # Like Megatron-LM, the scheduler counts samples.
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=run.lr, min_lr=run.min_lr,
            lr_warmup_steps=run.lr_warmup_steps * self.gbs, lr_decay_steps=run.lr_decay_steps * self.gbs,
            lr_decay_style="cosine", start_wd=run.weight_decay, end_wd=run.weight_decay,
            wd_incr_steps=run.lr_decay_steps * self.gbs, wd_incr_style="constant")
        cfg.finalize_model_grads_func = finalize_model_grads
        cfg.no_sync_func = model.no_sync
        cfg.grad_scale_func = self.optimizer.scale_loss
        self.config = cfg
        self.fb = get_forward_backward_func()
        self.iteration = 0
        self.counters = {"consumed_train_samples": 0}
        self.is_last_stage = ps.is_pipeline_last_stage()

    # ----------------------------------------------------------------------------- data
    def _sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.run.data_seed * 1_000_003 + index)
        return torch.randint(0, self.run.vocab_size, (self.run.seq_length + 1,), generator=g)

    def _micro_batches(self):
        run, base = self.run, self.counters["consumed_train_samples"]
        per_rank = run.micro_batch_size * run.num_microbatches
        s = run.seq_length
        mask = torch.tril(torch.ones(1, 1, s, s)) < 0.5  # True = masked (causal)
        for m in range(run.num_microbatches):
            first = base + self.dp_rank * per_rank + m * run.micro_batch_size
            toks = torch.stack([self._sample(first + i) for i in range(run.micro_batch_size)])
            yield {"tokens": toks[:, :-1].contiguous(), "labels": toks[:, 1:].contiguous(),
                   "loss_mask": torch.ones(run.micro_batch_size, s), "attention_mask": mask,
                   "position_ids": torch.arange(s).unsqueeze(0).expand(run.micro_batch_size, s).contiguous()}

    @staticmethod
    def _forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

        def loss_func(output_tensor):
            losses = output_tensor.float().view(-1)
            mask = b["loss_mask"].view(-1)
            loss = torch.sum(losses * mask) / mask.sum()
            # clone: the schedule divides the returned loss by num_microbatches in place
            return loss, {"lm loss": loss.detach().clone()}

        return out, loss_func

    # ----------------------------------------------------------------------------- one step
    def train_step(self) -> dict[str, Any]:
        """One iteration; returns {'loss': float or None (not last stage), 'grad_norm': float, 'lr': float}."""
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self.fb(forward_step_func=self._forward_step, data_iterator=self._micro_batches(),
                         model=self.model_chunks, num_microbatches=self.run.num_microbatches,
                         seq_length=self.run.seq_length, micro_batch_size=self.run.micro_batch_size,
                         forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=self.gbs)
        self.iteration += 1
        self.counters["consumed_train_samples"] += self.gbs
        loss = None
        if self.is_last_stage and losses:
            loss = float(sum(float(d["lm loss"]) for d in losses) / len(losses))
        return {"loss": loss, "grad_norm": float(grad_norm) if grad_norm is not None else None, "lr": lr, "ok": ok}

    # ----------------------------------------------------------------------------- shardsafe
    def adapter(self, extra: Optional[dict] = None):
        from shardsafe.adapters.megatron import MegatronStateAdapter

        def set_iteration(i: int) -> None:
            self.iteration = i

        return MegatronStateAdapter(self.model_chunks, self.optimizer, self.scheduler,
                                    get_iteration=lambda: self.iteration, set_iteration=set_iteration,
                                    get_counters=lambda: dict(self.counters),
                                    set_counters=lambda c: self.counters.update(c), extra=extra)

    def model_params(self) -> dict[str, torch.Tensor]:
        return {f"c{i}.{n}": p.detach() for i, c in enumerate(self.model_chunks) for n, p in c.named_parameters()}


def cpu_copy(state) -> tuple[dict[str, torch.Tensor], dict]:
    """What the runtime will do asynchronously: CPU copies of the tensors, meta through JSON."""
    return ({k: v.detach().cpu().clone() for k, v in state.tensors.items()},
            json.loads(json.dumps(state.meta)))


def init_distributed(timeout_s: float) -> None:
    """torchrun's env:// rendezvous; gloo when no GPU (with the CPU shims), NCCL otherwise."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    else:
        import _megatron_cpu_shims
        _megatron_cpu_shims.install()
        backend = "gloo"
    torch.distributed.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def build_parser() -> argparse.ArgumentParser:
    from shardsafe.adapters.megatron_args import add_arguments
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], fromfile_prefix_chars="@")
    p.convert_arg_line_to_args = lambda line: line.split("#")[0].split()  # @file: several flags per line
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--no-distributed-optimizer", dest="distributed_optimizer", action="store_false")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--num-microbatches", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timeout-s", type=float, default=60.0, help="gloo/NCCL collective timeout")
    p.add_argument("--demo-rollback", type=int, default=0, metavar="K",
                   help="snapshot after step K, train on, roll back in process and replay; check bit-identity")
    return add_arguments(p)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from shardsafe.adapters.megatron_args import config_from_args
    ss_cfg = config_from_args(args)  # bad --shardsafe-* values fail here, before anything is built
    run = TinyGPT(tp=args.tp, pp=args.pp, bf16=args.bf16, distributed_optimizer=args.distributed_optimizer,
                  num_layers=args.num_layers, hidden_size=args.hidden_size,
                  num_attention_heads=args.num_attention_heads, micro_batch_size=args.micro_batch_size,
                  num_microbatches=args.num_microbatches, lr=args.lr, seed=args.seed, timeout_s=args.timeout_s)
    init_distributed(args.timeout_s)
    rank = torch.distributed.get_rank()
    initialize_parallel(run)
    tr = Trainer(run)
    adapter = tr.adapter()
    if ss_cfg.enabled and rank == 0:
        print(f"[r{rank}] shardsafe: {json.dumps(ss_cfg.to_dict())} (holder runtime not wired into this example yet)")
    saved, replay_ref = None, []
    for step in range(1, args.steps + 1):
        out = tr.train_step()
        if saved is not None:
            replay_ref.append(out)
        print(f"[r{rank} it{tr.iteration}] loss={out['loss']} grad_norm={out['grad_norm']:.6f} lr={out['lr']:.3e}",
              flush=True)
        if args.demo_rollback and step == args.demo_rollback:
            saved = cpu_copy(adapter.capture())
    if saved is not None:
        adapter.apply(*saved)
        replay = [tr.train_step() for _ in replay_ref]
        same = all(a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] for a, b in zip(replay, replay_ref))
        print(f"[r{rank}] rollback to iteration {args.demo_rollback}, replayed {len(replay)} steps: "
              f"{'BIT-IDENTICAL' if same else 'DIFFERENT'}", flush=True)
        if not same:
            return 1
    torch.distributed.barrier()
    destroy_parallel()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
