"""Shared test set-up: one thread per process, CPU DeepSpeed, a private holder directory per session,
and no holder left running afterwards."""
import os
import signal
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
_HOLDER_ROOT = tempfile.mkdtemp(prefix="shardsafe-test-holders-")
os.environ["SHARDSAFE_HOLDER_DIR"] = _HOLDER_ROOT
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.fixture(scope="session")
def holder_root():
    return _HOLDER_ROOT


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_holders():
    yield
    # Detached holders started by trainers in tests carry the test root in their command line.
    out = subprocess.run(["pgrep", "-f", f"--holder-dir {_HOLDER_ROOT}"], capture_output=True, text=True).stdout
    for pid in out.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
