"""Megatron adapter: shardsafe for megatron-core training loops and for Megatron-LM's ``pretrain``.

One module per concept; the adapter's public names (``__all__``) are importable from ``shardsafe.adapters.megatron``:
  * :mod:`.state`: :class:`MegatronStateAdapter`, a rank's Megatron state as a ``RankState`` and back,
    in place (``capture``/``apply``), and its functional form ``snapshot_state``/``apply_state``.
  * :mod:`.state_checks`: what is checked before state moves: ``check_supported`` (unsupported setups
    rejected up front), ``rank_coordinates``/``parity_coordinates`` (the parallel layout), ``validate``.
  * :mod:`.core_api`: a megatron-core loop of your own: ``protect``, or ``restore`` once and ``snapshot``
    after every step, ``close``; ``default_runtime_factory`` and ``wrap_optimizer_step``.
  * :mod:`.hooks`: Megatron-LM's loop: ``pretrain`` (drop-in), ``install_hooks``, ``protected_pretrain``.
  * :mod:`.args`: the ``--shardsafe-*`` flags (``add_arguments``, ``config_from_args``).
  * :mod:`.prewarm`: start-up work a fork server does once (Megatron-LM's tokenizers).
  * :mod:`.inplace`: megatron-core's parallel state, cleared on a rank that restarts in place.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "MegatronStateAdapter": "state", "SnapshotMismatch": "state", "snapshot_state": "state", "apply_state": "state",
    "Protection": "core_api", "protect": "core_api", "restore": "core_api", "snapshot": "core_api", "close": "core_api",
    "Restored": "core_api", "protection_of": "core_api", "wrap_optimizer_step": "core_api",
    "default_runtime_factory": "core_api",
    "rank_coordinates": "state_checks", "parity_coordinates": "state_checks", "check_supported": "state_checks",
    "FORMAT": "state_checks",
    "install_hooks": "hooks", "pretrain": "hooks", "protected_pretrain": "hooks",
    "add_arguments": "args", "config_from_args": "args",
    "BaseRuntime": "shardsafe.runtime",
}
# the runtime wiring docs/megatron.md describes, and the entry the automatic activation calls, are among them
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """The public names load their module on first use: a fork server that preloads Megatron-LM's tokenizers
    (:mod:`.prewarm`) for unprotected trainers must not import the runtime with it."""
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'shardsafe.adapters.megatron' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod if "." in mod else f".{mod}", __name__), name)
    globals()[name] = value   # later lookups skip __getattr__
    return value
