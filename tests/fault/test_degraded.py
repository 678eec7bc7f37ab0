"""Failures of the protection itself never take training down, and say what happened."""
import os
import signal
import threading
import time

import pytest

from shardsafe.holder.client import HolderClient
from shardsafe.holder.paths import HolderPaths
from shardsafe.runcheck import compare_runs, read_jsonl

from .helpers import restores, run_job, trainer_logs

pytestmark = pytest.mark.slow


def test_holder_killed_while_training(tmp_path, reference):
    """SIGKILL the holder mid-run: training finishes exactly as without protection, one clear line per rank."""
    killed = {}

    def watcher(launcher):
        def kill_when_snapshots_flow():
            path = os.path.join(str(tmp_path), "events.jsonl")
            deadline = time.time() + 120
            while time.time() < deadline:
                if any(e.get("kind") == "snapshot" and e.get("version", 0) >= 4 for e in read_jsonl(path)):
                    proc = launcher.holders["node0"]
                    proc.send_signal(signal.SIGKILL)
                    killed["at"] = time.time()
                    return
                time.sleep(0.05)
        threading.Thread(target=kill_when_snapshots_flow, daemon=True).start()

    res = run_job(tmp_path, stage=2, dtype="bf16", steps=14, nodes=1, nproc=2, extra=["--step-sleep", "0.15"],
                  watcher=watcher, max_restarts=0)
    assert killed and res.ok and res.attempts == 1
    logs = trainer_logs(str(tmp_path))
    for rank in (0, 1):
        # One line per rank says what the kill cost it: the snapshot it was taking skipped, or (rank 0, which
        # commits for the job, when the kill lands in its commit) that commit failed; either way training went
        # on, and the next request started a new holder instead of skipping more.
        said = [ln for ln in logs.splitlines() if ln.startswith(f"[rank {rank}] ")
                and ((" snapshot " in ln and "skipped, training continues" in ln)
                     or (rank == 0 and ln.startswith("[rank 0] commit of snapshot ") and " failed: " in ln))]
        assert len(said) == 1, logs
    skipped = [e for e in read_jsonl(os.path.join(str(tmp_path), "events.jsonl")) if e.get("kind") == "snapshot_skipped"]
    assert skipped, "skipped snapshots must be recorded for TOR"
    cmp = compare_runs(str(tmp_path), str(reference(2, "bf16", 14)), 2, 14)
    assert cmp.bit_identical and not cmp.resume_problems, cmp


def test_fresh_start_with_no_holder_then_restore_from_autostarted_one(tmp_path, holder_root):
    """No holder running: the adapter starts one detached and starts fresh; a rerun restores from it."""
    job = "autostart-" + os.urandom(3).hex()
    res = run_job(tmp_path / "a", stage=2, dtype="fp32", steps=6, nodes=1, nproc=2, start_holders=False, job_id=job,
                  max_restarts=0)
    assert res.ok
    assert "no snapshot in memory for this job: starting fresh" in trainer_logs(str(tmp_path / "a"))
    assert restores(tmp_path / "a") == {0: -1}
    # The detached holder outlived the job (its own session); a new job with the same id restores.
    res = run_job(tmp_path / "b", stage=2, dtype="fp32", steps=8, nodes=1, nproc=2, start_holders=False, job_id=job,
                  max_restarts=0)
    assert res.ok and restores(tmp_path / "b") == {0: 6}
    c = HolderClient(HolderPaths(holder_root, job, "node0")).connect()
    c.shutdown()


def test_budget_too_small_names_bytes_and_training_continues(tmp_path, reference):
    res = run_job(tmp_path, stage=2, dtype="bf16", steps=14, nodes=1, nproc=2, budget_gb=0.001, max_restarts=0)
    assert res.ok
    logs = trainer_logs(str(tmp_path))
    assert "Raise memory_budget_gb" in logs and "bytes in use" in logs and "needed > budget" in logs
    assert not any(e.get("committed") for e in read_jsonl(os.path.join(str(tmp_path), "events.jsonl"))
                   if e.get("kind") == "snapshot")
    cmp = compare_runs(str(tmp_path), str(reference(2, "bf16", 14)), 2, 14)
    assert cmp.bit_identical and not cmp.resume_problems, cmp


def test_unsupported_configuration_rejected_at_initialize(tmp_path):
    res = run_job(tmp_path, stage=0, dtype="fp32", steps=2, nodes=1, nproc=1, max_restarts=0)
    assert not res.ok
    logs = trainer_logs(str(tmp_path))
    assert "zero_optimization.stage=0" in logs and "ConfigError" in logs and "replicated" in logs
