"""The run directory's plain-file protocol: completion markers and notifications to the controller.

A rank that finished writes ``RUN_DIR/markers/rank{R}.done`` as its very last act (a launcher must not take
``srun``'s exit status as proof that every rank finished); a script tells the job's controller about a lost
node or the job's end by dropping a JSON file into ``RUN_DIR/control``. Plain files, written atomically, so
bash scripts and trainers use them without a store client; nothing here imports torch (the CLI helpers
``shardsafe control notify`` and the trainers' ``mark_rank_done`` stay fast).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

from .. import env
from ..errors import ConfigError

CONTROL_DIR = "control"     # RUN_DIR/control: notifications from scripts to the controller
MARKER_DIR = "markers"      # RUN_DIR/markers/rank{R}.done: written by a rank that finished
LOG_DIR = "logs"


def _atomic_write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def mark_rank_done(run_dir: str | None = None, rank: int | None = None, **info: Any) -> Optional[str]:
    """Write ``RUN_DIR/markers/rank{R}.done`` (JSON: rank, node, attempt, t). Call it as the very last
    thing a rank does after finishing: a launcher must not take the exit status of ``srun`` as proof
    that every rank finished (a rank on a crashed node may never report one). No-op without a run dir."""
    run_dir = run_dir if run_dir is not None else env.get(env.RUN_DIR)
    if not run_dir:
        return None
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    path = os.path.join(run_dir, MARKER_DIR, f"rank{rank}.done")
    _atomic_write(path, {"rank": rank, "node": env.get(env.NODE) or None,
                         "attempt": env.get(env.ATTEMPT) or None, "t": time.time(), **info})
    return path


def done_ranks(run_dir: str) -> set[int]:
    d = os.path.join(run_dir, MARKER_DIR)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return set()
    return {int(n[4:-5]) for n in names if n.startswith("rank") and n.endswith(".done") and n[4:-5].isdigit()}


NOTIFICATIONS = ("node_lost", "job_end", "resize")


def notify(run_dir: str, what: str, **fields: Any) -> str:
    """Leave a notification for the job's controller (``node_lost`` with ``node``; ``job_end`` with ``ok``;
    ``resize`` with ``from_dp``, ``to_dp`` and ``world_size``: the script re-formed the job at another size)."""
    if what not in NOTIFICATIONS:
        raise ConfigError(f"unknown notification {what!r}: expected one of {', '.join(NOTIFICATIONS)}")
    name = f"{what}.{time.time_ns()}.{os.getpid()}.json"
    path = os.path.join(run_dir, CONTROL_DIR, name)
    _atomic_write(path, {"what": what, "t": time.time(), **fields})
    return path
