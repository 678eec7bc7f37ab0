"""One exception root: every error shardsafe raises on purpose is a ShardsafeError and keeps its builtin base."""
import importlib
import inspect
import pickle
import pkgutil

import pytest

import shardsafe
import shardsafe.adapters
import shardsafe.kernels
from shardsafe.adapters.megatron.state import SnapshotMismatch
from shardsafe.config import ConfigError
from shardsafe.errors import DeviceError, InternalError, ShardsafeError, UsageError
from shardsafe.parity.exchange import ExchangeError
from shardsafe.export.sources import ExportError
from shardsafe.holder.client import HolderUnavailable
from shardsafe.holder.paths import ForeignHolder, HolderSecurityError, UnsafeHolderDir
from shardsafe.holder.protocol import BadFrame, HolderError, HolderFailure, ProtocolError
from shardsafe.jobid import AmbiguousJobId, JobConflict
from shardsafe.launch.discovery import DiscoveryError
from shardsafe.launch.errors import LaunchError
from shardsafe.launch.prewarm import PrewarmError
from shardsafe.payload.manifest import ManifestError
from shardsafe.errors import (BackendUnavailable, InsufficientFragments, InvalidFragment, InvalidParameter,
                                     KernelError, ParityError)
from shardsafe.persist import PersistError
from shardsafe.snapshot.reshard import ReshardError
from shardsafe.snapshot.restore import RestoreError
from shardsafe.parity.topology import TopologyError, Unrecoverable
from shardsafe.tor.errors import TorError

# Every error class of the package and the builtin base that `except` clauses (ours and users') rely on.
ERRORS = {
    ParityError: Exception, InvalidParameter: ValueError, InvalidFragment: ValueError,
    InsufficientFragments: Exception, BackendUnavailable: RuntimeError, KernelError: RuntimeError,
    ConfigError: ValueError, PersistError: OSError, ExportError: RuntimeError,
    AmbiguousJobId: ValueError, JobConflict: RuntimeError, RestoreError: RuntimeError,
    ProtocolError: RuntimeError, BadFrame: RuntimeError, HolderError: RuntimeError,
    HolderUnavailable: RuntimeError, ExchangeError: RuntimeError, TorError: ValueError,
    ManifestError: ValueError, TopologyError: ValueError, Unrecoverable: ValueError,
    DiscoveryError: RuntimeError, LaunchError: RuntimeError, PrewarmError: RuntimeError,
    HolderFailure: RuntimeError, SnapshotMismatch: ValueError, UsageError: RuntimeError, DeviceError: RuntimeError, InternalError: RuntimeError,
    HolderSecurityError: PermissionError, UnsafeHolderDir: PermissionError, ForeignHolder: PermissionError,
    ReshardError: ValueError,
}
# Subclasses of another shardsafe error, beside their family's root.
FAMILY = {InvalidParameter: ParityError, InvalidFragment: ParityError, InsufficientFragments: ParityError,
          BackendUnavailable: ParityError, KernelError: ParityError, BadFrame: ProtocolError,
          HolderError: HolderFailure, HolderUnavailable: HolderFailure, ProtocolError: HolderFailure,
          Unrecoverable: TopologyError, UnsafeHolderDir: HolderSecurityError, ForeignHolder: HolderSecurityError}


def test_the_root_is_a_plain_exception():
    assert ShardsafeError.__bases__ == (Exception,)


@pytest.mark.parametrize("cls", list(ERRORS), ids=lambda c: c.__name__)
def test_each_error_has_the_root_and_keeps_its_builtin_base(cls):
    assert issubclass(cls, ShardsafeError)
    assert issubclass(cls, ERRORS[cls])
    if cls in FAMILY:
        assert issubclass(cls, FAMILY[cls])
    e = HolderError("budget", "msg") if cls is HolderError else cls("msg")
    assert str(e) == "msg" and isinstance(e, ShardsafeError) and isinstance(e, ERRORS[cls])
    if cls is not HolderError:   # its (code, message) constructor does not take its own args back
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is cls and str(again) == "msg"


def test_persist_error_still_takes_errno_arguments():
    e = PersistError(28, "No space left on device", "/ckpt/x")
    assert (e.errno, e.strerror, e.filename) == (28, "No space left on device", "/ckpt/x")
    assert isinstance(e, ShardsafeError) and str(e) == "[Errno 28] No space left on device: '/ckpt/x'"


def test_holder_error_keeps_its_code():
    e = HolderError("budget", "over the memory budget")
    assert e.code == "budget" and str(e) == "over the memory budget" and isinstance(e, ShardsafeError)


def _modules():
    """Every importable module of the package (shardsafe, and the folders setup.py maps into it)."""
    mods, skipped = [], []
    for pkg in (shardsafe, shardsafe.adapters, shardsafe.kernels):
        mods.append(pkg)
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name.rsplit(".", 1)[-1] == "__main__":   # importing it runs the command
                continue
            try:
                mods.append(importlib.import_module(info.name))
            except ImportError as e:   # an optional dependency or a GPU library (e.g. kernels' .so)
                skipped.append(f"{info.name}: {e}")
    for s in skipped:
        print(f"not imported: {s}")
    return mods


# The restart signal of shardsafe.inplace: it unwinds the program's training loop, whatever that loop catches.
CONTROL_FLOW = {"shardsafe.inplace.RestartInPlace"}


def test_every_exception_class_of_the_package_derives_from_the_root():
    """A new error class without ShardsafeError fails here. Warning classes are exempt: they are issued with
    warnings.warn, not raised, and `except ShardsafeError` is not how they are handled. So are the control-flow
    signals named in CONTROL_FLOW: BaseException only, like KeyboardInterrupt, so that no `except Exception` (which
    would catch a ShardsafeError) stops them."""
    found = {}
    for mod in _modules():
        for name, cls in vars(mod).items():
            if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == mod.__name__:
                if not issubclass(cls, Warning) and f"{mod.__name__}.{name}" not in CONTROL_FLOW:
                    found[f"{mod.__name__}.{name}"] = cls
    missing = sorted(n for n, c in found.items() if not issubclass(c, ShardsafeError))
    assert not missing, f"error classes without shardsafe.errors.ShardsafeError among their bases: {missing}"
    assert set(ERRORS) <= set(found.values()), "the walk missed a module: " + str(set(ERRORS) - set(found.values()))


def test_the_package_raises_no_bare_builtin_error():
    """Only TypeError (a wrong Python type) and OSError (a failed system call, caught by shardsafe where it must)
    stay builtins (shardsafe/errors.py says why); everything else raised on purpose is beneath the root."""
    import re
    from pathlib import Path
    root = Path(shardsafe.__file__).resolve().parents[1]
    bare = re.compile(r"raise (ValueError|RuntimeError|KeyError|IndexError|LookupError|Exception|AssertionError)\(")
    found = [f"{f.relative_to(root)}:{i}: {line.strip()[:80]}"
             for folder in ("shardsafe", "adapters", "kernels") for f in sorted((root / folder).rglob("*.py"))
             for i, line in enumerate(f.read_text().splitlines(), 1) if bare.search(line)]
    assert not found, found
