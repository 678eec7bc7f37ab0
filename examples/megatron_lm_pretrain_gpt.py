"""Tiny GPT through Megatron-LM's own training loop (``megatron.training.pretrain``), protected by shardsafe.

The only change to a Megatron-LM entry script is the import: ``shardsafe.adapters.megatron.pretrain``
instead of ``megatron.training.pretrain``. It adds the ``--shardsafe*`` flags to Megatron's parser and,
with ``--shardsafe``, hooks the holder runtime into ``megatron.training.training`` without forking it:
restore right after the model and optimizer exist, a snapshot after every optimizer step, and the wait
for the pending copy right before the next one. Without ``--shardsafe`` it is plain Megatron-LM.

Needs ``megatron.training``, which ships in the megatron-core wheels from 0.17 on (docs/megatron.md
says how to install 0.17.1 on Python 3.11; the project keeps it in ``.venv/mcore-0.17.1``). On a
CPU-only host the CPU shims are installed and gloo is used.

    PYTHONPATH=.venv/mcore-0.17.1 OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/megatron_lm_pretrain_gpt.py \\
        @configs/megatron/megatron_lm_tiny_gpt.args --shardsafe --out /tmp/ss-lm

Kill a rank mid-run and start the same command again: it continues from the newest snapshot,
bit-identically. ``--out DIR`` (default SHARDSAFE_RUN_DIR; taken out of argv before Megatron parses it)
receives losses_rank{R}.jsonl (``{"step", "loss": float.hex, "grad_norm", "attempt"}`` per iteration)
and final_rank{R}.{bin,json} (rank state + model params) for ``shardsafe.runcheck.compare_runs``, written when
Megatron-LM's ``train`` returns. Under ``shardsafe launch --restart in-place`` the script leaves torch.distributed
to shardsafe's ``pretrain``, which runs Megatron-LM's once per attempt (docs/operations.md, "Restart in place").
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from functools import partial
from typing import Any, Optional

if __name__ != "__mp_main__":
    # Megatron's torch_dist writer starts a multiprocessing Manager with the spawn method, which imports this script
    # as __mp_main__ and uses nothing of it: importing torch there cost about a second per save on every rank.
    import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

LOSSES: list[tuple[int, float]] = []  # (iteration, lm loss) seen by this rank, for tests


class MockGPTDataset:
    """Sample i: tokens fixed by (seed, i), so the data position is ``consumed_train_samples``. A map-style dataset
    (``__len__``, ``__getitem__``), which is all torch's DataLoader asks of one."""

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


def datasets_provider(train_val_test_num_samples, *_: Any, vp_stage: Optional[int] = None, **__: Any):
    """Mock datasets; with virtual pipeline stages Megatron-LM builds one loader per model chunk (and requires
    the ``vp_stage`` keyword), every chunk's over the same samples."""
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


RUN: dict[str, Any] = {}   # model, optimizer, scheduler and the last iteration of this process


def _attempt() -> int:
    return int(os.environ.get("SHARDSAFE_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def _rank() -> int:
    """This process's rank, also where no default group exists (before and after shardsafe.inplace.run)."""
    return int(os.environ.get("RANK", "0"))


def _pipeline_loss(loss: Optional[float]) -> Optional[float]:
    """The last pipeline stage's loss on every stage (training_log runs on all ranks every iteration)."""
    from megatron.core import parallel_state as ps
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return loss
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64, device=dev)
    torch.distributed.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(),
                                group=ps.get_pipeline_model_parallel_group())
    return float(t.item())


def _record(out_dir: str) -> None:
    """Keep the model/optimizer (for the final state) and each iteration's loss (training_log's loss dict)."""
    import megatron.training.training as T
    orig_log, orig_setup = T.training_log, T.setup_model_and_optimizer
    losses = None
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        losses = open(os.path.join(out_dir, f"losses_rank{_rank()}.jsonl"), "a")

    def setup_model_and_optimizer(*a, **k):
        RUN["model"], RUN["optimizer"], RUN["scheduler"] = out = orig_setup(*a, **k)
        return out

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, *a, **k):
        loss = float(loss_dict["lm loss"]) if "lm loss" in loss_dict else None
        loss = _pipeline_loss(loss)
        if loss is not None:
            LOSSES.append((int(iteration), loss))
        RUN["iteration"] = int(iteration)
        if losses is not None:
            losses.write(json.dumps({"step": int(iteration), "loss": loss.hex() if loss is not None else None,
                                     "grad_norm": float(grad_norm).hex() if grad_norm is not None else None,
                                     "attempt": _attempt()}) + "\n")
            losses.flush()
        return orig_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                        skipped_iter, grad_norm, *a, **k)

    orig_train = T.train

    def train(*a, **k):
        # The final state is saved where training ends, inside pretrain: under a restart in place the default group
        # exists only there (shardsafe.inplace.run ends it when pretrain returns).
        out = orig_train(*a, **k)
        if out_dir and "model" in RUN:
            before = set(sys.modules)
            _save_final(out_dir)
            RUN["imported_by_save"] = set(sys.modules) - before   # shardsafe's, not the program's (--plain-entry)
        return out

    T.training_log = training_log
    T.setup_model_and_optimizer = setup_model_and_optimizer
    T.train = train


def _save_final(out_dir: str) -> None:
    """Rank state (optimizer shards and state, RNGs, ...) plus every model parameter, bit for bit."""
    from shardsafe.adapters.megatron import MegatronStateAdapter
    from shardsafe.payload.manifest import save_tensors

    model = RUN["model"]
    ad = MegatronStateAdapter(model, RUN["optimizer"], RUN["scheduler"], get_iteration=lambda: RUN.get("iteration", 0),
                              set_iteration=lambda _: None)
    out = dict(ad.capture().tensors)
    out.update({f"model/c{i}.{n}": p.detach() for i, c in enumerate(model) for n, p in c.named_parameters()})
    save_tensors(os.path.join(out_dir, f"final_rank{_rank()}"), out)


def main(argv: Optional[list[str]] = None, *, runtime_factory=None) -> list[tuple[int, float]]:
    """Parse Megatron's flags from argv (plus ``--out``), train, return the losses this rank saw."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("@"):  # Megatron's parser has no fromfile support: expand it here
        with open(argv[0][1:]) as f:
            argv = f.read().split() + argv[1:]
    out_dir = os.environ.get("SHARDSAFE_RUN_DIR", "")
    # --plain-entry: call Megatron-LM's own pretrain (and parse_and_validate_args from 0.18 on) exactly as its
    # pretrain_gpt.py does, importing nothing of shardsafe: --shardsafe on the command line is then all that
    # protects the run (automatic activation, adapters/autoload.py).
    plain = "--plain-entry" in argv
    if plain:
        argv.remove("--plain-entry")
    if "--out" in argv:
        i = argv.index("--out")
        out_dir = argv[i + 1]
        del argv[i:i + 2]
    if os.environ.get("SHARDSAFE_RUN_DIR") and not plain:
        from shardsafe.tor import EventLog   # process start, before the slow framework imports
        EventLog(os.environ["SHARDSAFE_RUN_DIR"], source="trainer", rank=int(os.environ.get("RANK", 0)),
                 attempt=_attempt()).emit("trainer_start")
    if sys.version_info < (3, 12):
        import typing   # megatron.training >= 0.18 imports typing.override (Python 3.12); it is a no-op decorator
        if not hasattr(typing, "override"):
            typing.override = lambda f: f
    # Under `shardsafe launch --restart in-place` shardsafe's pretrain makes the default group itself, once per
    # attempt (shardsafe.inplace.run), as it lets Megatron-LM do on a GPU cluster.
    in_place = os.environ.get("SHARDSAFE_RESTART") == "in-place" and not plain
    if not torch.distributed.is_initialized():
        if torch.cuda.is_available():
            backend = "nccl"
        else:
            import _megatron_cpu_shims
            _megatron_cpu_shims.install_training_shims()
            backend = "gloo"
        if not in_place:
            torch.distributed.init_process_group(backend, timeout=timedelta(seconds=60))
    elif not torch.cuda.is_available():
        import _megatron_cpu_shims
        _megatron_cpu_shims.install_training_shims()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if os.environ.get("SHARDSAFE_TEST_FILL_EMPTY") == "1":
        # TEST-ONLY: torch.empty memory filled with NaN, so the never-written gaps of Megatron's
        # padded optimizer buffers are the same in two checkpoints (instead of whatever the
        # allocator returned) and files can be compared byte for byte.
        from torch.utils import deterministic
        torch.use_deterministic_algorithms(True, warn_only=True)
        deterministic.fill_uninitialized_memory = True

    if not plain and ("--save" in argv or "--shardsafe-export-dir" in argv):   # a save ahead (an export is one)
        _fork_results_queue()
    from megatron.core.enums import ModelType

    _record(out_dir)
    sys.argv = [sys.argv[0]] + argv  # Megatron-LM parses sys.argv
    kw = {"runtime_factory": runtime_factory} if runtime_factory is not None else {}
    import inspect
    import megatron.training.training as T
    if plain:
        _plain_entry(ModelType.encoder_or_decoder)
        if out_dir:
            with open(os.path.join(out_dir, f"modules_rank{_rank()}.json"), "w") as f:
                json.dump(sorted(m for m in sys.modules if (m == "shardsafe" or m.startswith("shardsafe."))
                                 and m not in RUN.get("imported_by_save", ())), f)
        return list(LOSSES)
    from shardsafe.adapters import megatron as ss_megatron
    if in_place:
        from shardsafe.inplace import on_let_go
        on_let_go("this example's model", RUN.clear)   # an abandoned attempt's model holds its groups
    if "extra_args_provider" in inspect.signature(T.pretrain).parameters:   # megatron-core <= 0.17
        ss_megatron.pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                             args_defaults={"tokenizer_type": "NullTokenizer"}, **kw)
    else:   # >= 0.18: the entry script parses the flags (with shardsafe's) and builds the config container
        from megatron.training.arguments import parse_and_validate_args
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        args = parse_and_validate_args(extra_args_provider=ss_megatron.add_arguments,
                                       args_defaults={"tokenizer_type": "NullTokenizer"})
        ss_megatron.pretrain(pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder,
                             forward_step, model_provider=model_provider, **kw)
    return list(LOSSES)


def _fork_results_queue() -> None:
    """Megatron's torch_dist writer keeps its results queue in a multiprocessing manager that it starts with "spawn",
    which imports this script again in a fresh interpreter on every rank at its first save (seconds of CPU each on a
    small host): the same manager is started here by fork instead, before Megatron asks for it. What crosses the
    queue and what is written are unchanged; the manager stops at exit with its proxy's owner, this process."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", "absent") is None:   # 0.17-0.19: one module-level queue
        import multiprocessing as mp
        filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()


def _plain_entry(model_type: Any) -> None:
    """What Megatron-LM's pretrain_gpt.py does (both calling conventions), with this file's providers."""
    from megatron.training import pretrain
    import inspect
    if "extra_args_provider" in inspect.signature(pretrain).parameters:   # megatron-core <= 0.17
        pretrain(datasets_provider, model_provider, model_type, forward_step,
                 args_defaults={"tokenizer_type": "NullTokenizer"}, extra_args_provider=None)
    else:
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args
        args = parse_and_validate_args(extra_args_provider=None, args_defaults={"tokenizer_type": "NullTokenizer"})
        pretrain(pretrain_cfg_container_from_args(args), datasets_provider, model_type, forward_step,
                 model_provider=model_provider)


if __name__ == "__main__":  # the guard matters: Megatron's async saving starts spawn-based helpers
    main()
