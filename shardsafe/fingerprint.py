"""Run identity: what makes a snapshot this run's, so that another run's state is never applied.

A job id says where snapshots live; it does not say whose they are. Two job steps of one allocation, a reused
``--rdzv-id``, or the same command line after the model or the hyperparameters changed find the same holders and
the same persistent directory. Every snapshot therefore carries the run's **fingerprint**, and a restore whose
fingerprint differs from the starting run's is refused before anything is applied (``resume: "auto"``), naming
the first field that differs.

The fields, in the order they are compared (each adapter fills them, shardsafe/snapshot/state.py
``StateAdapter.fingerprint``):

``config``
    the framework's configuration without the ``shardsafe`` block and without what may change between two
    attempts of one run (:data:`VOLATILE_CONFIG_KEYS`: logging, monitoring, checkpoint paths, and the schedule's
    length, so that a resumed run with a longer schedule still resumes).
``model``
    every parameter's name, shape, dtype and whether it trains (stored as a digest with a count).
``layout``
    the parallel layout (data/tensor/pipeline/expert parallel sizes, ZeRO stage, the optimizer wrapper).
``optimizer``
    the optimizer's class and every parameter group's hyperparameters when the engine was built, before any
    step or restore: the learning rate the program asked for, betas, eps, weight decay, ...
``batch``
    the global batch and the micro-batch (samples), where the adapter knows them.

What is not compared: the code itself (a change that keeps these fields), the data, the schedule's length
(``train_iters``, ``total_num_steps``: a longer run resumes), and the logging and checkpointing settings.

**Another data-parallel size is the same run** when the global batch is kept: a job that lost a node continues
on fewer data-parallel ranks with more gradient accumulation (and grows back later), and its snapshots
re-partition (shardsafe/snapshot/reshard_restore.py). So the keys that follow the data-parallel size at a fixed
global batch (:data:`DATA_PARALLEL_KEYS`: the data-parallel size and rank, the gradient accumulation steps) are
compared apart: ``config`` and ``layout`` that differ only there are the same, provided both fingerprints carry
``batch`` and it is equal. A different global batch or micro-batch is another run, named under ``batch``; a
different model, optimizer, tensor/pipeline layout or any other setting is another run as before.
``resume: "force"`` applies a snapshot whose fingerprint differs (the differences are logged); ``resume:
"never"`` starts fresh and drops the old versions.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import math
from typing import Any, Mapping, Optional

FIELDS = ("config", "model", "layout", "optimizer", "batch")
"""The fingerprint's fields, in the order a difference is named."""

DATA_PARALLEL_KEYS = {"config": frozenset({"gradient_accumulation_steps"}),
                      "layout": frozenset({"dp_world_size", "dp", "dp_size"})}
"""Top-level keys of a field that change with the data-parallel size while the global batch stays (DeepSpeed's
``gradient_accumulation_steps`` and ``dp_world_size``, Megatron's ``dp``/``dp_size`` coordinates)."""

VOLATILE_CONFIG_KEYS = frozenset({
    "shardsafe", "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "tensorboard",
    "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler", "monitor_config", "checkpoint", "timers",
    "total_num_steps", "train_iters", "lr_decay_iters", "lr_wsd_decay_iters", "save", "load", "save_interval",
    "exit_interval", "exit_duration_in_mins", "exit_signal_handler", "log_interval", "eval_interval", "eval_iters",
    "tensorboard_dir", "wandb_project", "wandb_exp_name", "wandb_save_dir",
})
"""Keys (at any depth of the config) that may differ between two attempts of one run: logging and monitoring,
checkpoint locations and intervals, and the schedule's length."""

SMALL = 8192
"""A field whose canonical JSON is at most this long is kept whole in every snapshot (so a difference can be
named down to its key); a longer one is kept as its digest and a summary."""


def _canonical(value: Any) -> str:
    return json.dumps(plain(value), sort_keys=True, separators=(",", ":"))


def plain(obj: Any) -> Any:
    """``obj`` as JSON values that are the same in every process of the same program: dataclasses (Megatron's
    TransformerConfig, OptimizerConfig) as dicts, enums as their values, functions and classes as their qualified
    names, a ``functools.partial`` as its function and arguments; any other object as its type's name (never a
    ``repr`` with a memory address)."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, enum.Enum):
        return plain(obj.value)
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((plain(v) for v in obj), key=repr)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name, None)) for f in dataclasses.fields(obj)}
    if isinstance(obj, functools.partial):
        return {"partial": plain(obj.func), "args": plain(obj.args), "kwargs": plain(obj.keywords)}
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"{getattr(obj, '__module__', '')}.{obj.__qualname__}"
    if type(obj).__module__ == "torch" and type(obj).__name__ == "dtype":
        return str(obj)
    return f"<{type(obj).__module__}.{type(obj).__qualname__}>"


def strip_volatile(config: Any) -> Any:
    """``config`` without :data:`VOLATILE_CONFIG_KEYS`, at any depth."""
    if isinstance(config, Mapping):
        return {str(k): strip_volatile(v) for k, v in config.items() if str(k) not in VOLATILE_CONFIG_KEYS}
    if isinstance(config, (list, tuple)):
        return [strip_volatile(v) for v in config]
    return config


def make(fields: Mapping[str, Any]) -> dict[str, dict]:
    """The fingerprint stored in every manifest: per field its digest, and its value when small (else, for a
    list such as the model's parameters, how many entries it has)."""
    out = {}
    for name in FIELDS:
        if name not in fields:
            continue
        text = _canonical(fields[name])
        entry: dict[str, Any] = {"digest": _digest(text)}
        scaled = _without_data_parallel(name, fields[name])
        if scaled is not None:   # what stays when only the data-parallel size changes
            entry["digest_any_dp"] = _digest(_canonical(scaled))
        if len(text) <= SMALL:
            entry["value"] = json.loads(text)
        elif isinstance(fields[name], (list, tuple)):
            entry["summary"] = f"{len(fields[name])} entries"
        out[name] = entry
    return out


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _without_data_parallel(name: str, value: Any) -> Optional[dict]:
    """``value`` without the keys :data:`DATA_PARALLEL_KEYS` names for field ``name`` (None: none of them there)."""
    keys = DATA_PARALLEL_KEYS.get(name)
    if not keys or not isinstance(value, Mapping) or not keys & set(value):
        return None
    return {k: v for k, v in value.items() if k not in keys}


def _first_difference(then: Any, now: Any, path: str = "") -> str:
    if isinstance(then, dict) and isinstance(now, dict):
        for k in sorted(set(then) | set(now)):
            if k not in then:
                return f"{path}{k} is new ({_short(now[k])})"
            if k not in now:
                return f"{path}{k} was {_short(then[k])} and is gone"
            if then[k] != now[k]:
                return _first_difference(then[k], now[k], f"{path}{k}.")
    if isinstance(then, list) and isinstance(now, list):
        if len(then) != len(now):
            return f"{path.rstrip('.') or 'the list'} had {len(then)} entries, now {len(now)}"
        for i, (a, b) in enumerate(zip(then, now)):
            if a != b:
                return _first_difference(a, b, f"{path}{i}.")
    return f"{path.rstrip('.') or 'the value'} was {_short(then)}, now {_short(now)}"


def _short(v: Any) -> str:
    text = json.dumps(v, default=repr)
    return text if len(text) <= 120 else text[:117] + "..."


def differences(then: Optional[Mapping[str, Any]], now: Mapping[str, Any]) -> list[str]:
    """How a snapshot's fingerprint ``then`` differs from the starting run's ``now``, first field first (empty:
    the same run). A run without a fingerprint (an adapter that gives none) compares equal to anything."""
    if not now:
        return []
    if not then:
        return ["the snapshot carries no run fingerprint (taken by a shardsafe that did not record one)"]
    # Another data-parallel size is this run only where both say which global batch they train with.
    any_dp = then.get("batch") is not None and now.get("batch") is not None
    out = []
    for name in FIELDS:
        a, b = then.get(name), now.get(name)
        if b is None or (a is not None and a.get("digest") == b.get("digest")):
            continue
        if name == "batch" and a is None:
            continue   # a snapshot from before the batch was recorded: compared as before (no size change allowed)
        if any_dp and a is not None and a.get("digest_any_dp") and a.get("digest_any_dp") == b.get("digest_any_dp"):
            continue   # only the data-parallel size and the accumulation that keeps the global batch differ
        if a is None:
            out.append(f"{name}: not recorded in the snapshot")
        elif "value" in a and "value" in b:
            keys = DATA_PARALLEL_KEYS.get(name, ()) if any_dp else ()
            va, vb = a["value"], b["value"]
            if keys and isinstance(va, dict) and isinstance(vb, dict):   # name what differs besides the size
                va, vb = ({k: v for k, v in x.items() if k not in keys} for x in (va, vb))
                if va == vb:
                    va, vb = a["value"], b["value"]
            out.append(f"{name}: {_first_difference(va, vb)}")
        else:
            out.append(f"{name}: {a.get('summary', 'digest ' + a['digest'])} in the snapshot, "
                       f"{b.get('summary', 'digest ' + b['digest'])} now")
    return out
