"""Megatron-LM's own checkpoint of the tiny GPT (examples/megatron_pretrain_gpt.py): megatron-core's
``dist_checkpointing`` (torch_dist) with the DistributedOptimizer's fully reshardable format (Megatron-LM's
``--dist-ckpt-optim-fully-reshardable``), saved and loaded as Megatron-LM's ``save_checkpoint`` / ``load_checkpoint``
build it: the unwrapped model's sharded state dict, the optimizer's, the scheduler, the iteration and consumed
samples, and the RNG state as ``get_rng_state`` wraps it (one ShardedObject per (PP, TP) coordinate, written by
data-parallel rank 0; a load at another data-parallel size gives every rank data-parallel rank 0's).

It is Megatron's native reshard: a checkpoint saved at data-parallel size D loads at D'. shardsafe's tests and
``shardsafe demo --shrink --engine megatron`` use it as the oracle of the re-partition from memory.

Megatron's load has bugs on this CPU path (torch Adam, no TE/Apex); this works around them, and only them:
* a fresh optimizer has no per-parameter state, and ``DistributedOptimizer.sharded_state_dict(is_loading=True)``
  calls ``state_dict()``, which asserts ``len(steps) == 1`` over an empty set (0.16.1 distrib_optimizer.py:642):
  Megatron's own ``_init_optimizer_states_with_dummy_values()`` runs first (what megatron-core 0.17 does for its
  fsdp_dtensor format; the dummy values are overwritten by the load);
* ``load_parameter_state_from_fully_reshardable`` hands ``_set_main_param_and_optimizer_states`` the param and the
  moments, which copies every key of the live state, ``step`` included, and raises ``KeyError: 'step'``
  (distrib_optimizer.py:940): the copy takes the keys the checkpoint has (``step`` comes from the param_groups, as
  Megatron's comment there says);
* ``DistributedOptimizer.load_state_dict`` gives every parameter's state one shared ``step`` tensor (:825), which
  torch Adam then advances once per parameter per step: each parameter gets its own copy.
It also leaves the checkpoint's param_groups ``step`` in the live groups, which torch Adam does not read. And the
fully reshardable *save* is wrong for a buffer of several buckets: ``get_parameter_state_dp_zero`` packs the buckets
without their end padding while ``sharded_param_state_fully_reshardable`` slices them at the padded buffer offsets,
so every parameter after the first bucket is saved from the wrong elements (megatron-core 0.16.1 and 0.17.1; fixed
upstream by NVIDIA/Megatron-LM PR 5077, "Fix bugs in re-sharding DistributedOptimizer state in torch_dist
checkpoint"): the padding is put back, which gives that fix's offsets.
"""
from __future__ import annotations

import multiprocessing as mp

import torch

FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable"}


def unwrapped(tr):
    """DDP -> (Float16Module ->) GPTModel, as Megatron-LM's unwrap_model (one model chunk)."""
    if len(tr.model_chunks) != 1:
        raise SystemExit(f"megatron_dist_ckpt saves one model chunk; this run has {len(tr.model_chunks)} "
                         "(virtual pipeline stages): run it without --vpp")
    m = tr.model_chunks[0].module
    return getattr(m, "module", m)


def rng_state_object():
    """Megatron-LM's ``get_rng_state(ckpt_format='torch_dist')`` without --data-parallel-random-init
    (megatron/training/checkpointing.py): this rank's states, one ShardedObject per (PP, TP) coordinate."""
    import random

    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    return ShardedObject("rng_state", [state], (ps.get_pipeline_model_parallel_world_size(),
                                                ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def sharded_state_dict(tr, loading: bool) -> dict:
    model_sd = unwrapped(tr).sharded_state_dict()
    return {"model": model_sd,
            "optimizer": tr.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=FULLY_RESHARDABLE),
            "rng_state": rng_state_object(), "opt_param_scheduler": tr.scheduler.state_dict(),
            "iteration": tr.iteration, "consumed_train_samples": tr.counters["consumed_train_samples"]}


def fix_multi_bucket_save() -> None:
    """Megatron-LM PR 5077 for megatron-core 0.16/0.17 (module docstring): the gathered world tensors with each
    bucket at its offset in the padded buffer, where ``sharded_param_state_fully_reshardable`` slices them. Once per
    process (a second wrap would pad the padded state again)."""
    from megatron.core.optimizer import DistributedOptimizer
    packed = DistributedOptimizer.get_parameter_state_dp_zero
    if getattr(packed, "_shardsafe_padded", False):
        return

    def padded(self, *args, **kwargs):
        state = packed(self, *args, **kwargs)
        for gbuf_idx, buffer in enumerate(self.buffers if state is not None else ()):
            for world_tensors in state[gbuf_idx].values():
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    flat, at = world_tensors[key], 0
                    out = torch.zeros(buffer.numel, dtype=flat.dtype)
                    for b in buffer.buckets:
                        out[b.offset: b.offset + b.numel_unpadded] = flat[at: at + b.numel_unpadded]
                        at += b.numel_unpadded
                    world_tensors[key] = out
        return state

    padded._shardsafe_padded = True
    DistributedOptimizer.get_parameter_state_dp_zero = padded


def save(tr, folder: str) -> None:
    """Megatron-LM's ``save_checkpoint`` of the trainer's current iteration into ``folder``, an empty or new folder
    (collective). The writer's results queue lives in a multiprocessing manager that Megatron starts with "spawn",
    which re-imports the program's ``__main__`` in a fresh interpreter (seconds per rank on a small host): the same
    manager is started here by fork instead, before Megatron asks for it (what crosses the queue, and what is
    written, is unchanged), and stopped after the save."""
    import os

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    before = set(mp.active_children())
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()
    fix_multi_bucket_save()
    os.makedirs(folder, exist_ok=True)
    dist_checkpointing.save(sharded_state_dict(tr, loading=False), folder)
    for child in set(mp.active_children()) - before:   # the writer's manager process: ours to stop
        child.terminate()
        child.join()
    filesystem_async._results_queue = None
    torch.distributed.barrier()


def load(tr, folder: str) -> None:
    """Megatron-LM's ``load_checkpoint`` order (model, optimizer, scheduler, counters, then ``rng_state[0]``), with
    the step workarounds of the module docstring."""
    import random

    import numpy as np
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core.optimizer import DistributedOptimizer

    def set_states(self, model_param, tensors):   # _set_main_param_and_optimizer_states without KeyError 'step'
        gi, go = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[gi]["params"][go]
        dst = {"param": main, **self.optimizer.state[main]}
        for key, value in tensors.items():
            dst[key].copy_(value)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    fix_multi_bucket_save()   # the load builds its templates with the same function
    for leaf in tr.optimizer.chained_optimizers:
        leaf._init_optimizer_states_with_dummy_values()
    state = dist_checkpointing.load(sharded_state_dict(tr, loading=True), folder)
    unwrapped(tr).load_state_dict(state["model"])
    tr.optimizer.load_state_dict(state["optimizer"])
    for leaf in tr.optimizer.chained_optimizers:
        for s in leaf.optimizer.state.values():
            s["step"] = s["step"].clone()
    tr.scheduler.load_state_dict(state["opt_param_scheduler"])
    tr.iteration = state["iteration"]
    tr.counters["consumed_train_samples"] = state["consumed_train_samples"]
    rng = state["rng_state"][0]
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    torch.cuda.set_rng_state(rng["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["rng_tracker_states"])
