"""DeepSpeed's checkpoint files written from verified snapshots, without an engine; and the way back after a
vanilla ``engine.load_checkpoint`` of them (:func:`apply_client_state`).

The files are assembled from what the adapter records in every manifest (``meta["ds_checkpoint"]``: parameter
names, shapes and offsets in the flat ZeRO groups, buffer names, the optimizer's bookkeeping, the DeepSpeed
config): ``latest``, ``global_stepN/`` with the model-states and per-rank ZeRO optimizer files, as
``engine.save_checkpoint(DST)`` writes them at that iteration. DeepSpeed checkpoints are pickles by DeepSpeed's
own design; they are written here for the user's own framework to read, never read by shardsafe.

What DeepSpeed's checkpoint has no place for -- the per-rank RNG states, the engine's ``micro_steps`` and module
buffers that differ between ranks (DeepSpeed keeps rank 0's) -- goes into the client state under ``"shardsafe"``;
:func:`apply_client_state` puts it back after ``load_checkpoint`` (plain DeepSpeed restores neither for its own
checkpoints).
"""
from __future__ import annotations

import logging
import os
import shutil
from collections import OrderedDict
from typing import Any, Mapping

import torch

from shardsafe.export.sources import ExportError, RankSnapshot
from shardsafe.payload import manifest as mf
from shardsafe.snapshot.state import apply_rng

from . import rng_trackers

log = logging.getLogger(__name__)
EXPORT_FORMAT = "shardsafe-export/1"


def _ds_check(ranks: list[RankSnapshot]) -> tuple[dict, dict]:
    metas = [r.meta for r in ranks]
    m0 = metas[0]
    if m0.get("engine") != "deepspeed":
        raise ExportError(f"the snapshot was taken by the {m0.get('engine')!r} adapter; --format deepspeed needs a "
                          "DeepSpeed job's snapshot (use --format megatron for Megatron jobs).")
    lay = m0.get("ds_checkpoint")
    if lay is None:
        raise ExportError("the snapshot has no DeepSpeed checkpoint layout (taken by a shardsafe before export "
                          "existed); take a new snapshot with this version and export that.")
    world = ranks[0].manifest["world_size"]
    if [r.rank for r in ranks] != list(range(world)):
        raise ExportError(f"expected the snapshots of all {world} ranks, found ranks {[r.rank for r in ranks]}")
    replay = ("pass the job's launch command after `--` (shardsafe export --format deepspeed SRC DST -- torchrun ... "
              "train.py ARGS): the job then restores and writes the checkpoint with DeepSpeed's own save_checkpoint")
    if lay["mp_world_size"] != 1 or m0["dp_world_size"] != world:
        raise ExportError(f"the offline export writes data-parallel-only DeepSpeed checkpoints; this job ran "
                          f"model-parallel size {lay['mp_world_size']} (pipeline x tensor) with data-parallel size "
                          f"{m0['dp_world_size']} of {world} ranks: {replay}.")
    if lay["frozen_params"]:
        raise ExportError(f"the model has frozen parameters ({', '.join(lay['frozen_params'][:4])}...) that are not "
                          "optimizer state and so not in the snapshot; export cannot write them.")
    if m0["optimizer"] == "DeepSpeedZeroOptimizer" and lay.get("elastic_checkpoint"):
        raise ExportError("zero_optimization.elastic_checkpoint=true is not supported by export; "
                          "train with it false (the default).")
    if m0["optimizer"] not in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"):
        raise ExportError(f"the offline export supports ZeRO stages 1-3 (DeepSpeedZeroOptimizer, ..._Stage3); this "
                          f"snapshot's optimizer is {m0['optimizer']}: {replay}.")
    if (m0.get("parallel") or {}).get("experts"):
        raise ExportError(f"the offline export does not write MoE expert files: {replay}.")
    return m0, lay


def _loss_scaler(meta: dict, lay: dict, tensors: Mapping[str, torch.Tensor]) -> Any:
    from deepspeed.runtime.fp16 import loss_scaler as ls
    cls = getattr(ls, lay["loss_scaler_class"], None)
    if cls is None:
        raise ExportError(f"unknown DeepSpeed loss scaler {lay['loss_scaler_class']!r} in the snapshot")
    obj = cls.__new__(cls)
    obj.__dict__.update(meta["loss_scaler"])
    for name, t in tensors.items():
        if name.startswith("loss_scaler/"):
            setattr(obj, name.split("/", 1)[1], t.clone())
    return obj


def _base_optimizer_state(meta: dict, tensors: Mapping[str, torch.Tensor], n_groups: int) -> dict:
    """``torch.optim.Optimizer.state_dict()`` of the inner optimizer: one flat param per group, index = group
    (rigid checkpoints keep the padding; elastic ones, which strip it, are refused up front)."""
    state: dict[int, dict] = {}
    for i in range(n_groups):
        st: dict[str, Any] = {}
        prefix = f"opt/state/{i}/"
        for name, t in tensors.items():
            if name.startswith(prefix):
                st[name[len(prefix):]] = t.clone()
        st.update(meta["opt_scalars"].get(str(i), {}))
        if st:
            state[i] = st
    groups = [dict(g, params=[i]) for i, g in enumerate(meta["param_groups"])]
    return {"state": state, "param_groups": groups}


def _client_state(ranks: list[RankSnapshot], version: int) -> dict:
    return {"shardsafe": {
        "format": EXPORT_FORMAT, "version": version,
        "micro_steps": int(ranks[0].meta["counters"].get("micro_steps", 0)),
        "ranks": {r.rank: {"rng": {k: v.clone() for k, v in r.tensors.items() if k.startswith("rng/")},
                           "rng_meta": {k: v for k, v in r.meta.items() if k.startswith("rng/")},
                           "rng_trackers": r.meta.get("rng_trackers") or {},
                           # DeepSpeed saves rank 0's buffers only; a per-rank buffer (running stats of
                           # a rank's own data) would come back as rank 0's without these.
                           "buffers": {k[len("module/buffer/"):]: v.clone() for k, v in r.tensors.items()
                                       if k.startswith("module/buffer/")},
                           "extra": r.meta.get("extra", {})} for r in ranks},
    }}


def _model_state_common(meta: dict, lay: dict, module: dict, stage: int, shared: dict) -> dict:
    from deepspeed.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE
    frozen = OrderedDict() if stage >= 2 else None   # saved for partitioned gradients/weights only
    return dict(
        module=module, buffer_names=list(lay["buffer_names"]), optimizer=None,
        param_shapes=[OrderedDict((n, torch.Size(s)) for n, s in g) for g in lay["param_shapes"]],
        frozen_param_shapes=frozen, shared_params=dict(shared),
        frozen_param_fragments=OrderedDict() if frozen is not None else None,
        lr_scheduler=meta["lr_scheduler"], data_sampler=None, random_ltd=None,
        skipped_steps=meta["counters"]["skipped_steps"], global_steps=meta["counters"]["global_steps"],
        global_samples=meta["counters"]["global_samples"], dp_world_size=lay["seq_dp_world_size"],
        mp_world_size=lay["mp_world_size"],
        **{CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: 1, CHECKPOINT_TP_DEGREE: 1}},
        ds_config=lay["ds_config"], ds_version=lay["ds_version"])


def _lp_dtype(lay: dict) -> torch.dtype:
    return mf.dtype_from_name(lay["lp_dtype"])


def _module_z12(ranks: list[RankSnapshot], lay: dict) -> dict[str, torch.Tensor]:
    """Full low-precision weights: the fp32 partitions of all ranks side by side are the flat group;
    each parameter is its slice cast the way DeepSpeed's update_lp_params casts it."""
    lp = _lp_dtype(lay)
    shapes = {n: s for g in lay["param_shapes"] for n, s in g}
    params: dict[str, torch.Tensor] = {}
    for i, members in enumerate(lay["flat_params"]):
        flat = torch.cat([r.tensors[f"opt/master/{i}"] for r in ranks])
        for name, off, numel in members:
            params[name] = flat[off: off + numel].to(lp).view(shapes[name]).clone()
    return _module_dict(ranks[0], lay, params)


def _module_dict(rank: RankSnapshot, lay: dict, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    shared = lay["shared_params"]
    module: dict[str, torch.Tensor] = OrderedDict()
    for key in lay["state_dict_keys"]:
        if key in params:
            module[key] = params[key]
        elif f"module/buffer/{key}" in rank.tensors:
            module[key] = rank.tensors[f"module/buffer/{key}"].clone()
        elif key in shared and shared[key] in params:
            module[key] = params[shared[key]]
        else:
            raise ExportError(f"module state entry {key!r} is neither an optimized parameter nor a persistent buffer "
                              "in the snapshot; export cannot write it.")
    return module


def export_deepspeed(ranks: list[RankSnapshot], dst: str, *, version: int, tag: str | None = None) -> str:
    """Write the checkpoint ``engine.save_checkpoint(dst, tag)`` writes; return the tag directory."""
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    m0, lay = _ds_check(ranks)
    stage = int(m0["zero_stage"])
    tag = tag or f"global_step{m0['counters']['global_steps']}"
    tdir = os.path.join(dst, tag)
    os.makedirs(tdir, exist_ok=True)
    prefix = "bf16_" if lay["bf16"] else ""
    n_groups = len(m0["param_groups"])
    client = _client_state(ranks, version)
    files: list[tuple[str, dict]] = []
    if m0["optimizer"] == "DeepSpeedZeroOptimizer":
        model = _model_state_common(m0, lay, _module_z12(ranks, lay), stage, lay["shared_params"])
        files.append(("mp_rank_00_model_states.pt", {**model, **client}))
        for r in ranks:
            rl = r.meta["ds_checkpoint"]
            masters = [r.tensors[f"opt/master/{i}"] for i in range(n_groups)]
            osd = {
                "loss_scaler": _loss_scaler(r.meta, rl, r.tensors), "dynamic_loss_scale": rl["dynamic_loss_scale"],
                "overflow": r.meta.get("overflow", False), "clip_grad": rl["clip_grad"],
                "base_optimizer_state": _base_optimizer_state(r.meta, r.tensors, n_groups),
                "single_partition_of_fp32_groups": [m[: m.numel() - pad].clone()
                                                    for m, pad in zip(masters, rl["group_paddings"])],
                "zero_stage": ZeroStageEnum(rl["zero_stage_enum"]), "group_paddings": list(rl["group_paddings"]),
                "param_alignment_paddings": rl["param_alignment_paddings"],
                "partition_count": rl["partition_count"], "ds_version": rl["ds_version"],
                "param_slice_mappings": [OrderedDict((n, fragment_address(numel=k, start=s)) for n, k, s in g)
                                         for g in rl["param_slice_mappings"]],
            }
            files.append((f"{prefix}zero_pp_rank_{r.rank}_mp_rank_00_optim_states.pt",
                          {"optimizer_state_dict": osd, "ds_config": lay["ds_config"], "ds_version": lay["ds_version"]}))
    else:   # ZeRO-3: every rank writes its own model-states file (empty parameter placeholders) and optimizer file
        lp = _lp_dtype(lay)
        names = [n for g in lay["param_shapes"] for n, _ in g]
        for r in ranks:
            rl = r.meta["ds_checkpoint"]
            masters = [r.tensors[f"opt/master/{i}"] for i in range(len(rl["param_shapes"]))]
            if len(masters) != n_groups:
                raise ExportError(f"ZeRO-3 with {len(masters)} sub-groups over {n_groups} parameter groups "
                                  "(zero_optimization.sub_group_size) is not supported by export.")
            placeholders = {n: torch.empty(0, dtype=lp) for n in names}
            model = _model_state_common(r.meta, rl, _module_dict(r, rl, placeholders), stage, rl["shared_params"])
            files.append((f"zero_pp_rank_{r.rank}_mp_rank_00_model_states.pt", {**model, **client}))
            osd = {
                "zero_stage": ZeroStageEnum.weights, "loss_scaler": _loss_scaler(r.meta, rl, r.tensors),
                "dynamic_loss_scale": rl["dynamic_loss_scale"], "overflow": r.meta.get("overflow", False),
                "partition_count": rl["partition_count"],
                "optimizer_state_dict": _base_optimizer_state(r.meta, r.tensors, n_groups),
                "fp32_flat_groups": [m.clone() for m in masters],
            }
            files.append((f"{prefix}zero_pp_rank_{r.rank}_mp_rank_00_optim_states.pt",
                          {"optimizer_state_dict": osd, "ds_config": lay["ds_config"], "ds_version": lay["ds_version"]}))
    for name, obj in files:
        _atomic_save(obj, os.path.join(tdir, name))
    _copy_recovery_scripts(dst)
    _atomic_write(os.path.join(dst, "latest"), tag.encode())   # last: the checkpoint is complete
    return tdir


def rank_side_file(tag_dir: str, rank: int) -> str:
    """Where an export run's rank keeps what DeepSpeed's files have no place for (its RNG, buffers, extra)."""
    return os.path.join(tag_dir, f"shardsafe_rank{rank}.pt")


def save_rank_side_file(path: str, obj: Mapping[str, Any]) -> None:
    _atomic_save({"format": EXPORT_FORMAT, **obj}, path)


def apply_client_state(engine: Any, client_state: Mapping[str, Any] | None, path: str | None = None) -> bool:
    """After a vanilla ``engine.load_checkpoint`` of an exported checkpoint: put back what DeepSpeed's
    format does not carry (this rank's RNG states and model-parallel RNG trackers, ``micro_steps``, buffers).
    ``path``: the checkpoint directory ``load_checkpoint`` returned (an export run's per-rank files are there).
    Returns False if there is nothing."""
    s = (client_state or {}).get("shardsafe")
    if not s:
        return False
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if s.get("per_rank_files"):
        # load_checkpoint returns the model-states file it read, inside the tag directory
        tag_dir = (str(path) if os.path.isdir(str(path)) else os.path.dirname(str(path))) if path else ""
        side = rank_side_file(tag_dir, rank) if tag_dir else ""
        if not side or not os.path.isfile(side):
            raise ExportError(f"the exported checkpoint keeps each rank's RNG states in shardsafe_rank<R>.pt beside its "
                              f"files and rank {rank}'s is missing ({side or 'no checkpoint directory passed'}); load it "
                              "with the world size it was exported at, and pass load_checkpoint's returned path.")
        mine = torch.load(side, map_location="cpu", weights_only=True)   # plain tensors and data only
    else:
        mine = s["ranks"].get(rank)
    if mine is None:
        raise ExportError(f"the exported checkpoint has RNG states for ranks {sorted(s['ranks'])}, not for rank {rank}; "
                          "load it with the world size it was taken at.")
    engine.micro_steps = int(s["micro_steps"])
    apply_rng(mine["rng"], mine["rng_meta"])
    problems = rng_trackers.problems(mine.get("rng_trackers"))
    if problems:
        raise ExportError("; ".join(problems))
    rng_trackers.apply(mine["rng"], mine.get("rng_trackers"))
    bufs = dict(engine.module.named_buffers())
    with torch.no_grad():
        for name, v in mine.get("buffers", {}).items():
            if name in bufs:
                bufs[name].copy_(v)
    return True


def _atomic_save(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_write(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _copy_recovery_scripts(dst: str) -> None:
    """DeepSpeed puts zero_to_fp32.py next to its checkpoints; so do we (best effort)."""
    try:
        import deepspeed.utils
        base = os.path.dirname(deepspeed.utils.__file__)
        for name in ("zero_to_fp32.py", "zero_to_torch.py"):
            if os.path.exists(os.path.join(base, name)):
                shutil.copyfile(os.path.join(base, name), os.path.join(dst, name))
    except (ImportError, OSError) as e:
        log.info("recovery scripts not copied: %s", e)
