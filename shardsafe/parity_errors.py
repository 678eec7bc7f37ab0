"""The erasure-coding errors: the codec contract (shardsafe.parity) and its backends (kernels/) raise these.

A module of its own, imported by both, so that the backends need nothing else of the codec module.
:class:`ParityError` derives from :class:`shardsafe.errors.ShardsafeError` alone (its builtin base was plain
Exception, which ShardsafeError already is); the subclasses keep their ValueError/RuntimeError.
"""
from __future__ import annotations

from .errors import ShardsafeError

__all__ = ["ParityError", "InvalidParameter", "InvalidFragment", "InsufficientFragments", "BackendUnavailable",
           "KernelError"]


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
