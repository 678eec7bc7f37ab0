"""Tiny GPT through Megatron-LM's own training loop (``megatron.training.pretrain``), protected by shardsafe.

The only change to a Megatron-LM entry script is the import: ``shardsafe.adapters.megatron.pretrain``
instead of ``megatron.training.pretrain``. It adds the ``--shardsafe*`` flags to Megatron's parser and
hooks snapshot (after every optimizer step) and restore (right after the model and optimizer exist)
into ``megatron.training.training`` without forking it.

Needs ``megatron.training``, which ships in the megatron-core wheels from 0.17 on (docs/megatron.md
says how to install 0.17.1 on Python 3.11). On a CPU-only host the CPU shims are installed and gloo is
used. Until the holder runtime is wired in, ``--demo-snapshot-dir DIR`` uses a file-based stand-in
(examples/_demo_runtime.py): run once with ``--train-iters 4``, then again with ``--train-iters 6``
and it continues from iteration 4, bit-identically.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/megatron_lm_pretrain_gpt.py \\
        @configs/megatron/megatron_lm_tiny_gpt.args --shardsafe --demo-snapshot-dir /tmp/ss-demo
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from functools import partial
from typing import Any, Optional

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

LOSSES: list[tuple[int, float]] = []  # (iteration, lm loss) seen by this rank, for tests


class MockGPTDataset(torch.utils.data.Dataset):
    """Sample i: tokens fixed by (seed, i), so the data position is ``consumed_train_samples``."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.n, self.s, self.v, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        toks = torch.randint(0, self.v, (self.s + 1,), generator=g)
        return {"tokens": toks[:-1], "labels": toks[1:], "loss_mask": torch.ones(self.s),
                "position_ids": torch.arange(self.s)}


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                   config: Any = None, pg_collection: Any = None, **_: Any):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, share_embeddings_and_output_weights=True,
                    **({"vp_stage": vp_stage} if vp_stage is not None else {}))


def datasets_provider(train_val_test_num_samples, *_: Any, **__: Any):
    from megatron.training import get_args
    args = get_args()
    return (MockGPTDataset(int(train_val_test_num_samples[0]), args.seq_length, args.padded_vocab_size, args.seed),
            None, None)


datasets_provider.is_distributed = True  # every rank builds its own loader: no TP broadcast of batches needed


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone().view(1)}


def forward_step(data_iterator, model, *_: Any, **__: Any):
    b = next(data_iterator)
    s = b["tokens"].shape[1]
    mask = torch.tril(torch.ones(1, 1, s, s, device=b["tokens"].device)) < 0.5
    out = model(b["tokens"], b["position_ids"], mask, labels=b["labels"])
    return out, partial(_loss_func, b["loss_mask"])


def _record_losses() -> None:
    """Keep each iteration's reported loss (training_log receives the DP-averaged loss dict)."""
    import megatron.training.training as T
    orig = T.training_log

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *a, **k):
        if "lm loss" in loss_dict:
            LOSSES.append((int(iteration), float(loss_dict["lm loss"])))
        return orig(loss_dict, total_loss_dict, learning_rate, iteration, *a, **k)

    T.training_log = training_log


def main(argv: Optional[list[str]] = None, *, runtime_factory=None) -> list[tuple[int, float]]:
    """Parse Megatron's flags from argv (plus ``--demo-snapshot-dir``), train, return the losses seen."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("@"):  # Megatron's parser has no fromfile support: expand it here
        with open(argv[0][1:]) as f:
            argv = f.read().split() + argv[1:]
    demo_dir = None
    if "--demo-snapshot-dir" in argv:
        i = argv.index("--demo-snapshot-dir")
        demo_dir = argv[i + 1]
        del argv[i:i + 2]
    if not torch.distributed.is_initialized():
        if torch.cuda.is_available():
            backend = "nccl"
        else:
            import _megatron_cpu_shims
            _megatron_cpu_shims.install_training_shims()
            backend = "gloo"
        torch.distributed.init_process_group(backend, timeout=timedelta(seconds=60))
    elif not torch.cuda.is_available():
        import _megatron_cpu_shims
        _megatron_cpu_shims.install_training_shims()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if runtime_factory is None and demo_dir is not None:
        from _demo_runtime import DirRuntime

        def runtime_factory(cfg):
            return DirRuntime(demo_dir, interval=cfg.interval)

    from megatron.core.enums import ModelType
    from shardsafe.adapters import megatron as ss_megatron

    _record_losses()
    sys.argv = [sys.argv[0]] + argv  # Megatron-LM parses sys.argv
    kw = {"runtime_factory": runtime_factory} if runtime_factory is not None else {}
    ss_megatron.pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                         args_defaults={"tokenizer_type": "NullTokenizer"}, **kw)
    return list(LOSSES)


if __name__ == "__main__":
    for it, loss in main():
        pass
