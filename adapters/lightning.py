"""Lightning's DeepSpeed strategy: a restored snapshot resumes ``Trainer.fit`` at its step, without ``ckpt_path``.

Lightning builds the engine in ``DeepSpeedStrategy.setup`` (``_initialize_deepspeed_train`` ->
``deepspeed.initialize`` with the strategy's config dict), and the automatic activation (adapters/autoload.py)
protects it there when the config has a ``"shardsafe"`` block: the engine restores the newest snapshot (version
v). Lightning's loops would still start at step 0, so the autoload also wraps two Lightning methods on their
classes (``lightning.pytorch`` and ``pytorch_lightning`` alike; no fork). Each checks the strategy's engine for
``engine.shardsafe`` first and is Lightning's own method when it is not protected:

- ``_CheckpointConnector.restore_training_state`` (runs once per ``fit``, after the strategy's setup, where
  Lightning restores the loops of a ``ckpt_path``): from then on a recorder puts the fit loop's
  ``state_dict()`` and the LR schedulers' states into ``engine.shardsafe.extra["lightning"]`` right before every
  snapshot (``ShardsafeEngineHook.before_capture``). After a restore to v (and no newer checkpoint: the engine's
  ``load_checkpoint`` keeps the newer of the two), the fit loop loads the record of v and the end of batch v's
  optimizer step and batch (``optimizer.step.increment_completed``, ``batch_progress.increment_processed``: the
  record was taken inside that step) is counted, which is exactly what Lightning's own checkpoint saved at
  ``on_train_batch_end`` of step v holds; Lightning's restart logic takes it from there. ``trainer.global_step``
  must then be v, or the run stops with an error instead of training on a wrong count.
- ``_TrainingEpochLoop.on_run_start``: in the epoch of step v, the batches already trained are taken from the
  data iterator (what a stateful loader's ``load_state_dict`` does; Lightning alone restarts the epoch's data
  and warns that the result is unreliable), batch v's own step-interval scheduler update (Lightning's
  ``on_advance_end``, after the snapshot) is made with Lightning's ``update_lr_schedulers``, and inside an epoch
  the RNG states the snapshot restored are put back (making the data iterator drew from them), so the next batch
  draws what it drew in the uninterrupted run.

Supported: automatic optimization (``training_step`` returns the loss), step- or epoch-interval schedulers
without ``ReduceLROnPlateau``. Manual optimization is refused with a message.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

EXTRA_KEY = "lightning"
"""The key of ``engine.shardsafe.extra`` that holds the fit loop's progress at the snapshot."""


def engine_hook(trainer: Any) -> Any:
    """The ``ShardsafeEngineHook`` of the trainer's DeepSpeed engine, or None (not DeepSpeed, not protected)."""
    return getattr(getattr(getattr(trainer, "strategy", None), "model", None), "shardsafe", None)


@dataclass(kw_only=True)
class PendingResume:
    """What the epoch loop of step v needs once its data iterator exists."""

    version: int
    rng: Any
    """The RNG the snapshot restored (``shardsafe.snapshot.state.capture_rng``), put back after the data skip."""


class LoopRecorder:
    """Records the fit loop's progress in the engine's ``extra`` right before every snapshot (called inside the
    optimizer step of the step being snapshotted). The LR scheduler is the engine's (Lightning takes DeepSpeed's
    out of the engine and steps it itself): the engine's snapshot holds it."""

    def __init__(self, trainer: Any):
        self._trainer = trainer

    def __call__(self) -> None:
        t = self._trainer
        hook = engine_hook(t)
        if hook is None:
            return
        hook.extra[EXTRA_KEY] = {"global_step": int(t.global_step), "fit_loop": t.fit_loop.state_dict()}

    def __repr__(self) -> str:
        return "shardsafe's Lightning loop recorder"


def _check_supported(trainer: Any) -> None:
    from shardsafe.config import ConfigError
    if not trainer.lightning_module.automatic_optimization:
        raise ConfigError("shardsafe resumes Lightning's fit loop for automatic optimization only; this "
                          "LightningModule sets automatic_optimization = False. Set \"enabled\": false in the "
                          "\"shardsafe\" block of the DeepSpeed config, or use automatic optimization.")
    for c in trainer.lr_scheduler_configs:
        if c.reduce_on_plateau:
            raise ConfigError(f"shardsafe cannot resume Lightning's ReduceLROnPlateau scheduler "
                              f"({type(c.scheduler).__name__}): its steps depend on logged metrics a snapshot does "
                              "not hold. Use a step or epoch schedule, or set \"enabled\": false in the "
                              "\"shardsafe\" block.")


def after_restore_training_state(connector: Any) -> None:
    """After Lightning's ``restore_training_state`` of a ``fit`` whose engine is protected."""
    trainer = connector.trainer
    hook = engine_hook(trainer)
    if hook is None or str(getattr(trainer.state.fn, "value", trainer.state.fn)) != "fit":
        return
    _check_supported(trainer)
    if not any(isinstance(f, LoopRecorder) for f in hook.before_capture):
        hook.before_capture.append(LoopRecorder(trainer))
    trainer.__dict__.pop("_shardsafe_resume", None)
    v = hook.restored.version
    engine = trainer.strategy.model
    if v < 0 or int(engine.global_steps) != v:   # nothing restored, or a newer checkpoint (ckpt_path) was loaded
        return
    from shardsafe.config import ConfigError
    from shardsafe.snapshot.state import capture_rng
    rec = hook.extra.get(EXTRA_KEY)
    if not rec or int(rec.get("global_step", -2)) != v - 1:
        raise ConfigError(f"shardsafe restored snapshot version {v} into this Lightning run's engine, but the "
                          f"snapshot holds no record of Lightning's loop at step {v} (found "
                          f"{None if not rec else rec.get('global_step')}): it was not taken by a Lightning fit of "
                          "this program. Use a new shardsafe job_id to start fresh, or set \"enabled\": false.")
    loop = trainer.fit_loop
    loop.load_state_dict(rec["fit_loop"])
    ep = loop.epoch_loop
    # The record was taken inside step v's optimizer step: count that step's end and its batch's processing,
    # which leaves the loop as Lightning's own checkpoint at on_train_batch_end of step v does.
    ep.automatic_optimization.optim_progress.optimizer.step.increment_completed()
    ep.batch_progress.increment_processed()
    if int(trainer.global_step) != v:
        raise ConfigError(f"shardsafe could not place Lightning's fit loop at snapshot version {v} (global_step "
                          f"{trainer.global_step} after loading its record): this Lightning version counts steps "
                          "differently from the one shardsafe is tested with (2.6.6). Set \"enabled\": false in the "
                          "\"shardsafe\" block.")
    trainer._shardsafe_resume = PendingResume(version=v, rng=capture_rng())
    if trainer.global_rank == 0:
        log.warning("shardsafe: Lightning fit resumed from snapshot version %d without ckpt_path: it continues at "
                    "global step %d with the snapshot's optimizer, LR schedule and RNG, its epoch's data past the "
                    "batches trained (protection on: the \"shardsafe\" block of the DeepSpeed config; Lightning's "
                    "warning that the dataloader is not resumable does not apply).", v, v)


def after_epoch_run_start(epoch_loop: Any, data_fetcher: Any) -> None:
    """After Lightning's ``_TrainingEpochLoop.on_run_start`` of the epoch that holds step v."""
    trainer = epoch_loop.trainer
    pending: PendingResume | None = trainer.__dict__.pop("_shardsafe_resume", None)
    if pending is None:
        return
    done = int(epoch_loop.batch_progress.current.ready)   # this epoch's batches up to and including step v
    it = data_fetcher.iterator
    for _ in range(done):
        next(it)
    epoch_loop.update_lr_schedulers("step", update_plateau_schedulers=False)   # batch v's on_advance_end
    if done:
        # Mid-epoch: the uninterrupted run made this epoch's data iterator before step v, the restart made it
        # (drawing from the RNG) after the restore: put the snapshot's RNG back. When step v ended its epoch
        # (done == 0, this is the next one), the uninterrupted run also made the new epoch's iterator after step
        # v, from the same RNG state the restore left: nothing to put back.
        from shardsafe.snapshot.state import apply_rng
        apply_rng(pending.rng.tensors, pending.rng.meta)
