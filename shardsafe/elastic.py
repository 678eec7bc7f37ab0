"""Compatibility: the former single module of ``shardsafe launch``, now split into the package
:mod:`shardsafe.launch` (errors, markers, incidents, controller, agent, elastic, cli).

Every name this module defined is re-exported here, so ``from shardsafe.elastic import ...`` keeps working;
new code imports from the module that defines the name. ``python -m shardsafe.elastic launch|agent|control``
still runs the commands (sbatch scripts written before the split); shardsafe's own callers use
``python -m shardsafe.launch``. Patch a name where it is looked up (its defining module), not here.
"""
from __future__ import annotations

import sys

from .launch.agent import AgentOptions, _AgentHooks, _start_fork_server, log, run_agent
from .launch.cli import (_add_agent_timing, _agent_options, _guarded, _script, _setup_logging, cmd_agent, cmd_control,
                         cmd_launch, main, register_cli)
from .launch.controller import Controller, Keys, ProgressTail, _store_client, attempt_base_from_log, publish, split_endpoint
from .launch.elastic import ElasticConfig, ElasticLauncher, LaunchResult, _kill_tree
from .launch.errors import EXIT_FATAL, LaunchError
from .launch.incidents import PRIORITY, Emit, Evidence, IncidentBook, _AttemptState, exit_evidence
from .launch.markers import CONTROL_DIR, LOG_DIR, MARKER_DIR, _atomic_write, done_ranks, mark_rank_done, notify
from .launch.presets import preload_modules as _preload_list   # --preload's parser (presets too)

__all__ = [
    "LaunchError", "EXIT_FATAL", "CONTROL_DIR", "MARKER_DIR", "LOG_DIR", "PRIORITY", "log",
    "_atomic_write", "mark_rank_done", "done_ranks", "notify",
    "Evidence", "_AttemptState", "Emit", "IncidentBook", "exit_evidence",
    "ProgressTail", "Keys", "_store_client", "split_endpoint", "publish", "attempt_base_from_log", "Controller",
    "AgentOptions", "_AgentHooks", "run_agent", "_start_fork_server",
    "ElasticConfig", "LaunchResult", "_kill_tree", "ElasticLauncher",
    "_setup_logging", "_script", "cmd_launch", "_agent_options", "_preload_list", "cmd_agent", "cmd_control",
    "_add_agent_timing", "_guarded", "register_cli", "main",
]

if __name__ == "__main__":
    sys.exit(main())
