"""Which slice of the model a DeepSpeed rank's state is (pipeline stage, tensor-parallel slice, experts), and
its coordinates for parity placement. Recorded in every snapshot and checked at restore (adapters/deepspeed.py).
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
