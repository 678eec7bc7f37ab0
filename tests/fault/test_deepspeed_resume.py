"""Bit-exact resume for ZeRO-1/2/3 x fp32/bf16 after real SIGKILLs, and torn writes never restored.

One protected job per configuration takes two successive failures: attempt 0 loses rank 1 to a
SIGKILL at the start of optimizer step 6 (after its backward pass); attempt 1 loses rank 0 while
it is halfway through copying snapshot 11 into the holder. Every effective loss, every loss any
attempt computed, and every rank's final state (fp32 masters, Adam moments and step, low-precision
params, RNG) must be torch.equal to an uninterrupted run of plain DeepSpeed.
"""
import os

import pytest

from shardsafe.runcheck import compare_runs, read_jsonl

from .helpers import early_opens, restores, run_job

STEPS = 14
COLD_PINS = {(1, "fp32"), (3, "bf16")}
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_kill_rank_then_kill_during_copy(tmp_path, reference, stage, dtype):
    # A cold reference for one ZeRO stage per dtype (and ZeRO-3) also pins that forked trainers compute what cold
    # ones do; the other configurations fork theirs (helpers.py).
    ref = reference(stage, dtype, STEPS, cold=(stage, dtype) in COLD_PINS)
    res = run_job(tmp_path, stage=stage, dtype=dtype, steps=STEPS, inject="kill-rank:1@6;kill-copy:0@11")
    assert res.ok and res.attempts == 3, res
    assert [f["rank"] for f in res.failures] == [1, 0] and all(f["rc"] == -9 for f in res.failures)
    got = restores(tmp_path)
    assert got[0] == -1                              # fresh start
    assert got[1] in (4, 5)                          # newest version sealed by both ranks before step 6
    assert got[2] == 10                              # the torn v11 is never restored: the previous committed one is
    # Rank 0, killed copying v11, held v10 as its newest: its forked trainer mapped and verified it while it started
    # up, and the restore hashed nothing again. (Rank 1 may have sealed v11, which its trainer then opened early in
    # vain.)
    early = early_opens(tmp_path)
    assert early[(2, 0)] == "used", early
    assert early_opens(tmp_path, "early_verify")[(2, 0)] == "used", early_opens(tmp_path, "early_verify")
    assert all(v == "used" or v.startswith("missed: opened version") for v in early.values()), early
    if stage != 3:   # one rank per node: the peers' shards are elsewhere, the lp params are all-gathered
        assert lp_paths(tmp_path) == {"all-gather"}
    cmp = compare_runs(str(tmp_path), str(ref), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches, cmp.state_mismatches, cmp.replayed_losses_equal)


def lp_paths(run_dir):
    return {e["notes"]["lp_params"] for e in read_jsonl(f"{run_dir}/events.jsonl")
            if e.get("kind") == "restore_end" and e.get("version", -1) >= 0}


@pytest.mark.parametrize("stage, dtype", [(1, "fp32"), (2, "bf16")])
def test_one_node_lp_params_from_the_holder(tmp_path, reference, stage, dtype):
    """Both ranks on one node: the restore casts every DP peer's fp32 shard from the node's holder
    instead of all-gathering the low-precision params; still bit-exact."""
    ref = reference(stage, dtype, STEPS)
    res = run_job(tmp_path, stage=stage, dtype=dtype, steps=STEPS, nodes=1, nproc=2,
                  inject="kill-rank:1@6;kill-copy:0@11")
    assert res.ok and res.attempts == 3, res
    assert restores(tmp_path)[2] == 10
    assert lp_paths(tmp_path) == {"from the node's holder"}
    cmp = compare_runs(str(tmp_path), str(ref), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches, cmp.state_mismatches, cmp.replayed_losses_equal)


def test_gradient_accumulation_resumes_bit_exact(tmp_path, reference):
    """Three micro-batches per optimizer step (ZeRO-2 bf16): snapshots are taken at accumulation boundaries
    only, and the restarted ranks go on with the next boundary's micro-batches (the engine's micro-step
    counter, hence the data position, comes back with the snapshot); bit-exact."""
    gas = ["--gas", "3"]
    ref = reference(2, "bf16", STEPS, extra=gas)
    res = run_job(tmp_path, stage=2, dtype="bf16", steps=STEPS, inject="kill-rank:1@6;kill-copy:0@11", extra=gas)
    assert res.ok and res.attempts == 3, res
    assert restores(tmp_path)[2] == 10
    cmp = compare_runs(str(tmp_path), str(ref), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches, cmp.state_mismatches, cmp.replayed_losses_equal)


def test_fp16_with_dynamic_loss_scaler(tmp_path, reference, monkeypatch):
    """fp16 + ZeRO-2: the loss scaler's state (scale, overflow and growth counters, hysteresis) is part of
    the snapshot. A 2**20 initial scale overflows and a 3-step window grows it again, so the scale moves
    both ways during the run; every step's scale after each restore must be the reference's, as must every
    loss (skipped steps included). DeepSpeed refuses fp16 on this CPU; the example's test-only switch lifts
    that refusal."""
    monkeypatch.setenv("SHARDSAFE_TEST_FORCE_FP16", "1")
    scaler = ["--fp16-scale-power", "20", "--fp16-scale-window", "3", "--fp16-hysteresis", "1"]
    ref = reference(2, "fp16", STEPS, extra=scaler, cold=True)
    # Restarts mid-window (after versions 6-7 and 11), where a scaler started afresh would grow at other steps.
    res = run_job(tmp_path, stage=2, dtype="fp16", steps=STEPS, inject="kill-rank:1@8;kill-copy:0@12", extra=scaler)
    assert res.ok and res.attempts == 3, res
    assert restores(tmp_path)[2] == 11
    cmp = compare_runs(str(tmp_path), str(ref), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches, cmp.state_mismatches)
    want = _scales(ref)
    moves = [b / a for a, b in zip(want[1:], want[2:])]
    assert any(x < 1 for x in moves) and any(x > 1 for x in moves), want   # overflowed and grew back
    assert _scales(tmp_path) == want


def _scales(run_dir) -> list:
    """Rank 0's loss scale per step, the last record of each step (a replayed step logs again)."""
    got = {}
    for rec in read_jsonl(os.path.join(str(run_dir), "losses_rank0.jsonl")):
        got[int(rec["step"])] = rec["loss_scale"]
    return [None] + [got[s] for s in range(1, STEPS + 1)]
