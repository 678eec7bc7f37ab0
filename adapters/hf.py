"""Hugging Face ``Trainer``: a restored snapshot resumes the Trainer as ``resume_from_checkpoint`` would.

HF/Accelerate build the DeepSpeed engine inside ``Trainer._inner_training_loop`` (``_prepare_for_training`` ->
``deepspeed_init`` / ``accelerator.prepare`` -> ``deepspeed.initialize``), and the automatic activation
(adapters/autoload.py) protects it there when HF's DeepSpeed config has a ``"shardsafe"`` block: the engine
restores the newest snapshot (version v) at initialize. By then HF has already decided where its loop starts
(``_init_training_state``: step 0 unless ``resume_from_checkpoint`` was passed), so the autoload also wraps four
``transformers.Trainer`` methods (on the class, when ``transformers.trainer`` is imported: no fork, no edit of
transformers' files). Each wrapper checks ``trainer.model_wrapped.shardsafe`` first and calls HF's own method
unchanged when the engine is not protected; only then is this module imported:

- ``_prepare_for_training``: after HF's, when the engine restored v (and a checkpoint the program passed as
  ``resume_from_checkpoint`` is not newer: the engine's ``load_checkpoint`` wrapper keeps the newer of the two),
  ``TrainerState`` continues at ``global_step = v`` with the reporting counters the snapshot recorded, and the
  RNG states the snapshot restored are kept aside for the data loop. Rank 0 says so in one log line.
- ``_run_epoch``: the epoch of step v runs as HF's resume runs it: the loop's ``epochs_trained`` and
  ``steps_trained_in_current_epoch`` are those of v (``v // updates_per_epoch``; ``(v % updates_per_epoch) *
  gradient_accumulation_steps`` batches skipped with ``skip_first_batches``, none with ``ignore_data_skip``),
  epochs before it are not run, and HF's ``_load_rng_state`` (after the skip, or at the epoch's start) puts back
  the snapshot's RNG instead of a checkpoint's file.
- ``_load_optimizer_and_scheduler`` / ``_load_scaler``: skipped when the snapshot won over the checkpoint passed
  as ``resume_from_checkpoint`` (HF would load the older checkpoint's LR scheduler over the snapshot's).

Every ``train()`` call (and every ``hyperparameter_search`` trial) builds a new engine, and each protected engine
of a process has its own snapshots (adapters/deepspeed/ ``ShardsafeEngineHook.ordinal``): after a crash in the
second ``train()``, the restarted program's first ``train()`` restores the first engine's last version (HF then
sees its last step done and trains nothing), and the second restores its own. At the end of every ``train()`` its
engine is retired: its newest committed version stays, its older one is freed, its snapshot thread stops.

The LR schedule is the engine's: HF's schedulers (LambdaLR) are stepped and snapshotted by DeepSpeed, and the
snapshot restores their state (adapters/deepspeed/checks.py ``scheduler_state``). What ``TrainerState`` holds beyond
the step (``total_flos``, ``num_input_tokens_seen``, ``best_*``, stateful callbacks) is recorded in
``engine.shardsafe.extra["hf_trainer"]`` at every step end; ``log_history`` is not (it grows with the run; the
restarted Trainer's history starts at v+1, the earlier entries went to the loggers already).
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

EXTRA_KEY = "hf_trainer"
"""The key of ``engine.shardsafe.extra`` that holds the Trainer's progress counters."""

HOOKS = ("_prepare_for_training", "_run_epoch", "_load_optimizer_and_scheduler", "_load_scaler")
"""The ``transformers.Trainer`` methods the automatic activation wraps (adapters/autoload.py)."""

_STATE_FIELDS = ("total_flos", "num_input_tokens_seen", "best_metric", "best_global_step", "best_model_checkpoint")


def engine_hook(trainer: Any) -> Any:
    """The ``ShardsafeEngineHook`` of the trainer's DeepSpeed engine, or None (not DeepSpeed, not protected)."""
    return getattr(getattr(trainer, "model_wrapped", None), "shardsafe", None)


def snapshot_won(trainer: Any) -> bool:
    """The engine continues from the snapshot it restored at initialize (version v >= 0): no checkpoint the
    program loaded since is newer (a newer one moves ``global_steps`` past v)."""
    hook = engine_hook(trainer)
    if hook is None or hook.restored.version < 0:
        return False
    return int(trainer.model_wrapped.global_steps) == hook.restored.version


@dataclass(kw_only=True)
class PendingResume:
    """What ``_run_epoch`` needs to continue after the restored step."""

    version: int
    """The restored snapshot's version: optimizer steps already trained."""
    rng: Any
    """The RNG states the snapshot restored (``shardsafe.snapshot.state.capture_rng``), put back where HF loads a
    checkpoint's ``rng_state_{rank}.pth``."""
    checkpoint: str | None
    """``resume_from_checkpoint`` as the program passed it (its files are not read)."""


try:   # this module is imported from the Trainer wrappers, so transformers is loaded; the docs import it without
    from transformers.trainer_callback import TrainerCallback as _CallbackBase
except ImportError:  # pragma: no cover
    _CallbackBase = object


class ProgressRecorder(_CallbackBase):
    """A ``TrainerCallback`` that records the
    Trainer's counters in the engine's ``extra`` at every optimizer step's end. The snapshot of step v is taken
    inside step v (DeepSpeed's ``engine.step``), so it holds the counters of step v-1 and the increment of that
    step; a restore adds the increment once."""

    def __init__(self, trainer: Any):
        self._trainer = trainer
        self._last: dict[str, float] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self._trainer
        hook = engine_hook(t)
        if hook is None:
            return
        flos = float(state.total_flos) + float(getattr(t, "current_flos", 0.0))
        tokens = int(state.num_input_tokens_seen or 0)
        rec: dict[str, Any] = {"global_step": int(state.global_step), "total_flos": flos,
                               "num_input_tokens_seen": tokens,
                               "step_flos": flos - self._last.get("total_flos", flos),
                               "step_tokens": tokens - int(self._last.get("num_input_tokens_seen", tokens)),
                               "best_metric": state.best_metric, "best_global_step": state.best_global_step,
                               "best_model_checkpoint": state.best_model_checkpoint,
                               "stateful_callbacks": _callback_states(t)}
        self._last = {"total_flos": flos, "num_input_tokens_seen": tokens}
        hook.extra[EXTRA_KEY] = rec

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """HF never steps this ``train()``'s engine again (the next call, or trial, builds its own): retire it
        now, while HF still holds it, rather than keep it alive past the ``release_memory`` HF runs between trials."""
        hook = engine_hook(self._trainer)
        if hook is not None:
            hook.retire()


def _callback_states(trainer: Any) -> dict[str, Any]:
    """``TrainerState.stateful_callbacks`` as HF's ``_save_checkpoint`` fills it, without TrainerControl (its
    flags are the step's own, and HF resets them every step)."""
    try:
        from transformers.trainer_callback import ExportableState
    except ImportError:
        return {}
    out: dict[str, Any] = {}
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, ExportableState):
            name = type(cb).__name__
            st = cb.state()
            if name in out:
                out[name] = (out[name] if isinstance(out[name], list) else [out[name]]) + [st]
            else:
                out[name] = st
    return out


def _bind(original: Any, trainer: Any, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    bound = inspect.signature(original).bind(trainer, *args, **kwargs)
    bound.apply_defaults()
    return bound


def after_prepare_call(original: Any, trainer: Any, args: tuple, kwargs: dict) -> None:
    """After HF's ``_prepare_for_training(*args, **kwargs)`` built a protected engine."""
    after_prepare(trainer, _bind(original, trainer, args, kwargs).arguments.get("resume_from_checkpoint"))


def after_prepare(trainer: Any, resume_from_checkpoint: str | None) -> None:
    """The engine is built (and restored): record progress from now on, and continue at the restored step."""
    hook = engine_hook(trainer)
    if hook is None:
        return
    if not any(isinstance(cb, ProgressRecorder) for cb in trainer.callback_handler.callbacks):
        trainer.callback_handler.add_callback(ProgressRecorder(trainer))
    trainer.__dict__.pop("_shardsafe_resume", None)
    v = hook.restored.version
    rank0 = hook.runtime.rank == 0
    if v < 0:
        return
    state = trainer.state
    if not snapshot_won(trainer):   # a newer checkpoint passed as resume_from_checkpoint was loaded
        if rank0 and resume_from_checkpoint is not None:
            log.warning("shardsafe: HF Trainer resumes from resume_from_checkpoint=%s (step %d), which is newer than "
                        "the snapshot (version %d): HF's own resume runs", resume_from_checkpoint, state.global_step, v)
        return
    from shardsafe.snapshot.state import capture_rng
    was = int(state.global_step)
    rec = hook.extra.get(EXTRA_KEY) or {}
    state.global_step = v
    if rec and int(rec.get("global_step", -2)) == v - 1:   # the counters of step v-1 plus one step's increment
        state.total_flos = float(rec["total_flos"]) + float(rec.get("step_flos", 0.0))
        state.num_input_tokens_seen = int(rec["num_input_tokens_seen"]) + int(rec.get("step_tokens", 0))
        for k in ("best_metric", "best_global_step", "best_model_checkpoint"):
            setattr(state, k, rec.get(k))
        if rec.get("stateful_callbacks"):
            state.stateful_callbacks = dict(rec["stateful_callbacks"])
            trainer._load_callback_state()
    trainer.current_flos = 0
    trainer._shardsafe_resume = PendingResume(version=v, rng=capture_rng(), checkpoint=resume_from_checkpoint)
    if rank0:
        how = (f"instead of resume_from_checkpoint={resume_from_checkpoint} (step {was}, older)"
               if resume_from_checkpoint is not None else "without resume_from_checkpoint being passed")
        log.warning("shardsafe: HF Trainer resumed from snapshot version %d %s: it continues at global step %d with "
                    "the snapshot's optimizer, LR schedule and RNG, its data loader fast-forwarded past the %d "
                    "step(s) trained, as trainer.train(resume_from_checkpoint=...) would (protection on: the "
                    "\"shardsafe\" block of the DeepSpeed config).", v, how, v, v)


def _run_epoch(original: Any, trainer: Any, args: tuple, kwargs: dict) -> Any:
    pending: PendingResume | None = trainer.__dict__.get("_shardsafe_resume")
    if pending is None:
        return original(trainer, *args, **kwargs)
    bound = _bind(original, trainer, args, kwargs)
    a = bound.arguments
    epoch, upe, steps_in_epoch = int(a["epoch"]), int(a["num_update_steps_per_epoch"]), int(a["steps_in_epoch"])
    v, targs = pending.version, trainer.args
    epochs_trained = v // upe
    skip = 0 if targs.ignore_data_skip else (v % upe) * targs.gradient_accumulation_steps
    if v >= trainer.state.max_steps > 0:   # the snapshot is the last step: nothing left to train
        trainer.__dict__.pop("_shardsafe_resume", None)
        trainer.control.should_training_stop = True
        return None
    if epoch < epochs_trained:   # trained before the snapshot: not run (HF's resume starts its loop at this one)
        return None
    trainer.__dict__.pop("_shardsafe_resume", None)
    if epoch > epochs_trained:
        return original(trainer, *args, **kwargs)
    trainer.state.epoch = epochs_trained + min(skip, steps_in_epoch) / max(steps_in_epoch, 1)
    a["resume_from_checkpoint"] = pending.checkpoint or f"<shardsafe snapshot version {v}>"
    a["epochs_trained"] = epochs_trained
    a["steps_trained_in_current_epoch"] = skip

    def _load_rng_state(checkpoint: Any) -> None:   # the snapshot's RNG, where HF loads rng_state_{rank}.pth
        from shardsafe.snapshot.state import apply_rng
        apply_rng(pending.rng.tensors, pending.rng.meta)

    trainer._load_rng_state = _load_rng_state   # this call only (the instance attribute shadows HF's method)
    try:
        return original(*bound.args, **bound.kwargs)
    finally:
        trainer.__dict__.pop("_load_rng_state", None)


def _load_optimizer_and_scheduler(original: Any, trainer: Any, args: tuple, kwargs: dict) -> Any:
    if snapshot_won(trainer):
        return None   # the engine holds the snapshot's optimizer and scheduler: an older checkpoint's must not win
    return original(trainer, *args, **kwargs)


def _load_scaler(original: Any, trainer: Any, args: tuple, kwargs: dict) -> Any:
    if snapshot_won(trainer):
        return None   # the engine's loss scaler is the snapshot's
    return original(trainer, *args, **kwargs)


def call(name: str, original: Any, trainer: Any, args: tuple, kwargs: dict) -> Any:
    """The autoload's Trainer wrappers land here once the engine is protected (adapters/autoload.py)."""
    return {"_run_epoch": _run_epoch,
            "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
            "_load_scaler": _load_scaler}[name](original, trainer, args, kwargs)
