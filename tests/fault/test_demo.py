"""`shardsafe demo --json` end to end, for both engines (what `make demo` runs, shortened).

Each demo is two real jobs on 2 simulated nodes x 2 ranks: a reference without failures, forked from a server
that imported the frameworks and nothing of shardsafe's runtime, and a protected run, forked from the preset's
server, that loses a rank and then a whole node. The demo
itself compares every loss and every rank's final state with torch.equal; the test checks its verdict
and that its JSON says what happened.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardsafe.launch.presets import RUNTIME_MODULES, without_runtime

from .._probes import installed_version

pytestmark = pytest.mark.slow

KEYS = {"engine", "zero_stage", "steps", "failures_injected", "restores", "restore_tier", "lost_iterations",
        "bit_identical", "snapshot_stall_ms_median", "restore_seconds", "node_losses", "rebuilt_bytes",
        "rebuild_seconds", "tor", "tor_breakdown", "tor_accounted"}


@pytest.mark.parametrize("engine, steps, restart", [
    ("deepspeed", 30, "full"),
    ("deepspeed-3d", 20, "full"),   # PipelineModule PP2 x DP2, BF16_Optimizer, 4 nodes x 1 rank
    # ZeRO-2 on 2 nodes x 2 ranks: rank 3 starts again alone while ranks 0 and 1 wait in an all-reduce with rank 2,
    # freed when rank 2's abandoned engine (kept alive by DeepSpeed's gradient hooks) is taken apart
    ("deepspeed", 30, "in-place"),
    # the killed rank (stage 1) starts again alone; the survivors build their pipeline engines again in their
    # processes, rank 0 freed from the data-parallel all-gather it waits in with rank 1; the node loss is a full
    # restart from parity
    ("deepspeed-3d", 20, "in-place"),
    pytest.param("megatron", 20, "full", marks=pytest.mark.skipif(
        not installed_version("megatron-core", "megatron.core"),
        reason="megatron-core is not installed in this venv (docs/megatron.md)")),
])
def test_demo_json(tmp_path, engine, steps, restart):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-m", "shardsafe.cli", "demo", "--engine", engine, "--steps", str(steps),
                        "--restart", restart, "--json", "--run-dir", str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stdout        # exactly one JSON object on stdout
    out = json.loads(lines[0])
    assert KEYS <= set(out), KEYS - set(out)
    assert out["engine"] == engine and out["steps"] == steps
    assert out["bit_identical"] is True and out["mismatches"] == []
    assert out["resumed"] is True, out["resume_problems"]   # the restarts continued, they did not start over
    assert out["failures_injected"] == 2 and out["restores"] == 2 and out["node_losses"] == 1
    assert out["restore_tiers"] == ["memory", "parity"] and out["rebuilt_bytes"] > 0
    assert out["restart"] == restart and out["restarts_in_place"] == (1 if restart == "in-place" else 0), out
    events = [json.loads(ln) for ln in open(tmp_path / "run" / "events.jsonl")]
    if restart == "in-place":   # attempt 1 started only the killed rank, and it was not given up for a full one
        starts = sorted((e.get("attempt"), e["rank"]) for e in events if e["kind"] == "trainer_start")
        assert [s for s in starts if s[0] == 1] == [(1, out["ranks"] - 1)], starts
        causes = [(e["cause"], e.get("rank"), e.get("rc")) for e in events if e["kind"] == "failure_detected"]
        assert causes == [("rank_exit", out["ranks"] - 1, -9), ("node_loss", None, -9)], causes
    assert out["tor_accounted"] is True and 0 < out["tor"] < 1
    # the protected run's trainers were forked from the preset's server, the reference's from one without
    # shardsafe's runtime
    assert any(e["kind"] == "prewarm_ready" for e in events)
    assert out["prewarm"]["preload"] and out["prewarm"]["seconds"] > 0
    ref_ready = [e for e in map(json.loads, open(tmp_path / "reference" / "events.jsonl"))
                 if e["kind"] == "prewarm_ready"]
    assert len(ref_ready) == 1 and ref_ready[0]["preload"] == list(without_runtime(tuple(out["prewarm"]["preload"])))
    assert set(out["prewarm"]["preload"]) & set(RUNTIME_MODULES) and not set(ref_ready[0]["preload"]) & set(
        RUNTIME_MODULES), (out["prewarm"], ref_ready)
    assert "start cold" not in r.stderr, r.stderr[-3000:]
    # `shardsafe tor project --from` the demo's own run dir takes the costs `tor report` measures there (issue 20)
    rep = subprocess.run([sys.executable, "-m", "shardsafe.cli", "tor", "report", str(tmp_path), "--json"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert rep.returncode == 0 and "reporting the protected run" in rep.stderr, rep.stderr[-2000:]
    by_class = json.loads(rep.stdout)["by_class"]
    proj = subprocess.run([sys.executable, "-m", "shardsafe.cli", "tor", "project", "--from", str(tmp_path),
                           "--gpus", "1024", "--no-simulate", "--json"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proj.returncode == 0, proj.stderr[-2000:]
    measured = json.loads(proj.stdout)["costs"]["measured"]
    for tier in ("memory", "parity"):
        assert by_class[tier]["failures"] == 1, by_class
        assert measured[f"restore_{tier}_s"] == pytest.approx(by_class[tier]["restore"], abs=1e-3), (measured, by_class)


def test_demo_shrink_json(tmp_path):
    """`shardsafe demo --shrink`: 4 nodes, no spare; node3 is lost, the job continues on 3 (its global batch of 24
    samples keeps at 3), node3 returns and the job grows back to 4; every kept loss and the final states equal
    DeepSpeed's own reshard (universal checkpoints of the same versions). ZeRO-2 with DeepSpeed's default FusedAdam;
    ZeRO-1 and ZeRO-3 run in tests/fault/test_shrink_e2e.py."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-m", "shardsafe.cli", "demo", "--shrink", "--optimizer", "fused-adamw",
                        "--steps", "15", "--json", "--run-dir", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stdout + r.stderr[-3000:]
    out = json.loads(lines[0])
    assert KEYS - {"zero_stage"} <= set(out) and {"data_parallel_sizes", "shrinks", "grows", "oracle"} <= set(out)
    assert out["data_parallel_sizes"] == [4, 3, 4] and (out["shrinks"], out["grows"]) == (1, 1), out
    assert out["oracle"]["ran"] and [s["dp"] for s in out["oracle"]["segments"]] == [4, 3, 4], out["oracle"]
    assert out["bit_identical"] is True and out["mismatches"] == [], out["mismatches"]
    assert out["resumed"] is True, out["resume_problems"]
    assert out["node_losses"] == 1 and out["restore_tiers"][0] == "parity"
    assert out["tor_accounted"] is True and r.returncode == 0, r.stderr[-3000:]
