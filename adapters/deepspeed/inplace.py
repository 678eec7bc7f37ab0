"""DeepSpeed's module-level process groups, forgotten on a rank that restarts in place (shardsafe.inplace).

``deepspeed.utils.groups`` keeps the groups it made at module level: the world clone a ZeRO engine without an mpu
takes as its data-parallel group, the ZeRO parameter group, the expert and expert-data groups of MoE layers, the
mpu a program handed to ``deepspeed.initialize``. After an in-place restart those groups are destroyed; the next
attempt's ``deepspeed.initialize`` would find them cached and use them. DeepSpeed forgets them itself when its own
``deepspeed.comm.destroy_process_group()`` destroys the world (``groups._release_process_group_references``, in
DeepSpeed 0.18 and later); shardsafe destroys the groups through torch, so it calls that here, or, on a DeepSpeed
without it, resets the same names to what the module starts with.
"""
from __future__ import annotations

import sys

# What deepspeed.utils.groups starts with, for a DeepSpeed without _release_process_group_references.
_INITIAL = {"_WORLD_GROUP": None, "_ZERO_PARAM_INTRA_PARALLEL_GROUP": None, "_TENSOR_MODEL_PARALLEL_GROUP": None,
            "_MODEL_PARALLEL_GROUP": None, "_DATA_PARALLEL_GROUP": None, "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": None,
            "_MPU_TENSOR_MODEL_PARALLEL_RANK": None, "mpu": None, "mesh_device": None,
            "expert_tensor_parallel_world_size": 1}
_MAPS = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
         "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP")


def forget_groups() -> None:
    """Drop every process group ``deepspeed.utils.groups`` cached (nothing when DeepSpeed was never imported)."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(group=None)
        return
    for name, value in _INITIAL.items():
        if hasattr(groups, name):
            setattr(groups, name, value)
    for name in _MAPS:
        cached = getattr(groups, name, None)
        if isinstance(cached, dict):
            cached.clear()
    sp = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    for name in ("_SEQUENCE_PARALLEL_GROUP", "_SEQUENCE_DATA_PARALLEL_GROUP"):
        if sp is not None and hasattr(sp, name):
            setattr(sp, name, None)
