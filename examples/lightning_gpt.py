"""A plain Lightning script that knows nothing of shardsafe: ``Trainer(strategy=DeepSpeedStrategy(config=...))``.

    shardsafe launch --nnodes 2 --nproc-per-node 1 examples/lightning_gpt.py --out run --steps 10 --cpu

A tiny GPT (examples/ds_pretrain_gpt.py's ``TinyGPT``) as a ``LightningModule`` trained with ``Trainer.fit`` and
Lightning's DeepSpeed strategy (ZeRO-2, bf16, DeepSpeed's AdamW from the config, gradient clipping), on a
synthetic deterministic dataset with a seeded ``DistributedSampler`` (Lightning's own). The ``"shardsafe"`` block
in the DeepSpeed config switches protection on (adapters/autoload.py), and after a crash the same command
continues at the snapshot's step (adapters/lightning.py). ``--no-shardsafe`` drops the block (the tests'
reference run). ``--cpu`` runs on this project's CPU machines: Lightning refuses its DeepSpeed strategy without a
CUDA accelerator, so the script then uses the GPU stand-in of examples/_lightning_cpu_shims.py.

For the tests it writes ``losses_rank{R}.jsonl``, ``modules_rank{R}.json`` and ``final_rank{R}`` like
examples/hf_trainer_gpt.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
VOCAB, SEQ = 256, 16


class SyntheticLM(torch.utils.data.Dataset):
    """``n`` token sequences, each a pure function of (seed, index)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100003 + i)
        ids = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
        return ids[:-1], ids[1:]


def ds_config(shardsafe: bool, interval: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,   # accumulation: Lightning's own
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                        "warmup_num_steps": 4}},
           "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "steps_per_print": 10 ** 9}
    if shardsafe:
        cfg["shardsafe"] = {"enabled": True, "interval": interval}
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--samples", type=int, default=24, help="dataset size (all ranks)")
    p.add_argument("--interval", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-shardsafe", action="store_true")
    p.add_argument("--cpu", action="store_true", help="the GPU stand-in (examples/_lightning_cpu_shims.py)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)

    torch.set_num_threads(1)
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False   # CPU: no shm-comm JIT build
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from ds_pretrain_gpt import TinyGPT

    rank = int(os.environ.get("RANK", 0))
    attempt = int(os.environ.get("SHARDSAFE_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    losses = open(os.path.join(a.out, f"losses_rank{rank}.jsonl"), "a") if a.out else None

    class LitGPT(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = TinyGPT(VOCAB, 32, 2, 4, SEQ)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.net(x, y)
            if losses:
                losses.write(json.dumps({"step": self.global_step + 1, "loss": float(loss.detach().float()).hex(),
                                         "attempt": attempt}) + "\n")
                losses.flush()
            return loss

        def configure_optimizers(self):
            return None   # DeepSpeed builds the optimizer and scheduler from its config

    pl.seed_everything(a.seed, workers=True)
    model = LitGPT()
    nodes = int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    accelerator: object = "gpu"
    if a.cpu:
        from _lightning_cpu_shims import CPUStandInForCUDA
        accelerator = CPUStandInForCUDA()
    trainer = pl.Trainer(accelerator=accelerator, devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), num_nodes=nodes,
                         strategy=DeepSpeedStrategy(config=ds_config(not a.no_shardsafe, a.interval),
                                                    process_group_backend="gloo" if a.cpu else None),
                         precision="bf16-mixed", max_steps=a.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=True,
                         default_root_dir=a.out or ".")
    loader = torch.utils.data.DataLoader(SyntheticLM(a.samples, a.seed), batch_size=4, shuffle=True, num_workers=0)
    trainer.fit(model, loader)
    print(f"[rank {rank}] fit() done at global step {trainer.global_step}", flush=True)
    if a.out:
        with open(os.path.join(a.out, f"modules_rank{rank}.json"), "w") as f:
            json.dump(sorted(m for m in sys.modules if m == "shardsafe" or m.startswith("shardsafe.")), f)
        from ds_pretrain_gpt import final_state
        from shardsafe.payload.manifest import save_tensors
        save_tensors(os.path.join(a.out, f"final_rank{rank}"), final_state(
            trainer.strategy.model, schedulers=tuple(c.scheduler for c in trainer.lr_scheduler_configs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
