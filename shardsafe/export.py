"""`shardsafe export`: write a committed snapshot as the framework's own checkpoint.

The way back from shardsafe to plain DeepSpeed: ``shardsafe export --format deepspeed SRC DST``
reads one committed version of every rank (from the persistent tier or from the live holders),
verifies every checksum, and writes the directory ``engine.save_checkpoint(DST)`` would have
written at that iteration (``latest``, ``global_stepN/`` with the model-states and per-rank ZeRO
optimizer files) -- so a vanilla ``engine.load_checkpoint(DST)`` resumes from it.

The files are assembled without an engine from what the adapter records in every manifest
(``meta["ds_checkpoint"]``: parameter names, shapes and offsets in the flat ZeRO groups, buffer
names, the optimizer's bookkeeping, the DeepSpeed config). DeepSpeed checkpoints are pickles by
DeepSpeed's own design; they are written here for the user's own framework to read, never read by
shardsafe.

What DeepSpeed's checkpoint has no place for -- the per-rank RNG states, the engine's
``micro_steps`` and module buffers that differ between ranks (DeepSpeed keeps rank 0's) -- goes into the client state under ``"shardsafe"``; :func:`apply_client_state`
puts it back after ``load_checkpoint`` (plain DeepSpeed restores neither for its own checkpoints).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from shardsafe import manifest as mf
from shardsafe.errors import ShardsafeError

log = logging.getLogger("shardsafe.export")
EXPORT_FORMAT = "shardsafe-export/1"


class ExportError(RuntimeError, ShardsafeError):
    """The snapshot cannot be exported; the message says what was expected, what was found and what to do."""


@dataclass
class RankSnapshot:
    """One rank's verified snapshot: its manifest, decoded meta and tensors viewing the payload."""
    rank: int
    manifest: dict
    meta: dict
    tensors: dict[str, torch.Tensor]
    _keep: list = field(default_factory=list, repr=False)   # the mappings the views point into


# ---- sources -----------------------------------------------------------------------------------------

def _verified(rank: int, manifest: dict, buf, where: str) -> RankSnapshot:
    bad = mf.verify(manifest, memoryview(buf))
    if bad:
        raise ExportError(f"rank {rank} of version {manifest.get('version')} in {where} fails its checksums "
                          f"({'; '.join(bad[:3])}); nothing was written. Export an older version (--version), "
                          "or restore the job once so parity repairs it and export again.")
    return RankSnapshot(rank, manifest, mf.from_jsonable(manifest["meta"]), mf.views(manifest, buf), [buf])


def open_persistent(job_dir: str, version: int | None = None) -> tuple[int, list[RankSnapshot]]:
    """Every rank of ``version`` (default: the newest complete one) from a persistent job directory
    (``PERSIST_DIR/JOB_ID``)."""
    from shardsafe.persist import PersistentStore
    job_dir = os.path.abspath(job_dir)
    store = PersistentStore(os.path.dirname(job_dir), os.path.basename(job_dir))
    versions = store.versions()
    if not versions:
        raise ExportError(f"no snapshot versions under {job_dir} (expected v<iteration>/rank<R>.bin|.json, written "
                          "by the holders' flush); pass the persistent job directory PERSIST_DIR/JOB_ID.")

    complete = [v for v in versions if _complete_on_disk(store, v)]
    if version is None:
        if not complete:
            raise ExportError(f"no version under {job_dir} has the files of every rank (found {versions}); "
                              "wait for the next flush, or pass --version of a complete one.")
        version = complete[-1]
    elif version not in complete:
        raise ExportError(f"version {version} under {job_dir} is missing or incomplete; complete versions: {complete}")
    out = []
    for r in _ranks_on_disk(store, version):
        man, mm = store.open(version, r)
        out.append(_verified(r, man, mm, store.version_dir(version)))
    return version, out


def _ranks_on_disk(store: Any, version: int) -> list[int]:
    """Ranks whose manifest of ``version`` is on disk (the manifest is written after the payload)."""
    return sorted(int(n[len("rank"):-len(".json")]) for n in os.listdir(store.version_dir(version))
                  if n.startswith("rank") and n.endswith(".json"))


def _complete_on_disk(store: Any, version: int) -> bool:
    """Every rank of the job (the manifests' world size) has its files of ``version``."""
    ranks = _ranks_on_disk(store, version)
    if not ranks:
        return False
    with open(store.paths(version, ranks[0])[1]) as f:
        world = int(json.load(f)["world_size"])
    return ranks == list(range(world)) and all(os.path.exists(store.paths(version, r)[0]) for r in ranks)


def open_holders(holder_dir: str, job_id: str, version: int | None = None) -> tuple[int, list[RankSnapshot]]:
    """Every rank of ``version`` (default: the newest committed on every rank) from the job's holders."""
    from shardsafe.holder.client import HolderClient, HolderUnavailable
    from shardsafe.holder.paths import HolderPaths
    nodes = HolderPaths.list_nodes(holder_dir, job_id)
    if not nodes:
        raise ExportError(f"no holder of job {job_id!r} under {holder_dir}; check --holder-dir and the job id "
                          "(`shardsafe status`), or export from the persistent directory instead.")
    clients, where, committed = [], {}, {}
    try:
        for node in nodes:
            try:
                c = HolderClient(HolderPaths(holder_dir, job_id, node), timeout_s=10).connect()
            except HolderUnavailable as e:
                log.warning("holder of node %s not reachable (%s); its ranks must come from another holder", node, e)
                continue
            clients.append(c)
            for rank, kinds in c.list().items():
                vs = {s["version"] for s in kinds.get("data", []) if s["state"] == "sealed" and s["committed"]}
                if vs:
                    where[int(rank)] = c
                    committed[int(rank)] = vs
        if not committed:
            raise ExportError(f"the holders of job {job_id!r} ({', '.join(nodes)}) hold no committed snapshot")
        common = set.intersection(*committed.values())
        if version is None:
            if not common:
                raise ExportError(f"no version is committed on every rank ({ {r: sorted(v) for r, v in committed.items()} }); "
                                  "restore the job once (parity rebuilds lost ranks), or export from the persistent tier.")
            version = max(common)
        elif version not in common:
            raise ExportError(f"version {version} is not committed on every rank; committed everywhere: {sorted(common)}")
        out = []
        for r in sorted(where):
            man, mm = where[r].open(rank=r, version=version)
            out.append(_verified(r, man, mm, f"the holder of node {man.get('node')}"))
        return version, out
    finally:
        for c in clients:
            c.close()


def open_source(src: str, *, holder_dir: str = "", version: int | None = None) -> tuple[int, list[RankSnapshot]]:
    """``holder://JOB_ID`` reads the live holders; anything else is a persistent job directory."""
    if src.startswith("holder://"):
        from shardsafe.config import ShardsafeConfig
        return open_holders(holder_dir or ShardsafeConfig().holder_dir, src[len("holder://"):], version)
    if not os.path.isdir(src):
        raise ExportError(f"{src} is not a directory; SRC is a persistent job directory (PERSIST_DIR/JOB_ID) "
                          "or holder://JOB_ID")
    return open_persistent(src, version)


# ---- DeepSpeed ----------------------------------------------------------------------------------------

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
    from shardsafe.state import apply_rng
    from shardsafe.adapters import rng_trackers
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


# ---- CLI ----------------------------------------------------------------------------------------------

def _replay_job(src: str, command: list[str], extra: Any, *, holder_dir: str, timeout_s: float | None) -> None:
    """Run the job's own command once more so that it restores SRC and writes the export with the framework's own
    writer. From holder://JOB_ID it reads the job's live holders; from a persistent job directory, fresh empty
    holders in a private directory make the restore fall through to the persistent tier. ``extra(job_id,
    persist_dir, holder_dir)`` returns the (flags, environment) that say so: Megatron reads flags, a DeepSpeed
    program its JSON block, which the environment completes."""
    import subprocess
    import tempfile
    scratch = None
    if src.startswith("holder://"):
        job, persist, hdir = src[len("holder://"):], "", holder_dir
    else:
        if not os.path.isdir(src):
            raise ExportError(f"{src} is not a directory; SRC is a persistent job directory (PERSIST_DIR/JOB_ID) "
                              "or holder://JOB_ID")
        job_dir = os.path.abspath(src)
        scratch = tempfile.mkdtemp(prefix="shardsafe-export-")
        job, persist, hdir = os.path.basename(job_dir), os.path.dirname(job_dir), scratch
    flags, env = extra(job, persist, hdir)
    try:
        p = subprocess.run([*command, *flags], env={**os.environ, **env}, timeout=timeout_s)
    finally:
        if scratch is not None:
            _stop_holders(scratch)
            shutil.rmtree(scratch, ignore_errors=True)
    if p.returncode != 0:
        raise ExportError(f"the export run exited with status {p.returncode}; its output above says why "
                          f"(command: {' '.join(command + flags)})")


def export_deepspeed_replay(src: str, dst: str, command: list[str], *, holder_dir: str = "",
                            timeout_s: float | None = None) -> str:
    """``shardsafe export --format deepspeed SRC DST -- COMMAND``: run the job's own command once more with
    SHARDSAFE_EXPORT_DIR=DST. Its engine restores the newest snapshot of SRC at ``deepspeed.initialize`` and
    writes it with DeepSpeed's own ``save_checkpoint``, then exits before training (adapters/deepspeed.py), so
    every layout DeepSpeed can save is exported as that DeepSpeed version writes it: pipeline stages, tensor
    and expert parallelism, BF16_Optimizer -- what the offline writer (``export_deepspeed``) does not assemble.
    The command must run the job's layout (world size, pipeline stages, mpu)."""
    from shardsafe.config import ENV_EXPORT_DIR, ENV_PERSIST_DIR
    dst = os.path.abspath(dst)

    if not command:
        raise ExportError("the export run needs the job's launch command after `--`")

    def extra(job: str, persist: str, hdir: str) -> tuple[list[str], dict[str, str]]:
        env = {ENV_EXPORT_DIR: dst, "SHARDSAFE_JOB_ID": job}
        if persist:
            env[ENV_PERSIST_DIR] = persist
        if hdir:
            env["SHARDSAFE_HOLDER_DIR"] = hdir
        return [], env

    _replay_job(src, command, extra, holder_dir=holder_dir, timeout_s=timeout_s)
    latest = os.path.join(dst, "latest")
    if not os.path.isfile(latest):
        raise ExportError(f"the export run finished but {latest} is missing: did the command call deepspeed.initialize "
                          "with the job's DeepSpeed config (its \"shardsafe\" block enabled)?")
    with open(latest) as f:
        return os.path.join(dst, f.read().strip())


def export_megatron(src: str, dst: str, command: list[str], *, holder_dir: str = "",
                    timeout_s: float | None = None) -> str:
    """Run the job's own Megatron-LM command once more with ``--shardsafe-export-dir``: it restores the
    newest snapshot of SRC and writes it with Megatron's ``save_checkpoint`` (the format and layout
    that Megatron version's ``--save`` writes), then exits before training. Megatron checkpoints hold
    the model's own sharding metadata (``sharded_state_dict`` of the live modules), which only the
    model code can produce; hence the replay instead of an offline writer as for DeepSpeed."""
    if not command:
        raise ExportError("--format megatron needs the job's launch command after `--` (e.g. `-- torchrun "
                          "--nproc-per-node 8 pretrain_gpt.py ARGS`), with the layout (TP/PP/DP) it was trained at.")

    def extra(job: str, persist: str, hdir: str) -> tuple[list[str], dict[str, str]]:
        flags = ["--shardsafe", "--shardsafe-export-dir", os.path.abspath(dst), "--shardsafe-parity-group-size", "1",
                 "--shardsafe-job-id", job]
        if persist:
            flags += ["--shardsafe-persist-dir", persist]
        if hdir:
            flags += ["--shardsafe-holder-dir", hdir]
        return flags, {}

    _replay_job(src, command, extra, holder_dir=holder_dir, timeout_s=timeout_s)
    marker = os.path.join(dst, "latest_checkpointed_iteration.txt")
    if not os.path.exists(marker):
        raise ExportError(f"the export run finished but {marker} is missing: was the command a Megatron-LM entry "
                          "script using shardsafe.adapters.megatron.pretrain?")
    with open(marker) as f:
        return os.path.join(dst, f"iter_{int(f.read().strip()):07d}")


def _stop_holders(holder_dir: str) -> None:
    from shardsafe.holder.client import HolderClient, HolderUnavailable
    from shardsafe.holder.paths import HolderPaths
    try:
        jobs = os.listdir(holder_dir)
    except OSError:
        return
    for job in jobs:
        for node in HolderPaths.list_nodes(holder_dir, job):
            try:
                c = HolderClient(HolderPaths(holder_dir, job, node), timeout_s=5).connect()
                c.shutdown()
                c.close()
            except (HolderUnavailable, OSError):
                pass


def cmd_export(a: Any) -> int:
    cmd = list(a.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        if a.format == "megatron":
            if a.version is not None:
                raise ExportError("--version is not supported with --format megatron: the export run restores the "
                                  "newest restorable version (drop newer ones from the persistent directory first).")
            out = export_megatron(a.src, a.dst, cmd, holder_dir=a.holder_dir)
            print(f"exported {a.src} as a Megatron checkpoint: {out}", flush=True)
            return 0
        if cmd:
            if a.version is not None or a.tag:
                raise ExportError("--version and --tag are not supported with a command after `--`: the export run "
                                  "restores the newest restorable version and saves it as global_step<N>.")
            out = export_deepspeed_replay(a.src, a.dst, cmd, holder_dir=a.holder_dir)
            print(f"exported {a.src} as a DeepSpeed checkpoint written by save_checkpoint: {out}", flush=True)
            return 0
        version, ranks = open_source(a.src, holder_dir=a.holder_dir, version=a.version)
        out = export_deepspeed(ranks, a.dst, version=version, tag=a.tag or None)
    except ExportError as e:
        print(f"shardsafe export: {e}", flush=True)
        return 2
    print(f"exported version {version} ({len(ranks)} ranks) as a {a.format} checkpoint: {out}", flush=True)
    return 0
