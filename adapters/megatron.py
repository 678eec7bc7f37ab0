"""Megatron adapter: a rank's Megatron state as a :class:`RankState`, and back, in place.

What one rank owns (megatron-core's torch-Adam, TE and Apex paths alike):
  * per optimizer of a ``ChainedOptimizer`` (dense, expert, ...):
      - the params the inner optimizer updates: DistributedOptimizer fp32 main-param *shards*
        (``shard_fp32_from_float16_groups``; for fp32 models, views into the param buffer),
        Float16OptimizerWithFloat16Params fp32 main params, FP32Optimizer model params;
      - the inner optimizer's per-param state (exp_avg, exp_avg_sq, ``step`` on torch Adam);
      - ``param_groups`` hyper-parameters (lr, weight_decay, ``step`` on TE/Apex FusedAdam, ...);
      - the grad scaler (fp16);
  * the LR/WD scheduler, the RNGs (torch CPU/CUDA, python, numpy, Megatron's CUDA RNG tracker),
    TE FP8 scaling state (scale, amax history) of layers that have it, persistent module buffers (e.g.
    the MoE router's expert bias), the iteration, counters (consumed samples, FLOPs, ...) and a user
    ``extra`` dict.
Low-precision model params are *not* saved: apply writes the main params back and re-derives them
exactly as ``optimizer.step()`` does (main -> model copy, then the DistOpt param all-gather).

Restore never goes through ``optimizer.load_state_dict`` / Megatron's checkpoint loaders, which
have step-counter bugs on the torch-Adam path (shared ``step`` tensor, ``KeyError: 'step'``, step
not restored; see shared/reference/megatron-core.md §3.4): every value is copied into the existing
tensors, and a fresh optimizer's missing per-param state is allocated one tensor per param.

Runtime wiring: :class:`HolderRuntime` puts :class:`shardsafe.runtime.Runtime` (node holder, async
snapshot pipeline, Reed-Solomon parity across DP peers on distinct nodes, restore) behind the
adapter; :func:`wrap_optimizer_step` makes every optimizer step wait for the pending snapshot copy.
Two ways in, both fork-free: :func:`protect` (or the two calls :func:`restore` once and
:func:`snapshot` after every step) for a megatron-core loop of your own, and
``pretrain`` / ``install_hooks`` for Megatron-LM's loop (wraps module globals of
``megatron.training.training``).
"""
from __future__ import annotations

import inspect
import logging
import time
from typing import Any, Callable, Iterable, Mapping, MutableMapping, Optional, Protocol, Sequence

import torch

from shardsafe.config import ConfigError, ShardsafeConfig
from shardsafe.state import RankState, apply_rng, capture_rng, cast_like_owner

from .megatron_args import add_arguments, compose_extra_args_provider, config_from_args

__all__ = [
    "MegatronStateAdapter", "SnapshotMismatch", "Runtime", "HolderRuntime", "Protection", "protect",
    "restore", "snapshot", "close", "Restored", "protection_of",
    "snapshot_state", "apply_state", "rank_coordinates", "parity_coordinates", "check_supported",
    "wrap_optimizer_step", "install_hooks", "pretrain", "add_arguments", "config_from_args", "FORMAT",
]

log = logging.getLogger("shardsafe.megatron")

FORMAT = "shardsafe.megatron/1"
"""Meta format tag: bumped when names or meta layout change, so an old snapshot is refused, not misread."""

_FP8_META_KEYS = ("scaling_fwd", "scaling_bwd")
_FP8_ATTRS = ("scale", "scale_inv", "amax_history")
# parallel_state coordinates that must be identical between the snapshotting and the restoring rank.
_COORD_KEYS = ("tp", "tp_size", "pp", "pp_size", "dp", "dp_size", "cp", "cp_size", "ep", "ep_size",
               "etp", "etp_size", "vpp_size")


class SnapshotMismatch(ValueError):
    """A snapshot does not fit the live model/optimizer (other layout, model or optimizer config)."""


class Runtime(Protocol):
    """What the Megatron-LM hooks and :func:`protect` drive: :class:`HolderRuntime` implements it.

    Optional members, used when present: ``before_step(iteration)`` (run right before every optimizer
    step; it finishes the pending snapshot copy), ``flush(timeout)``, ``close()``, ``events`` (TOR event
    log), ``last_stall_s`` and ``restored`` (a ``RestoreResult``). Test doubles may omit them.
    """

    def after_step(self, iteration: int, adapter: "MegatronStateAdapter") -> None:
        """Called after every optimizer step (scheduler stepped, ``iteration`` incremented).

        The runtime applies ``ShardsafeConfig.interval`` and may call ``adapter.capture()``; it
        must finish copying the captured tensors before the next optimizer step.
        """

    def on_exit(self, iteration: int, adapter: "MegatronStateAdapter") -> None:
        """Megatron-LM decided to exit (signal, exit interval/duration): seal or flush snapshots."""

    def try_restore(self, adapter: "MegatronStateAdapter") -> Optional[int]:
        """Restore the newest recoverable version through ``adapter.apply`` (a collective on every
        rank); return its iteration, or None when nothing was restored."""


# --------------------------------------------------------------------------------------------------
# Supported configurations
# --------------------------------------------------------------------------------------------------

def _mcore():
    try:
        import megatron.core as mc
    except ImportError as e:  # pragma: no cover - exercised only without megatron-core
        raise ImportError("shardsafe's Megatron adapter needs megatron-core: pip install megatron-core==0.16.1 "
                          "(see docs/megatron.md for 0.17+ on Python 3.11)") from e
    return mc


def megatron_core_version() -> str:
    return str(getattr(_mcore(), "__version__", "unknown"))


def leaf_optimizers(optimizer: Any) -> list:
    """The MegatronOptimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _kind(leaf: Any) -> str:
    from megatron.core.optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params
    if isinstance(leaf, DistributedOptimizer):
        return "DistributedOptimizer"
    if isinstance(leaf, Float16OptimizerWithFloat16Params):
        return "Float16OptimizerWithFloat16Params"
    if isinstance(leaf, FP32Optimizer):
        return "FP32Optimizer"
    raise ConfigError(f"shardsafe's Megatron adapter supports DistributedOptimizer, Float16OptimizerWithFloat16Params "
                      f"and FP32Optimizer; got {type(leaf).__name__}. Use --use-distributed-optimizer "
                      f"(OptimizerConfig.use_distributed_optimizer=True) or run without --shardsafe.")


def check_supported(model_chunks: Sequence[Any], optimizer: Any) -> None:
    """Reject configurations whose state the adapter cannot restore exactly, naming the setting.

    Raises:
        ConfigError: the first unsupported setting found.
    """
    for leaf in leaf_optimizers(optimizer):
        kind = _kind(leaf)
        cfg = getattr(leaf, "config", None)
        if cfg is not None and getattr(cfg, "use_precision_aware_optimizer", False):
            raise ConfigError("--use-precision-aware-optimizer (OptimizerConfig.use_precision_aware_optimizer) is not "
                              "supported by shardsafe: TE FusedAdam then keeps the master weights and their remainders "
                              "inside its own state. Turn it off, or run without --shardsafe.")
        if cfg is not None and getattr(cfg, "optimizer_cpu_offload", False):
            raise ConfigError("--optimizer-cpu-offload (OptimizerConfig.optimizer_cpu_offload) is not supported by "
                              "shardsafe: HybridDeviceOptimizer keeps the state in CPU sub-optimizers. Turn it off, "
                              "or run without --shardsafe.")
        if kind == "DistributedOptimizer" and not getattr(leaf, "is_stub_optimizer", False):
            ddp_cfg = getattr(leaf, "ddp_config", None)
            if ddp_cfg is not None and getattr(ddp_cfg, "use_megatron_fsdp", False):
                raise ConfigError("--use-megatron-fsdp (DistributedDataParallelConfig.use_megatron_fsdp) is not "
                                  "supported by shardsafe: use --use-distributed-optimizer with Megatron DDP.")
            for attr in ("buffers", "model_param_gbuf_map", "shard_fp32_groups", "shard_fp32_from_float16_groups",
                         "model_fp32_groups", "model_float16_groups", "_copy_main_params_to_model_params"):
                if not hasattr(leaf, attr):
                    raise ConfigError(f"megatron-core {megatron_core_version()}: DistributedOptimizer has no '{attr}'; "
                                      "this version is not supported by shardsafe (tested: 0.16.1, 0.17.1).")
    for i, chunk in enumerate(model_chunks):
        if not hasattr(chunk, "named_parameters"):
            raise ConfigError(f"model_chunks[{i}] is a {type(chunk).__name__}, not a torch module: pass the list "
                              "of (DDP-wrapped) model chunks returned by get_model()/setup_model_and_optimizer().")


# --------------------------------------------------------------------------------------------------
# Rank coordinates (parity placement)
# --------------------------------------------------------------------------------------------------

def rank_coordinates() -> dict[str, Any]:
    """This rank's place in Megatron's parallel layout, from ``megatron.core.parallel_state``.

    Returns a JSON-able dict: ``rank``/``world_size``; ``tp``, ``pp``, ``dp``, ``cp``, ``ep``, ``etp``
    ranks with their ``*_size``; ``vpp_size``; and the world ranks of the groups a parity group is
    placed in: ``dp_ranks`` (the group the DistributedOptimizer shards over: data-parallel with
    context-parallel), ``tp_ranks``, ``pp_ranks`` and, with experts, ``edp_ranks``.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("rank_coordinates(): megatron.core.parallel_state is not initialized; call it after "
                           "initialize_model_parallel() (Megatron-LM: after initialize_megatron()).")

    def ranks(group) -> list[int]:
        return [int(r) for r in dist.get_process_group_ranks(group)] if group is not None else [dist.get_rank()]

    def opt(fn: str, *a, default=None, **k):
        f = getattr(ps, fn, None)
        if f is None:
            return default
        try:
            return f(*a, **k)
        except (AssertionError, RuntimeError, TypeError):
            return default

    c: dict[str, Any] = {
        "rank": dist.get_rank(), "world_size": dist.get_world_size(),
        "tp": ps.get_tensor_model_parallel_rank(), "tp_size": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_rank(), "pp_size": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_rank(with_context_parallel=True),
        "dp_size": ps.get_data_parallel_world_size(with_context_parallel=True),
        "cp": opt("get_context_parallel_rank", default=0), "cp_size": opt("get_context_parallel_world_size", default=1),
        "ep": opt("get_expert_model_parallel_rank", default=0),
        "ep_size": opt("get_expert_model_parallel_world_size", default=1),
        "etp": opt("get_expert_tensor_parallel_rank", default=0),
        "etp_size": opt("get_expert_tensor_parallel_world_size", default=1),
        "vpp_size": opt("get_virtual_pipeline_model_parallel_world_size", default=None) or 1,
        "dp_ranks": ranks(ps.get_data_parallel_group(with_context_parallel=True)),
        "tp_ranks": ranks(ps.get_tensor_model_parallel_group()),
        "pp_ranks": ranks(ps.get_pipeline_model_parallel_group()),
    }
    if c["ep_size"] > 1:
        c["edp_ranks"] = ranks(opt("get_expert_data_parallel_group"))
    return c


# --------------------------------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------------------------------

def _jsonable(v: Any, where: str) -> Any:
    """Plain JSON values only (tuples become lists; ``apply`` turns them back where the live value is a tuple)."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x, f"{where}.{k}") for k, x in v.items()}
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0 and not isinstance(v, torch.Tensor):  # numpy scalar
        return v.item()
    raise TypeError(f"{where} is a {type(v).__name__}, which a snapshot's JSON metadata cannot hold; "
                    "keep counters and extra values to numbers/strings/lists/dicts, or pass them as tensors.")


def _like_live(saved: Any, live: Any) -> Any:
    if isinstance(live, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved


class MegatronStateAdapter:
    """:class:`shardsafe.state.StateAdapter` for megatron-core model chunks + MegatronOptimizer.

    Args:
        model_chunks: the DDP-wrapped model chunks (one per virtual pipeline stage).
        optimizer: ``get_megatron_optimizer(...)``'s result (ChainedOptimizer or a single optimizer).
        scheduler: ``OptimizerParamScheduler`` (or any object with ``state_dict``/``load_state_dict``), or None.
        get_iteration / set_iteration: read and write the training loop's iteration counter.
        extra: user state. Tensor values are captured by reference and copied back in place; other
            values must be JSON-able and are written back into this same mapping on ``apply``.
        get_counters / set_counters: read/write loop counters (consumed samples, FLOPs so far, ...),
            a flat ``{name: number}`` dict; Megatron-LM's hooks bind them to ``get_args()``.
        include_rng: capture/restore the RNGs (torch, CUDA, python, numpy, Megatron's RNG tracker).

    ``apply`` is collective: every rank of the job must call it (the DistOpt param all-gather).
    Call ``validate`` first (no communication) and agree on the result before calling ``apply``.
    """

    def __init__(self, model_chunks: Any, optimizer: Any, scheduler: Any = None, *,
                 get_iteration: Callable[[], int], set_iteration: Callable[[int], None],
                 extra: Optional[MutableMapping[str, Any]] = None,
                 get_counters: Optional[Callable[[], Mapping[str, Any]]] = None,
                 set_counters: Optional[Callable[[Mapping[str, Any]], None]] = None,
                 include_rng: bool = True) -> None:
        self.model_chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.get_iteration = get_iteration
        self.set_iteration = set_iteration
        self.extra = extra
        self.get_counters = get_counters
        self.set_counters = set_counters
        self.include_rng = include_rng
        check_supported(self.model_chunks, optimizer)
        self.leaves = leaf_optimizers(optimizer)
        self._kinds = [_kind(leaf) for leaf in self.leaves]
        self._param_names = {id(p): f"c{ci}.{n}" for ci, chunk in enumerate(self.model_chunks)
                             for n, p in chunk.named_parameters()}
        self._coords: Optional[dict[str, Any]] = None

    # ---------------------------------------------------------------- enumeration (one place, used both ways)
    def _groups(self, li: int) -> list[dict]:
        inner = getattr(self.leaves[li], "optimizer", None)
        return list(inner.param_groups) if inner is not None else []

    def _model_param_of(self, li: int) -> dict[int, tuple[Any, Optional[list[int]]]]:
        """id(optimizer param) -> (model param, [start, end) of the model param this rank owns or None)."""
        leaf, kind, out = self.leaves[li], self._kinds[li], {}
        if getattr(leaf, "optimizer", None) is None:
            return out
        if kind == "DistributedOptimizer":
            pairs = []
            for shards, models in ((leaf.shard_fp32_groups, leaf.model_fp32_groups),
                                   (leaf.shard_fp32_from_float16_groups, leaf.model_float16_groups)):
                for sg, mg in zip(shards, models):
                    pairs.extend(zip(sg, mg))
            for shard, model in pairs:
                if shard is None:
                    continue
                rng = None
                try:
                    r = leaf._get_model_param_range_map(model)["param"]
                    rng = [int(r.start), int(r.end)]
                except (AttributeError, KeyError):
                    pass
                out[id(shard)] = (model, rng)
        elif kind == "Float16OptimizerWithFloat16Params":
            for g16, g32 in zip(leaf.float16_groups, leaf.fp32_from_fp32_groups):
                for p in g16:
                    out[id(p.main_param)] = (p, None)
                for p in g32:
                    out[id(p)] = (p, None)
        else:
            for g in self._groups(li):
                for p in g["params"]:
                    out[id(p)] = (p, None)
        return out

    def _persistent_buffers(self) -> Iterable[tuple[str, torch.Tensor]]:
        """(name, tensor) of the model's persistent module buffers (those a ``state_dict`` holds), e.g. the MoE
        router's ``expert_bias`` of aux-loss-free load balancing, which training updates."""
        for ci, chunk in enumerate(self.model_chunks):
            for mname, m in chunk.named_modules():
                skip = getattr(m, "_non_persistent_buffers_set", ())
                for bname, b in getattr(m, "_buffers", {}).items():
                    if isinstance(b, torch.Tensor) and bname not in skip:
                        yield f"c{ci}.{mname + '.' if mname else ''}{bname}", b

    def _fp8_modules(self) -> Iterable[tuple[str, Any]]:
        """(name, module) of TE modules carrying FP8 scaling state (duck-typed: ``fp8_meta`` dict)."""
        for ci, chunk in enumerate(self.model_chunks):
            for name, m in chunk.named_modules():
                if isinstance(getattr(m, "fp8_meta", None), dict):
                    yield f"c{ci}.{name}", m

    def _coordinates(self) -> Optional[dict[str, Any]]:
        """``rank_coordinates()``, computed once: the layout does not change under a live optimizer, and
        every snapshot's metadata carries it (a few ms per call on large groups)."""
        if self._coords is None:
            try:
                self._coords = rank_coordinates()
            except RuntimeError:
                return None
        return self._coords

    @property
    def optional_prefixes(self) -> tuple[str, ...]:
        """Snapshot tensor names a fresh process does not have yet (``manifest.check_matches``): the
        inner optimizer's per-param state (torch Adam creates it in the first step) and TE FP8 scaling
        state (allocated in the first FP8 forward). ``apply`` creates them; ``validate`` checks the rest."""
        out = ["fp8/"]
        for li in range(len(self.leaves)):
            inner = getattr(self.leaves[li], "optimizer", None)
            if inner is None:
                continue
            for gi, group in enumerate(self._groups(li)):
                out.extend(f"opt{li}/g{gi}/p{pi}/" for pi, p in enumerate(group["params"]) if not inner.state.get(p))
        return tuple(out)

    # ---------------------------------------------------------------- capture
    def capture(self) -> RankState:
        """References to this rank's live state tensors plus JSON metadata (see module docstring).

        Exceptions to "references": RNG states are copies by nature, and TE FP8 scaling tensors are
        cloned because TE updates amax history during the *forward* pass, i.e. before the next step.
        """
        st = RankState()
        meta: dict[str, Any] = {"format": FORMAT, "megatron_core": megatron_core_version(),
                                "iteration": int(self.get_iteration())}
        meta["coords"] = self._coordinates()  # None without parallel_state: single-process use
        opts = []
        for li, leaf in enumerate(self.leaves):
            inner = getattr(leaf, "optimizer", None)
            owner = self._model_param_of(li)
            om: dict[str, Any] = {"type": self._kinds[li], "stub": inner is None, "groups": []}
            for gi, group in enumerate(self._groups(li)):
                gm: dict[str, Any] = {"hparams": {}, "hparam_tensors": [], "params": []}
                for k, v in group.items():
                    if k == "params":
                        continue
                    if isinstance(v, torch.Tensor):
                        st.tensors[f"opt{li}/g{gi}/hp/{k}"] = v
                        gm["hparam_tensors"].append(k)
                    else:
                        try:
                            gm["hparams"][k] = _jsonable(v, f"param_groups[{gi}][{k!r}]")
                        except TypeError:
                            log.debug("param_groups[%d][%r] (%s) is not snapshotted", gi, k, type(v).__name__)
                for pi, p in enumerate(group["params"]):
                    model, rng = owner.get(id(p), (None, None))
                    pre = f"opt{li}/g{gi}/p{pi}"
                    st.tensors[f"{pre}/param"] = p.detach()
                    state = inner.state.get(p, {})
                    pm = {"name": self._param_names.get(id(model)) if model is not None else None,
                          "shape": list(p.shape), "range": rng, "state": sorted(state), "state_meta": {}}
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor):
                            st.tensors[f"{pre}/{k}"] = v
                        else:
                            pm["state_meta"][k] = _jsonable(v, f"optimizer.state[{pre}][{k!r}]")
                    gm["params"].append(pm)
                om["groups"].append(gm)
            om["grad_scaler"] = self._capture_grad_scaler(li, st)
            opts.append(om)
        meta["optimizers"] = opts
        meta["scheduler"] = (_jsonable(self.scheduler.state_dict(), "scheduler.state_dict()")
                             if self.scheduler is not None else None)
        meta["counters"] = _jsonable(dict(self.get_counters()), "counters") if self.get_counters else {}
        meta["extra"] = self._capture_extra(st)
        meta["fp8"] = self._capture_fp8(st)
        # Copies: buffers such as the MoE router's expert bias are updated before the next optimizer step
        # (in finalize_model_grads), i.e. while the asynchronous copy of this snapshot may still run.
        meta["buffers"] = []
        for name, b in self._persistent_buffers():
            st.tensors[f"buf/{name}"] = b.detach().clone()
            meta["buffers"].append(name)
        meta["rng"] = self._capture_rng(st) if self.include_rng else None
        st.meta = meta
        return st

    def _capture_grad_scaler(self, li: int, st: RankState) -> Optional[dict]:
        gs = getattr(self.leaves[li], "grad_scaler", None)
        if gs is None:
            return None
        out: dict[str, Any] = {"type": type(gs).__name__, "attrs": {}}
        for k, v in vars(gs).items():
            if isinstance(v, torch.Tensor):
                st.tensors[f"opt{li}/grad_scaler/{k}"] = v
            elif isinstance(v, (int, float, bool)):
                out["attrs"][k] = v
        return out

    def _capture_extra(self, st: RankState) -> dict:
        out: dict[str, Any] = {}
        for k, v in (self.extra or {}).items():
            if isinstance(v, torch.Tensor):
                st.tensors[f"extra/{k}"] = v
            else:
                out[k] = _jsonable(v, f"extra[{k!r}]")
        return out

    def _capture_fp8(self, st: RankState) -> list:
        found = []
        for name, m in self._fp8_modules():
            for key in _FP8_META_KEYS:
                obj = m.fp8_meta.get(key)
                for attr in _FP8_ATTRS:
                    t = getattr(obj, attr, None)
                    if isinstance(t, torch.Tensor):
                        st.tensors[f"fp8/{name}/{key}/{attr}"] = t.detach().clone()
                        found.append([name, key, attr])
        return found

    def capture_rng_state(self) -> RankState:
        """Copies of every RNG state (torch, CUDA, python, numpy, Megatron tracker) right now."""
        st = RankState()
        st.meta = {"rng": self._capture_rng(st)}
        st.tensors = {k: v.clone() for k, v in st.tensors.items()}
        return st

    def apply_rng_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Set every RNG from ``capture_rng_state()``'s result (or a full snapshot's)."""
        self._apply_rng(meta["rng"], tensors)

    def _capture_rng(self, st: RankState) -> dict:
        r = capture_rng("rng")
        st.tensors.update(r.tensors)
        tracker_names = []
        tracker = _rng_tracker()
        if tracker is not None:
            for name, s in tracker.get_states().items():
                st.tensors[f"rng/tracker/{name}"] = s.get_state() if isinstance(s, torch.Generator) else s
                tracker_names.append(name)
        return {"base": r.meta, "tracker": tracker_names}

    # ---------------------------------------------------------------- validate
    def validate(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> list[str]:
        """Problems that would stop ``apply`` (empty list = applicable). No communication, no mutation."""
        p: list[str] = []
        if meta.get("format") != FORMAT:
            return [f"snapshot format {meta.get('format')!r} is not {FORMAT!r} (written by another shardsafe version)"]
        cur = self._coordinates()
        old = meta.get("coords")
        if cur is not None and old is not None:
            diff = [f"{k}: snapshot {old.get(k)} vs now {cur.get(k)}" for k in _COORD_KEYS if old.get(k) != cur.get(k)]
            if diff:
                p.append("parallel layout differs (" + "; ".join(diff) + "); restore with the same --tensor-model-"
                         "parallel-size/--pipeline-model-parallel-size/data-parallel size and rank order, or use "
                         "Megatron's persistent checkpoint (--load) to change the layout")
        opts = meta.get("optimizers", [])
        if len(opts) != len(self.leaves):
            p.append(f"snapshot has {len(opts)} optimizer(s), the live ChainedOptimizer has {len(self.leaves)}")
            return p
        for li, om in enumerate(opts):
            if om["type"] != self._kinds[li]:
                p.append(f"optimizer {li}: snapshot {om['type']} vs live {self._kinds[li]} (--use-distributed-optimizer, "
                         f"--bf16/--fp16 must match)")
                continue
            owner = self._model_param_of(li)
            groups = self._groups(li)
            if len(om["groups"]) != len(groups):
                p.append(f"optimizer {li}: {len(om['groups'])} param groups in the snapshot vs {len(groups)} live")
                continue
            inner = getattr(self.leaves[li], "optimizer", None)
            for gi, (gm, group) in enumerate(zip(om["groups"], groups)):
                if len(gm["params"]) != len(group["params"]):
                    p.append(f"optimizer {li} group {gi}: {len(gm['params'])} params in the snapshot vs "
                             f"{len(group['params'])} live (another model or optimizer config)")
                    continue
                for k in gm["hparam_tensors"]:
                    self._check_tensor(p, tensors, f"opt{li}/g{gi}/hp/{k}", group.get(k))
                for pi, (pm, param) in enumerate(zip(gm["params"], group["params"])):
                    pre = f"opt{li}/g{gi}/p{pi}"
                    model, rng = owner.get(id(param), (None, None))
                    name = self._param_names.get(id(model)) if model is not None else None
                    if pm["name"] != name or pm["range"] != rng:
                        p.append(f"{pre}: snapshot holds {pm['name']}{pm['range'] or ''}, live is {name}{rng or ''}")
                        continue
                    self._check_tensor(p, tensors, f"{pre}/param", param)
                    live_state = inner.state.get(param, {}) if inner is not None else {}
                    if live_state and sorted(live_state) != pm["state"]:
                        p.append(f"{pre}: optimizer state keys {pm['state']} in the snapshot vs {sorted(live_state)} "
                                 "live (another optimizer, or amsgrad differs)")
                        continue
                    for k in pm["state"]:
                        if k in pm["state_meta"]:
                            continue
                        self._check_tensor(p, tensors, f"{pre}/{k}", live_state.get(k))
            gs = getattr(self.leaves[li], "grad_scaler", None)
            if (om["grad_scaler"] is None) != (gs is None):
                p.append(f"optimizer {li}: grad scaler {'missing' if gs is None else 'present'} live but not in the "
                         "snapshot (--fp16/--loss-scale must match)")
            elif gs is not None:
                for k, v in vars(gs).items():
                    if isinstance(v, torch.Tensor):
                        self._check_tensor(p, tensors, f"opt{li}/grad_scaler/{k}", v)
        if (meta.get("scheduler") is None) != (self.scheduler is None):
            p.append("scheduler state is " + ("missing from the snapshot" if meta.get("scheduler") is None else
                                              "in the snapshot but no scheduler was given to the adapter"))
        elif self.scheduler is not None:
            p.extend(self._scheduler_problems(meta["scheduler"]))
        for k, v in (meta.get("extra") or {}).items():
            if self.extra is None:
                p.append(f"extra[{k!r}] is in the snapshot but the adapter has no extra mapping")
                break
        for k in _names_with_prefix(tensors, "extra/"):
            live = (self.extra or {}).get(k[len("extra/"):])
            self._check_tensor(p, tensors, k, live)
        if "buffers" in meta:
            live_bufs = dict(self._persistent_buffers())
            if sorted(meta["buffers"]) != sorted(live_bufs):
                p.append(f"persistent module buffers differ: snapshot {sorted(meta['buffers'])[:5]} vs live "
                         f"{sorted(live_bufs)[:5]} (another model config)")
            else:
                for name in meta["buffers"]:
                    self._check_tensor(p, tensors, f"buf/{name}", live_bufs[name])
        if self.include_rng and meta.get("rng") is None:
            p.append("the snapshot has no RNG state (taken with include_rng=False)")
        return p

    def _scheduler_problems(self, sd: Mapping[str, Any]) -> list[str]:
        """OptimizerParamScheduler.load_state_dict asserts the schedule is unchanged unless told otherwise;
        find that here, before anything is mutated, and say which flag changed."""
        sch = self.scheduler
        if not hasattr(sch, "use_checkpoint_opt_param_scheduler"):
            return []
        if sch.use_checkpoint_opt_param_scheduler or getattr(sch, "override_opt_param_scheduler", False):
            return []
        diff = [f"{k}: snapshot {v} vs now {getattr(sch, k)}" for k, v in sd.items()
                if k != "num_steps" and hasattr(sch, k) and getattr(sch, k) != v]
        if not diff:
            return []
        return ["the LR/WD schedule differs from the snapshot's (" + "; ".join(diff) + "); keep --lr, --min-lr, "
                "--lr-warmup-*, --lr-decay-* (which default to --train-iters), --start/--end-weight-decay unchanged, or "
                "pass --use-checkpoint-opt_param-scheduler / --override-opt_param-scheduler"]

    @staticmethod
    def _check_tensor(p: list[str], tensors: Mapping[str, torch.Tensor], name: str, live: Any) -> None:
        t = tensors.get(name)
        if t is None:
            p.append(f"tensor {name} is missing from the snapshot")
        elif isinstance(live, torch.Tensor) and (t.shape != live.shape or t.dtype != live.dtype):
            p.append(f"tensor {name}: snapshot {tuple(t.shape)} {t.dtype} vs live {tuple(live.shape)} {live.dtype}")

    # ---------------------------------------------------------------- apply
    # restore_from_holder passes a PeerPayloads: DP peers' shards can come from the node's holder.
    uses_peer_payloads = True

    @torch.no_grad()
    def apply(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], peers: Any = None) -> None:
        """Copy a verified snapshot into the live state, in place, then re-derive the model params.

        Collective (DistOpt param all-gather, or the agreement to read the DP peers' shards from the
        node's holder instead): every rank calls it. Raises SnapshotMismatch before touching anything
        if ``validate`` finds a problem.
        """
        problems = self.validate(tensors, meta)
        if problems:
            more = f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""
            raise SnapshotMismatch("the snapshot does not fit this model/optimizer: " + "; ".join(problems[:8]) + more)
        for li, om in enumerate(meta["optimizers"]):
            self._apply_optimizer_tensors(li, om, tensors)
        # Scheduler before hyper-parameters: Megatron's scheduler.load_state_dict rewrites lr/wd of
        # every param group, and the snapshot's param_groups are the exact values to continue with.
        self._apply_scheduler(meta.get("scheduler"))
        for li, om in enumerate(meta["optimizers"]):
            self._apply_hparams(li, om, tensors)
            self._apply_grad_scaler(li, om, tensors)
        self._apply_fp8(meta.get("fp8") or [], tensors)
        if meta.get("buffers"):
            live_bufs = dict(self._persistent_buffers())
            for name in meta["buffers"]:
                live_bufs[name].copy_(tensors[f"buf/{name}"])
        self._apply_extra(meta.get("extra") or {}, tensors)
        if self.set_counters is not None:
            self.set_counters(dict(meta.get("counters") or {}))
        self.set_iteration(int(meta["iteration"]))
        self._rederive_model_params(peers)
        if self.include_rng:  # last: nothing above may draw random numbers after it
            self._apply_rng(meta["rng"], tensors)

    def _apply_optimizer_tensors(self, li: int, om: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        inner = getattr(self.leaves[li], "optimizer", None)
        for gi, (gm, group) in enumerate(zip(om["groups"], self._groups(li))):
            for pi, (pm, param) in enumerate(zip(gm["params"], group["params"])):
                pre = f"opt{li}/g{gi}/p{pi}"
                param.detach().copy_(tensors[f"{pre}/param"])
                state = inner.state[param]
                for k in pm["state"]:
                    if k in pm["state_meta"]:
                        state[k] = _like_live(pm["state_meta"][k], state.get(k))
                        continue
                    src = tensors[f"{pre}/{k}"]
                    if k not in state:
                        state[k] = _allocate_state(src, param, group)
                    state[k].copy_(src)

    def _apply_scheduler(self, sd: Optional[Mapping[str, Any]]) -> None:
        if sd is None or self.scheduler is None:
            return
        if hasattr(self.scheduler, "num_steps"):
            # OptimizerParamScheduler.load_state_dict does step(increment=num_steps): it *adds* the saved
            # count to the live one. Start from zero so a roll-back does not count twice.
            self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(dict(sd))

    def _apply_hparams(self, li: int, om: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        for gi, (gm, group) in enumerate(zip(om["groups"], self._groups(li))):
            for k, v in gm["hparams"].items():
                group[k] = _like_live(v, group.get(k))
            for k in gm["hparam_tensors"]:
                group[k].copy_(tensors[f"opt{li}/g{gi}/hp/{k}"])

    def _apply_grad_scaler(self, li: int, om: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        gs = getattr(self.leaves[li], "grad_scaler", None)
        if gs is None or om.get("grad_scaler") is None:
            return
        for k, v in vars(gs).items():
            if isinstance(v, torch.Tensor):
                v.copy_(tensors[f"opt{li}/grad_scaler/{k}"])
        for k, v in om["grad_scaler"]["attrs"].items():
            setattr(gs, k, v)

    def _apply_extra(self, em: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        if self.extra is None:
            return
        for name in _names_with_prefix(tensors, "extra/"):
            self.extra[name[len("extra/"):]].copy_(tensors[name])
        for k, v in em.items():
            self.extra[k] = v

    def _apply_fp8(self, found: list, tensors: Mapping[str, torch.Tensor]) -> None:
        """TE FP8 scaling state; code path only (TE is not installable without CUDA, see docs/megatron.md)."""
        if not found:
            return
        modules = dict(self._fp8_modules())
        pending: dict[str, list] = {}
        for name, key, attr in found:
            m = modules.get(name)
            if m is None:
                raise SnapshotMismatch(f"the snapshot has FP8 scaling state for {name}, which is not a TE module here "
                                       "(--fp8-format / --transformer-impl must match)")
            live = getattr(m.fp8_meta.get(key), attr, None)
            if isinstance(live, torch.Tensor):
                live.copy_(tensors[f"fp8/{name}/{key}/{attr}"])
            else:
                pending.setdefault(name, []).append((key, attr, tensors[f"fp8/{name}/{key}/{attr}"].clone()))
        for name, items in pending.items():
            _defer_fp8_restore(modules[name], items)

    def _rederive_model_params(self, peers: Any = None) -> None:
        """Main params -> model params, as ``optimizer.step()`` ends, then the DistOpt param all-gather
        (or, when the node's holder has every DP peer's snapshot, the peers' shards cast locally)."""
        any_distopt = False
        for leaf, kind in zip(self.leaves, self._kinds):
            if getattr(leaf, "optimizer", None) is None or kind == "FP32Optimizer":
                continue  # FP32Optimizer updates the model params themselves
            leaf._copy_main_params_to_model_params()
            any_distopt |= kind == "DistributedOptimizer"
        self.restore_notes = {"model_params": "all-gather" if any_distopt else "local"}
        if any_distopt and self._model_params_from_peers(peers):
            self.restore_notes = {"model_params": "from the node's holder" if self._peers_read else "local"}
            return
        if any_distopt:
            for chunk in self.model_chunks:
                # With --overlap-param-gather a gather dispatched before the roll-back may be pending, and
                # start_param_sync(force_sync=True) then only waits for it: call twice so the second one
                # gathers the restored shards.
                chunk.start_param_sync(force_sync=True)
                if getattr(getattr(chunk, "ddp_config", None), "overlap_param_gather", False):
                    chunk.start_param_sync(force_sync=True)

    def _model_params_from_peers(self, peers: Any) -> bool:
        """The DistOpt param all-gather without the network: every DP peer's main-param shards, read
        from the node's holder, cast into the model params at the ranges the peer owns -- the same
        ``copy_`` each owner's ``_copy_main_params_to_model_params`` runs before the gather, so the
        model params are bit-identical (the buckets' padding, which no param views, is not touched).
        Collective decision (``peers.available``); False = use the all-gather."""
        if peers is None or not torch.distributed.is_initialized():
            return False   # the same on every rank: no collective needed
        me = torch.distributed.get_rank()
        params = {f"c{ci}.{n}": p for ci, chunk in enumerate(self.model_chunks) for n, p in chunk.named_parameters()}
        # FP8 params (TE) are cast through their own quantizers; multiple DistOpt instances gather in stages.
        usable = all(type(p.data) is torch.Tensor for p in params.values())
        need: dict[int, list[int]] = {}   # leaf index -> the other DP ranks whose shards it needs
        for li, (leaf, kind) in enumerate(zip(self.leaves, self._kinds)):
            if kind != "DistributedOptimizer" or getattr(leaf, "optimizer", None) is None:
                continue
            group = getattr(leaf, "data_parallel_group", None)
            if group is None or getattr(getattr(leaf, "ddp_config", None), "num_distributed_optimizer_instances", 1) != 1:
                usable = False
                continue
            need[li] = [r for r in torch.distributed.get_process_group_ranks(group) if r != me]
        if not peers.available(sorted({r for rs in need.values() for r in rs}), usable=usable and bool(need)):
            return False
        self._peers_read = sum(len(rs) for rs in need.values())
        with torch.no_grad():
            for li, rs in need.items():
                for r in rs:
                    pm_all, tensors = peers.meta(r)["optimizers"][li], peers.tensors(r)
                    for gi, gm in enumerate(pm_all["groups"]):
                        for pi, pm in enumerate(gm["params"]):
                            if pm.get("name") is None or pm.get("range") is None:
                                continue
                            start, end = pm["range"]
                            cast_like_owner(params[pm["name"]].detach().view(-1)[start:end],
                                            tensors[f"opt{li}/g{gi}/p{pi}/param"])
        return True

    def _apply_rng(self, rm: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        apply_rng(tensors, rm["base"], "rng")
        names = rm.get("tracker") or []
        if not names:
            return
        tracker = _rng_tracker()
        if tracker is None:
            raise SnapshotMismatch("the snapshot has Megatron RNG tracker states but the tracker is not initialized "
                                   "here: call model_parallel_cuda_manual_seed() before restoring")
        live = tracker.get_states()
        new = {}
        for name in names:
            saved = tensors[f"rng/tracker/{name}"]
            cur = live.get(name)
            if isinstance(cur, torch.Generator):
                cur.set_state(saved.clone())
                new[name] = cur
            else:
                new[name] = saved.clone()  # the snapshot's memory is not ours to keep
        tracker.set_states(new)


def _names_with_prefix(tensors: Mapping[str, Any], prefix: str) -> list[str]:
    return [k for k in tensors if k.startswith(prefix)]


def _allocate_state(src: torch.Tensor, param: torch.Tensor, group: Mapping[str, Any]) -> torch.Tensor:
    """One state tensor for a fresh optimizer, placed where torch.optim.Adam/AdamW would put it.

    Param-shaped state (exp_avg, ...) lives with the param; torch Adam keeps the scalar ``step`` on
    the CPU unless ``capturable``/``fused``. Every param gets its own tensor (Megatron's own
    load_state_dict shares one ``step`` tensor across params, which then advances N times per step).
    """
    if src.shape == param.shape:
        device = param.device
    elif src.dim() == 0:
        device = param.device if (group.get("capturable") or group.get("fused")) else torch.device("cpu")
    else:
        device = param.device
    return torch.empty(src.shape, dtype=src.dtype, device=device)


def _defer_fp8_restore(module: Any, items: list) -> None:
    """TE allocates FP8 scaling tensors in its first FP8 forward; restore them right there.

    A one-shot forward pre-hook asks TE to allocate (``init_fp8_metadata``, inside the caller's
    fp8_autocast) and copies the saved values in before the forward computes with them.
    """
    num_gemms = None
    for key, attr, t in items:
        if key == "scaling_fwd" and attr == "scale":
            num_gemms = max(1, t.numel() // 3)  # TE: 3 forward scaling slots (input, weight, output) per GEMM

    def hook(mod, _inputs):
        init = getattr(mod, "init_fp8_metadata", None)
        if init is not None:
            init(num_gemms=num_gemms) if num_gemms is not None else init()
        for key, attr, t in items:
            live = getattr(mod.fp8_meta.get(key), attr, None)
            if not isinstance(live, torch.Tensor):
                raise SnapshotMismatch(f"TE did not allocate fp8_meta[{key!r}].{attr} for {type(mod).__name__}; "
                                       "its FP8 scaling state cannot be restored (check --fp8-format/--fp8-recipe)")
            with torch.no_grad():
                live.copy_(t.to(live.device))
        handle.remove()

    handle = module.register_forward_pre_hook(hook)


def _rng_tracker():
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    except ImportError:  # pragma: no cover
        return None
    tracker = get_cuda_rng_tracker()
    init = getattr(tracker, "is_initialized", None)
    if init is not None and not init():
        return None
    return tracker


# --------------------------------------------------------------------------------------------------
# Core API for megatron-core users with their own loop
# --------------------------------------------------------------------------------------------------

def snapshot_state(model_chunks: Any, optimizer: Any, scheduler: Any, iteration: int,
                   extra: Optional[MutableMapping[str, Any]] = None) -> RankState:
    """This rank's state after the optimizer step of ``iteration`` (references; see ``MegatronStateAdapter``)."""
    return MegatronStateAdapter(model_chunks, optimizer, scheduler, get_iteration=lambda: iteration,
                                set_iteration=lambda _: None, extra=extra).capture()


def apply_state(model_chunks: Any, optimizer: Any, scheduler: Any, tensors: Mapping[str, torch.Tensor],
                meta: Mapping[str, Any], extra: Optional[MutableMapping[str, Any]] = None) -> int:
    """Restore a ``snapshot_state`` result in place (collective); returns the snapshot's iteration."""
    box = {}
    MegatronStateAdapter(model_chunks, optimizer, scheduler, get_iteration=lambda: 0,
                         set_iteration=lambda i: box.__setitem__("it", i), extra=extra).apply(tensors, meta)
    return box["it"]


# --------------------------------------------------------------------------------------------------
# The holder runtime, and the before-step wait
# --------------------------------------------------------------------------------------------------

def parity_coordinates(coords: Optional[Mapping[str, Any]] = None) -> Optional[dict[str, int]]:
    """``{"dp", "tp", "pp"}`` for the parity plan, from ``rank_coordinates()`` (None without parallel_state).

    ``dp`` is the rank in the group the DistributedOptimizer shards over (data-parallel with
    context-parallel): ranks with equal ``tp``/``pp`` and different ``dp`` hold different shards of
    the same model partition, and parity groups are formed from them on distinct nodes.
    """
    if coords is None:
        try:
            coords = rank_coordinates()
        except RuntimeError:
            return None
    return {"dp": int(coords["dp"]), "tp": int(coords["tp"]), "pp": int(coords["pp"])}


class HolderRuntime:
    """shardsafe's holder runtime (:class:`shardsafe.runtime.Runtime`) behind the Megatron ``Runtime`` protocol.

    Connects to (or starts) the node's holder, builds the parity plan from Megatron's layout (DP peers
    with equal TP/PP coordinates, on distinct nodes), restores, and snapshots after optimizer steps.
    ``before_step`` must run right before every optimizer step that follows a snapshot (it waits for the
    asynchronous copy; :func:`wrap_optimizer_step` arranges that). Collective: every rank creates one.

    Args:
        cfg: the checked config (``config_from_args(args)``).
        rank, world_size: default ``torch.distributed``'s.
        coords: ``rank_coordinates()``-style dict (default: read from ``megatron.core.parallel_state``).

    Raises:
        ConfigError: the parity settings cannot be placed on this layout (e.g. a ``--shardsafe-parity-group-size``
            larger than the number of DP peers on distinct nodes); raised on every rank, before training.
    """

    def __init__(self, cfg: ShardsafeConfig, *, rank: Optional[int] = None, world_size: Optional[int] = None,
                 coords: Optional[Mapping[str, Any]] = None) -> None:
        import torch.distributed as dist
        from shardsafe.runtime import Runtime as CoreRuntime

        initialized = dist.is_available() and dist.is_initialized()
        self.rank = int(rank if rank is not None else (dist.get_rank() if initialized else 0))
        self.world_size = int(world_size if world_size is not None else (dist.get_world_size() if initialized else 1))
        self.cfg = cfg
        try:
            self.core = CoreRuntime(cfg, rank=self.rank, world_size=self.world_size, coords=parity_coordinates(coords))
        except ConfigError as e:
            if "parity" not in str(e):
                raise
            raise ConfigError(f"{e} Set --shardsafe-parity-group-size (0 = the largest feasible, 1 = no parity) and "
                              "--shardsafe-parity-shards to fit this layout: parity groups are data-parallel "
                              "peers (equal tensor/pipeline ranks) on distinct nodes.") from None
        self.restored = None          # shardsafe.restore.RestoreResult after try_restore
        self.last_stall_s = 0.0       # seconds the last optimizer step waited for a snapshot copy
        self._closed = False

    @property
    def events(self) -> Any:
        """The TOR event log (``emit(kind, **fields)``; a no-op without a run directory)."""
        return self.core.events

    @property
    def pipeline(self) -> Any:
        return self.core.pipeline

    @property
    def stall_total_s(self) -> float:
        """Seconds the training loop has spent blocked by snapshots so far (see shardsafe.runtime)."""
        return self.core.stall_total_s

    def try_restore(self, adapter: "MegatronStateAdapter") -> Optional[int]:
        """Collective. The restored iteration, or None on a fresh start.

        Raises:
            shardsafe.restore.RestoreError: snapshots exist but none is restorable (more lost nodes than
                parity covers, every version corrupt or not fitting this job); the message says what to do.
        """
        self.restored = self.core.try_restore(adapter)
        return self.restored.version if self.restored.version >= 0 else None

    def before_step(self, iteration: int) -> float:
        """Right before the optimizer step of ``iteration``: fault injection, then wait for the pending copy."""
        self.last_stall_s = self.core.before_step(iteration)
        return self.last_stall_s

    def after_step(self, iteration: int, adapter: "MegatronStateAdapter") -> None:
        self.core.after_step(iteration, adapter)

    def on_exit(self, iteration: int, adapter: "MegatronStateAdapter") -> None:
        """Megatron-LM decided to exit after ``iteration``: a final snapshot of it (when the interval skipped
        it), committed, and flushed to the persistent tier when one is set (Runtime.on_exit)."""
        self.core.on_exit(iteration, adapter)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until the last submitted snapshot is sealed and voted on; True if it committed."""
        return self.core.pipeline.flush(timeout)

    def close(self) -> None:
        """Flush, stop the snapshot worker, disconnect from the holder (which keeps its memory). Idempotent."""
        if not self._closed:
            self._closed = True
            self.core.close()


def default_runtime_factory(cfg: ShardsafeConfig) -> HolderRuntime:
    """The holder runtime, for this process's rank and Megatron layout (see :class:`HolderRuntime`)."""
    return HolderRuntime(cfg)


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
        restored: ``shardsafe.restore.RestoreResult`` (``version`` -1: fresh start; ``tier``, ``seconds``,
            ``message``). The loop's iteration and counters are already set to the restored values.
        adapter: the :class:`MegatronStateAdapter`.
        runtime: the runtime (None when shardsafe is disabled).
    """

    def __init__(self, adapter: "MegatronStateAdapter", runtime: Any, restored: Any, undo_step: Callable[[], None]):
        self.adapter, self.runtime, self.restored = adapter, runtime, restored
        self._undo_step = undo_step

    @property
    def enabled(self) -> bool:
        return self.runtime is not None

    @property
    def events(self) -> Any:
        """TOR event log of the runtime (``emit(kind, **fields)``); a no-op when disabled or without a run dir."""
        ev = getattr(self.runtime, "events", None)
        return ev if ev is not None else _NO_EVENTS

    @property
    def last_stall_s(self) -> float:
        """Seconds the last optimizer step waited for the snapshot copy."""
        return float(getattr(self.runtime, "last_stall_s", 0.0) or 0.0)

    @property
    def stall_total_s(self) -> float:
        """Seconds the training loop has spent blocked by snapshots so far (waits and captures): an
        iteration's TOR `seconds` are its wall time minus this counter's growth over it (docs/tor.md)."""
        return float(getattr(self.runtime, "stall_total_s", 0.0) or 0.0)

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
        return bool(self.runtime.flush(timeout)) if self.runtime is not None and hasattr(self.runtime, "flush") else True

    def close(self) -> None:
        """Flush the last snapshot, remove the optimizer-step wrapper, disconnect. Idempotent."""
        self._undo_step()
        self._undo_step = lambda: None
        if self.runtime is not None and hasattr(self.runtime, "close"):
            self.runtime.close()

    def __enter__(self) -> "Protection":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _NoEvents:
    def emit(self, kind: str, **fields: Any) -> None:
        pass


_NO_EVENTS = _NoEvents()


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
            runtime_factory: Callable[[ShardsafeConfig], Any] = default_runtime_factory) -> Protection:
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
        shardsafe.restore.RestoreError: snapshots exist but none can be restored (the message says what to do).
    """
    conf = _as_config(cfg)
    adapter = MegatronStateAdapter(model_chunks, optimizer, scheduler, get_iteration=get_iteration,
                                   set_iteration=set_iteration, get_counters=get_counters, set_counters=set_counters,
                                   extra=extra)
    if not conf.enabled:
        from shardsafe.restore import RestoreResult
        return Protection(adapter, None, RestoreResult(message="shardsafe disabled"), lambda: None)
    runtime = runtime_factory(conf)
    undo = wrap_optimizer_step(optimizer, runtime.before_step, get_iteration) if hasattr(runtime, "before_step") \
        else (lambda: None)
    try:
        runtime.try_restore(adapter)
    except BaseException:
        undo()
        if hasattr(runtime, "close"):
            runtime.close()
        raise
    restored = getattr(runtime, "restored", None)
    if restored is None:
        from shardsafe.restore import RestoreResult
        restored = RestoreResult()
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
        result: the full ``shardsafe.restore.RestoreResult``.
        protection: the :class:`Protection` behind the calls (events, stall counters, flush).
    """

    def __init__(self, iteration: Optional[int], counters: Mapping[str, Any], protection: "Protection") -> None:
        self.iteration, self.counters, self.protection = iteration, dict(counters), protection
        self.result = protection.restored
        self.tier = str(getattr(self.result, "tier", "none"))
        self.seconds = float(getattr(self.result, "seconds", 0.0) or 0.0)
        self.message = str(getattr(self.result, "message", ""))

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
        raise RuntimeError(f"shardsafe.adapters.megatron.{call}: no protection for this optimizer. Call "
                           "restore(model_chunks, optimizer, scheduler, cfg) once on every rank before the "
                           "first snapshot (it connects to the holder, sets up parity and restores when a "
                           "snapshot exists; pass a config with restore disabled, --shardsafe-no-restore, to "
                           "only set up).")
    chunks = _chunks(model_chunks)
    if len(chunks) != len(s.model_chunks) or any(a is not b for a, b in zip(chunks, s.model_chunks)) \
            or scheduler is not s.scheduler:
        raise ValueError(f"shardsafe.adapters.megatron.{call}: the model chunks or the scheduler are not the "
                         "objects restore() was given for this optimizer; pass the same objects (the snapshot "
                         "references their tensors), or close(optimizer) and restore() again for new ones.")
    return s


def restore(model_chunks: Any, optimizer: Any, scheduler: Any, cfg: Any, *,
            extra: Optional[MutableMapping[str, Any]] = None,
            runtime_factory: Callable[[ShardsafeConfig], Any] = default_runtime_factory) -> Restored:
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
        ConfigError, shardsafe.restore.RestoreError: as :func:`protect`.
    """
    if id(optimizer) in _SESSIONS:
        raise RuntimeError("shardsafe.adapters.megatron.restore: this optimizer is already protected (restore() "
                           "was called for it before); call close(optimizer) first to start over.")
    conf = _as_config(cfg)
    s = _Session(_chunks(model_chunks), optimizer, scheduler)
    s.interval = conf.interval
    prot = protect(s.model_chunks, optimizer, scheduler, conf, get_iteration=lambda: s.iteration,
                   set_iteration=s.set_iteration, get_counters=lambda: dict(s.counters),
                   set_counters=s.set_counters, extra=extra, runtime_factory=runtime_factory)
    s.protection = prot
    _SESSIONS[id(optimizer)] = s
    version = int(getattr(prot.restored, "version", -1))
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
    def __init__(self, runtime_factory: Callable[[ShardsafeConfig], Runtime]):
        self.runtime_factory = runtime_factory
        self.runtime: Optional[Runtime] = None
        self.adapter: Optional[MegatronStateAdapter] = None
        self.iteration = 0
        self.flops = 0.0
        self.pending_rng: Optional[RankState] = None
        self.undo_step: Callable[[], None] = lambda: None
        self.events: Any = _NO_EVENTS
        self.train_ready = False
        self.t_step = 0.0


class HookHandle:
    """Undo ``install_hooks`` (tests; a second pretrain in one process) and close the runtime."""

    def __init__(self, module: Any, originals: dict[str, Any], state: _HookState):
        self._module, self._originals, self.state = module, originals, state

    @property
    def runtime(self) -> Optional[Runtime]:
        return self.state.runtime

    @property
    def adapter(self) -> Optional[MegatronStateAdapter]:
        return self.state.adapter

    def remove(self) -> None:
        """Restore Megatron-LM's functions and the optimizer's step, flush the last snapshot, disconnect."""
        for k, v in self._originals.items():
            setattr(self._module, k, v)
        self._originals = {}
        self.state.undo_step()
        self.state.undo_step = lambda: None
        rt = self.state.runtime
        if rt is not None and hasattr(rt, "close"):
            rt.close()


def install_hooks(runtime_factory: Callable[[ShardsafeConfig], Runtime] = default_runtime_factory, *,
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

    state = _HookState(runtime_factory)
    orig_setup, orig_ckpt, orig_train_step = T.setup_model_and_optimizer, T.checkpoint_and_decide_exit, T.train_step

    def setup_model_and_optimizer(*a, **kw):
        args = get_args()
        cfg = config_from_args(args)  # ConfigError here: before the model is built or anything trains
        model, optimizer, scheduler = orig_setup(*a, **kw)
        if not cfg.enabled or optimizer is None:
            return model, optimizer, scheduler
        state.iteration = int(args.iteration)
        state.flops = float(getattr(args, "num_floating_point_operations_so_far", 0) or 0)

        def get_counters():
            c = {k: getattr(args, k) for k in _ARGS_COUNTERS if getattr(args, k, None) is not None}
            c["num_floating_point_operations_so_far"] = state.flops
            rsm = _rerun_state_machine()
            if isinstance(getattr(rsm, "current_iteration", None), int):
                # Megatron's --load restores it; a Megatron checkpoint exported from a snapshot carries it.
                c[_RERUN_ITERATION] = rsm.current_iteration
            return c

        def set_counters(c):
            for k in _ARGS_COUNTERS:
                if k in c:
                    setattr(args, k, c[k])
            state.flops = c.get("num_floating_point_operations_so_far", state.flops)
            args.num_floating_point_operations_so_far = state.flops
            rsm = _rerun_state_machine()
            if _RERUN_ITERATION in c and isinstance(getattr(rsm, "current_iteration", None), int):
                rsm.current_iteration = int(c[_RERUN_ITERATION])

        def set_iteration(i):
            state.iteration = i
            args.iteration = i

        state.adapter = MegatronStateAdapter(model, optimizer, scheduler, get_iteration=lambda: state.iteration,
                                             set_iteration=set_iteration, get_counters=get_counters,
                                             set_counters=set_counters)
        state.runtime = state.runtime_factory(cfg)  # ConfigError (parity placement) here, on every rank
        state.events = getattr(state.runtime, "events", None) or _NO_EVENTS
        if hasattr(state.runtime, "before_step"):
            state.undo_step = wrap_optimizer_step(optimizer, state.runtime.before_step, lambda: state.iteration)
        if cfg.restore:
            restored = state.runtime.try_restore(state.adapter)
            if restored is not None:
                # Between here and the first step Megatron-LM builds the data iterators, and
                # iter(DataLoader) draws a seed from the torch RNG: set the restored RNGs again
                # right before the first train_step so they continue exactly where they stopped.
                state.pending_rng = state.adapter.capture_rng_state()
                from megatron.core.num_microbatches_calculator import update_num_microbatches
                update_num_microbatches(args.consumed_train_samples, consistency_check=False, verbose=True)
                log.info("shardsafe: restored iteration %d (consumed_train_samples=%s)", restored,
                         getattr(args, "consumed_train_samples", None))
        export_dir = getattr(args, "shardsafe_export_dir", None)
        if export_dir:
            how = getattr(getattr(state.runtime, "restored", None), "message", "")
            _export_and_exit(args, export_dir, restored if cfg.restore else None, model, optimizer, scheduler,
                             state.flops, how)
        return model, optimizer, scheduler

    ckpt_sig = inspect.signature(orig_ckpt)

    def checkpoint_and_decide_exit(*a, **kw):
        # Called once per iteration after optimizer.step(), scheduler.step() and iteration += 1.
        if state.runtime is not None:
            named = ckpt_sig.bind(*a, **kw).arguments
            state.iteration = int(named["iteration"])
            state.flops = float(named.get("num_floating_point_operations_so_far", state.flops))
            if state.t_step:
                stall = float(getattr(state.runtime, "last_stall_s", 0.0) or 0.0)
                state.events.emit("iteration", iteration=state.iteration,
                                  seconds=max(0.0, time.perf_counter() - state.t_step - stall))
            state.runtime.after_step(state.iteration, state.adapter)
        should_exit = orig_ckpt(*a, **kw)
        if should_exit and state.runtime is not None:
            state.runtime.on_exit(state.iteration, state.adapter)
        return should_exit

    def train_step(*a, **kw):
        if state.pending_rng is not None:
            state.adapter.apply_rng_state(state.pending_rng.tensors, state.pending_rng.meta)
            state.pending_rng = None
        if state.runtime is not None:
            if not state.train_ready:
                state.train_ready = True
                state.events.emit("train_ready", iteration=state.iteration + 1)
            state.t_step = time.perf_counter()
        return orig_train_step(*a, **kw)

    originals = {"setup_model_and_optimizer": orig_setup, "checkpoint_and_decide_exit": orig_ckpt,
                 "train_step": orig_train_step}
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


def pretrain(*args: Any, runtime_factory: Callable[[ShardsafeConfig], Runtime] = default_runtime_factory,
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
                       runtime_factory: Callable[[ShardsafeConfig], Runtime] = default_runtime_factory) -> Any:
    """``original(*args, **kwargs)`` (Megatron-LM's ``pretrain``) with shardsafe's flags added to its parser
    (<= 0.17) and the hooks installed into ``megatron.training.training`` for the call."""
    import megatron.training.training as T

    sig = inspect.signature(original)
    if "extra_args_provider" in sig.parameters:
        bound = sig.bind_partial(*args, **kwargs)
        bound.arguments["extra_args_provider"] = compose_extra_args_provider(bound.arguments.get("extra_args_provider"))
        args, kwargs = bound.args, bound.kwargs
    handle = install_hooks(runtime_factory, training_module=T)
    try:
        return original(*args, **kwargs)
    finally:
        handle.remove()
