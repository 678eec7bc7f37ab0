"""Whole-node loss with real DeepSpeed: trainers and holder SIGKILLed, shared memory gone, a fresh
empty holder in its place; the lost ranks are rebuilt from parity and the run stays bit-exact.

One rank per simulated node, so a lost node loses exactly one member of the parity group.
"""
import json

import pytest

from shardsafe.runcheck import compare_runs, read_jsonl

from .helpers import restores, run_job, trainer_logs

STEPS = 10
pytestmark = pytest.mark.slow


def tiers(run_dir):
    return {int(e.get("attempt") or 0): e["tier"] for e in read_jsonl(f"{run_dir}/events.jsonl")
            if e.get("kind") == "restore_end"}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("m, nodes, lose", [(1, 3, "node1"), (2, 4, "node0+node2")])
def test_node_loss_rebuilt_from_parity(tmp_path, reference, stage, m, nodes, lose):
    ref = reference(stage, "bf16", STEPS, world=nodes)
    res = run_job(tmp_path, stage=stage, dtype="bf16", steps=STEPS, nodes=nodes, nproc=1,
                  inject=f"kill-node:{lose}@6", extra=["--shardsafe-json", json.dumps({"parity_shards": m})])
    assert res.ok and res.attempts == 2 and res.failures[0]["cause"] == "node_loss", res
    # The launcher kills the node once it sees iteration 6 finish; a step or two may complete meanwhile.
    done = max(e["iteration"] for e in read_jsonl(f"{tmp_path}/events.jsonl")
               if e.get("kind") == "iteration" and not e.get("attempt"))
    assert 4 <= restores(tmp_path)[1] <= done and tiers(tmp_path)[1] == "parity"
    assert "could not be re-encoded" not in trainer_logs(str(tmp_path))   # the rebuilt ranks hold parity again
    cmp = compare_runs(str(tmp_path), str(ref), nodes, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches, cmp.state_mismatches)


def test_second_node_loss_before_the_next_snapshot(tmp_path, reference):
    """node1 lost, rebuilt from parity; then node2 lost before another snapshot commits. With m=1 the
    second rebuild needs the parity shares node1 held: the first rebuild re-encoded them."""
    ref = reference(2, "bf16", 12, world=3)
    # Version 5 must commit (its parity exchanged, the vote done) before node1 goes at step 7: steps after the 5th
    # take half a second, else a loaded machine can still be exchanging version 5's parity when the node is lost.
    res = run_job(tmp_path, stage=2, dtype="bf16", steps=12, nodes=3, nproc=1,
                  inject="kill-node:node1@7;kill-node:node2@7",
                  extra=["--interval", "5", "--step-sleep", "0.5", "--step-sleep-after", "5"])
    assert res.ok and res.attempts == 3, res
    assert [f["cause"] for f in res.failures] == ["node_loss", "node_loss"], res.failures
    # Snapshots at 5 and 10 only: both restores are of version 5, both rebuilt from parity.
    assert restores(tmp_path)[1] == 5 and restores(tmp_path)[2] == 5, restores(tmp_path)
    assert tiers(tmp_path)[1] == "parity" and tiers(tmp_path)[2] == "parity"
    cmp = compare_runs(str(tmp_path), str(ref), 3, 12)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches, cmp.state_mismatches)


def test_more_node_losses_than_parity_fail_clearly(tmp_path):
    res = run_job(tmp_path, stage=2, dtype="fp32", steps=8, nodes=3, nproc=1, inject="kill-node:node0+node1@4",
                  max_restarts=1)
    assert not res.ok   # nothing restored, nothing loaded: the attempt after the loss stops with the error
    logs = trainer_logs(str(tmp_path))
    assert "RestoreError: cannot restore from memory" in logs
    assert "nodes ['node0', 'node1']" in logs and "parity_shards >= 2" in logs and "disk checkpoint" in logs


def test_more_node_losses_than_parity_fall_back_to_disk(tmp_path, reference):
    """m+1 lost nodes: memory cannot serve, the holders' background flushes can; bit-exact from there."""
    ref = reference(2, "fp32", 10, world=3)
    disk = tmp_path / "persist"
    res = run_job(tmp_path, stage=2, dtype="fp32", steps=10, nodes=3, nproc=1, inject="kill-node:node0+node1@7",
                  extra=["--shardsafe-json", json.dumps({"persist_dir": str(disk), "persist_every": 2})])
    assert res.ok and res.attempts == 2, res
    restored = restores(tmp_path)[1]
    assert tiers(tmp_path)[1] == "persistent" and restored % 2 == 0 and 2 <= restored <= 7
    assert "from the persistent tier" in trainer_logs(str(tmp_path))
    flushes = [e for e in read_jsonl(f"{tmp_path}/events.jsonl") if e.get("kind") == "flush" and e.get("ok")]
    assert flushes and all(e["version"] % 2 == 0 for e in flushes)
    cmp = compare_runs(str(tmp_path), str(ref), 3, 10)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches, cmp.state_mismatches)
