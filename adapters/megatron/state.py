"""The Megatron state adapter: a rank's Megatron state as a :class:`RankState`, and back, in place.

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
not restored on a fresh optimizer): every value is copied into the existing
tensors, and a fresh optimizer's missing per-param state is allocated one tensor per param.

Capture and apply walk the same enumeration and live here together; what is checked before either
runs (supported setups, the parallel layout, whether a snapshot fits) is in :mod:`.state_checks`.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping, MutableMapping, Optional

import torch

from shardsafe.errors import ShardsafeError
from shardsafe.snapshot.state import RankState, apply_rng, capture_rng, cast_like_owner

from .distopt_layout import record as distopt_record
from .reshard import ReshardingMixin, batch_record
from .state_checks import (FORMAT, _kind, _names_with_prefix, _SnapshotChecks, check_supported, leaf_optimizers,
                           megatron_core_version, rank_coordinates)

log = logging.getLogger(__name__)

_FP8_META_KEYS = ("scaling_fwd", "scaling_bwd")
_FP8_ATTRS = ("scale", "scale_inv", "amax_history")


class SnapshotMismatch(ValueError, ShardsafeError):
    """A snapshot does not fit the live model/optimizer (other layout, model or optimizer config)."""


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


# ReshardingMixin first: StateAdapter (under _SnapshotChecks) has refusing defaults of resharder() / apply_resharded()
# that would otherwise come first in the method order.
class MegatronStateAdapter(ReshardingMixin, _SnapshotChecks):
    """:class:`shardsafe.snapshot.state.StateAdapter` for megatron-core model chunks + MegatronOptimizer.

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
        meta: dict[str, Any] = {"format": FORMAT, "engine": "megatron", "megatron_core": megatron_core_version(),
                                "iteration": int(self.get_iteration()), "batch": batch_record()}
        meta["coords"] = self._coordinates()  # None without parallel_state: single-process use
        opts = []
        for li, leaf in enumerate(self.leaves):
            inner = getattr(leaf, "optimizer", None)
            owner = self._model_param_of(li)
            om: dict[str, Any] = {"type": self._kinds[li], "stub": inner is None, "groups": []}
            if self._kinds[li] == "DistributedOptimizer" and inner is not None:   # for re-partitioning (.reshard)
                om["distopt"] = distopt_record(leaf, self.model_chunks, self._param_names)
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

    # ---------------------------------------------------------------- validate: see state_checks._SnapshotChecks

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
        model params are bit-identical (the buckets' padding, which no param views, is not touched). Only
        for params in host memory (``peers.pays_off``: on a GPU, NCCL's all-gather is the cheaper way).
        Collective decision (``peers.available``); False = use the all-gather."""
        if peers is None or not torch.distributed.is_initialized():
            return False   # the same on every rank: no collective needed
        me = torch.distributed.get_rank()
        params = {f"c{ci}.{n}": p for ci, chunk in enumerate(self.model_chunks) for n, p in chunk.named_parameters()}
        # FP8 params (TE) are cast through their own quantizers; multiple DistOpt instances gather in stages.
        usable = all(type(p.data) is torch.Tensor for p in params.values()) and peers.pays_off(params.values())
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

