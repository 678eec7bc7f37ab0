"""Tiny GPT pretraining with megatron-core (own loop: forward_backward_func + DistributedOptimizer).

Runs on GPUs with NCCL, and on CPU over gloo with the CPU shims (examples/_megatron_cpu_shims.py,
installed automatically when no GPU is present). Mock data, fully deterministic: the tokens of
sample ``s`` depend only on ``--data-seed`` and ``s``, so the data position is the
``consumed_samples`` counter that shardsafe snapshots.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/megatron_pretrain_gpt.py @configs/megatron/tiny_gpt_tp2_dp2.args

With ``--shardsafe`` (and the other ``--shardsafe-*`` flags, docs/megatron.md) the loop is protected by
``shardsafe.adapters.megatron.protect``: snapshots into the node's holder after every optimizer step,
restore at start after a crash (the first rank on a node starts its holder if none runs);
``--core-api functions`` drives the same runtime through the two-call API instead
(``restore(...)`` once, ``snapshot(..., iteration)`` after every step, ``close(optimizer)``)::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/megatron_pretrain_gpt.py \
        @configs/megatron/tiny_gpt_tp2_dp2.args --steps 8 --shardsafe --out /tmp/ss-run

tests/fault/test_megatron_resume.py runs it under ``shardsafe.launch.LocalLauncher`` (simulated nodes,
one holder each, real SIGKILLs of ranks and whole nodes).

Per iteration every rank appends ``{"step", "loss" (float.hex; the last pipeline stage's loss),
"grad_norm", "attempt"}`` to ``--out``/losses_rank{R}.jsonl and at the end writes its final state
(rank state + model params) to final_rank{R}.{bin,json}, for ``shardsafe.runcheck.compare_runs``.

``--demo-rollback K`` shows the adapter without the holder runtime: snapshot after step K into CPU
copies, train on, roll back in process, replay, and check every loss is bit-identical.
The functions here (``TinyGPT``, ``Trainer``) are reused by tests/dist/test_megatron_state.py.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
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
    vpp: int = 1      # virtual pipeline stages (model chunks) per pipeline rank: interleaved 1F1B when > 1
    num_experts: int = 0   # > 0: MoE MLPs (top-2 router, allgather dispatcher); experts sharded over ep ranks
    ep: int = 1
    bf16: bool = False
    fp16: bool = False     # fp16 params with Megatron's dynamic loss scaler (the three knobs below)
    initial_loss_scale: float = 2.0 ** 32
    loss_scale_window: int = 1000
    hysteresis: int = 2
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
                                 virtual_pipeline_model_parallel_size=run.vpp if run.vpp > 1 else None,
                                 expert_model_parallel_size=run.ep,
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
        dtype = torch.bfloat16 if run.bf16 else torch.float16 if run.fp16 else torch.float32
        cfg = TransformerConfig(
            num_layers=run.num_layers, hidden_size=run.hidden_size, num_attention_heads=run.num_attention_heads,
            tensor_model_parallel_size=run.tp, pipeline_model_parallel_size=run.pp, pipeline_dtype=dtype,
            virtual_pipeline_model_parallel_size=run.vpp if run.vpp > 1 else None,
            expert_model_parallel_size=run.ep,
            **(dict(num_moe_experts=run.num_experts, moe_router_topk=2, moe_token_dispatcher_type="allgather",
                    moe_aux_loss_coeff=1e-2, moe_grouped_gemm=False) if run.num_experts else {}),
            bf16=run.bf16, fp16=run.fp16, params_dtype=dtype, use_cpu_initialization=True,
            hidden_dropout=run.dropout, attention_dropout=run.dropout,
            gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
            bias_activation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        )
        ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=run.distributed_optimizer,
                                                grad_reduce_in_fp32=True)
        # One model chunk per virtual stage, as Megatron-LM's get_model builds them: chunk i of pipeline rank r
        # holds layer block i * pp + r; only the very first / last chunk has the embedding / the output layer.
        self.model_chunks = []
        for i in range(run.vpp):
            vp = i if run.vpp > 1 else None
            model = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=run.num_experts or None),
                             vocab_size=run.vocab_size, max_sequence_length=run.seq_length,
                             pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                             post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                             share_embeddings_and_output_weights=True, **({"vp_stage": vp} if vp is not None else {}))
            if torch.cuda.is_available():   # as Megatron-LM's get_model does (a no-op under the CPU shims)
                model.cuda(torch.cuda.current_device())
            if run.bf16 or run.fp16:
                model = Float16Module(cfg, model)
            self.model_chunks.append(DDP(cfg, ddp_cfg, model, disable_bucketing=i > 0))
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=run.lr, min_lr=run.min_lr, weight_decay=run.weight_decay,
                            bf16=run.bf16, fp16=run.fp16, params_dtype=dtype, clip_grad=run.clip_grad,
                            initial_loss_scale=run.initial_loss_scale, loss_scale_window=run.loss_scale_window,
                            hysteresis=run.hysteresis, use_distributed_optimizer=run.distributed_optimizer),
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
        no_sync = [c.no_sync for c in self.model_chunks]
        cfg.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
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
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        for m in range(run.num_microbatches):
            first = base + self.dp_rank * per_rank + m * run.micro_batch_size
            toks = torch.stack([self._sample(first + i) for i in range(run.micro_batch_size)])
            b = {"tokens": toks[:, :-1].contiguous(), "labels": toks[:, 1:].contiguous(),
                 "loss_mask": torch.ones(run.micro_batch_size, s), "attention_mask": mask,
                 "position_ids": torch.arange(s).unsqueeze(0).expand(run.micro_batch_size, s).contiguous()}
            yield {k: v.to(dev) for k, v in b.items()} if dev is not None else b

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
        # Interleaved schedules take one iterator per model chunk (each chunk's forward reads its own).
        data = [self._micro_batches() for _ in self.model_chunks] if len(self.model_chunks) > 1 else self._micro_batches()
        losses = self.fb(forward_step_func=self._forward_step, data_iterator=data,
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
        # fp16: a step with inf/nan grads is skipped (ok False, no grad norm) and the loss scale moves
        return {"loss": loss, "grad_norm": float(grad_norm) if grad_norm is not None else None, "lr": lr, "ok": ok,
                "loss_scale": float(self.optimizer.get_loss_scale())}

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


def init_distributed(timeout_s: float, *, in_place: bool = False) -> str:
    """torchrun's env:// rendezvous; gloo when no GPU (with the CPU shims), NCCL otherwise; returns the backend.
    ``in_place``: the backend only (shardsafe.inplace.run makes the default group, once per attempt)."""
    if torch.cuda.is_available():
        # Bit-exact comparisons between runs need deterministic kernels (cuBLAS reads this at its first use).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    else:
        import _megatron_cpu_shims
        _megatron_cpu_shims.install()
        backend = "gloo"
    if not in_place:
        torch.distributed.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return backend


def build_parser() -> argparse.ArgumentParser:
    from shardsafe.adapters.megatron.args import add_arguments
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], fromfile_prefix_chars="@")
    p.convert_arg_line_to_args = lambda line: line.split("#")[0].split()  # @file: several flags per line
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, default=1)
    p.add_argument("--virtual-pipeline-model-parallel-size", "--vpp", dest="vpp", type=int, default=1,
                   help="model chunks per pipeline rank (interleaved schedule; --num-layers divisible by pp * vpp)")
    p.add_argument("--num-experts", type=int, default=0, help="MoE MLPs with this many experts (0 = dense)")
    p.add_argument("--expert-model-parallel-size", "--ep", dest="ep", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true", help="fp16 params and Megatron's dynamic loss scaler")
    p.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    p.add_argument("--loss-scale-window", type=int, default=1000)
    p.add_argument("--hysteresis", type=int, default=2)
    p.add_argument("--no-distributed-optimizer", dest="distributed_optimizer", action="store_false")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--num-microbatches", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--steps", type=int, default=6, help="train until this iteration (a restored run continues)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="gloo/NCCL collective timeout")
    p.add_argument("--in-place", action="store_true",
                   help="train inside shardsafe.inplace.run: under `shardsafe launch --restart in-place` a rank that "
                        "survives a peer's death goes on in its process, building parallel_state and the model again")
    p.add_argument("--out", default=os.environ.get("SHARDSAFE_RUN_DIR", ""),
                   help="write losses_rank{R}.jsonl and final_rank{R}.{bin,json} here (default SHARDSAFE_RUN_DIR)")
    p.add_argument("--core-api", choices=("protect", "functions"), default="protect",
                   help="with --shardsafe: protect() (default) or the restore()/snapshot()/close() calls")
    p.add_argument("--save-dir", default="",
                   help="Megatron-LM's own checkpoint (dist_checkpointing, fully reshardable optimizer) into this "
                        "empty or new folder after iteration --save-at (examples/megatron_dist_ckpt.py)")
    p.add_argument("--save-at", type=int, default=0, help="iteration after which --save-dir is written")
    p.add_argument("--load-dir", default="",
                   help="start from Megatron-LM's own checkpoint in this folder, saved at any data-parallel size")
    p.add_argument("--step-sleep", type=float, default=0.0, help="sleep per step (simulate a slower model)")
    p.add_argument("--step-sleep-after", type=int, default=0, help="sleep only after this iteration")
    p.add_argument("--demo-rollback", type=int, default=0, metavar="K",
                   help="snapshot after step K, train on, roll back in process and replay; check bit-identity")
    return add_arguments(p)


def _microbatches_keeping_global_batch(args: argparse.Namespace) -> int:
    """``--num-microbatches`` counts micro-batches per rank at the job's full size; a job the launcher re-formed at
    another world size (SHARDSAFE_FULL_WORLD_SIZE) runs as many more or fewer that the global batch stays, as
    Megatron-LM does with --global-batch-size (ConfigError, naming the sizes that fit, when it cannot)."""
    from shardsafe import env
    from shardsafe.adapters.megatron.args import keep_global_batch
    full = env.get(env.FULL_WORLD_SIZE)
    world = int(os.environ.get("WORLD_SIZE") or 0)
    if not full or not world or int(full) == world:
        return args.num_microbatches
    full_dp = int(full) // (args.tp * args.pp)
    ns = argparse.Namespace(micro_batch_size=args.micro_batch_size, tensor_model_parallel_size=args.tp,
                            pipeline_model_parallel_size=args.pp,
                            global_batch_size=args.micro_batch_size * args.num_microbatches * full_dp)
    keep_global_batch(ns)
    return ns.global_batch_size // (args.micro_batch_size * (world // (args.tp * args.pp)))


def _attempt() -> int:
    return int(os.environ.get("SHARDSAFE_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def final_state(tr: Trainer, adapter) -> dict[str, torch.Tensor]:
    """Everything that must match bit for bit at the end: the rank state (optimizer shards and state,
    RNGs, ...) plus every model parameter this rank holds (re-derived low-precision params included)."""
    out = dict(adapter.capture().tensors)
    out.update({f"model/{k}": v for k, v in tr.model_params().items()})
    return out


def pipeline_loss(tr: Trainer, loss: Optional[float]) -> float:
    """The last pipeline stage's loss on every stage (one scalar broadcast per step), so every rank's
    loss log carries the iteration's loss."""
    from megatron.core import parallel_state as ps
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return float(loss)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64, device=dev)
    torch.distributed.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(),
                                group=ps.get_pipeline_model_parallel_group())
    return float(t.item())


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from shardsafe.adapters.megatron.args import config_from_args
    ss_cfg = config_from_args(args)  # bad --shardsafe-* values fail here, before anything is built
    rank = int(os.environ.get("RANK", 0))
    if os.environ.get("SHARDSAFE_RUN_DIR"):
        from shardsafe.tor import EventLog   # process start, before the slow framework imports
        EventLog(os.environ["SHARDSAFE_RUN_DIR"], source="trainer", rank=rank, attempt=_attempt()).emit("trainer_start")
    args.num_microbatches = _microbatches_keeping_global_batch(args)
    run = TinyGPT(tp=args.tp, pp=args.pp, vpp=args.vpp, num_experts=args.num_experts, ep=args.ep, bf16=args.bf16,
                  fp16=args.fp16, initial_loss_scale=args.initial_loss_scale,
                  loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
                  distributed_optimizer=args.distributed_optimizer,
                  num_layers=args.num_layers, hidden_size=args.hidden_size,
                  num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                  seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                  num_microbatches=args.num_microbatches, lr=args.lr, seed=args.seed, timeout_s=args.timeout_s)
    backend = init_distributed(args.timeout_s, in_place=args.in_place)

    def train() -> int:
        # with --in-place, once per attempt on a rank that restarts in place: parallel_state, the model, the
        # optimizer and shardsafe's protection are built here
        rank = torch.distributed.get_rank()
        initialize_parallel(run)
        from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
        # Megatron's calculator, as Megatron-LM's initialize sets it: the snapshots record the global batch from it, so
        # that a job continued at another data-parallel size with the same batch restores them (re-partitioned).
        init_num_microbatches_calculator(rank, None, run.global_batch_size(torch.distributed.get_world_size() //
                                                                           (run.tp * run.pp)),
                                         run.micro_batch_size, torch.distributed.get_world_size() // (run.tp * run.pp))
        tr = Trainer(run)
        if args.load_dir:
            import megatron_dist_ckpt
            megatron_dist_ckpt.load(tr, args.load_dir)
            print(f"[r{rank}] loaded Megatron's checkpoint {args.load_dir} at iteration {tr.iteration}", flush=True)
        prot = None
        if ss_cfg.enabled:
            from shardsafe.adapters.megatron import protect

            def set_iteration(i: int) -> None:
                tr.iteration = i

            # Collective: holder, parity plan, restore. A restored run continues from the snapshot's
            # iteration; counters (the data position) and RNGs come back with it.
            if args.core_api == "functions":
                from shardsafe.adapters.megatron import restore
                got = restore(tr.model_chunks, tr.optimizer, tr.scheduler, ss_cfg)
                if got.iteration is not None:
                    tr.iteration = got.iteration
                    tr.counters.update(got.counters)
                prot = got.protection
            else:
                prot = protect(tr.model_chunks, tr.optimizer, tr.scheduler, ss_cfg, get_iteration=lambda: tr.iteration,
                               set_iteration=set_iteration, get_counters=lambda: dict(tr.counters),
                               set_counters=lambda c: tr.counters.update(c))
            r = prot.restored
            print(f"[r{rank}] shardsafe: {r.message} (tier {r.tier}, {r.seconds:.3f} s)", flush=True)
        adapter = prot.adapter if prot is not None else tr.adapter()
        losses = open(os.path.join(args.out, f"losses_rank{rank}.jsonl"), "a") if args.out else None
        events = prot.events if prot is not None else None
        if events is not None:
            events.emit("train_ready", iteration=tr.iteration + 1)
        saved, replay_ref = None, []
        while tr.iteration < args.steps:
            t0 = time.perf_counter()
            stall0 = prot.stall_total_s if prot is not None else 0.0
            out = tr.train_step()        # optimizer.step() first waits for the pending snapshot copy
            if prot is not None and args.core_api == "functions":
                from shardsafe.adapters.megatron import snapshot
                # The last iteration is sealed even when the interval skips it (final=True waits for its commit).
                snapshot(tr.model_chunks, tr.optimizer, tr.scheduler, tr.iteration, counters=tr.counters,
                         final=tr.iteration >= args.steps)
            elif prot is not None:
                prot.after_step(tr.iteration)
            loss = pipeline_loss(tr, out["loss"])
            if losses is not None:
                g = out["grad_norm"]
                losses.write(json.dumps({"step": tr.iteration, "loss": loss.hex(),
                                         "grad_norm": float(g).hex() if g is not None else None,
                                         "loss_scale": out["loss_scale"], "attempt": _attempt()}) + "\n")
                losses.flush()
            if args.save_dir and tr.iteration == args.save_at:
                import megatron_dist_ckpt
                megatron_dist_ckpt.save(tr, args.save_dir)
            if args.step_sleep and tr.iteration > args.step_sleep_after:
                time.sleep(args.step_sleep)
            if events is not None:
                events.emit("iteration", iteration=tr.iteration,
                            seconds=max(0.0, time.perf_counter() - t0 - (prot.stall_total_s - stall0)))
            if saved is not None:
                replay_ref.append(out)
            print(f"[r{rank} it{tr.iteration}] loss={out['loss']} grad_norm={out['grad_norm']} lr={out['lr']:.3e} "
                  f"loss_scale={out['loss_scale']:g}",
                  flush=True)
            if args.demo_rollback and tr.iteration == args.demo_rollback:
                saved = cpu_copy(adapter.capture())
        if prot is not None:
            prot.flush()
        if args.out:
            from shardsafe.payload.manifest import save_tensors
            save_tensors(os.path.join(args.out, f"final_rank{rank}"), final_state(tr, adapter))
        if prot is not None and args.core_api == "functions":
            from shardsafe.adapters.megatron import close
            close(tr.optimizer)
        elif prot is not None:
            prot.close()
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

    if args.in_place:
        from shardsafe.inplace import run as run_in_place
        return run_in_place(train, backend=backend, timeout_s=args.timeout_s)
    return train()


if __name__ == "__main__":
    sys.exit(main())
