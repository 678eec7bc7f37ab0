"""Whether this interpreter has a package, found from its installed metadata without importing it.

The skip conditions of test modules run at collection; importing megatron.core to find out costs 3-4 s
each (it was three subprocesses, ~12 s of every `make test`). A package that is installed but broken
then fails its tests loudly instead of skipping them, which is what a broken venv should do.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util


def installed_version(dist: str, module: str) -> str | None:
    """The version of distribution *dist* if its top-level *module* is on sys.path (None otherwise), e.g.
    ``installed_version("megatron-core", "megatron.core")``. sys.path includes PYTHONPATH, so a side folder
    put first there (.venv/mcore-0.17.1) is what the trainers started from this environment import too."""
    try:
        if importlib.util.find_spec(module) is None:
            return None
        return importlib.metadata.version(dist)
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return None
