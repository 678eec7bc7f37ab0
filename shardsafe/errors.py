"""The root of shardsafe's errors.

Every error shardsafe raises on purpose derives from :class:`ShardsafeError`, so ``except ShardsafeError``
catches what shardsafe raises and nothing else (a bug's TypeError, an interrupted system call, a torch error
pass through). Each concrete error also keeps its builtin base (ValueError, RuntimeError, OSError, ...), so an
existing ``except ValueError`` or ``except OSError`` keeps catching it: the builtin comes first among the bases,
``ShardsafeError`` after it, e.g. ``class HolderError(RuntimeError, ShardsafeError)``. What stays a builtin on
purpose: a ``TypeError`` for an argument of the wrong Python type (an adapter that is no ``StateAdapter``, a
metadata value JSON cannot hold), as Python's own functions raise it, and the ``OSError`` of a failed system
call, which shardsafe catches where it must (a snapshot that fails never takes training down).

The families live beside the code that raises them (docs/operations.md "Errors" lists them), except the
erasure-coding family below: the codec (:mod:`shardsafe.parity.codec`) and its backends in kernels/ both raise
it, and kernels/ sits below the codec, so the family lives here, where both can import it without importing
each other. This module imports nothing of shardsafe: the backends in kernels/ and the holder daemon import it.
"""
from __future__ import annotations

__all__ = ["ShardsafeError", "ConfigError", "UsageError", "DeviceError", "InternalError", "ParityError", "InvalidParameter", "InvalidFragment", "InsufficientFragments",
           "BackendUnavailable", "KernelError"]


class ShardsafeError(Exception):
    """Base of every error shardsafe raises on purpose; the concrete errors also keep their builtin base."""


# --- families every layer raises -------------------------------------------------------------------

class ConfigError(ValueError, ShardsafeError):
    """A shardsafe setting is malformed or cannot be honoured (also importable as shardsafe.config.ConfigError).

    A trainer that dies of it leaves a marker, and the launchers stop instead of restarting (shardsafe.fatal):
    every restart would end the same way."""


class UsageError(RuntimeError, ShardsafeError):
    """An API called in the wrong order or for objects it does not know (no protection for this optimizer,
    Megatron's parallel state not initialized yet); the message names the call to make first."""


class DeviceError(RuntimeError, ShardsafeError):
    """A CUDA runtime call shardsafe makes itself failed (registering holder memory for DMA)."""


class InternalError(RuntimeError, ShardsafeError):
    """One of shardsafe's own consistency checks failed: a bug. The message says what was expected; report it."""


# --- erasure coding (the codec contract and its kernels/ backends) ---------------------------------

class ParityError(ShardsafeError):
    """Base of every erasure-coding error (the codec and its backends)."""


class InvalidParameter(ParityError, ValueError):
    """A construction argument or an index argument is out of range or of the wrong type."""


class InvalidFragment(ParityError, ValueError):
    """A fragment buffer has the wrong type, dtype, layout, length or is not writable."""


class InsufficientFragments(ParityError):
    """Fewer than k fragments of a codeword survive: it cannot be rebuilt from memory."""


class BackendUnavailable(ParityError, RuntimeError):
    """The requested backend's library, device or Python package is missing."""


class KernelError(ParityError, RuntimeError):
    """A backend call failed at run time (e.g. a CUDA launch error)."""
