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
"""
from __future__ import annotations

from .args import add_arguments, config_from_args
from shardsafe.runtime import BaseRuntime

from .core_api import (Protection, Restored, close, default_runtime_factory, protect, protection_of, restore, snapshot,
                       wrap_optimizer_step)
from .hooks import install_hooks, pretrain, protected_pretrain
from .state import MegatronStateAdapter, SnapshotMismatch, apply_state, snapshot_state
from .state_checks import FORMAT, check_supported, parity_coordinates, rank_coordinates

__all__ = [
    "MegatronStateAdapter", "SnapshotMismatch", "BaseRuntime", "Protection", "protect",
    "restore", "snapshot", "close", "Restored", "protection_of",
    "snapshot_state", "apply_state", "rank_coordinates", "parity_coordinates", "check_supported",
    "wrap_optimizer_step", "install_hooks", "pretrain", "add_arguments", "config_from_args", "FORMAT",
    # the runtime wiring docs/megatron.md describes, and the entry the automatic activation calls
    "default_runtime_factory", "protected_pretrain",
]
