"""The rank state of a DeepSpeed engine (ZeRO-1/2/3, BF16_Optimizer): what a snapshot captures, how it is checked
against the live engine, and how it is written back into the optimizer's own tensors (never through DeepSpeed's
load paths)."""
from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch

from shardsafe.config import ConfigError
from shardsafe.snapshot.state import (RankState, StateAdapter, apply_rng, capture_rng, cast_like_owner,
                                      copy_and_cast)

from . import rng_trackers
from .checks import check_supported, scheduler_state
from .cpu_adam_powers import AdamPowersTracker
from .layout import checkpoint_layout, describe, parallel_layout
from .schedulers import ProgramSchedulers

log = logging.getLogger(__name__)

COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")



class DeepSpeedStateAdapter(StateAdapter):
    """Rank state of a DeepSpeed engine with a ZeRO-1/2/3 or BF16 optimizer."""

    # Adam moments/step exist only after the first step: a fresh engine restores them from the snapshot.
    optional_prefixes = ("opt/state/",)

    def __init__(self, engine: Any, extra: dict | None = None):
        self.engine = engine
        self._buffer_list: list[tuple[str, torch.Tensor]] | None = None
        self.extra: dict[str, Any] = extra if extra is not None else {}
        check_supported(engine)
        o = engine.optimizer
        self.kind = type(o).__name__
        self.z3 = self.kind == "DeepSpeedZeroOptimizer_Stage3"
        self._ckpt_layout: dict[str, Any] | None = None
        self.parallel = parallel_layout(engine)
        self.restore_notes: dict[str, Any] = {}
        # The engine's LR scheduler as initialize built it: Lightning's strategy then takes it out of the engine
        # (engine.lr_scheduler = None) and steps it itself; it is still this engine's schedule to snapshot.
        self._scheduler_at_init = engine.lr_scheduler
        # A scheduler the program builds and steps itself over this optimizer (HF's Trainer without an "optimizer"
        # block): snapshotted with the engine, put back before the first step after a restore (schedulers.py).
        self.program_schedulers = ProgramSchedulers(o.optimizer, lambda: self.lr_scheduler,
                                                    rank=int(getattr(engine, "global_rank", 0)))
        # The hyperparameters the program asked for, before any step or restore changes param_groups (the run's
        # fingerprint, shardsafe/fingerprint.py).
        from shardsafe.fingerprint import plain
        self._hyper0 = [plain({k: v for k, v in g.items() if k != "params"}) for g in o.optimizer.param_groups]
        # DeepSpeed's CPU Adam kernels keep beta1^t / beta2^t outside optimizer.state (cpu_adam_powers.py).
        # One tracker per optimizer: a second adapter on the same engine must not observe the calls twice.
        base = o.optimizer
        if not hasattr(base, "_shardsafe_adam_powers"):
            base._shardsafe_adam_powers = AdamPowersTracker.for_optimizer(base)
        self.adam_powers: AdamPowersTracker | None = base._shardsafe_adam_powers

    def checkpoint_layout(self) -> dict[str, Any]:
        """What ``shardsafe export --format deepspeed`` needs to write this engine's own checkpoint layout without
        the engine (ds_layout.checkpoint_layout). Static after initialize, so it is computed once."""
        if self._ckpt_layout is None:
            self._ckpt_layout = checkpoint_layout(self.engine, self.kind)
        return self._ckpt_layout

    @property
    def lr_scheduler(self) -> Any:
        """The engine's LR scheduler, also when a wrapper stepping it itself took it out of the engine."""
        e = self.engine
        return e.lr_scheduler if e.lr_scheduler is not None else self._scheduler_at_init

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        # Resolved once: capture() runs after every optimizer step, the module tree does not change.
        if self._buffer_list is None:
            m = self.engine.module
            skip = {f"{mod_name}.{b}" if mod_name else b for mod_name, mod in m.named_modules()
                    for b in getattr(mod, "_non_persistent_buffers_set", ())}
            self._buffer_list = [(n, b) for n, b in m.named_buffers() if n not in skip]
        return self._buffer_list

    def masters(self) -> list[torch.Tensor]:
        o = self.engine.optimizer
        if self.kind == "DeepSpeedZeroOptimizer":
            return list(o.single_partition_of_fp32_groups)
        if self.z3:
            return list(o.fp32_partitioned_groups_flat)
        return list(o.fp32_groups_flat_partition)

    def capture(self) -> RankState:
        e, o = self.engine, self.engine.optimizer
        base = o.optimizer
        st = RankState()
        scalars: dict[str, dict[str, Any]] = {}
        for i, m in enumerate(self.masters()):
            st.tensors[f"opt/master/{i}"] = m
            for k, v in base.state.get(m, {}).items():
                if torch.is_tensor(v):
                    st.tensors[f"opt/state/{i}/{k}"] = v
                else:
                    scalars.setdefault(str(i), {})[k] = v
        # Module buffers (BatchNorm running stats, ...) are replicated, not partitioned, and not in the
        # optimizer: they are rank state too. Unlike optimizer state they change in the *next forward*,
        # while the asynchronous copy may still run: clone them now (they are small).
        for name, buf in self.buffers():
            st.tensors[f"module/buffer/{name}"] = buf.detach().clone()
        rng = capture_rng()
        st.tensors.update(rng.tensors)
        trackers = rng_trackers.capture(st.tensors)
        scaler = {}
        if getattr(o, "loss_scaler", None) is not None:
            for k, v in vars(o.loss_scaler).items():
                if torch.is_tensor(v):
                    st.tensors[f"loss_scaler/{k}"] = v
                elif isinstance(v, (bool, int, float, str, type(None))):
                    scaler[k] = v
        st.meta = {
            "engine": "deepspeed", "optimizer": self.kind, "zero_stage": int(e.zero_optimization_stage()),
            "dp_world_size": int(e.dp_world_size), "parallel": self.parallel,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups],
            "opt_scalars": scalars,
            "state_devices": {n: str(t.device) for n, t in st.tensors.items()},
            "lr_scheduler": scheduler_state(self.lr_scheduler),
            "program_schedulers": self.program_schedulers.capture(),
            "counters": {k: int(getattr(e, k)) for k in COUNTERS},
            "loss_scaler": scaler, "overflow": bool(getattr(o, "overflow", False)),
            "extra": dict(self.extra), "ds_checkpoint": self.checkpoint_layout(), **rng.meta,
            "rng_trackers": trackers,
            "base_optimizer": type(base).__name__,
            "adam_powers": self.adam_powers.state() if self.adam_powers is not None else None,
        }
        return st

    def fingerprint(self) -> dict[str, Any]:
        """shardsafe/fingerprint.py: the DeepSpeed config (without the volatile keys), this rank's parameters
        (ZeRO-3: their full shapes), the parallel layout, the optimizer's hyperparameters at initialize and the
        global batch."""
        from shardsafe.fingerprint import plain, strip_volatile
        e = self.engine
        params = [[n, list(getattr(p, "ds_shape", p.shape)), str(p.dtype).removeprefix("torch."), bool(p.requires_grad)]
                  for n, p in e.module.named_parameters()]
        raw = getattr(getattr(e, "_config", None), "_param_dict", None) or {}
        return {"config": strip_volatile(plain(raw)), "model": params,
                "layout": {**self.parallel, "zero_stage": int(e.zero_optimization_stage()),
                           "dp_world_size": int(e.dp_world_size), "optimizer_wrapper": self.kind},
                "optimizer": {"class": type(self.engine.optimizer.optimizer).__name__, "param_groups": self._hyper0},
                # the global batch a restore at another data-parallel size must keep (shardsafe/fingerprint.py)
                "batch": {"global_batch_size": int(e.train_batch_size()),
                          "micro_batch_size": int(e.train_micro_batch_size_per_gpu())}}

    # fp32 tensors per master an optimizer keeps once it stepped (its moments): for the start-time budget check
    _MOMENTS = {"AdamW": 2, "Adam": 2, "FusedAdam": 2, "DeepSpeedCPUAdam": 2, "FusedLamb": 2, "Lion": 1,
                "FusedLion": 1, "DeepSpeedCPULion": 1, "Adagrad": 1, "DeepSpeedCPUAdagrad": 1}

    def pending_state_nbytes(self) -> int:
        base = self.engine.optimizer.optimizer
        n = self._MOMENTS.get(type(base).__name__, 0)
        return sum(n * m.numel() * 4 for m in self.masters() if not base.state.get(m))

    def before_optimizer_step(self) -> None:
        """Right before each optimizer step (the hook's ``_take_model_step``): the program's own schedulers."""
        self.program_schedulers.before_step()

    def _lp_from_peers_plan(self, peers: Any) -> Optional[list[tuple[list, list[int]]]]:
        """Whether the low-precision params come from the node's holder instead of ``update_lp_params()``'s
        all-gather, decided before any state is written: when the node's holder has every data-parallel peer's
        snapshot, each rank casts every partition's fp32 master into its own low-precision flat buffer -- the same
        ``copy_`` cast each owner would run before the all-gather, so the result is bit-identical. Only for
        partitions in host memory (``peers.pays_off``: on a GPU, NCCL's all-gather of the bf16 partitions is the
        cheaper way). Collective decision (``peers.available``): either every rank takes this path or every rank
        all-gathers. Returns, per parameter group, (its low-precision partitions, the data-parallel ranks owning
        them), or None for ``update_lp_params``."""
        o = self.engine.optimizer
        if peers is None or self.kind != "DeepSpeedZeroOptimizer":
            return None
        import torch.distributed as dist
        groups = [dist.get_process_group_ranks(g) for g in o.real_dp_process_group]
        lp = [part for parts in o.parallel_partitioned_bit16_groups for part in parts]
        if not peers.available(sorted({r for g in groups for r in g}), usable=peers.pays_off(lp)):
            return None
        return list(zip(o.parallel_partitioned_bit16_groups, groups))

    def _own_lp_partition(self, plan: Optional[list], i: int) -> Optional[torch.Tensor]:
        """This rank's low-precision partition of group ``i`` when ``plan`` derives it here (None: no plan)."""
        if plan is None:
            return None
        import torch.distributed as dist
        parts, ranks = plan[i]
        return parts[ranks.index(dist.get_rank())].data

    def _lp_from_peers(self, plan: list, peers: Any) -> None:
        """The peers' partitions of ``plan`` cast from their snapshots in the node's holder (this rank's own were
        cast with its masters' copy, ``copy_and_cast``)."""
        import torch.distributed as dist
        me = dist.get_rank()
        with torch.no_grad():
            for i, (parts, ranks) in enumerate(plan):
                for part, r in zip(parts, ranks):
                    if r != me:
                        cast_like_owner(part.data, peers.tensors(r)[f"opt/master/{i}"].data)

    # restore_from_holder passes a PeerPayloads: the lp params can come from the node's holder.
    uses_peer_payloads = True

    def validate(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> list[str]:
        """Whether a verified snapshot fits this engine, checked on every rank before any rank applies (the
        restore votes on the answer): optimizer wrapper, ZeRO stage, data-parallel size and the base optimizer.
        Each problem names the setting that changed and what to do."""
        e, o = self.engine, self.engine.optimizer
        out = []
        stage = int(e.zero_optimization_stage())
        if meta.get("optimizer") != self.kind or meta.get("zero_stage") != stage:
            out.append(f"the snapshot was taken with zero_optimization.stage={meta.get('zero_stage')} "
                       f"({meta.get('optimizer')}), this engine runs stage {stage} ({self.kind}): set the stage back, or "
                       "export the snapshot (`shardsafe export --format deepspeed`) and convert it with DeepSpeed's "
                       "universal checkpoint under a new shardsafe job_id")
        if meta.get("dp_world_size") != e.dp_world_size:
            out.append(f"the snapshot was taken at data-parallel size {meta.get('dp_world_size')}, this engine runs "
                       f"{e.dp_world_size}: ZeRO partitions do not fit another size; run at the original size or "
                       "export the snapshot and reshard it with DeepSpeed's universal checkpoint")
        then = meta.get("parallel", self.parallel)
        if then != self.parallel:
            out.append(f"the snapshot was taken at {describe(then)}, this engine runs {describe(self.parallel)}: "
                       "each rank's state belongs to one pipeline stage's layers, one tensor-parallel slice and its "
                       "experts (num_stages, partition_method, the PipelineModule's layers, the mpu, num_experts or "
                       "ep_size changed); run with "
                       "the original layout, or export the snapshot (`shardsafe export --format deepspeed`) and "
                       "convert it with DeepSpeed's universal checkpoint under a new shardsafe job_id")
        base = type(o.optimizer).__name__
        if meta.get("base_optimizer", base) != base:
            out.append(f"the snapshot's optimizer is {meta.get('base_optimizer')}, this engine's is {base} (the "
                       "\"optimizer\" section or torch_adam / offload_optimizer changed): their state differs; "
                       "restore with the original optimizer settings")
        if len(meta.get("param_groups", [])) != len(o.optimizer.param_groups):
            out.append(f"the snapshot has {len(meta.get('param_groups', []))} optimizer param groups, this engine "
                       f"{len(o.optimizer.param_groups)}: the model or its parameter grouping changed")
        out += rng_trackers.problems(meta.get("rng_trackers"))
        if (meta.get("lr_scheduler") is None) != (self.lr_scheduler is None):
            out.append("the snapshot was taken " + ("without" if meta.get("lr_scheduler") is None else "with")
                       + " an LR scheduler and this engine runs " + ("with" if self.lr_scheduler is not None else "without")
                       + " one: restore with the original \"scheduler\" section")
        return out

    def apply(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], peers: Any = None) -> None:
        e, o = self.engine, self.engine.optimizer
        base = o.optimizer
        self.restore_notes = {}
        problems = self.validate(tensors, meta)   # restore ran validate on every rank before; callers may not
        if problems:
            raise ConfigError("; ".join(problems))
        lp_then = (meta.get("ds_checkpoint") or {}).get("lp_dtype")
        lp_now = str(next(e.module.parameters()).dtype).removeprefix("torch.")
        if lp_then and lp_then != lp_now:
            # The fp32 masters and moments are the state; the model's precision may change on purpose.
            log.warning("[rank %d] the snapshot was taken with %s model parameters and this engine runs %s "
                        "(bf16/fp16 settings changed): the fp32 master weights and optimizer state are restored and "
                        "the parameters re-derived in %s; the run is not bit-identical to one that kept %s",
                        e.global_rank, lp_then, lp_now, lp_now, lp_then)
            self.restore_notes["precision_changed"] = f"{lp_then} -> {lp_now}"
        if self.z3:
            o.checkpoint_event_prologue()   # release gathered/persistent params before touching partitions
        masters = self.masters()
        plan = None if self.z3 else self._lp_from_peers_plan(peers)
        with torch.no_grad():
            for i, m in enumerate(masters):
                own = self._own_lp_partition(plan, i)
                if own is not None:   # the owner's cast of its own partition, fused with the master's copy
                    copy_and_cast(m, own, tensors[f"opt/master/{i}"])
                else:
                    m.copy_(tensors[f"opt/master/{i}"])
                state = base.state[m]   # empty on a fresh engine: entries are created
                prefix = f"opt/state/{i}/"
                for name, v in tensors.items():
                    if not name.startswith(prefix):
                        continue
                    k = name[len(prefix):]
                    cur = state.get(k)
                    if torch.is_tensor(cur) and cur.shape == v.shape and cur.dtype == v.dtype:
                        cur.copy_(v)
                    else:
                        dev = meta["state_devices"].get(name, str(m.device))
                        state[k] = v.to(device=dev, copy=True)
                for k, v in meta["opt_scalars"].get(str(i), {}).items():
                    state[k] = v
        for g, saved in zip(base.param_groups, meta["param_groups"]):
            g.update(saved)   # lr etc.: a restored scheduler does not rewrite param_group['lr']
        if self.lr_scheduler is not None and meta["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(meta["lr_scheduler"])
        self.program_schedulers.restore(meta.get("program_schedulers"), meta["param_groups"])
        for k, v in meta["counters"].items():
            setattr(e, k, v)
        if getattr(o, "loss_scaler", None) is not None:
            for k, v in meta["loss_scaler"].items():
                setattr(o.loss_scaler, k, v)
            for name, v in tensors.items():
                if name.startswith("loss_scaler/"):
                    getattr(o.loss_scaler, name.split("/", 1)[1]).copy_(v)
        with torch.no_grad():
            for name, buf in self.buffers():
                key = f"module/buffer/{name}"
                if key in tensors:
                    buf.copy_(tensors[key])
        if "resharded" not in meta:   # a re-partitioned state carries no RNG: the program's seeding stands
            apply_rng(tensors, meta)
            rng_trackers.apply(tensors, meta.get("rng_trackers"))
        if self.adam_powers is not None and meta.get("adam_powers"):
            self.restore_notes["adam_powers_calls"] = self.adam_powers.restore(meta["adam_powers"])
        self.extra.clear()
        self.extra.update(meta.get("extra", {}))
        if not self.z3:
            if plan is not None:
                self._lp_from_peers(plan, peers)
            else:
                o.update_lp_params()   # fp32 shard -> own low-precision partition -> all-gather over DP
            self.restore_notes["lp_params"] = "from the node's holder" if plan is not None else "all-gather"
        else:
            with torch.no_grad():
                for fp32, lp in zip(o.fp32_partitioned_groups_flat, o.fp16_partitioned_groups_flat):
                    lp.copy_(fp32)
            o.checkpoint_event_epilogue()

    @staticmethod
    def resharder() -> Any:
        """DeepSpeed's re-partitioning rules, for shardsafe.snapshot.reshard (adapters/deepspeed/reshard.py)."""
        from .reshard import DeepSpeedResharder
        return DeepSpeedResharder()

    def resharded_problems(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> list[str]:
        """Why a re-partitioned state does not fit this engine: not re-partitioned, cut elsewhere than this engine
        cuts its ZeRO state, another setup (:meth:`validate`), or tensors that differ from the live ones (every
        live tensor but the RNG's is written; the RNG stays as the program seeded it)."""
        from shardsafe.payload import manifest as mf

        from .reshard import layout_problems
        if "resharded" not in meta:
            return ["the state given to apply_resharded was not re-partitioned (no 'resharded' in its meta): use apply"]
        out = layout_problems(meta, self.checkpoint_layout())
        if out:
            return out
        out = self.validate(tensors, meta)
        live = {n: t for n, t in self.capture().tensors.items() if not n.startswith("rng/")}
        try:
            mf.check_matches({"version": "re-partitioned", "entries": mf.layout(tensors)[0]}, live,
                             tuple(self.optional_prefixes))
        except mf.ManifestError as e:
            out.append(str(e))
        return out

    def apply_resharded(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """A state re-partitioned to this engine's data-parallel size from snapshots taken at another one
        (shardsafe.snapshot.reshard): refused unless this engine cuts its ZeRO state exactly where the re-partition
        put it, then applied as a snapshot is, except the RNG, which stays as the program seeded it (as after
        DeepSpeed's own universal-checkpoint resume; adapters/deepspeed/reshard.py)."""
        problems = self.resharded_problems(tensors, meta)
        if problems:
            raise ConfigError("; ".join(problems))
        self.apply(tensors, meta)
