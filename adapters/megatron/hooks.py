"""Megatron-LM integration: :func:`pretrain` / :func:`install_hooks` for Megatron-LM's own training loop.

Fork-free: ``train()`` looks up ``setup_model_and_optimizer``, ``checkpoint_and_decide_exit`` and
``train_step`` as module globals of ``megatron.training.training`` at call time, so wrapping those
globals (and ``optimizer.step`` on the instance, :func:`~.core_api.wrap_optimizer_step`) is enough;
Megatron-LM is not modified. The wrappers drive the same :class:`shardsafe.runtime.BaseRuntime` contract as the
core API, bind the adapter's iteration and counters to Megatron-LM's ``args``, and implement
``--shardsafe-export-dir`` with Megatron-LM's own ``save_checkpoint``. :func:`protected_pretrain` is also
what the automatic activation (adapters/autoload.py) calls; under ``SHARDSAFE_RESTART=in-place`` it runs
Megatron-LM's ``pretrain`` inside :func:`shardsafe.inplace.run`, once per attempt.
"""
from __future__ import annotations

import inspect
import logging
import os
import time
from typing import Any, Callable, Optional

import torch

from shardsafe import env
from shardsafe.config import ShardsafeConfig
from shardsafe.fatal import install_excepthook
from shardsafe.runtime import BaseRuntime
from shardsafe.snapshot.state import RankState

from .args import compose_extra_args_provider, config_from_args

from .core_api import _NO_EVENTS, _say_state, default_runtime_factory, wrap_optimizer_step
from .state import MegatronStateAdapter

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Megatron-LM integration (fork-free: wraps module globals of megatron.training.training)
# --------------------------------------------------------------------------------------------------

# Counters Megatron-LM keeps on ``args`` and restores from a checkpoint (checkpointing.load_checkpoint).
_ARGS_COUNTERS = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")
_RERUN_ITERATION = "rerun_state_machine_iteration"


def _rerun_state_machine() -> Any:
    """Megatron's RerunStateMachine (it counts iterations itself and checkpoints that count from
    megatron-core 0.18 on), or None where this megatron-core has none."""
    try:
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        return get_rerun_state_machine()
    except Exception:  # noqa: BLE001 - older megatron-core, or not initialized: nothing to carry
        return None


class _HookState:
    """The three wrappers of Megatron-LM's loop functions and what they share (one per ``install_hooks``).

    ``setup`` runs inside ``setup_model_and_optimizer`` (builds the adapter and runtime, restores), ``checkpoint``
    inside ``checkpoint_and_decide_exit`` (once per iteration: snapshot, exit), ``train_step`` before each step
    (re-seats the restored RNGs once; TOR timing).
    """

    def __init__(self, runtime_factory: Callable[[ShardsafeConfig], BaseRuntime], get_args: Callable[[], Any]):
        self.runtime_factory, self.get_args = runtime_factory, get_args
        self.runtime: Optional[BaseRuntime] = None
        self.adapter: Optional[MegatronStateAdapter] = None
        self.iteration = 0
        self.flops = 0.0
        self.pending_rng: Optional[RankState] = None
        self.undo_step: Callable[[], None] = lambda: None
        self.events: Any = _NO_EVENTS
        self.train_ready = False
        self.t_step = 0.0

    # ---- setup_model_and_optimizer ------------------------------------------------------------------
    def setup(self, orig: Callable[..., Any], a: tuple, kw: dict) -> Any:
        args = self.get_args()
        install_excepthook()   # a ConfigError that ends the process leaves a record for the launcher
        cfg = config_from_args(args)  # ConfigError here: before the model is built or anything trains
        model, optimizer, scheduler = orig(*a, **kw)
        if not cfg.enabled or optimizer is None:
            return model, optimizer, scheduler
        self.iteration = int(args.iteration)
        self.flops = float(getattr(args, "num_floating_point_operations_so_far", 0) or 0)
        self.adapter = self._adapter(args, model, optimizer, scheduler)
        self.runtime = self.runtime_factory(cfg)  # ConfigError (parity placement) here, on every rank
        self.events = self.runtime.events
        self.undo_step = wrap_optimizer_step(optimizer, self.runtime.before_step, lambda: self.iteration)
        restored = self._restore(args)   # resume "never" (restore false) drops the old versions there
        _say_state(self.runtime, cfg)
        export_dir = getattr(args, "shardsafe_export_dir", None)
        if export_dir:
            how = self.runtime.restored.message if self.runtime.restored is not None else ""
            _export_and_exit(args, export_dir, restored, model, optimizer, scheduler, self.flops, how)
        return model, optimizer, scheduler

    def _adapter(self, args: Any, model: Any, optimizer: Any, scheduler: Any) -> MegatronStateAdapter:
        """The state adapter, its iteration and counters bound to Megatron-LM's ``args`` (and its rerun state
        machine's iteration count, which megatron-core >= 0.18 checkpoints)."""
        def get_counters():
            c = {k: getattr(args, k) for k in _ARGS_COUNTERS if getattr(args, k, None) is not None}
            c["num_floating_point_operations_so_far"] = self.flops
            rsm = _rerun_state_machine()
            if isinstance(getattr(rsm, "current_iteration", None), int):
                # Megatron's --load restores it; a Megatron checkpoint exported from a snapshot carries it.
                c[_RERUN_ITERATION] = rsm.current_iteration
            return c

        def set_counters(c):
            for k in _ARGS_COUNTERS:
                if k in c:
                    setattr(args, k, c[k])
            self.flops = c.get("num_floating_point_operations_so_far", self.flops)
            args.num_floating_point_operations_so_far = self.flops
            rsm = _rerun_state_machine()
            if _RERUN_ITERATION in c and isinstance(getattr(rsm, "current_iteration", None), int):
                rsm.current_iteration = int(c[_RERUN_ITERATION])

        def set_iteration(i):
            self.iteration = i
            args.iteration = i

        return MegatronStateAdapter(model, optimizer, scheduler, get_iteration=lambda: self.iteration,
                                    set_iteration=set_iteration, get_counters=get_counters, set_counters=set_counters)

    def _restore(self, args: Any) -> Optional[int]:
        """Collective: the restored iteration, or None on a fresh start."""
        result = self.runtime.try_restore(self.adapter)
        if result.version < 0:
            return None
        # Between here and the first step Megatron-LM builds the data iterators, and iter(DataLoader) draws a
        # seed from the torch RNG: set the restored RNGs again right before the first train_step so they
        # continue exactly where they stopped.
        self.pending_rng = self.adapter.capture_rng_state()
        from megatron.core.num_microbatches_calculator import update_num_microbatches
        update_num_microbatches(args.consumed_train_samples, consistency_check=False, verbose=True)
        log.info("shardsafe: restored iteration %d (consumed_train_samples=%s)", result.version,
                 getattr(args, "consumed_train_samples", None))
        return result.version

    # ---- checkpoint_and_decide_exit: once per iteration, after optimizer.step(), scheduler.step(), iteration += 1
    def checkpoint(self, orig: Callable[..., Any], sig: inspect.Signature, a: tuple, kw: dict) -> Any:
        if self.runtime is not None:
            named = sig.bind(*a, **kw).arguments
            self.iteration = int(named["iteration"])
            self.flops = float(named.get("num_floating_point_operations_so_far", self.flops))
            if self.t_step:
                self.events.emit("iteration", iteration=self.iteration,
                                 seconds=max(0.0, time.perf_counter() - self.t_step - float(self.runtime.last_stall_s)))
            self.runtime.after_step(self.iteration, self.adapter)
        should_exit = orig(*a, **kw)
        if should_exit and self.runtime is not None:
            self.runtime.on_exit(self.iteration, self.adapter)
        return should_exit

    # ---- train_step ---------------------------------------------------------------------------------
    def train_step(self, orig: Callable[..., Any], a: tuple, kw: dict) -> Any:
        if self.pending_rng is not None:
            self.adapter.apply_rng_state(self.pending_rng.tensors, self.pending_rng.meta)
            self.pending_rng = None
        if self.runtime is not None:
            if not self.train_ready:
                self.train_ready = True
                self.events.emit("train_ready", iteration=self.iteration + 1)
            self.t_step = time.perf_counter()
        return orig(*a, **kw)


class HookHandle:
    """Undo ``install_hooks`` (tests; a second pretrain in one process) and close the runtime."""

    def __init__(self, module: Any, originals: dict[str, Any], state: _HookState):
        self._module, self._originals, self.state = module, originals, state

    @property
    def runtime(self) -> Optional[BaseRuntime]:
        return self.state.runtime

    @property
    def adapter(self) -> Optional[MegatronStateAdapter]:
        return self.state.adapter

    def remove(self, *, close: bool = True) -> None:
        """Restore Megatron-LM's functions and the optimizer's step, flush the last snapshot, disconnect.
        ``close=False``: the attempt was abandoned for a restart in place; shardsafe.inplace abandons its runtime
        (a flush would vote with peers that are gone)."""
        for k, v in self._originals.items():
            setattr(self._module, k, v)
        self._originals = {}
        self.state.undo_step()
        self.state.undo_step = lambda: None
        rt = self.state.runtime
        if rt is not None and close:
            rt.close()


def install_hooks(runtime_factory: Callable[[ShardsafeConfig], BaseRuntime] = default_runtime_factory, *,
                  training_module: Any = None) -> HookHandle:
    """Wrap ``setup_model_and_optimizer`` (restore, runtime, before-step wait), ``checkpoint_and_decide_exit``
    (snapshot, exit) and ``train_step`` (re-seat the restored RNGs right before the first step).

    ``train()`` looks these up as module globals at call time, so replacing them before
    ``pretrain()`` runs is enough; Megatron-LM is not modified. The flags must be parsed already
    (``extra_args_provider=add_arguments``); with ``--shardsafe`` absent the wrappers only pass through.

    Restore happens right after the model and optimizer exist (after any ``--load``) and before
    the data iterators are built, so ``consumed_train_samples`` positions the data sampler. The
    returned optimizer's ``step`` is wrapped on the instance so that the pending snapshot copy is
    finished right before each optimizer step (the runtime's ``before_step``). With a run directory
    (``--shardsafe-run-dir`` / SHARDSAFE_RUN_DIR) the TOR events ``train_ready`` and ``iteration``
    are emitted from here, so ``shardsafe tor report`` works for Megatron-LM runs.
    """
    if training_module is None:
        import megatron.training.training as training_module
    T = training_module
    from megatron.training.global_vars import get_args

    state = _HookState(runtime_factory, get_args)
    originals = {"setup_model_and_optimizer": T.setup_model_and_optimizer,
                 "checkpoint_and_decide_exit": T.checkpoint_and_decide_exit, "train_step": T.train_step}
    orig_setup, orig_ckpt, orig_train_step = originals.values()
    ckpt_sig = inspect.signature(orig_ckpt)

    def setup_model_and_optimizer(*a, **kw):
        return state.setup(orig_setup, a, kw)

    def checkpoint_and_decide_exit(*a, **kw):
        return state.checkpoint(orig_ckpt, ckpt_sig, a, kw)

    def train_step(*a, **kw):
        return state.train_step(orig_train_step, a, kw)

    T.setup_model_and_optimizer = setup_model_and_optimizer
    T.checkpoint_and_decide_exit = checkpoint_and_decide_exit
    T.train_step = train_step
    return HookHandle(T, originals, state)


def _export_and_exit(args: Any, export_dir: str, restored: Optional[int], model: Any, optimizer: Any,
                     scheduler: Any, flops: float, how: str = "") -> None:
    """``--shardsafe-export-dir``: the restored state, written by Megatron-LM's own ``save_checkpoint``
    (so the files are exactly what this Megatron version's ``--save`` writes in ``--ckpt-format``,
    for every TP/PP/DP layout), then a clean exit before any training step."""
    from megatron.training.checkpointing import save_checkpoint
    if restored is None:
        raise SystemExit("shardsafe export: no snapshot could be restored (see the restore message above); "
                         "nothing was written to " + export_dir)
    args.save = export_dir
    args.async_save = False   # the process exits right after: the files must be complete
    save_checkpoint(restored, model, optimizer, scheduler, num_floating_point_operations_so_far=flops)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    log.info("shardsafe: exported iteration %d to %s", restored, export_dir)
    if (not torch.distributed.is_initialized()) or torch.distributed.get_rank() == 0:
        print(f"shardsafe: exported iteration {restored} to {export_dir} ({how})", flush=True)
    raise SystemExit(0)


def pretrain(*args: Any, runtime_factory: Callable[[ShardsafeConfig], BaseRuntime] = default_runtime_factory,
             **kwargs: Any) -> Any:
    """Drop-in for ``megatron.training.pretrain`` that adds shardsafe's flags and hooks.

    megatron-core <= 0.17: ``pretrain(dataset_provider, model_provider, model_type, forward_step, ...)``;
    the user's ``extra_args_provider`` (if any) is kept and shardsafe's flags are added to it.
    megatron-core >= 0.18: ``pretrain(cfg_container, ...)`` no longer parses arguments; parse them
    with ``parse_and_validate_args(extra_args_provider=add_arguments)`` before calling this.
    When training ends (or Megatron-LM exits through ``sys.exit``) the last snapshot is flushed and
    the runtime closed; the holder keeps the snapshots for a restart.
    """
    import megatron.training.training as T
    # Megatron's own pretrain, also when the automatic activation (adapters/autoload.py) has wrapped it
    return protected_pretrain(getattr(T.pretrain, "__wrapped__", T.pretrain), args, kwargs,
                              runtime_factory=runtime_factory)


def protected_pretrain(original: Callable[..., Any], args: tuple, kwargs: dict, *,
                       runtime_factory: Callable[[ShardsafeConfig], BaseRuntime] = default_runtime_factory) -> Any:
    """``original(*args, **kwargs)`` (Megatron-LM's ``pretrain``) with shardsafe's flags added to its parser
    (<= 0.17) and the hooks installed into ``megatron.training.training`` for the call."""
    import megatron.training.training as T

    sig = inspect.signature(original)
    if "extra_args_provider" in sig.parameters:
        bound = sig.bind_partial(*args, **kwargs)
        bound.arguments["extra_args_provider"] = compose_extra_args_provider(bound.arguments.get("extra_args_provider"))
        args, kwargs = bound.args, bound.kwargs
    if env.restart_mode() != "in-place":
        return _pretrain_once(T, original, args, kwargs, runtime_factory)
    if torch.distributed.is_initialized():
        log.warning("shardsafe: %s=in-place, but torch.distributed was initialised before pretrain: this rank "
                    "cannot restart in place, and a restart in place of the job ends it (the job then restarts "
                    "in full). Let pretrain initialise torch.distributed (Megatron-LM's pretrain_gpt.py does)",
                    env.RESTART)
        return _pretrain_once(T, original, args, kwargs, runtime_factory)
    from shardsafe.inplace import run
    if torch.cuda.is_available():
        # Megatron-LM sets the device only where it initialises torch.distributed itself
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))   # torchrun's
    # Each attempt is a whole pretrain: Megatron-LM parses its arguments, initialises its globals and groups
    # (cleared on let go, adapters/megatron/inplace.py), builds the model and restores; torch.distributed's
    # default group is made by run, once per attempt, and Megatron-LM finds it initialised.
    # pretrain sets its startup timestamps at module level, and whether it all-reduces them depends on whether they
    # are set: every attempt starts from what the first one found, as a rank started again does.
    stamps = getattr(T, "_STARTUP_TIMESTAMPS", None)
    found = dict(stamps) if isinstance(stamps, dict) else None
    parsed = None if "extra_args_provider" in sig.parameters else _parsed_arguments()
    attempts = 0

    def attempt() -> Any:
        nonlocal attempts
        if found is not None:
            stamps.update(found)
        if attempts and parsed is not None:
            parsed()
        attempts += 1
        return _pretrain_once(T, original, args, kwargs, runtime_factory)

    return run(attempt, backend="nccl" if torch.cuda.is_available() else "gloo")


def _parsed_arguments() -> Callable[[], None]:
    """megatron-core >= 0.18: the entry script parsed the arguments and set Megatron-LM's globals from them before
    calling pretrain, which parses nothing. Cleared on let go, they are set again for every later attempt from a
    copy of what the entry parsed (training changes the live ones: iteration, consumed samples)."""
    import copy

    from megatron.training.global_vars import get_args, set_global_variables
    kept = copy.deepcopy(get_args())
    return lambda: set_global_variables(copy.deepcopy(kept))


def _pretrain_once(T: Any, original: Callable[..., Any], args: tuple, kwargs: dict,
                   runtime_factory: Callable[[ShardsafeConfig], BaseRuntime]) -> Any:
    from shardsafe.inplace import RestartInPlace
    handle = install_hooks(runtime_factory, training_module=T)
    close = True
    try:
        return original(*args, **kwargs)
    except RestartInPlace:
        close = False
        raise
    finally:
        handle.remove(close=close)
