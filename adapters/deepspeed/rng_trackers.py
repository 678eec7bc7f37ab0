"""The model-parallel RNG trackers a DeepSpeed program may draw from, captured and restored with its rank state.

Tensor-parallel programs (Megatron-DeepSpeed, GPT-NeoX) run the dropout of their tensor-parallel regions under
a tracker's ``fork()``: a named RNG state per tensor-parallel rank, kept apart from torch's default generator.
Two implementations exist: DeepSpeed's ``deepspeed.checkpointing`` tracker (what Megatron-DeepSpeed configures
with ``--deepspeed-activation-checkpointing``, GPT-NeoX always) and megatron-core's. Only trackers whose module
the program has already imported are looked at (nothing is imported here), and only those with states: a
program that never seeded one has nothing to restore.
"""
from __future__ import annotations

import sys
from typing import Any, Mapping

import torch

# key -> module that defines get_cuda_rng_tracker()
TRACKER_MODULES = {
    "deepspeed": "deepspeed.runtime.activation_checkpointing.checkpointing",
    "megatron": "megatron.core.tensor_parallel.random",
}


def live_trackers() -> dict[str, Any]:
    """key -> tracker, for every seeded tracker of an imported module (one entry per tracker object: Megatron
    code configured for DeepSpeed's checkpointing returns DeepSpeed's tracker from its own function)."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for key, mod_name in TRACKER_MODULES.items():
        mod = sys.modules.get(mod_name)
        get = getattr(mod, "get_cuda_rng_tracker", None) if mod is not None else None
        if get is None:
            continue
        tracker = get()
        if id(tracker) in seen or not tracker.get_states():
            continue
        seen.add(id(tracker))
        out[key] = tracker
    return out


def _state_tensor(s: Any) -> torch.Tensor:
    # DeepSpeed and older megatron-core keep ByteTensors (replaced, never mutated, by fork()); newer megatron-core
    # keeps torch.Generator objects.
    return s.get_state() if isinstance(s, torch.Generator) else s


def capture(tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Put every live tracker's states into ``tensors`` as ``rng/tracker/<key>/<name>``; returns key -> names."""
    names: dict[str, list[str]] = {}
    for key, tracker in live_trackers().items():
        for name, s in tracker.get_states().items():
            tensors[f"rng/tracker/{key}/{name}"] = _state_tensor(s)
            names.setdefault(key, []).append(name)
    return names


def problems(saved: Mapping[str, list[str]] | None) -> list[str]:
    """Why the snapshot's trackers cannot be restored here (checked before any rank applies)."""
    live = live_trackers()
    out = []
    for key, names in (saved or {}).items():
        if key not in live:
            out.append(f"the snapshot has {key}'s model-parallel RNG tracker states ({', '.join(names)}) and this "
                       f"program has not seeded that tracker before deepspeed.initialize: seed it as the original run "
                       f"did (model_parallel_cuda_manual_seed) before the engine is built")
    return out


def apply(tensors: Mapping[str, torch.Tensor], saved: Mapping[str, list[str]] | None) -> None:
    """Set every tracker's states from the snapshot; states the snapshot does not name are kept."""
    live = live_trackers()
    for key, names in (saved or {}).items():
        tracker = live[key]
        states = dict(tracker.get_states())
        for name in names:
            t = tensors[f"rng/tracker/{key}/{name}"]
            cur = states.get(name)
            if isinstance(cur, torch.Generator):
                cur.set_state(t.clone())
            else:
                states[name] = t.clone()   # the snapshot's memory is not ours to keep
        tracker.set_states(states)


def client_states() -> dict[str, Any] | None:
    """The tracker states as Megatron-DeepSpeed saves them in a checkpoint's ``rng_state[i]['rng_tracker_states']``
    (its tracker's ``get_states()``), or None when no tracker is seeded."""
    live = live_trackers()
    if not live:
        return None
    return dict(next(iter(live.values())).get_states())
