"""Launching a protected job: the two launchers and everything around their workers, one module per concept.

- :mod:`.local`       :class:`LocalLauncher`: N simulated nodes on one host, one holder each, whole-group
                      restarts (``shardsafe demo`` and the tests)
- :mod:`.elastic`     :class:`~.elastic.ElasticLauncher`: ``shardsafe launch``, torch elastic (torchrun) on
                      simulated nodes, one holder and one agent per node
- :mod:`.agent`       one node's torchrun agent with job-wide attempt numbers (``shardsafe agent``)
- :mod:`.controller`  the job's controller: rendezvous/control store, progress watchdog, launcher events
- :mod:`.incidents`   the incident book: one event stream per attempt from many reporters' facts (pure)
- :mod:`.markers`     the run directory's plain-file protocol: completion markers, notifications
- :mod:`.holders`, :mod:`.signals`
                      what both launchers share: holder checks, environment and kill; stop on a signal
- :mod:`.prewarm`     the fork server: trainers forked from a process that imported the heavy modules once
- :mod:`.presets`     what it preloads: ``--preload deepspeed|megatron|hf`` or a module list
- :mod:`.discovery`   rank, world size and node from torchrun, SLURM or MPI (called by trainers)
- :mod:`.faults`      deterministic fault injection (``SHARDSAFE_INJECT``), for trainers, holders and launchers
- :mod:`.errors`      :class:`~.errors.LaunchError` and the commands' exit codes
- :mod:`.cli`         ``shardsafe launch | agent | control`` (``python -m shardsafe.launch`` too)

The local launcher (:class:`LocalLauncher`, :class:`LaunchConfig`, :class:`LaunchResult`) and the fork server's
presets (``PRELOAD_DEEPSPEED``, ``PRELOAD_MEGATRON``, ``PRELOAD_HF``, :func:`preload_modules`) are importable from
here, the path docs/operations.md gives; everything else from its module. They load on first use (PEP 562), as
in :mod:`shardsafe.tor`: trainers and holders import :mod:`.faults`, :mod:`.discovery` or
:mod:`.markers` at start without the launchers, and ``python -m shardsafe.launch.prewarm`` runs a module the
package has not imported yet.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "local": ("LaunchConfig", "LaunchResult", "LocalLauncher"),
    "presets": ("PRELOAD_DEEPSPEED", "PRELOAD_MEGATRON", "PRELOAD_HF", "preload_modules"),
}
_WHERE = {name: mod for mod, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'shardsafe.launch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = sorted(_WHERE)
