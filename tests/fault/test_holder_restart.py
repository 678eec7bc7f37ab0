"""A node's holder SIGKILLed while its trainers run comes back, and the snapshots with it.

Two ranks on one node (DeepSpeed ZeRO-2 bf16, real processes). Once both have committed a few versions the
launcher's holder is SIGKILLed: the snapshot in flight is skipped, the node's first rank (rank 0) starts a new
holder and records `holder_restarted`, rank 1 connects to it, and later versions are committed on both ranks
again. A later SIGKILL of rank 1 then restores from the *new* holder (a version newer than anything the killed
one held), and the job ends bit-identical to an uninterrupted run, having resumed where it restored.
"""
import os
import signal
import threading
import time

import pytest

from shardsafe.runcheck import compare_runs, read_jsonl, resume_problems

from .helpers import restores, run_job, trainer_logs

pytestmark = pytest.mark.slow
STEPS = 16
FUSED = ("--optimizer", "fused-adamw")


def _committed(evs, attempt=0):
    """rank -> versions committed in ``attempt``."""
    out: dict[int, set[int]] = {}
    for e in evs:
        if e.get("kind") == "snapshot" and e.get("committed") and int(e.get("attempt") or 0) == attempt:
            out.setdefault(int(e["rank"]), set()).add(int(e["version"]))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(ln.startswith("State:") and "Z" in ln.split()[1] for ln in f)
    except FileNotFoundError:
        return False


def test_killed_holder_is_restarted_and_snapshots_resume(tmp_path, reference):
    events = os.path.join(str(tmp_path), "events.jsonl")
    killed = {}

    def watcher(launcher):
        def kill_when_both_ranks_committed():
            deadline = time.time() + 240
            while time.time() < deadline:
                c = _committed(read_jsonl(events))
                both = c.get(0, set()) & c.get(1, set())
                if max(both, default=0) >= 3:
                    proc = launcher.holders["node0"]
                    killed.update(after=max(both), pid=proc.pid)
                    proc.send_signal(signal.SIGKILL)
                    return
                time.sleep(0.02)
        threading.Thread(target=kill_when_both_ranks_committed, daemon=True).start()

    # DeepSpeed's default optimizer (FusedAdam: "AdamW" without torch_adam), as users get it
    res = run_job(tmp_path, stage=2, dtype="bf16", steps=STEPS, nodes=1, nproc=2,
                  extra=["--step-sleep", "0.15", *FUSED],
                  watcher=watcher, inject=f"kill-rank:1@{STEPS - 2}", max_restarts=1)
    assert killed, "the holder was never killed: no version committed on both ranks in time"
    assert res.ok and res.attempts == 2, res
    evs = read_jsonl(events)

    # rank 0, the node's first rank, started exactly one new holder, in the attempt whose holder was killed
    restarted = [e for e in evs if e.get("kind") == "holder_restarted"]
    assert [(e["rank"], e["node"], int(e.get("attempt") or 0)) for e in restarted] == [(0, "node0", 0)], restarted
    new_pid = restarted[0]["pid"]
    assert new_pid != killed["pid"]
    assert "was gone: started a new one" in trainer_logs(str(tmp_path))

    # snapshots resumed on both ranks after the kill (today: every later one skipped)
    c = _committed(evs)
    after = sorted(v for v in c[0] & c[1] if v > killed["after"] + 1)
    assert len(after) >= 3, (killed, sorted(c[0]), sorted(c[1]))

    # the restart after rank 1's kill restored from the new holder: a version the killed holder never held
    got = restores(tmp_path)
    assert got[0] == -1 and got[1] >= max(after) > killed["after"], (got, after, killed)
    assert resume_problems(str(tmp_path), 2) == []
    cmp = compare_runs(str(tmp_path), str(reference(2, "bf16", STEPS, extra=FUSED)), 2, STEPS)
    assert cmp.bit_identical, (cmp.loss_mismatches, cmp.state_mismatches, cmp.replayed_losses_equal)

    # the launcher's stop at the end reached the holder rank 0 started (it serves the same socket)
    deadline = time.time() + 15
    while _alive(new_pid) and time.time() < deadline:
        time.sleep(0.1)
    if _alive(new_pid):
        os.kill(new_pid, signal.SIGKILL)
        pytest.fail(f"the restarted holder (pid {new_pid}) was still running after the job ended")
