"""Protection users can trust (issue 40): another run's state is never applied, and a rank that is not protected
says so, at start and while it lasts. Real DeepSpeed (ZeRO-2, bf16, DeepSpeed's FusedAdam from the config with a
WarmupLR schedule and gradient clipping), real processes and holders, real SIGKILL."""
import json
import os
import re
import uuid

import pytest

from shardsafe.runcheck import compare_runs, read_jsonl

from .helpers import (PLAIN_DEEPSPEED, reference_preload, restores, resumed_without_start_over, run_job,
                      trainer_logs)
from .test_two_jobs import stop_job_holders

pytestmark = pytest.mark.slow


def _events(run_dir, kind):
    return [e for e in read_jsonl(os.path.join(str(run_dir), "events.jsonl")) if e.get("kind") == kind]


def test_another_runs_snapshot_is_refused_and_the_same_run_with_a_longer_schedule_resumes(tmp_path, reference):
    """One job id, four launches, the holders outliving them (the trainers start them, as under plain torchrun):
    1. lr 1e-3, killed at step 5 with no restart: versions up to 4 stay in the holders;
    2. the same command with lr 2e-3 (a changed hyperparameter): before, it restored run 1's state, lr and
       schedule included; now the restore is refused on every rank before anything is applied, naming the field;
    3. run 1's command with more steps (a longer schedule): it resumes, first step v + 1, and ends bit-exact with an
       uninterrupted 8-step run;
    4. lr 2e-3 with resume "never": starts fresh and drops the old versions."""
    holders, job = str(tmp_path / "holders"), f"t{uuid.uuid4().hex[:8]}"
    common = dict(stage=2, dtype="bf16", job_id=job, start_holders=False, holder_dir=holders, max_restarts=0)
    try:
        first = tmp_path / "first"
        res = run_job(first, steps=6, inject="kill-rank:1@5", extra=["--optimizer", "fused-adamw"], **common)
        assert not res.ok, trainer_logs(str(first))[-2000:]
        other = tmp_path / "other"
        res = run_job(other, steps=6, extra=["--optimizer", "fused-adamw", "--lr", "2e-3"], **common)
        assert not res.ok and res.fatal, (res, trainer_logs(str(other))[-3000:])
        logs = trainer_logs(str(other))
        assert "another run's snapshot (its fingerprint differs: config: optimizer.params.lr was 0.001, now 0.002" \
            in logs, logs[-3000:]
        assert not os.path.exists(os.path.join(str(other), "losses_rank0.jsonl"))   # nothing trained, nothing applied
        longer = tmp_path / "longer"
        res = run_job(longer, steps=8, extra=["--optimizer", "fused-adamw"], **common)
        assert res.ok, trainer_logs(str(longer))[-3000:]
        v = restores(longer)[0]
        assert v in (3, 4), restores(longer)
        logs = trainer_logs(str(longer))
        assert f"restored version {v} from holder memory, taken " in logs and "ds_pretrain_gpt.py" in logs, logs[-2000:]
        for r in range(2):
            steps = [rec["step"] for rec in read_jsonl(os.path.join(str(longer), f"losses_rank{r}.jsonl"))]
            assert steps[0] == v + 1 and steps[-1] == 8, steps
        for r in range(2):   # the steps before the restored version ran in the first launch
            path = os.path.join(str(longer), f"losses_rank{r}.jsonl")
            with open(os.path.join(str(first), f"losses_rank{r}.jsonl")) as a, open(path) as b:
                merged = a.read() + b.read()
            with open(path, "w") as f:
                f.write(merged)
        ref = reference(2, "bf16", 8, extra=("--optimizer", "fused-adamw"))
        cmp = compare_runs(str(longer), str(ref), 2, 8)
        assert not cmp.loss_mismatches and not cmp.state_mismatches, (cmp.loss_mismatches, cmp.state_mismatches)
        fresh = tmp_path / "fresh"
        res = run_job(fresh, steps=4, extra=["--optimizer", "fused-adamw", "--lr", "2e-3", "--shardsafe-json",
                                             json.dumps({"resume": "never"})], **common)
        assert res.ok, trainer_logs(str(fresh))[-3000:]
        assert restores(fresh)[0] == -1
        assert re.search(r'resume is "never": started fresh and dropped \d+ older version', trainer_logs(str(fresh)))
    finally:
        stop_job_holders(holders)


def _need_gib(logs):
    m = re.search(r"Raise memory_budget_gb \(--memory-budget-gb\) to at least ([0-9.]+) GiB", logs)
    assert m, logs[-3000:]
    return float(m.group(1))


def test_a_budget_that_cannot_keep_two_versions_is_said_at_start_never_a_silent_first_version(tmp_path):
    """Before: with a budget for one version per rank but not two, version 1 committed, every later snapshot failed
    with one warning per rank, and rank 0's banner said the engine was protected (a crash at step 10,000 restores
    step 1). Now the start checks every node's need through its holder: on_unprotected "fail" stops the run with the
    number to raise the budget to; "warn" trains on with a banner that says it is NOT protected and a lapse that
    is recorded."""
    strict = tmp_path / "strict"
    res = run_job(strict, stage=2, dtype="bf16", steps=3, budget_gb=0.002, max_restarts=0,
                  extra=["--shardsafe-json", json.dumps({"on_unprotected": "fail"})])
    assert not res.ok and res.fatal, (res, trainer_logs(str(strict))[-3000:])
    need = _need_gib(trainer_logs(str(strict)))
    one = tmp_path / "one-version"
    res = run_job(one, stage=2, dtype="bf16", steps=8, budget_gb=round(need * 0.7, 4), max_restarts=0,
                  extra=["--shardsafe-json", json.dumps({"warn_interval_s": 0.05})])
    assert res.ok, trainer_logs(str(one))[-3000:]
    logs = trainer_logs(str(one))
    assert "this DeepSpeed engine is NOT protected: budget: the holder of node" in logs, logs[-3000:]
    assert "this DeepSpeed engine is protected" not in logs
    assert _events(one, "protection_lapsed"), "no lapse recorded"
    committed = {e["version"] for e in _events(one, "snapshot") if e.get("committed")}
    assert committed and max(committed) < 8, committed   # the second version never fits


def test_without_a_holder_the_banner_says_so_and_the_warning_repeats(tmp_path):
    """Before: "no holder ... training runs unprotected" once in the log, and rank 0's banner said the engine was
    protected. Now the banner says NOT protected with the cause, the warning repeats while it lasts, the lapse is a
    TOR event, and with on_unprotected "fail" the run does not start unprotected."""
    block = {"start_holder": False, "warn_interval_s": 0.05}
    run = tmp_path / "warn"
    res = run_job(run, stage=2, dtype="bf16", steps=6, start_holders=False, max_restarts=0,
                  holder_dir=str(tmp_path / "none"), extra=["--step-sleep", "0.06", "--shardsafe-json", json.dumps(block)])
    assert res.ok, trainer_logs(str(run))[-3000:]
    logs = trainer_logs(str(run))
    assert "this DeepSpeed engine is NOT protected: no_holder: rank 0: no holder for job" in logs, logs[-3000:]
    assert "engine is protected" not in logs
    assert logs.count("training is NOT protected at step") >= 2, logs[-3000:]
    assert _events(run, "protection_lapsed")
    strict = tmp_path / "fail"
    res = run_job(strict, stage=2, dtype="bf16", steps=6, start_holders=False, max_restarts=0,
                  holder_dir=str(tmp_path / "none"),
                  extra=["--shardsafe-json", json.dumps({**block, "on_unprotected": "fail"})])
    assert not res.ok
    assert 'on_unprotected is "fail"' in trainer_logs(str(strict))


def test_a_failed_commit_vote_rebuilds_its_group_and_protection_resumes(tmp_path, reference):
    """Rank 1's snapshot worker stalls past timeout_s right before the commit vote of version 4 (a slow rank):
    every rank's vote fails. Before: the pipeline marked itself broken and skipped every later snapshot with one
    warning, so the kill at step 10 restored version 3. Now the vote's groups (and the parity group's) are built
    again under that version and the vote resumes at the next snapshot: the restart restores version 8 or 9 and the
    run ends bit-exact with an uninterrupted one."""
    block = {"timeout_s": 3}
    res = run_job(tmp_path, stage=2, dtype="bf16", steps=12, inject="stall-vote:1@4&kill-rank:1@10",
                  extra=["--optimizer", "fused-adamw", "--shardsafe-json", json.dumps(block)],
                  env={"SHARDSAFE_INJECT_STALL_S": "4.5"})
    assert res.ok and res.attempts == 2, (res, trainer_logs(str(tmp_path))[-4000:])
    got = restores(tmp_path)
    assert got[0] == -1 and got[1] in (8, 9), got
    logs = trainer_logs(str(tmp_path))
    assert "the commit vote of snapshot 4 failed" in logs and "vote retried at version 5" in logs, logs[-4000:]
    committed = {e["version"] for e in _events(tmp_path, "snapshot") if e.get("committed") and e.get("attempt") == 0}
    assert 4 not in committed and {5, 6, 7, 8} <= committed, sorted(committed)
    resumed_without_start_over(tmp_path, got[1], 12)
    ref = reference(2, "bf16", 12, extra=("--optimizer", "fused-adamw"))
    cmp = compare_runs(str(tmp_path), str(ref), 2, 12)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)


def test_the_programs_own_load_checkpoint_after_a_restore_is_decided_by_every_rank_together(tmp_path, reference):
    """The program resumes with its own ``engine.load_checkpoint(dir)`` after the restore, and its directories are
    node-local: rank 0 finds a checkpoint of step 8 (newer than the snapshot), rank 1 one of step 3 (older). Before,
    each rank decided alone: rank 0 loaded step 8 and rank 1 kept the snapshot (two states in one job). Now the ranks
    agree first: they find different checkpoints, so every rank continues from the snapshot, said once, and the run
    ends bit-exact."""
    ck = tmp_path / "ck"
    for rank, step in ((0, 8), (1, 3)):   # each directory: a plain DeepSpeed checkpoint of the same job at `step`
        d = tmp_path / f"save{step}"
        res = run_job(d, stage=2, dtype="bf16", steps=step, shardsafe=False, max_restarts=0,
                      extra=["--optimizer", "fused-adamw", "--save-dir", str(ck / f"d{rank}"), "--save-at", str(step)],
                      preload=reference_preload(PLAIN_DEEPSPEED, False))
        assert res.ok, trainer_logs(str(d))[-2000:]
    run = tmp_path / "run"
    res = run_job(run, stage=2, dtype="bf16", steps=10, inject="kill-rank:1@6", max_restarts=1,
                  extra=["--optimizer", "fused-adamw", "--load", str(ck / "d{rank}"), "--load-from-attempt", "1"])
    assert res.ok and res.attempts == 2, (res, trainer_logs(str(run))[-4000:])
    v = restores(run)[1]
    logs = trainer_logs(str(run))
    assert "the ranks find different checkpoints under" in logs and "global steps [8, 3]" in logs, logs[-3000:]
    resumed_without_start_over(run, v, 10)
    cmp = compare_runs(str(run), str(reference(2, "bf16", 10, extra=("--optimizer", "fused-adamw"))), 2, 10)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)
