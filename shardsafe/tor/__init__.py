"""Training Overhead Ratio (TOR): the run's event log, TOR, where the lost time went, the model, the projection.

TOR = T_opt / T_obs (Lu et al., arXiv 2408.07482): the time an ideal, failure-free, overhead-free system needs
for the work this job finally kept, over the wall time the job took. docs/tor.md specifies the event format and
every equation. One module per concept:

- :mod:`.events`      the event-log contract (format, writer, reader, tail, null log); stdlib only, so the
                      holder daemon and trainers import it without the accounting, report or plot
- :mod:`.records`     the report's records (options, failures, attempts, phases, model, report, categories)
- :mod:`.accounting`  :func:`compute_tor`: TOR of one run and its exact breakdown; :mod:`.attempts` the
                      attempts and failures it reads, :mod:`.degraded` the attempts at a reduced data-parallel size
- :mod:`.model`       the first-order model of one run: :func:`predict_tor`, :func:`young_interval`
- :mod:`.report`      JSON and text output; :mod:`.plot` the timeline PNG
- :mod:`.running`     :class:`RunningTor`, logged by the trainer while it trains
- :mod:`.classes`, :mod:`.project`, :mod:`.profiles`, :mod:`.simulate`
                      TOR at cluster scale: failure classes, the closed-form projection, published failure
                      profiles and the Monte Carlo simulator that checks the closed form; :mod:`.shrink` the
                      shrink policy's closed form, :mod:`.policy` spares or shrink, side by side
- :mod:`.inputs`      rates and costs from files, a bench JSON or a run's events (``project --from``);
                      :mod:`.projection_report` the projection's and the simulation's JSON and text
- :mod:`.growth`      control-plane costs fitted as functions of the rank count from the many-rank bench
                      (``project --from-bench``)
- :mod:`.cli`         ``shardsafe tor report|project|simulate`` (``python -m shardsafe.tor`` too)

Importable from here: what docs/tor.md and the example trainers use (:class:`EventLog`, :func:`read_events`,
:func:`check_event`, :class:`RunningTor`) and what ``shardsafe demo`` and the CLI call (:func:`compute_tor`,
:func:`report_dict`, :func:`report_text`, :func:`register_cli`); everything else from its module. Code that only
writes or reads events imports :mod:`shardsafe.tor.events`.
"""
from __future__ import annotations

import importlib
from typing import Any

from .events import EventLog, check_event, read_events

# Everything beyond the event log loads on first use (PEP 562), so that `import shardsafe.tor.events` (the
# holder daemon, the trainers at process start) does not pull in the accounting, report, plot and CLI.
_LAZY = {
    "accounting": ("compute_tor",),
    "report": ("report_dict", "report_text"),
    "running": ("RunningTor",),
    "cli": ("register_cli",),
}
_WHERE = {name: mod for mod, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'shardsafe.tor' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = ["EventLog", "read_events", "check_event", "RunningTor", "compute_tor", "report_dict", "report_text",
           "register_cli"]
