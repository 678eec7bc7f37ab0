"""`shardsafe export`: write a committed snapshot as the framework's own checkpoint.

Modules: :mod:`.sources` (open one verified version of every rank from the persistent tier or the live holders),
:mod:`.replay` (the job's own command run once more so that the framework writes the export itself; the
``shardsafe export`` command), and, framework glue, :mod:`shardsafe.adapters.deepspeed.export` (DeepSpeed's checkpoint
files assembled offline, and ``apply_client_state``).

The way back from shardsafe to plain DeepSpeed: ``shardsafe export --format deepspeed SRC DST``
reads one committed version of every rank (from the persistent tier or from the live holders),
verifies every checksum, and writes the directory ``engine.save_checkpoint(DST)`` would have
written at that iteration (``latest``, ``global_stepN/`` with the model-states and per-rank ZeRO
optimizer files) -- so a vanilla ``engine.load_checkpoint(DST)`` resumes from it.

The files are assembled without an engine from what the adapter records in every manifest
(``meta["ds_checkpoint"]``: parameter names, shapes and offsets in the flat ZeRO groups, buffer
names, the optimizer's bookkeeping, the DeepSpeed config). DeepSpeed checkpoints are pickles by
DeepSpeed's own design; they are written here for the user's own framework to read, never read by
shardsafe.

What DeepSpeed's checkpoint has no place for -- the per-rank RNG states, the engine's
``micro_steps`` and module buffers that differ between ranks (DeepSpeed keeps rank 0's) -- goes into the client state under ``"shardsafe"``; :func:`apply_client_state`
puts it back after ``load_checkpoint`` (plain DeepSpeed restores neither for its own checkpoints).
"""
from __future__ import annotations

import importlib
from typing import Any

# ``shardsafe.export.apply_client_state``, a public path (docs/architecture.md), loaded on first use: it is the
# DeepSpeed writer's, framework glue in adapters/ that imports this package's sources. Everything else is imported
# from its module (:mod:`.sources`, :mod:`.replay`, :mod:`shardsafe.adapters.deepspeed.export`).
_WHERE = {"apply_client_state": "shardsafe.adapters.deepspeed.export"}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'shardsafe.export' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
