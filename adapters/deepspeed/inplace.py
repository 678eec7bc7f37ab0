"""DeepSpeed's module-level process groups, forgotten on a rank that restarts in place (shardsafe.inplace).

``deepspeed.utils.groups`` keeps the groups it made at module level: the world clone a ZeRO engine without an mpu
takes as its data-parallel group, the ZeRO parameter group, the expert and expert-data groups of MoE layers, the
mpu a program handed to ``deepspeed.initialize``. After an in-place restart those groups are destroyed; the next
attempt's ``deepspeed.initialize`` would find them cached and use them. DeepSpeed forgets them itself when its own
``deepspeed.comm.destroy_process_group()`` destroys the world (``groups._release_process_group_references``, in
DeepSpeed 0.18 and later); shardsafe destroys the groups through torch, so it calls that here, or, on a DeepSpeed
without it, resets the same names to what the module starts with. The pipeline engine's point-to-point module keeps
its grid and groups too, and forgets them here. An abandoned engine that would outlive the attempt (through its
optimizer's gradient hooks) is taken apart as well.
"""
from __future__ import annotations

import sys
import types
import weakref
from typing import Any

# What deepspeed.utils.groups starts with, for a DeepSpeed without _release_process_group_references.
_INITIAL = {"_WORLD_GROUP": None, "_ZERO_PARAM_INTRA_PARALLEL_GROUP": None, "_TENSOR_MODEL_PARALLEL_GROUP": None,
            "_MODEL_PARALLEL_GROUP": None, "_DATA_PARALLEL_GROUP": None, "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": None,
            "_MPU_TENSOR_MODEL_PARALLEL_RANK": None, "mpu": None, "mesh_device": None,
            "expert_tensor_parallel_world_size": 1}
_MAPS = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
         "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP")


def forget_groups() -> None:
    """Drop every process group DeepSpeed cached at module level and take the abandoned engines apart (nothing when
    DeepSpeed was never imported)."""
    _forget_pipeline_groups()
    _take_engines_apart()
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


def _forget_pipeline_groups() -> None:
    """A PipelineEngine hands its grid (which holds the data-, pipe- and model-parallel groups) to
    ``deepspeed.runtime.pipe.p2p``, which keeps it at module level with the point-to-point groups and any sends in
    flight. Kept, those groups outlive the attempt: their sockets stay open, and a survivor of another stage blocked
    in a collective with this rank (the data-parallel all-gather of a BF16_Optimizer step) waits for it until its
    watchdog gives up restarting in place."""
    p2p = sys.modules.get("deepspeed.runtime.pipe.p2p")
    if p2p is None:
        return
    for name in ("_groups", "_grid"):
        if hasattr(p2p, name):
            setattr(p2p, name, None)
    pending = getattr(p2p, "_async", None)
    if isinstance(pending, list):
        pending.clear()


# The engines this process built and their parameters (weak: an engine's own teardown frees them as usual).
_ENGINES: list = []
_PARAMETERS: list = []
# What DeepSpeed's optimizers put on each low-precision parameter (deepspeed.utils.mixed_precision_linkage) and
# which keeps the attempt's groups and fp32 state alive.
_LINKS = ("_dp_group", "_hp_mapping", "get_full_hp_param", "get_full_hp_grad", "set_full_hp_param",
          "set_full_hp_grad", "load_hp_checkpoint_state", "_index_in_param_group")


def remember_engine(engine: Any) -> None:
    """Note ``engine`` and its parameters, to take them apart if the job restarts in place."""
    _ENGINES[:] = [r for r in _ENGINES if r() is not None]
    _PARAMETERS[:] = [r for r in _PARAMETERS if r() is not None]
    _ENGINES.append(weakref.ref(engine))
    module = getattr(engine, "module", None)
    if module is not None:
        _PARAMETERS.extend(weakref.ref(p) for p in module.parameters())


def _take_engines_apart() -> int:
    """Take the abandoned attempt's engines and parameters apart where they are still alive; how many engines were.

    ZeRO-1/2 and BF16_Optimizer register gradient hooks that close over the optimizer, on nodes of the autograd
    graph where the garbage collector cannot follow them, and link every low-precision parameter to its fp32
    fragment through the parameter's own attributes (its data-parallel group, the fragment, methods bound to the
    parameter itself). Left alone, the engine outlives the attempt with its fp32 state and process groups, whose
    sockets then stay open: a peer blocked in one of their collectives (the data-parallel all-gather of a
    BF16_Optimizer step, while this rank failed elsewhere) waited for this rank until its watchdog gave up
    restarting in place. The hooks are removed as DeepSpeed's ``engine.destroy()`` does, and the links stripped."""
    import torch.distributed as dist
    engines = [e for e in (r() for r in _ENGINES) if e is not None]
    params = [p for p in (r() for r in _PARAMETERS) if p is not None]
    _ENGINES.clear()
    _PARAMETERS.clear()
    for engine in engines:   # what engine.destroy() removes; it also talks to deepspeed.comm, already torn down
        optimizer = getattr(engine, "optimizer", None)
        for hook in getattr(optimizer, "_grad_acc_hooks", None) or ():
            hook.remove()
    for p in params:
        attrs = getattr(p, "__dict__", None)
        if not attrs:
            continue
        for name in [k for k, v in attrs.items() if k in _LINKS or isinstance(v, dist.ProcessGroup)
                     or (isinstance(v, types.MethodType) and v.__self__ is p)]:
            del attrs[name]
    return len(engines)
