"""Which slice of the model a DeepSpeed rank's state is (pipeline stage, tensor-parallel slice, experts), and
its coordinates for parity placement. Recorded in every snapshot and checked at restore (adapters/deepspeed/).
"""
from __future__ import annotations

import json
from typing import Any, Mapping


def parallel_layout(engine: Any) -> dict[str, Any]:
    """Which slice of the model this rank's state is: tensor-parallel rank and size (the mpu's), and under a
    PipelineEngine the stage, the number of stages and the layer boundaries of every stage (PipelineModule's
    ``parts``: the partitioning method's result). A snapshot fits only the same slice."""
    mpu = engine.mpu
    out: dict[str, Any] = {"tp": 0, "tp_size": 1}
    if mpu is not None:
        # The tensor-parallel rank, never ``get_model_parallel_rank`` when a tensor method exists: on a
        # PipelineParallelGrid that is the rank in the combined pipeline x tensor group (old Megatron mpus, which
        # have no tensor method, mean tensor by it).
        tensor = hasattr(mpu, "get_tensor_model_parallel_rank")
        out["tp"] = int(mpu.get_tensor_model_parallel_rank() if tensor else mpu.get_model_parallel_rank())
        out["tp_size"] = int(mpu.get_tensor_model_parallel_world_size() if tensor
                             else mpu.get_model_parallel_world_size())
    if is_pipeline(engine):
        out.update(stage=int(engine.stage_id), stages=int(engine.num_stages),
                   parts=[int(x) for x in engine.module.parts])
    if engine.has_moe_layers:
        # MoE layers (deepspeed.moe.layer.MoE): this rank holds num_experts / ep_size of each layer's experts, and
        # their optimizer state is partitioned over the expert-data-parallel group only (ZeRO's MoE param groups).
        from deepspeed.moe.layer import MoE
        from deepspeed.utils import groups
        out["experts"] = {name: [int(m.num_experts), int(groups._get_expert_parallel_rank(m.expert_group_name)),
                                 int(m.ep_size)]
                          for name, m in engine.module.named_modules() if isinstance(m, MoE)}
    return out


def describe(p: Mapping[str, Any]) -> str:
    where = f"tensor-parallel rank {p.get('tp')} of {p.get('tp_size')}"
    if p.get("experts"):
        where += ", MoE layers (name: [experts, expert-parallel rank, expert-parallel size]) " + \
            json.dumps(p["experts"], sort_keys=True)
    if "stage" in p:
        parts = p["parts"]
        s = p["stage"]
        where = (f"pipeline stage {s} of {p['stages']} (layers {parts[s]}-{parts[s + 1] - 1}, stage boundaries "
                 f"{parts}), " + where)
    return where


def is_pipeline(engine: Any) -> bool:
    """A PipelineEngine (a PipelineModule handed to deepspeed.initialize). Imported here, not at module import:
    this module must not pull DeepSpeed in before the program does (adapters/autoload.py)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    return isinstance(engine, PipelineEngine)


def coords(engine: Any, layout: Mapping[str, Any]) -> dict[str, int]:
    """Data/tensor/pipeline-parallel coordinates for parity placement: parity groups are data-parallel ranks of
    equal (tp, pp), whose payloads have one layout. tp and the stage come from ``parallel_layout``; the
    data-parallel rank from the engine's mpu (a Megatron-style mpu, deepspeed.utils.groups under AutoTP, or the
    PipelineParallelGrid a PipelineEngine gets from its PipelineModule)."""
    mpu = engine.mpu
    if mpu is None:
        return {"dp": int(engine.global_rank), "tp": 0, "pp": 0}
    pp = layout.get("stage")
    if pp is None:   # a Megatron mpu handed to a plain engine still names its pipeline rank
        get_pp = getattr(mpu, "get_pipeline_model_parallel_rank", None)
        pp = int(get_pp()) if get_pp is not None else 0
    return {"dp": int(mpu.get_data_parallel_rank()), "tp": int(layout["tp"]), "pp": int(pp)}


def checkpoint_layout(engine: Any, kind: str) -> dict[str, Any]:
    """What ``shardsafe export --format deepspeed`` needs to write this engine's own checkpoint layout without the
    engine: parameter names, shapes and flat offsets, buffer names, the ZeRO bookkeeping ``optimizer.state_dict()``
    carries, and the config (``kind``: the optimizer wrapper's class name). It walks the module: call it once."""
    import deepspeed
    e, o = engine, engine.optimizer
    shapes = [[[name, list(shape)] for name, shape in g.items()] for g in e._get_zero_param_shapes()]
    frozen = [e.param_names[p] for p in e.module.parameters() if not p.requires_grad and p in e.param_names]
    lay: dict[str, Any] = {
        "ds_version": deepspeed.__version__, "ds_config": _plain(e.config),
        "mp_world_size": int(e.mp_world_size), "seq_dp_world_size": int(e.seq_dp_world_size),
        "bf16": bool(e.bfloat16_enabled()), "fp16": bool(e.fp16_enabled()),
        "lp_dtype": str(next(e.module.parameters()).dtype).removeprefix("torch."),
        "param_shapes": shapes, "frozen_params": frozen,
        "buffer_names": e._get_buffer_names(), "shared_params": dict(e._get_shared_params()),
        "state_dict_keys": list(e.module.state_dict().keys()),
        "loss_scaler_class": type(getattr(o, "loss_scaler", None)).__name__,
        "dynamic_loss_scale": bool(getattr(o, "dynamic_loss_scale", False)),
        "clip_grad": float(getattr(o, "clip_grad", 0.0) or 0.0),
        "partition_count": _plain(getattr(o, "partition_count", None)),
    }
    if kind == "DeepSpeedZeroOptimizer":
        flats = []
        for params, flat in zip(o.round_robin_bit16_groups, o.bit16_groups_flat):
            es = flat.element_size()
            flats.append([[e.param_names[p], (p.data_ptr() - flat.data_ptr()) // es, p.numel()] for p in params])
        lay.update(zero_stage_enum=2 if o.partition_gradients else 1, flat_params=flats,
                   group_paddings=[int(x) for x in o.groups_padding],
                   param_alignment_paddings=_plain(o.round_robin_bit16_padding),
                   elastic_checkpoint=bool(o.elastic_checkpoint),
                   param_slice_mappings=[[[n, int(a.numel), int(a.start)] for n, a in g.items()]
                                         for g in o._param_slice_mappings])
    elif kind == "DeepSpeedZeroOptimizer_Stage3":
        # the sub-groups (one flat master each) depend on the data-parallel size: re-partitioning regroups them
        lay.update(zero_stage_enum=3, sub_group_size=int(o.sub_group_size),
                   sub_group_to_group=[int(o.sub_group_to_group_id[j]) for j in range(len(o.fp16_groups))])
    return lay


def _plain(obj: Any) -> Any:
    """JSON-able copy of config-like data (DeepSpeed enums become their values)."""
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "value"):
        return _plain(obj.value)
    return str(obj)
