"""A plain Hugging Face ``Trainer`` script that knows nothing of shardsafe: protection comes from its config alone.

    torchrun --nproc-per-node 2 examples/hf_trainer_gpt.py --out run --steps 10
    shardsafe launch --nnodes 2 --nproc-per-node 1 examples/hf_trainer_gpt.py --out run --steps 10

A tiny GPT-2 (``transformers.GPT2Config``: 2 layers, width 64, vocabulary 256, built from the config: nothing is
downloaded) trained on a synthetic, deterministic dataset with ``Trainer.train()`` and a DeepSpeed ZeRO-2 config
passed as ``TrainingArguments(deepspeed=<dict>)`` with HF's ``"auto"`` values. HF/Accelerate call
``deepspeed.initialize`` with that dict; the ``"shardsafe"`` block in it switches protection on
(adapters/autoload.py), and after a crash the same command continues at the snapshot's step with its data
position, LR schedule and RNG, as ``trainer.train(resume_from_checkpoint=...)`` would (adapters/hf.py).
``--no-shardsafe`` drops the block (the reference run of the tests). ``--hp-trials N`` runs
``Trainer.hyperparameter_search`` (optuna, a seeded sampler) instead: one engine per trial, each with its own
snapshots, so a crash in trial k resumes trial k (the finished trials restore their last step and end at once). ``--save-steps N --resume-last`` is the
resume pattern of HF's example scripts (run_clm.py): HF checkpoints every N steps, and ``train(resume_from_checkpoint=
get_last_checkpoint(output_dir))``; after a crash the snapshot, being newer than the last checkpoint, wins.

For the tests it writes, like examples/ds_plain_gpt.py, ``losses_rank{R}.jsonl`` (this rank's loss of every
optimizer step as float.hex, recorded by a ``compute_loss`` override that calls HF's own), ``modules_rank{R}.json``
(the shardsafe modules imported by the end of training) and ``final_rank{R}`` (the engine's state in shardsafe's
format: the only shardsafe import, after training).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

VOCAB, SEQ = 256, 32


class SyntheticLM(torch.utils.data.Dataset):
    """``n`` token sequences, each a pure function of (seed, index): every run and rank sees the same data."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 100003 + i)
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def ds_config(shardsafe: bool, interval: int, *, ds_optimizer: bool = True, ds_scheduler: bool = False,
              stage: int = 2) -> dict:
    """ZeRO-2, bf16, DeepSpeed's AdamW, HF's own (LambdaLR) schedule: the "auto" values are HF's to fill in.
    ``ds_optimizer=False``: no "optimizer" block, so HF builds its own (``TrainingArguments.optim``) and steps its
    own schedule; ``ds_scheduler``: a "scheduler" block (DeepSpeed's WarmupDecayLR, which the engine steps)."""
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": "auto"},
        "steps_per_print": 1000000000,
    }
    if ds_scheduler:
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto", "total_num_steps": "auto"}}
    if ds_optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}}
    if shardsafe:
        cfg["shardsafe"] = {"enabled": True, "interval": interval}
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--gas", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--samples", type=int, default=256, help="dataset size (samples per epoch, all ranks)")
    p.add_argument("--interval", type=int, default=1, help="shardsafe snapshot interval")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-shardsafe", action="store_true", help="no \"shardsafe\" block in the DeepSpeed config")
    p.add_argument("--save-steps", type=int, default=0, help="HF checkpoints every N steps (0: none)")
    p.add_argument("--resume-last", action="store_true",
                   help="train(resume_from_checkpoint=<newest checkpoint-N in output_dir>), as HF's run_clm.py does")
    p.add_argument("--hp-trials", type=int, default=0,
                   help="run Trainer.hyperparameter_search (optuna, seeded random sampler, learning rate) with this many "
                        "trials instead of one train(): HF builds a new DeepSpeed engine for every trial")
    p.add_argument("--optim", default="",
                   help="no \"optimizer\" block in the DeepSpeed config: HF builds this optimizer itself "
                        "(TrainingArguments.optim: adamw_torch_fused, adamw_torch, adafactor, sgd, ...)")
    p.add_argument("--lr-scheduler", default="linear", help="TrainingArguments.lr_scheduler_type")
    p.add_argument("--ds-scheduler", action="store_true",
                   help="a \"scheduler\" block (DeepSpeed's WarmupDecayLR) instead of HF's own schedule")
    p.add_argument("--zero-stage", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--out", default="")
    a = p.parse_args(argv)

    torch.set_num_threads(1)
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False   # CPU: no shm-comm JIT build
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=os.path.join(a.out or ".", "hf_output"), max_steps=a.steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=a.gas, learning_rate=1e-3, weight_decay=0.01, warmup_steps=2,
        lr_scheduler_type=a.lr_scheduler, **({"optim": a.optim} if a.optim else {}), logging_steps=1, report_to=[], seed=a.seed,
        save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500,
        dataloader_num_workers=0, bf16=True, use_cpu=True, deepspeed=ds_config(not a.no_shardsafe, a.interval, ds_optimizer=not a.optim,
                                                                  ds_scheduler=a.ds_scheduler, stage=a.zero_stage),
        ddp_backend="gloo", disable_tqdm=True)
    rank = args.process_index
    # the model after TrainingArguments (it sets up the process group) and with the seed fixed, as HF examples do
    from transformers import set_seed
    set_seed(a.seed)
    def model_init(trial: object = None) -> GPT2LMHeadModel:
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4))

    model = None if a.hp_trials else model_init()   # a search builds one per trial (HF seeds before each)
    attempt = int(os.environ.get("SHARDSAFE_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    losses = open(os.path.join(a.out, f"losses_rank{rank}.jsonl"), "a") if a.out else None

    class LoggingTrainer(Trainer):
        """Trainer with the loss of every optimizer step recorded in the tests' format (nothing else changed)."""

        _acc = 0.0
        _phase = -1          # which train() call of the process is running (a search: the trial)
        engines: list = []   # each train()'s engine: a search frees the trainer's reference after every trial

        def train(self, *args, **kwargs):
            self._phase += 1
            out = super().train(*args, **kwargs)
            self.engines.append(self.model_wrapped)
            if a.hp_trials:   # the trial's learning rate and what its loop ended with
                print(f"[rank {rank}] trial {self._phase}: learning_rate {self.args.learning_rate!r}, "
                      f"global step {self.state.global_step}, training loss {float(out.training_loss).hex()}", flush=True)
            return out

        def compute_loss(self, model, inputs, *args, **kwargs):
            out = super().compute_loss(model, inputs, *args, **kwargs)
            if not model.training:   # evaluate() (a search's objective) computes its loss here too: not a step
                return out
            loss = out[0] if isinstance(out, tuple) else out
            self._acc += float(loss.detach().float().item())
            micro = getattr(self, "_micro", 0) + 1
            self._micro = micro
            if losses and micro % a.gas == 0:
                step = self._phase * a.steps + self.state.global_step + 1   # numbered across the train() calls
                rec = {"step": step, "loss": float(self._acc).hex(), "attempt": attempt}
                if self._phase:   # HF's engine of this train() is the process's engine number _phase (its scope)
                    rec["engine"] = f"engine{self._phase}"
                losses.write(json.dumps(rec) + "\n")
                losses.flush()
                self._acc = 0.0
            return out

    trainer = LoggingTrainer(model=model, model_init=model_init if a.hp_trials else None, args=args,
                             train_dataset=SyntheticLM(a.samples, a.seed),
                             eval_dataset=SyntheticLM(8, a.seed + 1) if a.hp_trials else None)
    if a.hp_trials:
        import optuna
        best = trainer.hyperparameter_search(
            direction="minimize", backend="optuna", n_trials=a.hp_trials,
            hp_space=lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-4, 3e-3, log=True)},
            sampler=optuna.samplers.RandomSampler(seed=a.seed))
        print(f"[rank {rank}] hyperparameter_search done after {trainer._phase + 1} trial(s): best {best}", flush=True)
    else:
        last = None
        if a.resume_last and os.path.isdir(args.output_dir):
            from transformers.trainer_utils import get_last_checkpoint
            last = get_last_checkpoint(args.output_dir)
        print(f"[rank {rank}] train(resume_from_checkpoint={last})", flush=True)
        result = trainer.train(resume_from_checkpoint=last)
        print(f"[rank {rank}] train() done at global step {trainer.state.global_step} "
              f"(epoch {trainer.state.epoch:.3f}, training loss {result.training_loss:.4f})", flush=True)
    if a.out:
        with open(os.path.join(a.out, f"modules_rank{rank}.json"), "w") as f:
            json.dump(sorted(m for m in sys.modules if m == "shardsafe" or m.startswith("shardsafe.")), f)
        # test-only: the state to compare bit for bit, in shardsafe's format (imports its adapter)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from ds_pretrain_gpt import final_state
        from shardsafe.payload.manifest import save_tensors
        save_tensors(os.path.join(a.out, f"final_rank{rank}"), final_state(trainer.engines[-1],
                                                                          schedulers=(trainer.lr_scheduler,)))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
