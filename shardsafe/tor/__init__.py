"""Training Overhead Ratio (TOR): the run's event log, TOR, where the lost time went, the model, the projection.

TOR = T_opt / T_obs (Lu et al., arXiv 2408.07482): the time an ideal, failure-free, overhead-free system needs
for the work this job finally kept, over the wall time the job took. docs/tor.md specifies the event format and
every equation. One module per concept:

- :mod:`.events`      the event-log contract (format, writer, reader, tail, null log); stdlib only, so the
                      holder daemon and trainers import it without the accounting, report or plot
- :mod:`.records`     the report's records (options, failures, attempts, phases, model, report, categories)
- :mod:`.accounting`  :func:`compute_tor`: TOR of one run and its exact breakdown
- :mod:`.model`       the first-order model of one run: :func:`predict_tor`, :func:`young_interval`
- :mod:`.report`      JSON and text output; :mod:`.plot` the timeline PNG
- :mod:`.running`     :class:`RunningTor`, logged by the trainer while it trains
- :mod:`.classes`, :mod:`.project`, :mod:`.profiles`, :mod:`.simulate`
                      TOR at cluster scale: failure classes, the closed-form projection, published failure
                      profiles and the Monte Carlo simulator that checks the closed form
- :mod:`.inputs`      rates and costs from files, a bench JSON or a run's events (``project --from``);
                      :mod:`.projection_report` the projection's and the simulation's JSON and text
- :mod:`.growth`      control-plane costs fitted as functions of the rank count from the many-rank bench
                      (``project --from-bench``)
- :mod:`.cli`         ``shardsafe tor report|project|simulate`` (``python -m shardsafe.tor`` too)

Every public name of the former single module ``shardsafe.tor`` is re-exported here, so importers need not
change; new code that only writes or reads events should import :mod:`shardsafe.tor.events`.
"""
from __future__ import annotations

import importlib
import os  # noqa: F401 - kept as an attribute: tests patch tor.os.write, as they did on the single module
from typing import Any

from .errors import TorError
from .events import (ENV_ATTEMPT, ENV_JOB_START, ENV_NODE, EVENT_KINDS, EVENTS_FILE, MAX_LINE_BYTES, SOURCES, TIERS,
                     EventLog, JsonlTail, NullEventLog, check_event, read_events)

# Everything beyond the event log loads on first use (PEP 562), so that `import shardsafe.tor.events` (the
# holder daemon, the trainers at process start) does not pull in the accounting, report, plot and CLI.
_LAZY = {
    "records": ("CATEGORIES", "Attempt", "Failure", "Segment", "TorModel", "TorOptions", "TorReport"),
    "model": ("predict_tor", "young_interval"),
    "accounting": ("compute_tor",),
    "report": ("report_dict", "report_text"),
    "plot": ("plot_timeline",),
    "running": ("RunningTor",),
    "cli": ("main", "register_cli"),
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


__all__ = [
    "EVENTS_FILE", "EVENT_KINDS", "SOURCES", "TIERS", "CATEGORIES", "MAX_LINE_BYTES",
    "ENV_ATTEMPT", "ENV_NODE", "ENV_JOB_START",
    "TorError", "EventLog", "NullEventLog", "JsonlTail", "read_events", "check_event",
    "TorOptions", "Failure", "Attempt", "Segment", "TorModel", "TorReport", "compute_tor",
    "young_interval", "predict_tor",
    "report_dict", "report_text", "plot_timeline", "RunningTor", "register_cli", "main",
]
