"""The program's own resume through ``engine.load_checkpoint`` after a restore: what an older disk checkpoint's
client state must say for a program that sets its counters, data position and RNG from it (GPT-NeoX,
Megatron-DeepSpeed, plain scripts). Used by the DeepSpeed adapter's ``load_checkpoint`` wrapper
(adapters/deepspeed/ ``ShardsafeEngineHook._resume_load``); docs/deepspeed.md has the table of rules.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from . import rng_trackers

# What DeepSpeed keeps for itself in a checkpoint's model-states file (engine._load_checkpoint); the rest is the
# program's client state.
DS_CHECKPOINT_KEYS = frozenset({"module", "buffer_names", "optimizer", "lr_scheduler", "sparse_tensor_module_names",
                                 "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                                 "data_sampler", "random_ltd", "ds_config", "ds_version", "shared_params",
                                 "frozen_param_shapes", "frozen_param_fragments", "param_shapes"})
_CLIENT_COUNTERS = ("iteration", "step", "steps", "global_step", "global_steps")
# Data position a program keeps in its client state as a sample count (Megatron-DeepSpeed: ``args``), moved
# from the checkpoint's ``global_samples`` to the engine's when they are equal.
_CLIENT_SAMPLE_COUNTERS = ("consumed_train_samples", "consumed_samples")
# RNG states GPT-NeoX (``save_ds_checkpoint``) and Megatron-DeepSpeed (``get_rng_state``: a list of these dicts
# under ``rng_state``, one per data-parallel rank) keep in the client state and set after load_checkpoint.
_CLIENT_RNG_KEYS = ("random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states")


def megatron_ds_counters(args: Any, *, v: int, samples: int) -> dict[str, int]:
    """Megatron-DeepSpeed's counters beyond ``consumed_train_samples`` as of step v with ``samples`` consumed,
    where its loop makes them a function of those two (megatron/training.py ``train``/``evaluate``), and only
    then:

    - ``consumed_train_tokens`` = samples x ``seq_length``: every step adds ``new_samples * actual_seq_length``,
      which is ``seq_length`` unless curriculum learning or random-LTD shortens it;
    - ``consumed_valid_samples`` = (v // ``eval_interval``) x ``eval_iters`` x ``global_batch_size``: every
      ``eval_interval``-th iteration evaluates ``eval_iters`` global batches (the value Megatron-DeepSpeed itself
      derives when an iteration-based checkpoint has none), unless the batch size ramps up.

    Without validation data the loop never reads ``consumed_valid_samples``, so the formula is harmless there."""
    out: dict[str, int] = {}
    variable = any(getattr(args, k, False) for k in ("curriculum_learning_legacy", "data_efficiency_curriculum_learning",
                                                      "curriculum_learning", "random_ltd"))
    seq = getattr(args, "seq_length", None)
    if not variable and _pos_int(seq):
        out["consumed_train_tokens"] = samples * seq
    ev, iters, gbs = (getattr(args, k, None) for k in ("eval_interval", "eval_iters", "global_batch_size"))
    if all(_pos_int(x) for x in (ev, iters, gbs)) and not getattr(args, "rampup_batch_size", None):
        out["consumed_valid_samples"] = (v // ev) * iters * gbs
    return out


def _pos_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def live_rng() -> dict[str, Any]:
    """This process's RNG states in the form those programs save them."""
    import random
    import numpy as np
    out: dict[str, Any] = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                           "torch_rng_state": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_rng_state"] = torch.cuda.get_rng_state()
    tracker = rng_trackers.client_states()
    if tracker is not None:   # Megatron-DeepSpeed's get_rng_state(): the model-parallel tracker's states
        out["rng_tracker_states"] = tracker
    return out


def client_state_at(client: dict, *, step: int, v: int, samples: Any, live_samples: int,
                     rng: Mapping[str, Any] | None, dp_rank: int) -> list[str]:
    """The client state of an older disk checkpoint, as it would be had the program saved it at v: the
    program sets its counters, data position and RNG from it after load_checkpoint, and the engine holds v.
    Step counters equal to the checkpoint's step become v, sample counters equal to its ``global_samples``
    the engine's, and the RNG states those programs keep (top level, or ``rng_state[i]``) the ones the
    snapshot restored. Returns the keys it changed (for the log)."""
    changed: list[str] = []
    for k in _CLIENT_COUNTERS:
        if isinstance(client.get(k), int) and not isinstance(client[k], bool) and client[k] == step:
            client[k] = v
            changed.append(k)
    holders: list[tuple[str, Any]] = [("", client)]
    if "args" in client:
        holders.append(("args.", client["args"]))
    for where, h in holders:
        for k in _CLIENT_SAMPLE_COUNTERS:
            cur = h.get(k) if isinstance(h, dict) else getattr(h, k, None)
            if isinstance(cur, int) and not isinstance(cur, bool) and isinstance(samples, int) and cur == samples:
                if isinstance(h, dict):
                    h[k] = live_samples
                else:
                    setattr(h, k, live_samples)
                changed.append(where + k)
    ckpt_args = client.get("args")
    if ckpt_args is not None and not isinstance(ckpt_args, dict) and isinstance(samples, int):
        # Megatron-DeepSpeed's tokens and validation position, moved from the checkpoint's step to v when they
        # are what its loop made of that step (megatron_ds_counters), never otherwise.
        then = megatron_ds_counters(ckpt_args, v=step, samples=samples)
        now = megatron_ds_counters(ckpt_args, v=v, samples=live_samples)
        for k, val in then.items():
            if getattr(ckpt_args, k, None) == val and k in now:
                setattr(ckpt_args, k, now[k])
                changed.append("args." + k)
    if rng:
        dicts: list[tuple[str, dict]] = [("", client)]
        listed = client.get("rng_state")
        if isinstance(listed, list):   # Megatron-DeepSpeed reads [dp_rank] or [0]: both are this rank's at v
            for i in {0, dp_rank} & set(range(len(listed))):
                if isinstance(listed[i], dict):
                    listed[i] = dict(listed[i])
                    dicts.append((f"rng_state[{i}].", listed[i]))
        for where, d in dicts:
            for k in _CLIENT_RNG_KEYS:
                if k in d and k in rng:
                    d[k] = rng[k]
                    changed.append(where + k)
    return changed


def disk_checkpoint(engine: Any, load_dir: Any, tag: Any) -> tuple[Any, dict | None]:
    """(tag, the model-states dict) of the checkpoint ``engine.load_checkpoint(load_dir, tag)`` would load, or
    (tag, None) when there is none. The file is the program's own checkpoint, read as DeepSpeed reads it."""
    if tag is None:
        latest = os.path.join(str(load_dir), "latest")
        if not os.path.isfile(latest):
            return None, None
        with open(latest) as f:
            tag = f.read().strip()
    path = engine._get_ckpt_name(str(load_dir), tag)
    if not os.path.isfile(path):
        return tag, None
    return tag, torch.load(path, map_location="cpu", weights_only=False)


# --- no disk checkpoint yet: the client state the program would have saved at v -------------------------------

def program_layout(setting: str, program_args: Any) -> str:
    """Whose client state a program keeps: the ``resume_client_state`` setting, or for "auto" the kind of the
    ``args`` it gave deepspeed.initialize: GPT-NeoX passes its ``NeoXArgs``; Megatron-DeepSpeed its argparse
    namespace, which holds the data position (``consumed_train_samples``) beside ``deepspeed``. Anything else:
    "none" (a program that loops from ``engine.global_steps``)."""
    if setting != "auto":
        return setting
    if program_args is None:
        return "none"
    if type(program_args).__name__ == "NeoXArgs":
        return "neox"
    if all(hasattr(program_args, k) for k in ("deepspeed", "consumed_train_samples", "consumed_valid_samples")):
        return "megatron-deepspeed"
    return "none"


def client_state_without_checkpoint(layout: str, *, v: int, program_args: Any, live_samples: int,
                                    rng: Mapping[str, Any] | None, dp_world: int) -> dict | None:
    """The client state ``layout``'s program saves with its checkpoints, as of snapshot version v, for a
    ``load_checkpoint`` that finds no checkpoint: without it GPT-NeoX and Megatron-DeepSpeed take DeepSpeed's
    (None, None) for a fresh start and count their iterations (and Megatron-DeepSpeed its data position) from 0
    while the engine holds v. None for "none".

    - neox (megatron/checkpointing.py ``save_ds_checkpoint``): ``iteration`` and the RNG states at top level
      (no ``args``: GPT-NeoX then skips its argument check, as for a checkpoint without them);
    - megatron-deepspeed (``save_checkpoint``/``generate_state_dict``): ``iteration``, ``checkpoint_version``,
      ``args`` (a copy of the program's own, so ``check_checkpoint_args`` agrees, with ``consumed_train_samples``
      the engine's restored ``global_samples``), and ``rng_state``, one entry per data-parallel rank, each this
      rank's restored RNG (Megatron-DeepSpeed reads the entry at its DP rank or at 0: either way the RNG this
      rank had at v), and ``consumed_train_tokens`` / ``consumed_valid_samples`` as the loop makes them of step
      v (:func:`megatron_ds_counters`; where it does not, they keep the program's start values: docs/deepspeed.md).
    """
    if layout == "none":
        return None
    states = dict(rng or {})
    if layout == "neox":
        return {"iteration": v, **states}
    import copy
    args = copy.copy(program_args)
    if args is not None and hasattr(args, "consumed_train_samples"):
        args.consumed_train_samples = live_samples
        for k, val in megatron_ds_counters(args, v=v, samples=live_samples).items():
            if hasattr(args, k):
                setattr(args, k, val)
    per_rank = [states] * max(1, dp_world)
    return {"iteration": v, "checkpoint_version": 3.0, "args": args, "rng_state": per_rank}
