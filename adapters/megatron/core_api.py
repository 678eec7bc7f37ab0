"""The Megatron core API: protection for a megatron-core training loop of your own.

Runtime wiring: :func:`default_runtime_factory` builds :class:`shardsafe.runtime.Runtime` (node holder, async
snapshot pipeline, Reed-Solomon parity across DP peers on distinct nodes, restore) for Megatron's layout, behind
the adapter of :mod:`.state`; :func:`wrap_optimizer_step` makes every optimizer step wait for the pending
snapshot copy. Two ways in, both fork-free: :func:`protect`, or the two calls :func:`restore` once and
:func:`snapshot` after every step (a registry keyed by the optimizer keeps the iteration and counters
between them). Megatron-LM's own loop drives the same :class:`shardsafe.runtime.BaseRuntime` contract from
:mod:`.hooks`.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, MutableMapping, Optional

from shardsafe.config import ConfigError, ShardsafeConfig
from shardsafe.errors import UsageError
from shardsafe.fatal import install_excepthook
from shardsafe.inplace import on_let_go
from shardsafe.runtime import BaseRuntime, Runtime
from shardsafe.tor.events import NullEventLog

from .args import config_from_args
from .inplace import forget_parallel_state
from .state import MegatronStateAdapter
from .state_checks import parity_coordinates

log = logging.getLogger(__name__)
on_let_go("megatron-core", forget_parallel_state)   # a rank restarted in place initialises them again

# Where the runtime has no event log (disabled, a test double): emits nothing.
_NO_EVENTS = NullEventLog()


def default_runtime_factory(cfg: ShardsafeConfig) -> Runtime:
    """The holder runtime (:class:`shardsafe.runtime.Runtime`) for this process's rank and Megatron layout.

    Connects to (or starts) the node's holder and builds the parity plan from Megatron's layout (DP peers with
    equal TP/PP coordinates, on distinct nodes, read from ``megatron.core.parallel_state``). Collective: every
    rank creates one. ``before_step`` must run right before every optimizer step that follows a snapshot (it
    waits for the asynchronous copy; :func:`wrap_optimizer_step` arranges that).

    Raises:
        ConfigError: the parity settings cannot be placed on this layout (e.g. a ``--shardsafe-parity-group-size``
            larger than the number of DP peers on distinct nodes); raised on every rank, before training.
    """
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else 0
    world_size = dist.get_world_size() if initialized else 1
    try:
        return Runtime(cfg, rank=rank, world_size=world_size, coords=parity_coordinates(None))
    except ConfigError as e:
        if "parity" not in str(e):
            raise
        raise ConfigError(f"{e} Set --shardsafe-parity-group-size (0 = the largest feasible, 1 = no parity) and "
                          "--shardsafe-parity-shards to fit this layout: parity groups are data-parallel "
                          "peers (equal tensor/pipeline ranks) on distinct nodes.") from None


def wrap_optimizer_step(optimizer: Any, before_step: Callable[[int], Any],
                        get_iteration: Callable[[], int]) -> Callable[[], None]:
    """Run ``before_step(get_iteration() + 1)`` right before every ``optimizer.step()``; return an undo.

    The wrapper is set on the instance (no subclass, no change to Megatron): Megatron-LM's ``train_step``
    and an own loop both call ``optimizer.step()`` on this object once per iteration, and the step
    (inner Adam, main -> model params, the scheduler after it) is the first thing that mutates the
    state a snapshot references. ``get_iteration`` returns the iteration of the last completed step.
    """
    d = vars(optimizer)
    had, previous = "step" in d, d.get("step")
    orig = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        before_step(int(get_iteration()) + 1)
        return orig(*args, **kwargs)

    step.__wrapped__ = orig  # type: ignore[attr-defined]
    optimizer.step = step

    def undo() -> None:
        if vars(optimizer).get("step") is step:
            if had:
                optimizer.step = previous
            else:
                del optimizer.step

    return undo


# --------------------------------------------------------------------------------------------------
# Core API: protect a megatron-core training loop of your own
# --------------------------------------------------------------------------------------------------

class Protection:
    """What :func:`protect` returns.

    Attributes:
        restored: ``shardsafe.snapshot.restore.RestoreResult`` (``version`` -1: fresh start; ``tier``, ``seconds``,
            ``message``). The loop's iteration and counters are already set to the restored values.
        adapter: the :class:`MegatronStateAdapter`.
        runtime: the runtime (None when shardsafe is disabled).
    """

    def __init__(self, adapter: "MegatronStateAdapter", runtime: Optional[BaseRuntime], restored: Any,
                 undo_step: Callable[[], None]):
        self.adapter, self.runtime, self.restored = adapter, runtime, restored
        self._undo_step = undo_step

    @property
    def enabled(self) -> bool:
        return self.runtime is not None

    @property
    def events(self) -> Any:
        """TOR event log of the runtime (``emit(kind, **fields)``); a no-op when disabled or without a run dir."""
        return self.runtime.events if self.runtime is not None else _NO_EVENTS

    @property
    def last_stall_s(self) -> float:
        """Seconds the last optimizer step waited for the snapshot copy."""
        return float(self.runtime.last_stall_s) if self.runtime is not None else 0.0

    @property
    def stall_total_s(self) -> float:
        """Seconds the training loop has spent blocked by snapshots so far (waits and captures): an
        iteration's TOR `seconds` are its wall time minus this counter's growth over it (docs/tor.md)."""
        return float(self.runtime.stall_total_s) if self.runtime is not None else 0.0

    def after_step(self, iteration: Optional[int] = None) -> None:
        """Call after every optimizer step (and scheduler step / counter updates) with the iteration just
        completed (default: ``get_iteration()``); snapshots every ``interval`` iterations, asynchronously."""
        if self.runtime is not None:
            self.runtime.after_step(int(self.adapter.get_iteration() if iteration is None else iteration), self.adapter)

    def on_exit(self, iteration: Optional[int] = None) -> None:
        """Call when the loop stops early after ``iteration`` (a signal, a time limit): snapshots it if the
        interval skipped it, waits for the commit, and flushes it to the persistent tier when one is set."""
        if self.runtime is not None:
            self.runtime.on_exit(int(self.adapter.get_iteration() if iteration is None else iteration), self.adapter)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait for the last snapshot to be sealed and committed (e.g. before a planned exit)."""
        return bool(self.runtime.flush(timeout)) if self.runtime is not None else True

    def close(self) -> None:
        """Flush the last snapshot, remove the optimizer-step wrapper, disconnect. Idempotent."""
        self._undo_step()
        self._undo_step = lambda: None
        if self.runtime is not None:
            self.runtime.close()

    def __enter__(self) -> "Protection":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _as_config(cfg: Any) -> ShardsafeConfig:
    if isinstance(cfg, ShardsafeConfig):
        return cfg
    if isinstance(cfg, Mapping):
        return ShardsafeConfig.from_dict(cfg, where="shardsafe config")
    return config_from_args(cfg)  # a parsed namespace with the --shardsafe* flags


def protect(model_chunks: Any, optimizer: Any, scheduler: Any, cfg: Any, *,
            get_iteration: Callable[[], int], set_iteration: Callable[[int], None],
            get_counters: Optional[Callable[[], Mapping[str, Any]]] = None,
            set_counters: Optional[Callable[[Mapping[str, Any]], None]] = None,
            extra: Optional[MutableMapping[str, Any]] = None,
            runtime_factory: Callable[[ShardsafeConfig], BaseRuntime] = default_runtime_factory) -> Protection:
    """Protect a megatron-core training loop: restore now (if a snapshot exists), snapshot after steps.

    Call on every rank after ``initialize_model_parallel``, the model seed and the model, optimizer and
    scheduler exist, and before the loop's first step (collective: it builds process groups and may
    restore). Then call ``.after_step(iteration)`` after each optimizer step and ``.close()`` at the end::

        prot = protect(model_chunks, optimizer, scheduler, config_from_args(args),
                       get_iteration=lambda: it, set_iteration=set_it,
                       get_counters=lambda: {"consumed_train_samples": n}, set_counters=set_counters)
        while it < train_iters:
            train_step()                  # optimizer.step() waits for the pending snapshot copy itself
            it += 1; n += global_batch
            prot.after_step(it)
        prot.close()

    ``optimizer.step`` is wrapped on the instance so the pending copy is finished right before it
    mutates the state. Anything that draws from an RNG between ``protect`` and the first step (e.g.
    ``iter(DataLoader)``) shifts the RNG streams: build such things before calling ``protect``.

    Args:
        cfg: ``ShardsafeConfig``, a parsed namespace with the ``--shardsafe*`` flags, or a dict of config keys.
        get_iteration / set_iteration / get_counters / set_counters / extra: see :class:`MegatronStateAdapter`.
        runtime_factory: builds the runtime from the config (default: the holder runtime).
    Raises:
        ConfigError: bad flags, an unsupported optimizer setup, or parity that cannot be placed on this
            layout; before any snapshot or restore.
        shardsafe.snapshot.restore.RestoreError: snapshots exist but none can be restored (the message says what to do).
    """
    install_excepthook()   # a ConfigError that ends the process leaves a record for the launcher
    conf = _as_config(cfg)
    adapter = MegatronStateAdapter(model_chunks, optimizer, scheduler, get_iteration=get_iteration,
                                   set_iteration=set_iteration, get_counters=get_counters, set_counters=set_counters,
                                   extra=extra)
    if not conf.enabled:
        from shardsafe.snapshot.restore import RestoreResult
        return Protection(adapter, None, RestoreResult(message="shardsafe disabled"), lambda: None)
    runtime = runtime_factory(conf)
    undo = wrap_optimizer_step(optimizer, runtime.before_step, get_iteration)
    try:
        restored = runtime.try_restore(adapter)
        _say_state(runtime, conf)
    except BaseException:
        undo()
        runtime.close()
        raise
    return Protection(adapter, runtime, restored, undo)


# --------------------------------------------------------------------------------------------------
# Core API as two calls: restore(...) once, snapshot(...) after every optimizer step
# --------------------------------------------------------------------------------------------------

class Restored:
    """What :func:`restore` returns.

    Attributes:
        iteration: the restored iteration, or None on a fresh start (nothing to restore, or restore disabled).
        counters: the restored loop counters (the ``counters`` given to :func:`snapshot`); ``{}`` on a fresh start.
        tier / seconds / message: where it came from (``memory``, ``parity``, ``persistent``, ``none``), how long
            it took, and a sentence for the log.
        result: the full ``shardsafe.snapshot.restore.RestoreResult``.
        protection: the :class:`Protection` behind the calls (events, stall counters, flush).
    """

    def __init__(self, iteration: Optional[int], counters: Mapping[str, Any], protection: "Protection") -> None:
        self.iteration, self.counters, self.protection = iteration, dict(counters), protection
        self.result = protection.restored
        self.tier = str(self.result.tier)
        self.seconds = float(self.result.seconds)
        self.message = str(self.result.message)

    def __repr__(self) -> str:
        return f"Restored(iteration={self.iteration}, tier={self.tier!r}, seconds={self.seconds:.3f})"


class _Session:
    """One optimizer's protection behind :func:`restore` / :func:`snapshot` / :func:`close`."""

    def __init__(self, model_chunks: list, optimizer: Any, scheduler: Any) -> None:
        self.model_chunks, self.optimizer, self.scheduler = model_chunks, optimizer, scheduler
        self.iteration = 0
        self.interval = 1
        self.counters: dict[str, Any] = {}
        self.protection: Optional[Protection] = None

    def set_iteration(self, i: int) -> None:
        self.iteration = int(i)

    def set_counters(self, c: Mapping[str, Any]) -> None:
        self.counters = dict(c)


# Keyed by id(optimizer); the session holds the optimizer, so an id cannot be reused while it is registered.
_SESSIONS: dict[int, _Session] = {}


def _chunks(model_chunks: Any) -> list:
    return list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]


def _session_for(model_chunks: Any, optimizer: Any, scheduler: Any, call: str) -> _Session:
    s = _SESSIONS.get(id(optimizer))
    if s is None:
        raise UsageError(f"shardsafe.adapters.megatron.{call}: no protection for this optimizer. Call "
                           "restore(model_chunks, optimizer, scheduler, cfg) once on every rank before the "
                           "first snapshot (it connects to the holder, sets up parity and restores when a "
                           "snapshot exists; pass a config with restore disabled, --shardsafe-no-restore, to "
                           "only set up).")
    chunks = _chunks(model_chunks)
    if len(chunks) != len(s.model_chunks) or any(a is not b for a, b in zip(chunks, s.model_chunks)) \
            or scheduler is not s.scheduler:
        raise ConfigError(f"shardsafe.adapters.megatron.{call}: the model chunks or the scheduler are not the "
                         "objects restore() was given for this optimizer; pass the same objects (the snapshot "
                         "references their tensors), or close(optimizer) and restore() again for new ones.")
    return s


def restore(model_chunks: Any, optimizer: Any, scheduler: Any, cfg: Any, *,
            extra: Optional[MutableMapping[str, Any]] = None,
            runtime_factory: Callable[[ShardsafeConfig], BaseRuntime] = default_runtime_factory) -> Restored:
    """Set up protection for this rank's model/optimizer/scheduler and restore the newest snapshot, in place.

    Collective: every rank calls it once, after ``initialize_model_parallel``, the model seed and the
    model, optimizer and scheduler exist, before the first optimizer step (build data iterators before
    it: anything drawing from an RNG in between shifts the restored streams). It is :func:`protect`
    with the iteration and counters kept for you: the state comes back from the cheapest complete tier
    (node holder memory, parity rebuild across DP peers on other nodes, the persistent directory),
    verified, written into the existing tensors (never through ``load_state_dict``), and
    ``optimizer.step`` is wrapped so each step first waits for the pending snapshot copy. Then call
    :func:`snapshot` after every optimizer step, and :func:`close` at the end::

        r = restore(model_chunks, optimizer, scheduler, config_from_args(args), extra=my_json_state)
        it = r.iteration or 0; samples = r.counters.get("consumed_train_samples", 0)
        while it < train_iters:
            train_step(); it += 1; samples += global_batch
            snapshot(model_chunks, optimizer, scheduler, it, counters={"consumed_train_samples": samples})
        close(optimizer)

    Args:
        cfg: ``ShardsafeConfig``, a parsed namespace with the ``--shardsafe*`` flags, or a dict of config keys.
        extra: user state; JSON values are written back into this mapping, tensors copied in place.
        runtime_factory: builds the runtime from the config (default: the holder runtime).
    Returns:
        :class:`Restored` (``iteration`` None on a fresh start).
    Raises:
        RuntimeError: restore() was already called for this optimizer (close() it first).
        ConfigError, shardsafe.snapshot.restore.RestoreError: as :func:`protect`.
    """
    if id(optimizer) in _SESSIONS:
        raise UsageError("shardsafe.adapters.megatron.restore: this optimizer is already protected (restore() "
                           "was called for it before); call close(optimizer) first to start over.")
    conf = _as_config(cfg)
    s = _Session(_chunks(model_chunks), optimizer, scheduler)
    s.interval = conf.interval
    prot = protect(s.model_chunks, optimizer, scheduler, conf, get_iteration=lambda: s.iteration,
                   set_iteration=s.set_iteration, get_counters=lambda: dict(s.counters),
                   set_counters=s.set_counters, extra=extra, runtime_factory=runtime_factory)
    s.protection = prot
    _SESSIONS[id(optimizer)] = s
    version = int(prot.restored.version)
    return Restored(s.iteration if version >= 0 else None, s.counters if version >= 0 else {}, prot)


def snapshot(model_chunks: Any, optimizer: Any, scheduler: Any, iteration: int,
             extra: Optional[MutableMapping[str, Any]] = None, *,
             counters: Optional[Mapping[str, Any]] = None, final: bool = False) -> bool:
    """Snapshot this rank's state after the optimizer step of ``iteration``, asynchronously (collective).

    Call on every rank after every optimizer step (and the scheduler step), with the iteration just
    completed; the configured interval decides which iterations are captured (default 1: all). Capture
    takes references and JSON metadata (milliseconds); a worker copies the tensors into the node
    holder's shared memory, checksums, seals, encodes parity inside the DP parity group and commits;
    the next ``optimizer.step()`` waits only if that copy is still running. A failed snapshot (holder
    gone, budget) is logged and recorded, never raised: training goes on.

    Args:
        iteration: the iteration whose optimizer step just completed (1-based, as Megatron counts).
        extra: user state to capture from now on (default: the mapping given to :func:`restore`).
        counters: flat ``{name: number}`` loop counters to restore with the state (consumed samples, ...);
            kept until replaced.
        final: the loop stops after this iteration (a signal, a time limit): snapshot it even if the
            interval skips it, wait until it commits, and flush it to the persistent tier when one is set.
    Returns:
        True if this iteration was captured, False if the interval skipped it or shardsafe is disabled.
    Raises:
        RuntimeError: :func:`restore` was not called for this optimizer. ValueError: other model chunks or
            scheduler than restore() was given.
    """
    s = _session_for(model_chunks, optimizer, scheduler, "snapshot")
    prot = s.protection
    assert prot is not None
    s.iteration = int(iteration)
    if counters is not None:
        s.counters = dict(counters)
    if extra is not None:
        prot.adapter.extra = extra
    if not prot.enabled:
        return False
    prot.after_step(s.iteration)           # the runtime applies the interval
    if final:
        prot.on_exit(s.iteration)          # snapshots it if the interval skipped it; waits for the commit
        return True
    return s.iteration % s.interval == 0


def close(optimizer: Any) -> None:
    """Wait for the last snapshot to commit, unwrap ``optimizer.step``, disconnect from the holder (which keeps
    the snapshots for a restart). Idempotent; call at the end of training on every rank."""
    s = _SESSIONS.pop(id(optimizer), None)
    if s is not None and s.protection is not None:
        s.protection.close()


def protection_of(optimizer: Any) -> Optional[Protection]:
    """The :class:`Protection` behind :func:`restore`/:func:`snapshot` for this optimizer (events, stall
    counters, flush), or None when it is not protected."""
    s = _SESSIONS.get(id(optimizer))
    return s.protection if s is not None else None


def _say_state(runtime: BaseRuntime, cfg: ShardsafeConfig) -> None:
    """Rank 0's one line at start: protected or not, and why (on_unprotected "fail" raises here on every rank)."""
    import torch.distributed as dist
    state = runtime.banner()
    if (not dist.is_initialized()) or dist.get_rank() == 0:
        how = runtime.restored.message if runtime.restored is not None else ""
        cfg = getattr(runtime, "cfg", cfg)   # the runtime's: what the environment filled in (the job id)
        log.warning("shardsafe: Megatron training is %s (in-memory snapshots every %d iteration(s), job %s); "
                    "--shardsafe-enabled off turns protection off. %s", state, cfg.interval, cfg.job_id, how)
