"""Shared test set-up: one thread per process, CPU DeepSpeed, a private holder directory per session,
and no holder left running afterwards; ``holder_factory``: real holder processes for one test."""
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed's CPU ops (FusedAdam's CPU build, DeepSpeedCPUAdam, DeepSpeedCPULion) are JIT-compiled by torch's
# cpp_extension into ~/.cache/torch_extensions by op name, and rebuilt when a venv at another path loads them
# (the build file names the venv's include paths): ~35 s per op on this machine, every time two checkouts take
# turns. One build folder per venv keeps each checkout's builds.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
_HOLDER_ROOT = tempfile.mkdtemp(prefix="shardsafe-test-holders-")
_HOLDER_ROOT_PID = os.getpid()
# removed at exit by the process that made it (xdist's controller too), never by a child forked from it
atexit.register(lambda: os.getpid() == _HOLDER_ROOT_PID and shutil.rmtree(_HOLDER_ROOT, ignore_errors=True))
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


# ---- real holder processes for one test ----------------------------------------------------------------------

HOLDER_STOP_TIMEOUT_S = 15.0


class RunningHolder:
    """One holder process started by ``holder_factory``: its paths and process."""

    def __init__(self, paths, proc, err_path=None):
        self.paths, self.proc, self.err_path = paths, proc, err_path

    def stderr(self) -> str:
        """What the holder wrote to stderr so far; '' unless it was started with ``stderr_file=True``."""
        return self.err_path.read_text(errors="replace") if self.err_path is not None else ""

    def __repr__(self):
        return f"holder {self.paths.job_id}/{self.paths.node} (pid {self.proc.pid})"


class Holders(list):
    """The holders one ``holder_factory`` call started, in node order, and the directory they live in."""

    def __init__(self, root: str):
        super().__init__()
        self.root = root


def _holder_pids(root: str) -> list[int]:
    """Processes whose command line runs a holder in ``root`` (``--holder-dir root``)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"holder" in argv and any(a == b"--holder-dir" and b == root.encode() for a, b in zip(argv, argv[1:])):
            pids.append(int(d))
    return pids


def _stop_holders(started: list, timeout_s: float) -> None:
    """SIGTERM every holder still running, SIGKILL any that has not exited after ``timeout_s``; then check
    that each stopped cleanly (status 0, socket removed) and that no holder process of their roots is left."""
    problems = []
    ours = [h for h in started if h.proc.poll() is None]   # the others the test stopped (or killed) itself
    for h in ours:
        h.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for h in ours:
        try:
            rc = h.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            h.proc.kill()
            h.proc.wait()
            problems.append(f"{h} did not exit within {timeout_s:.0f} s of SIGTERM: killed\n{h.stderr()[-2000:]}")
            continue
        if rc == -signal.SIGKILL:
            continue   # the test killed it, just before its end (not yet reaped when polled above)
        if rc != 0:
            problems.append(f"{h} exited with status {rc} on SIGTERM\n{h.stderr()[-2000:]}")
        elif os.path.exists(h.paths.socket):
            problems.append(f"{h} exited but left its socket {h.paths.socket}")
    for h in started:
        h.proc.wait()
        if h.proc.stdout is not None:
            h.proc.stdout.close()
    for root in sorted({h.paths.root for h in started}):
        for pid in _holder_pids(root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            problems.append(f"a holder process (pid {pid}) of {root} still ran after the test: killed")
    assert not problems, "holder teardown:\n" + "\n".join(problems)


@pytest.fixture
def holder_factory(tmp_path, tmp_path_factory):
    """Start real holder processes for a test; all are stopped at its end.

    ``start(nodes=1, *, job="pjob", budget_gb=0.1, root=None, stderr_file=False, **opts)``
    starts one holder per node, one after the other, each waited for until it serves (its "holder ready"
    line), and returns them as a :class:`Holders` list (``.root``: their directory, ``tmp_path`` unless
    ``root`` is given). ``nodes`` is a count (nodes n0, n1, ...) or a list of node names; ``budget_gb`` one
    budget for all or one per node; ``opts`` go to ``holder_command`` (idle_exit_s, read_timeout_s,
    max_clients, run_dir, scrub_interval_s). With ``stderr_file`` the holder's stderr goes to a file,
    read back by :meth:`RunningHolder.stderr`; otherwise it is inherited.

    At teardown each holder still running gets SIGTERM, then SIGKILL after HOLDER_STOP_TIMEOUT_S; the test
    fails if one had to be killed, exited with a status other than 0, left its socket, or if any holder
    process of their directories is still running (those are killed)."""
    from shardsafe.holder.client import holder_command
    from shardsafe.holder.paths import HolderPaths

    started = []

    def start(nodes=1, *, job="pjob", budget_gb=0.1, root=None, stderr_file=False, **opts) -> Holders:
        names = [f"n{i}" for i in range(nodes)] if isinstance(nodes, int) else list(nodes)
        budgets = list(budget_gb) if isinstance(budget_gb, (list, tuple)) else [budget_gb] * len(names)
        assert names and len(budgets) == len(names), (names, budgets)
        group = Holders(str(root if root is not None else tmp_path))
        for node, gb in zip(names, budgets):
            paths = HolderPaths(group.root, job, node)
            err_path = tmp_path_factory.mktemp("holder-stderr") / f"{job}.{node}.err" if stderr_file else None
            err = open(err_path, "wb") if err_path is not None else None
            try:
                proc = subprocess.Popen(holder_command(paths, budget_gb=gb, **opts), stdout=subprocess.PIPE,
                                        stderr=err)
            finally:
                if err is not None:
                    err.close()
            h = RunningHolder(paths, proc, err_path)
            started.append(h)
            group.append(h)
            line = proc.stdout.readline()
            assert line.startswith(b"holder ready"), (h, line, h.stderr())
        return group

    yield start
    _stop_holders(started, HOLDER_STOP_TIMEOUT_S)


# ---- order: the longest files first ---------------------------------------------------------------------------

# Under pytest-xdist (`make test`) each file runs on one worker; a long file handed out last would run alone at the
# end. These start first, longest first (their wall times in `make test`; a file's own tests keep their order); the
# rest follow in collection order. `make test` passes --no-loadscope-reorder: by default xdist hands out the files
# with the most tests first, which put the long files of few tests (the sbatch and shrink ones) at the end.
_LONGEST_FIRST = ("fault/test_deepspeed_3d.py", "fault/test_shrink_e2e.py", "fault/test_megatron_resume.py",
                  "slurm/test_slurm.py", "fault/test_export_megatron.py", "fault/test_deepspeed_resume.py",
                  "fault/test_launch.py", "fault/test_demo.py", "fault/test_hf_trainer.py", "fault/test_two_jobs.py",
                  "fault/test_unchanged_programs.py", "fault/test_node_loss.py", "dist/test_ds_reshard_oracle.py",
                  "package/test_install.py", "fault/test_lightning.py", "fault/test_deepspeed_optimizers.py",
                  "fault/test_resize_launch.py", "dist/test_megatron_state.py", "fault/test_export.py",
                  "fault/test_resubmission.py", "dist/test_megatron_reshard_oracle.py", "fault/test_trust.py")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return next((i for i, f in enumerate(_LONGEST_FIRST) if path.endswith(f)), len(_LONGEST_FIRST))

    items.sort(key=rank)   # stable: each file's tests keep their order


_LOG_TAIL_LINES = 40


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that ran trainers shows the end of each trainer log under its tmp_path in its report: a
    failure seen once on a loaded CI machine must be readable from that run's output alone."""
    outcome = yield
    report = outcome.get_result()
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if not report.failed or tmp is None or not os.path.isdir(tmp):
        return
    parts = []
    for root, _, files in sorted(os.walk(tmp)):
        for f in sorted(files):
            if f.startswith("trainer_rank") and f.endswith(".log"):
                path = os.path.join(root, f)
                with open(path, errors="replace") as fh:
                    tail = fh.readlines()[-_LOG_TAIL_LINES:]
                parts.append(f"---- {os.path.relpath(path, tmp)} (last {len(tail)} lines)\n" + "".join(tail))
    if parts:
        report.sections.append(("trainer logs", "\n".join(parts[:16])))


def pytest_terminal_summary(terminalreporter):
    """The files that took longest, summed over their tests' set-up, call and teardown (under pytest-xdist,
    each worker's time): where the suite's time goes."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) in ("setup", "call", "teardown") and hasattr(r, "duration"):
                f = r.nodeid.split("::")[0]
                per_file[f] = per_file.get(f, 0.0) + r.duration
    if not per_file:
        return
    total = sum(per_file.values())
    terminalreporter.write_sep("=", f"slowest files (of {total:.0f} s summed over all tests)")
    for f, s in sorted(per_file.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{s:8.1f}s {100 * s / total:5.1f}%  {f}")
