"""A plain DeepSpeed training script that knows nothing of shardsafe: protection comes from its config alone.

    torchrun --nproc-per-node 2 examples/ds_plain_gpt.py --config configs/deepspeed/plain_zero2_bf16.json \
        --ckpt-dir ckpt --steps 50
    shardsafe launch --nnodes 2 --nproc-per-node 1 examples/ds_plain_gpt.py --config ... --steps 50

It is written the way user scripts are: ``deepspeed.initialize(...)``, then ``engine.load_checkpoint(ckpt_dir)``
to resume, a loop from ``engine.global_steps``, and ``engine.save_checkpoint`` every ``--save-every`` steps.
With ``--client-state neox|megatron-deepspeed`` it behaves as those programs do: it gives deepspeed.initialize
their kind of ``args``, saves their client state, and counts its own iterations from the client state that
``load_checkpoint`` returns (from 0 when it returns none).
There is no ``import shardsafe`` below: with shardsafe installed, a ``"shardsafe"`` block in the config switches
protection on (adapters/autoload.py), and after a crash the restarted script continues from the newest
snapshot (its ``load_checkpoint`` of an older checkpoint keeps the snapshot).

For the tests it also writes, like examples/ds_pretrain_gpt.py, ``losses_rank{R}.jsonl`` (float.hex losses) and
``final_rank{R}``, and ``modules_rank{R}.json``: the shardsafe modules the program had imported when its
training ended (before the test-only state dump below imports shardsafe's adapter).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from datetime import timedelta

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_pretrain_gpt import TinyGPT, batch  # noqa: E402  (the same model and data as the other example)


def client_state(kind: str, step: int, consumed: int) -> dict:
    """save_checkpoint's client_state, in the layout of the program ``kind`` stands for."""
    if kind == "step":
        return {"step": step}
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state()}
    if kind == "neox":   # gpt-neox megatron/checkpointing.py save_ds_checkpoint
        return {"iteration": step, "args": {"iteration": step}, **rng}
    world = torch.distributed.get_world_size()   # Megatron-DeepSpeed: every data-parallel rank's RNG, gathered
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, rng)
    return {"iteration": step, "checkpoint_version": 3.0, "rng_state": gathered,
            "args": argparse.Namespace(consumed_train_samples=consumed, consumed_valid_samples=0)}


class NeoXArgs(argparse.Namespace):
    """GPT-NeoX passes its arguments object, a NeoXArgs, to deepspeed.initialize (``args=neox_args``)."""


def program_args(kind: str, a: argparse.Namespace) -> argparse.Namespace | None:
    """The ``args`` this script gives deepspeed.initialize, as the program ``kind`` stands for does: GPT-NeoX its
    NeoXArgs, Megatron-DeepSpeed its argparse namespace (with the data position beside ``deepspeed``), a plain
    script none unless the config travels in it (--config-as args)."""
    local = {"local_rank": int(os.environ.get("LOCAL_RANK", 0))}
    cfg = {"deepspeed_config": a.config} if a.config_as == "args" else {}
    if kind == "neox":
        return NeoXArgs(**local, **cfg)
    if kind == "megatron-deepspeed":
        return argparse.Namespace(deepspeed=True, consumed_train_samples=0, consumed_valid_samples=0, **local, **cfg)
    return argparse.Namespace(**local, **cfg) if cfg else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="DeepSpeed JSON config")
    p.add_argument("--config-as", choices=["path", "dict", "config_params", "args"], default="path",
                   help="how the config reaches deepspeed.initialize (every form DeepSpeed accepts)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ckpt-dir", default="", help="engine.load_checkpoint from here at start, save_checkpoint here")
    p.add_argument("--save-every", type=int, default=0, help="save_checkpoint every N steps (0 = never)")
    p.add_argument("--client-state", choices=["step", "neox", "megatron-deepspeed"], default="step",
                   help="what save_checkpoint's client_state holds and what the script sets from it after "
                        "load_checkpoint: its step only; GPT-NeoX's iteration and RNG states "
                        "(save_ds_checkpoint); Megatron-DeepSpeed's iteration, args.consumed_train_samples "
                        "(its data position) and rng_state list (one entry per data-parallel rank)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False   # CPU: no shm-comm JIT build
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=30))
    rank = torch.distributed.get_rank()
    torch.manual_seed(a.seed)
    model = TinyGPT(vocab=256, d=64, layers=2, heads=4, seq=32)
    torch.manual_seed(a.seed + 1 + rank)
    random.seed(a.seed + rank)
    np.random.seed(a.seed + rank)
    with open(a.config) as f:
        cfg = json.load(f)
    kw = {"path": {"config": a.config}, "dict": {"config": cfg}, "config_params": {"config_params": cfg},
          "args": {}}[a.config_as]
    pargs = program_args(a.client_state, a)
    if pargs is not None:
        kw["args"] = pargs
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), **kw)
    consumed = 0   # samples trained (all ranks): the data position in the megatron-deepspeed layout
    # GPT-NeoX and Megatron-DeepSpeed count their own iterations, from the client state's (0 without a checkpoint);
    # a plain script loops from the engine's counter
    own_counter = a.client_state != "step"
    iteration = 0
    if a.ckpt_dir:
        path, client = engine.load_checkpoint(a.ckpt_dir)
        if path is not None and own_counter:
            iteration = client["iteration"]
        if client and a.client_state != "step":   # these programs set their counters and RNG from it
            # Megatron-DeepSpeed with --data-parallel-random-init (this script seeds every rank differently)
            rng = client if a.client_state == "neox" else client["rng_state"][rank % engine.dp_world_size]
            random.setstate(rng["random_rng_state"])
            np.random.set_state(rng["np_rng_state"])
            torch.set_rng_state(rng["torch_rng_state"])
            if a.client_state == "megatron-deepspeed":
                consumed = client["args"].consumed_train_samples
            print(f"[rank {rank}] iteration {client['iteration']} from the client state", flush=True)
        print(f"[rank {rank}] load_checkpoint({a.ckpt_dir}) -> {path}, client state {sorted(client or {})}; "
              f"continuing after step {engine.global_steps}", flush=True)
    attempt = int(os.environ.get("SHARDSAFE_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    losses = open(os.path.join(a.out, f"losses_rank{rank}.jsonl"), "a") if a.out else None
    gas = engine.gradient_accumulation_steps()
    dp_rank = rank % engine.dp_world_size
    if not own_counter:
        iteration = engine.global_steps
    while iteration < a.steps:
        total = 0.0
        mb = engine.train_micro_batch_size_per_gpu()
        for i in range(gas):
            pos = consumed // (mb * engine.dp_world_size) if a.client_state == "megatron-deepspeed" else \
                engine.micro_steps
            x, y = batch(a.seed, pos, dp_rank, mb, 32, 256)
            consumed += mb * engine.dp_world_size
            loss = engine(x, y)
            engine.backward(loss)
            total += loss.item()
            if losses and i == gas - 1:
                losses.write(json.dumps({"step": iteration + 1, "loss": float(total).hex(),
                                         "attempt": attempt}) + "\n")
                losses.flush()
            engine.step()
        iteration = iteration + 1 if own_counter else engine.global_steps
        if a.ckpt_dir and a.save_every and iteration % a.save_every == 0:
            engine.save_checkpoint(a.ckpt_dir, client_state=client_state(a.client_state, iteration, consumed))
    if a.out:
        with open(os.path.join(a.out, f"modules_rank{rank}.json"), "w") as f:
            json.dump(sorted(m for m in sys.modules if m == "shardsafe" or m.startswith("shardsafe.")), f)
        # test-only: the state to compare bit for bit, in shardsafe's format (imports its adapter)
        from ds_pretrain_gpt import final_state
        from shardsafe.payload.manifest import save_tensors
        save_tensors(os.path.join(a.out, f"final_rank{rank}"), final_state(engine))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
