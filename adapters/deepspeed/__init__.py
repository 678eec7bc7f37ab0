"""The DeepSpeed adapter: ``initialize`` (a drop-in for ``deepspeed.initialize``) and ``protect`` (what the automatic
activation calls), the engine hooks (:mod:`.engine`), the rank state of ZeRO-1/2/3 and BF16_Optimizer engines
(:mod:`.state`), and what they stand on: the parallel layout (:mod:`.layout`), the setups refused at initialize
(:mod:`.checks`), the program's own ``load_checkpoint`` resume (:mod:`.client_state`), the LR schedulers a program
steps itself (:mod:`.schedulers`), DeepSpeed's checkpoint files from snapshots (:mod:`.export`), re-partitioning to
another data-parallel size (:mod:`.reshard`), start-up work a fork server does once (:mod:`.prewarm`), model-parallel
RNG trackers (:mod:`.rng_trackers`), DeepSpeed's CPU Adam beta powers (:mod:`.cpu_adam_powers`) and its cached
process groups, forgotten on a rank that restarts in place (:mod:`.inplace`). The config as
DeepSpeed takes it is read by ``shardsafe.adapters.ds_config`` (standard library only: the activation hook reads it
before anything of this package is imported).

The public names below load their module on first use: a fork server that runs :mod:`.prewarm` for unprotected
trainers must not import the engine hooks and the runtime with it.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"initialize": "engine", "protect": "engine", "ShardsafeEngineHook": "engine", "config_from_ds": "engine",
          "DeepSpeedStateAdapter": "state", "COUNTERS": "state"}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'shardsafe.adapters.deepspeed' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value   # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
