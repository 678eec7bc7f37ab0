"""Engine hooks: ``shardsafe.adapters.deepspeed.initialize`` is a drop-in for ``deepspeed.initialize``.

Switched on by a top-level ``"shardsafe": {...}`` block in the DeepSpeed config (DeepSpeed ignores
unknown top-level keys). No fork: the engine's ``_take_model_step`` is wrapped *on the instance*
(it fires exactly once per optimizer step, also under gradient accumulation), and state is read from /
written back into the optimizer's own tensors (:mod:`.state`).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping

from shardsafe import env
from shardsafe.config import ShardsafeConfig
from shardsafe.fatal import install_excepthook
from shardsafe.inplace import on_let_go
from shardsafe.ordinals import next_ordinal
from shardsafe.snapshot.state import capture_rng

from .. import ds_config
from . import rng_trackers
from .client_state import (DS_CHECKPOINT_KEYS, client_state_at, client_state_without_checkpoint, disk_checkpoint,
                           live_rng, program_layout)
from .inplace import forget_groups, remember_engine
from .layout import coords as parallel_coords
from .layout import is_pipeline
from .prewarm import memo_cpu_info
from .state import DeepSpeedStateAdapter

log = logging.getLogger(__name__)
on_let_go("DeepSpeed", forget_groups)   # a rank restarted in place builds its engine again (shardsafe.inplace)


def config_from_ds(ds_config: Mapping[str, Any] | None) -> ShardsafeConfig:
    if ds_config is None or "shardsafe" not in ds_config:
        return ShardsafeConfig(enabled=False)
    return ShardsafeConfig.from_dict(ds_config["shardsafe"], where='"shardsafe" block of the DeepSpeed config')


class ShardsafeEngineHook:
    """What ``initialize`` attaches to the engine as ``engine.shardsafe``.

    ``ordinal``: this engine's place among the protected engines the process built (0 for the first). Each
    ordinal has its own snapshots (``Runtime(scope=engine_scope(ordinal))``): HF's Trainer builds a new engine
    for every ``train()`` call and hyperparameter trial, RLHF programs run several at once, and an engine must
    only ever restore its own state. A restarted program builds its engines in the same order, so engine k
    restores engine k's newest version."""

    def __init__(self, engine: Any, cfg: ShardsafeConfig, *, auto: str = "", program_args: Any = None):
        from shardsafe.runtime import Runtime, engine_scope
        import torch.distributed as dist
        self.cfg, self.auto = cfg, auto
        self.ordinal = next_ordinal("deepspeed_engine")   # shardsafe.runtime.engine_scope
        self._program_args = program_args   # the args given to deepspeed.initialize (GPT-NeoX, Megatron-DeepSpeed)
        self._stepped = False   # load_checkpoint calls before the first step are the program's resume
        self.before_capture: list[Any] = []
        """Callables run right before a snapshot's state is taken (inside the optimizer step): a framework's
        loop records its progress in :attr:`extra` there (adapters/lightning.py). One that raises costs that
        record, never the step."""
        self.adapter = DeepSpeedStateAdapter(engine)
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        coords = parallel_coords(engine, self.adapter.parallel)
        self._dp_rank = coords["dp"]
        self.runtime = Runtime(cfg, rank=rank, world_size=world, coords=coords, scope=engine_scope(self.ordinal))
        self.restored = self.runtime.try_restore(self.adapter)
        # The RNG the snapshot restored, for the program's client state (its load_checkpoint comes later).
        self._restored_rng = live_rng() if self.restored.version >= 0 else None
        if cfg.export_dir:
            self._export_and_exit(cfg.export_dir)
        self._install(engine)

    @property
    def extra(self) -> dict:
        """User state (JSON-able: e.g. a data-loader position) saved and restored with every snapshot."""
        return self.adapter.extra

    def _install(self, engine: Any) -> None:
        # Two per-instance wrappers (no fork): _take_model_step runs exactly once per optimizer step
        # and is where the pending copy must be finished before the optimizer mutates the state;
        # the snapshot itself is taken after engine.step() returns, when micro_steps and the other
        # counters have their post-step values (they are bumped after _take_model_step).
        orig_take, orig_step = engine._take_model_step, engine.step
        rt, adapter = self.runtime, self.adapter

        def _take_model_step(*args: Any, **kwargs: Any) -> Any:
            self._stepped = True
            rt.before_step(engine.global_steps + 1)
            adapter.before_optimizer_step()
            return orig_take(*args, **kwargs)

        def step(*args: Any, **kwargs: Any) -> Any:
            boundary = engine.is_gradient_accumulation_boundary()
            out = orig_step(*args, **kwargs)
            if boundary:
                self._run_before_capture(engine.global_steps)
                rt.after_step(engine.global_steps, adapter)
            return out

        engine._take_model_step = _take_model_step
        if is_pipeline(engine):
            # train_batch() runs the whole schedule, optimizer step included, and never calls engine.step()
            # (PipelineEngine.step raises): the snapshot is taken when it returns, once per optimizer step.
            orig_train_batch = engine.train_batch

            def train_batch(*args: Any, **kwargs: Any) -> Any:
                out = orig_train_batch(*args, **kwargs)
                self._run_before_capture(engine.global_steps)
                rt.after_step(engine.global_steps, adapter)
                return out

            engine.train_batch = train_batch
        else:
            engine.step = step
        orig_load = engine.load_checkpoint

        def load_checkpoint(load_dir: Any, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
            if self._stepped or self.restored.version < 0:
                return orig_load(load_dir, tag, *args, **kwargs)
            return self._resume_load(orig_load, load_dir, tag, args, kwargs)

        engine.load_checkpoint = load_checkpoint

    def _run_before_capture(self, step: int) -> None:
        if not self.before_capture or step % self.cfg.interval:
            return
        for f in self.before_capture:
            try:
                f()
            except Exception as e:  # noqa: BLE001 - a progress record must never cost the training step
                log.warning("[rank %d] shardsafe: %r failed before snapshot %d (%s: %s); the snapshot keeps the "
                            "previous record", self.runtime.rank, f, step, type(e).__name__, e)

    def _resume_load(self, orig_load: Any, load_dir: Any, tag: Any, args: tuple, kwargs: dict) -> Any:
        """The program's own resume after a restore to version v: its ``load_checkpoint(dir)`` loads the disk
        checkpoint only if that is newer than v. Otherwise the engine keeps the snapshot, and the call returns
        what DeepSpeed's would: ``(None, None)`` when the directory holds no checkpoint, else the checkpoint's
        path and its client state as of v (``_client_state_at``): the step counters the program saved there
        (``iteration``, ``step``, ``global_step(s)`` when they equal the checkpoint's step) moved to v, sample
        counters (``consumed_train_samples``) to the engine's, and the RNG states GPT-NeoX and Megatron-DeepSpeed
        keep there replaced by the snapshot's, so a program that sets them after loading continues as at v."""
        v, engine = self.restored.version, self.adapter.engine
        rank0 = self.runtime.rank == 0
        tag, states = disk_checkpoint(engine, load_dir, tag)
        step = int(states.get("global_steps", -1)) if states is not None else -1
        # One decision for every rank (node-local directories can differ): the disk checkpoint is loaded only when
        # every rank finds the same one and it is newer than the snapshot; anything else keeps the snapshot.
        steps = [int(s[0]) for s in self.runtime.coll.gather_ints([step])]
        if len(set(steps)) == 1 and step > v:
            if rank0:
                log.warning("shardsafe: disk checkpoint %s (step %d) is newer than the snapshot (version %d): "
                            "loading it", tag, step, v)
            return orig_load(load_dir, tag, *args, **kwargs)
        if len(set(steps)) > 1 and rank0:
            log.warning("shardsafe: the ranks find different checkpoints under %r (global steps %s by rank%s): every "
                        "rank continues from snapshot version %d, none loads its checkpoint (mixing them would give "
                        "ranks different states)", str(load_dir), steps[:16], "..." if len(steps) > 16 else "", v)
        if states is None:
            return self._no_checkpoint(load_dir, v)
        if rank0 and step <= v:
            log.warning("shardsafe: snapshot version %d is newer than disk checkpoint %s (step %d): continuing from "
                        "the snapshot; the checkpoint was not loaded", v, tag, step)
        client = {k: val for k, val in states.items() if k not in DS_CHECKPOINT_KEYS}
        changed = client_state_at(client, step=step, v=v, samples=states.get("global_samples"),
                                   live_samples=int(engine.global_samples), rng=self._restored_rng,
                                   dp_rank=self._dp_rank)
        if rank0 and changed:
            log.warning("shardsafe: the checkpoint's client state is returned as of the snapshot: %s",
                        ", ".join(changed))
        return os.path.join(str(load_dir), str(tag)), client

    def _no_checkpoint(self, load_dir: Any, v: int) -> tuple[Any, Any]:
        """``load_checkpoint`` found no checkpoint, but the engine holds snapshot v: DeepSpeed's (None, None) for a
        program that loops from ``engine.global_steps``; for GPT-NeoX and Megatron-DeepSpeed (cfg
        ``resume_client_state``) the client state they would have saved at v, so that they continue at v instead
        of counting from 0 (ds_client_state.client_state_without_checkpoint)."""
        layout = program_layout(self.cfg.resume_client_state, self._program_args)
        engine = self.adapter.engine
        client = client_state_without_checkpoint(layout, v=v, program_args=self._program_args,
                                                 live_samples=int(engine.global_samples), rng=self._restored_rng,
                                                 dp_world=int(engine.dp_world_size))
        rank0 = self.runtime.rank == 0
        if client is None:
            if rank0:
                log.warning("shardsafe: load_checkpoint(%r): no checkpoint there; the engine continues from snapshot "
                            "version %d (restored at initialize)", str(load_dir), v)
            return None, None
        if rank0:
            log.warning("shardsafe: load_checkpoint(%r): no checkpoint there; the engine continues from snapshot "
                        "version %d, and the call returns a %s client state as of it (%s) so the program continues "
                        "at iteration %d", str(load_dir), v, layout, ", ".join(sorted(client)), v)
        return os.path.join(str(load_dir), f"shardsafe-snapshot-v{v}"), client

    def _export_and_exit(self, export_dir: str) -> None:
        """The export run (``shardsafe export --format deepspeed SRC DST -- COMMAND``): the restored state written by
        this engine's own ``save_checkpoint`` -- DeepSpeed's files for whatever layout the job has (pipeline layer
        files, mp_rank files per model-parallel rank, BF16_Optimizer and MoE expert files) -- then a clean exit
        before the program trains. What DeepSpeed's format has no place for (this rank's RNG states and
        model-parallel RNG trackers, module buffers, ``extra``) goes to ``shardsafe_rank{R}.pt`` beside them, which
        ``shardsafe.adapters.deepspeed.export.apply_client_state`` reads after a vanilla ``load_checkpoint``."""
        import torch.distributed as dist
        from .export import EXPORT_FORMAT, rank_side_file, save_rank_side_file
        engine, v = self.adapter.engine, self.restored.version
        if v < 0:
            raise SystemExit(f"shardsafe export: no snapshot could be restored ({self.restored.message}); nothing was "
                             f"written to {export_dir}")
        tag = f"global_step{v}"
        client = {"shardsafe": {"format": EXPORT_FORMAT, "version": v, "micro_steps": int(engine.micro_steps),
                                "per_rank_files": True}}
        engine.save_checkpoint(export_dir, tag=tag, client_state=client)
        rng = capture_rng()
        trackers = rng_trackers.capture(rng.tensors)
        save_rank_side_file(rank_side_file(os.path.join(export_dir, tag), self.runtime.rank), {
            "rng": rng.tensors, "rng_meta": rng.meta, "rng_trackers": trackers,
            "buffers": {n: b.detach().clone() for n, b in self.adapter.buffers()}, "extra": dict(self.adapter.extra)})
        if dist.is_initialized():
            dist.barrier()
        if self.runtime.rank == 0:
            print(f"shardsafe: exported version {v} to {os.path.join(export_dir, tag)} (DeepSpeed save_checkpoint of "
                  f"the restored engine)", flush=True)
        self.close()
        raise SystemExit(0)

    def flush(self) -> bool:
        return self.runtime.flush()

    def retire(self) -> None:
        """The program will not step this engine again (HF's Trainer at the end of every ``train()``): its newest
        committed version stays in the holder, so a restarted program that builds this engine again restores its
        end state, and the rest of its memory and threads go."""
        self.runtime.retire()

    def close(self) -> None:
        self.runtime.close()


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, *pos: Any, config: Any = None,
               config_params: Any = None, **kwargs: Any):
    """Same arguments and return value as ``deepspeed.initialize``; protects the engine when the config
    has ``"shardsafe": {"enabled": true, ...}``. A malformed block raises ConfigError before DeepSpeed runs."""
    import deepspeed
    # DeepSpeed's own initialize, also when the automatic activation (adapters/autoload.py) has wrapped it
    original = getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)
    install_excepthook()
    # A job re-formed at another world size keeps its global batch (SHARDSAFE_FULL_WORLD_SIZE), as the activation does.
    pos_args, kw = ds_config.keep_global_batch((args, model, optimizer, model_parameters, training_data, lr_scheduler,
                                                *pos), dict(config=config, config_params=config_params, **kwargs))
    return protect(original, pos_args, kw)


def protect(ds_initialize: Any, args: tuple, kwargs: dict, *, auto: str = ""):
    """``ds_initialize(*args, **kwargs)`` (DeepSpeed's own), with the engine protected when its config has an
    enabled ``"shardsafe"`` block. ``auto``: set when reached through the automatic activation (the program
    itself calls ``deepspeed.initialize``) to what turns it off; rank 0 says so in one log line."""
    # From here on a ConfigError or RestoreError that ends the process leaves a record for the launcher, which then
    # stops instead of restarting (shardsafe.fatal). Validate first: a typo fails fast, before the engine is built.
    install_excepthook()
    cfg = config_from_ds(ds_config.read_config(ds_config.config_source(args, kwargs)))
    if cfg.enabled:
        cfg = cfg.resolved()
        # DeepSpeed's CPU op builders (FusedAdam's CPU build, CPUAdam under offload) ask py-cpuinfo twice per op,
        # a Python subprocess per call: a restarted trainer started cold reads this boot's answer instead (prewarm.py)
        memo_cpu_info(cfg.holder_dir)
    ret = ds_initialize(*args, **kwargs)
    engine = ret[0]
    if env.restart_mode() == "in-place":
        remember_engine(engine)
    program_args = kwargs.get("args", args[0] if args else None)
    engine.shardsafe = ShardsafeEngineHook(engine, cfg, auto=auto, program_args=program_args) if cfg.enabled else None
    # What is true now, on every rank (on_unprotected "fail" raises here when a rank cannot be protected).
    state = engine.shardsafe.runtime.banner() if engine.shardsafe is not None else ""
    if engine.shardsafe is not None and engine.shardsafe.runtime.rank == 0:
        how = (f"the \"shardsafe\" block of the DeepSpeed config (automatic activation; {auto} turns the "
               "activation off)") if auto else "shardsafe.adapters.deepspeed.initialize"
        which = f", engine {engine.shardsafe.ordinal} of this process" if engine.shardsafe.ordinal else ""
        log.warning("shardsafe: this DeepSpeed engine is %s (in-memory snapshots every %d step(s), job %s%s), "
                    "switched on by %s; \"enabled\": false in the block turns protection off. %s", state, cfg.interval,
                    cfg.job_id, which, how, engine.shardsafe.restored.message)
    return ret
