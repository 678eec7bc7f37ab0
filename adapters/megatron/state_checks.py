"""What the Megatron state adapter checks before it touches anything.

* Supported configurations (:func:`check_supported`): setups whose state cannot be restored exactly are
  rejected when the adapter is built, with a message naming the setting, not discovered at restore time.
* The rank's place in Megatron's parallel layout (:func:`rank_coordinates`): every snapshot carries it,
  because a snapshot only fits a rank at the same coordinates; :func:`parity_coordinates` derives the
  parity placement's input from it.
* Whether a snapshot fits the live model/optimizer (``validate``, mixed into
  :class:`~.state.MegatronStateAdapter`): no communication and no mutation, so every rank can check and
  the ranks agree on the result before the collective ``apply`` changes anything.

Kept apart from :mod:`.state` so that module is the capture/apply pair alone.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from shardsafe.config import ConfigError
from shardsafe.errors import UsageError
from shardsafe.snapshot.state import StateAdapter

FORMAT = "shardsafe.megatron/1"
"""Meta format tag: bumped when names or meta layout change, so an old snapshot is refused, not misread."""

# parallel_state coordinates that must be identical between the snapshotting and the restoring rank.
_COORD_KEYS = ("tp", "tp_size", "pp", "pp_size", "dp", "dp_size", "cp", "cp_size", "ep", "ep_size",
               "etp", "etp_size", "vpp_size")


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
        raise UsageError("rank_coordinates(): megatron.core.parallel_state is not initialized; call it after "
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


def batch_record() -> Optional[dict[str, int]]:
    """Megatron's global batch as its num-microbatches calculator has it (Megatron-LM's loop initialises it), or
    None (a loop of one's own: pass the batch to :class:`MegatronResharder`)."""
    try:
        from megatron.core import num_microbatches_calculator as nmc
    except ImportError:   # pragma: no cover - only without megatron-core
        return None
    if getattr(nmc, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None) is None:
        return None
    return {"global_batch_size": int(nmc.get_current_global_batch_size()),
            "micro_batch_size": int(nmc.get_micro_batch_size()), "num_microbatches": int(nmc.get_num_microbatches())}


# --------------------------------------------------------------------------------------------------
# Does a snapshot fit the live model/optimizer?
# --------------------------------------------------------------------------------------------------

class _SnapshotChecks(StateAdapter):
    """``validate`` of :class:`~.state.MegatronStateAdapter`, which it is mixed into: it reads the adapter's
    enumeration (``leaves``, ``_kinds``, ``_groups``, ``_model_param_of``, ``_param_names``,
    ``_persistent_buffers``, ``_coordinates``) and its ``scheduler``, ``extra`` and ``include_rng``."""

    # Parameter-group keys Megatron's OptimizerParamScheduler rewrites every step (and a --load changes): not the
    # run's identity, which its optimizer config carries.
    _SCHEDULED_GROUP_KEYS = frozenset({"params", "lr", "weight_decay", "step"})

    def fingerprint(self) -> dict[str, Any]:
        """shardsafe/fingerprint.py: the model's TransformerConfig and the optimizer's OptimizerConfig (without the
        volatile keys), this rank's parameters, its parallel layout and the optimizers' static group settings, and
        the global batch and micro-batch where Megatron's num-microbatches calculator has them (Megatron-LM's loop
        initialises it): with the batch recorded, a job at another data-parallel size that keeps it is this run."""
        from shardsafe.fingerprint import plain, strip_volatile
        chunk = self.model_chunks[0]
        model_cfg = getattr(chunk, "config", None) or getattr(getattr(chunk, "module", None), "config", None)
        opt_cfg = getattr(self.optimizer, "config", None)
        if opt_cfg is None and self.leaves:
            opt_cfg = getattr(self.leaves[0], "config", None)
        params = [[self._param_names.get(id(p), "?"), list(p.shape), str(p.dtype).removeprefix("torch."),
                   bool(p.requires_grad)] for c in self.model_chunks for p in c.parameters()]
        coords = self._coordinates() or {}
        layout = {k: coords.get(k) for k in _COORD_KEYS}
        groups = [[{k: v for k, v in g.items() if k not in self._SCHEDULED_GROUP_KEYS} for g in self._groups(li)]
                  for li in range(len(self.leaves))]
        out = {"config": strip_volatile(plain({"model": model_cfg, "optimizer": opt_cfg})), "model": params,
               "layout": plain(layout), "optimizer": plain({"kinds": self._kinds, "param_groups": groups})}
        batch = batch_record()
        if batch is not None:   # the samples per step, not how they are split: another DP size is this run
            out["batch"] = {k: batch[k] for k in ("global_batch_size", "micro_batch_size")}
        return out

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
            p.extend(self._optimizer_problems(li, om, tensors))
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

    def _optimizer_problems(self, li: int, om: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> list[str]:
        """Does leaf optimizer ``li`` fit its snapshot record ``om``: type, groups, params, state, grad scaler."""
        p: list[str] = []
        if om["type"] != self._kinds[li]:
            p.append(f"optimizer {li}: snapshot {om['type']} vs live {self._kinds[li]} (--use-distributed-optimizer, "
                     f"--bf16/--fp16 must match)")
            return p
        owner = self._model_param_of(li)
        groups = self._groups(li)
        if len(om["groups"]) != len(groups):
            p.append(f"optimizer {li}: {len(om['groups'])} param groups in the snapshot vs {len(groups)} live")
            return p
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


def _names_with_prefix(tensors: Mapping[str, Any], prefix: str) -> list[str]:
    return [k for k in tensors if k.startswith(prefix)]

