"""The root of shardsafe's errors.

Every error shardsafe raises on purpose derives from :class:`ShardsafeError`, so ``except ShardsafeError``
catches what shardsafe raises and nothing else (a bug's TypeError, an interrupted system call, a torch error
pass through). Each concrete error also keeps its builtin base (ValueError, RuntimeError, OSError, ...), so an
existing ``except ValueError`` or ``except OSError`` keeps catching it: the builtin comes first among the bases,
``ShardsafeError`` after it, e.g. ``class HolderError(RuntimeError, ShardsafeError)``. Not yet covered: the
plain ValueError/RuntimeError that some argument checks raise directly (the TOR model's inputs, the launchers'
settings, the reference kernels' shapes); they are still builtins.

The families live beside the code that raises them (docs/operations.md "Errors" lists them). This module
imports nothing of shardsafe: the backends in kernels/ and the holder daemon import it.
"""
from __future__ import annotations

__all__ = ["ShardsafeError"]


class ShardsafeError(Exception):
    """Base of every error shardsafe raises on purpose; the concrete errors also keep their builtin base."""
