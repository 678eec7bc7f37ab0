"""Restart in place (``--restart in-place``, shardsafe.inplace): a SIGKILLed rank starts again alone, the others go on
in their processes, and every rank ends bit-exact.

Two simulated nodes of two ranks under ``shardsafe launch``'s launcher (torchrun agents, holders, fork servers),
bench/control_plane_trainer.py on every rank: shardsafe's runtime, parity and restore over a synthetic optimizer
state (an fp32 master and two moments, and a step counter) whose every step is an in-place update. The oracle is
the state an uninterrupted run ends with, computed here from the same seed and updates: every rank's final state
must hash to it, byte for byte.
"""
import hashlib
import json
import os
import sys

import pytest

from shardsafe.launch.elastic import ElasticConfig, ElasticLauncher
from shardsafe.runcheck import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(ROOT, "bench", "control_plane_trainer.py")
PRELOAD = ("torch", "torch.distributed", "shardsafe.runtime", "shardsafe.snapshot.pipeline")
STEPS, KILL_AT, MB, WORLD = 10, 5, 0.5, 4
pytestmark = pytest.mark.slow


def expected_digest(rank: int) -> str:
    """What rank ``rank`` ends with when nothing fails: the trainer's synthetic state after STEPS updates."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from control_plane_trainer import _synthetic_adapter
    finally:
        sys.path.pop(0)
    state = _synthetic_adapter(int(MB * 1e6), seed=rank)
    for step in range(1, STEPS + 1):
        state.optimizer_step(step)
    return hashlib.sha256(b"".join(state.tensors[k].numpy().tobytes() for k in sorted(state.tensors))).hexdigest()


def run(tmp_path, inject: str):
    cfg = ElasticConfig(nodes=2, nproc_per_node=2, run_dir=str(tmp_path), inject=inject, memory_budget_gb=0.25,
                        max_restarts=2, timeout_s=300, preload=PRELOAD, restart="in-place")
    res = ElasticLauncher(cfg).run([TRAINER, "--out", str(tmp_path), "--mb", str(MB), "--steps", str(STEPS),
                                    "--step-s", "0.2", "--votes", "tree", "--timeout-s", "30"])
    logd = tmp_path / "logs"
    logs = "".join((logd / f).read_text(errors="replace") for f in sorted(os.listdir(logd)) if f.startswith("agent_"))
    lines = {r: [json.loads(x) for x in (tmp_path / f"bench_rank{r}.jsonl").read_text().splitlines() if x.strip()]
             for r in range(WORLD)}
    return res, logs, lines, read_jsonl(str(tmp_path / "events.jsonl"))


def started(lines, attempt):
    """Per rank: the line each attempt's start wrote (pid, restored version)."""
    return {r: next(x for x in ls if x.get("attempt") == attempt and "restored_version" in x) for r, ls in lines.items()}


def check_bit_exact(lines):
    for r, ls in lines.items():
        end = [x for x in ls if "done" in x]
        assert len(end) == 1 and end[0]["done"] == STEPS, (r, ls)
        assert end[0]["state_sha256"] == expected_digest(r), f"rank {r} ended with another state"


def check_resumed(evs, version):
    """Attempt 1 restored ``version`` from memory on every rank and went on with the step after it."""
    ends = [e for e in evs if e["kind"] == "restore_end" and e.get("attempt") == 1]
    assert sorted(e["rank"] for e in ends) == list(range(WORLD)), ends
    assert {(e["tier"], e["version"]) for e in ends} == {("memory", version)}, ends
    ready = {e["rank"]: e["iteration"] for e in evs if e["kind"] == "train_ready" and e.get("attempt") == 1}
    assert ready == {r: version + 1 for r in range(WORLD)}, ready
    first = {}
    for e in evs:
        if e["kind"] == "iteration" and e.get("attempt") == 1:
            first.setdefault(e["rank"], e["iteration"])
    assert first == {r: version + 1 for r in range(WORLD)}, first


def test_a_killed_rank_starts_again_alone_and_every_rank_ends_bit_exact(tmp_path):
    res, logs, lines, evs = run(tmp_path, f"kill-rank:3@{KILL_AT}")
    assert res.ok and res.attempts == 2, (res, logs[-4000:])
    assert [(f["cause"], f["rank"], f["rc"]) for f in res.failures] == [("rank_exit", 3, -9)], res.failures
    assert "restarting them in place as attempt 1" in logs, logs[-4000:]
    a0, a1 = started(lines, 0), started(lines, 1)
    # in place: the survivors are the same processes, only rank 3 is a new one
    assert [a0[r]["pid"] == a1[r]["pid"] for r in range(WORLD)] == [True, True, True, False], (a0, a1)
    assert {a1[r]["in_place"].get("let_go_s") is not None for r in (0, 1, 2)} == {True}
    # the newest version every rank sealed before the kill at the start of step 5: 4, or 3 if rank 3's copy of 4
    # was still running when it died; the same on every rank
    (version,) = {a1[r]["restored_version"] for r in range(WORLD)}
    assert version in (KILL_AT - 2, KILL_AT - 1), version
    check_resumed(evs, version)
    check_bit_exact(lines)
    kinds = [(e["kind"], e.get("attempt")) for e in evs if e["kind"] in ("attempt_start", "failure_detected")]
    assert kinds == [("attempt_start", 0), ("failure_detected", 0), ("attempt_start", 1)], kinds


def test_rank_0_killed_restarts_every_worker_and_ends_bit_exact(tmp_path):
    """Rank 0's process hosts the workers' store: no restart in place, the agents restart every worker (and say
    why), as without --restart in-place."""
    res, logs, lines, evs = run(tmp_path, f"kill-rank:0@{KILL_AT}")
    assert res.ok and res.attempts == 2, (res, logs[-4000:])
    assert "not restarting in place (rank 0 hosts the workers' store)" in logs, logs[-4000:]
    a0, a1 = started(lines, 0), started(lines, 1)
    assert not any(a0[r]["pid"] == a1[r]["pid"] for r in range(WORLD)), (a0, a1)
    (version,) = {a1[r]["restored_version"] for r in range(WORLD)}
    check_resumed(evs, version)
    check_bit_exact(lines)
