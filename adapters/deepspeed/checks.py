"""What the DeepSpeed adapter checks before it protects an engine: setups whose state it cannot restore exactly are
refused at ``initialize`` with a message naming the setting (:func:`check_supported`), and the LR scheduler's
state is taken as plain data (:func:`scheduler_state`), which is how the snapshot stores it (JSON, no pickle)."""
from __future__ import annotations

import json
from typing import Any

from shardsafe.config import ConfigError
from shardsafe.payload.manifest import to_jsonable

SUPPORTED = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer")
"""Optimizer wrappers whose state is partitioned over data-parallel ranks (what shardsafe snapshots)."""


def check_supported(engine: Any) -> None:
    """Reject configurations shardsafe cannot protect yet, naming the setting."""
    name = type(engine.optimizer).__name__
    if name not in SUPPORTED:
        stage = engine.zero_optimization_stage()
        # Without ZeRO (and outside BF16_Optimizer) every data-parallel rank holds the whole optimizer state:
        # DeepSpeed's FP16_Optimizer (fp16, or bf16 without a pipeline) or the bare torch optimizer (fp32).
        raise ConfigError(f"shardsafe protects partitioned optimizer state: ZeRO stages 1-3 and BF16_Optimizer (bf16 "
                          f"with zero_optimization.stage=0 under a PipelineModule, or stage 1 with "
                          f"data_types.grad_accum_dtype=fp32); this engine runs zero_optimization.stage={stage} with "
                          f"{name}, whose state is replicated on every data-parallel rank. Set "
                          f"zero_optimization.stage to 1, 2 or 3, or set shardsafe.enabled=false.")
    zc = engine._config.zero_config
    for what, sub in (("offload_optimizer", zc.offload_optimizer), ("offload_param", zc.offload_param)):
        dev = getattr(getattr(sub, "device", None), "value", getattr(sub, "device", None))
        if dev == "nvme":
            raise ConfigError(f"shardsafe does not protect zero_optimization.{what}.device=nvme (state lives on "
                              "NVMe, not in memory); use device cpu or none, or set shardsafe.enabled=false.")
    sd = scheduler_state(engine.lr_scheduler)
    try:
        json.dumps(to_jsonable(sd))
    except (TypeError, ValueError) as e:
        bad = sorted(k for k, v in (sd or {}).items() if not _jsonable(v)) if isinstance(sd, dict) else []
        raise ConfigError(f"the LR scheduler {type(engine.lr_scheduler).__name__} has state that is not plain data "
                          f"({', '.join(bad) or e}); shardsafe stores scheduler state as JSON and cannot restore "
                          "it. Use a DeepSpeed or torch scheduler (LambdaLR with any callables is fine), or set "
                          "shardsafe.enabled=false.") from None


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(to_jsonable(v))
        return True
    except (TypeError, ValueError):
        return False


def scheduler_state(sched: Any) -> Any:
    """The scheduler's ``state_dict`` as shardsafe stores it. LambdaLR / MultiplicativeLR (HF's schedulers) keep
    each lr_lambda's ``__dict__`` there (None for a plain function or lambda); a callable whose ``__dict__`` is
    not plain data is stored as None, so restoring keeps the callable the restarted program built again (the same
    one: it is rebuilt from the program's own arguments), and everything else of the state is restored."""
    if sched is None:
        return None
    sd = sched.state_dict()
    lambdas = sd.get("lr_lambdas") if isinstance(sd, dict) else None
    if isinstance(lambdas, list) and not _jsonable(lambdas):
        sd = {**sd, "lr_lambdas": [x if _jsonable(x) else None for x in lambdas]}
    return sd
