"""Start-up work of a DeepSpeed trainer that a fork server does once for every trainer it forks.

Listed in ``PRELOAD_DEEPSPEED`` as ``shardsafe.adapters.ds_prewarm:remember_cpu_info`` and
``...:probe_compatible_ops`` (shardsafe/launch/prewarm.py calls them after the imports, before it forks anything).

DeepSpeed's op builders ask py-cpuinfo for the CPU's vendor and SIMD flags (``OpBuilder.cpu_arch`` and
``simd_width``, each a call of ``cpuinfo.get_cpu_info()``) every time a process loads one of its CPU ops:
FusedAdam's CPU build (``"AdamW"`` without ``torch_adam``, DeepSpeed's default optimizer), and DeepSpeedCPUAdam /
CPULion / CPUAdagrad (``offload_optimizer``, on GPU nodes too); DeepSpeedCPUAdam's constructor asks once more.
``get_cpu_info()`` starts a Python subprocess each time: 1.15 s here, so a trainer loading FusedAdam spent 2.3 s
in it, most of its restart (bench/restart_bench.py --optimizer fused-adamw: recovery 3.29 s, 0.69 s with the
answer remembered). The answer cannot change between the server's start and a fork on the same host, so the
server asks once and its trainers get a copy of that answer.
"""
from __future__ import annotations

import copy


def remember_cpu_info() -> str:
    """Ask py-cpuinfo once and make ``cpuinfo.get_cpu_info()`` return a copy of that answer in this process and
    every process forked from it (DeepSpeed imports the function at call time: ``from cpuinfo import
    get_cpu_info``). Returns a line for the fork server's log."""
    import cpuinfo
    info = cpuinfo.get_cpu_info()
    if not info.get("flags"):
        # py-cpuinfo returns {} when its subprocess fails: leave the function alone, DeepSpeed then falls back to
        # lscpu itself (OpBuilder._backup_cpuinfo), as in a cold start.
        return "py-cpuinfo found no CPU flags; not remembered"

    def get_cpu_info() -> dict:
        return copy.deepcopy(info)

    get_cpu_info.__doc__ = "py-cpuinfo's answer, asked once by the fork server (shardsafe.adapters.ds_prewarm)."
    cpuinfo.get_cpu_info = get_cpu_info
    return f"py-cpuinfo asked once ({info.get('brand_raw', 'unknown CPU')}, {len(info['flags'])} flags)"


def probe_compatible_ops() -> str:
    """Run DeepSpeed's op-compatibility probe once, on the CPU accelerator, so that every forked trainer finds its
    answer (``deepspeed.ops.__compatible_ops__``, computed on first access and kept in the module) instead of
    running it: ``deepspeed.comm`` asks for it when the process group comes up, and the probe compiles a test
    program for async_io with the system's C compiler, 38 ms of each trainer's start here. On a GPU the probe
    queries the device, which the fork server must not touch (a forked child cannot use a CUDA context made
    before the fork): not probed there, the trainers probe as a cold start does. Returns a line for the fork
    server's log."""
    from deepspeed.accelerator import get_accelerator
    name = get_accelerator().device_name()
    if name != "cpu":
        return f"not probed on the {name} accelerator (the probe queries the device); each trainer probes"
    import deepspeed.ops
    ops = deepspeed.ops.__compatible_ops__
    return f"DeepSpeed's op compatibility probed once ({sum(1 for v in ops.values() if v)} of {len(ops)} compatible)"
