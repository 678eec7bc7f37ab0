"""HF ``transformers.Trainer`` protected by its DeepSpeed config's "shardsafe" block alone (issue 16, HF part).

examples/hf_trainer_gpt.py is a plain Trainer script: a tiny GPT-2 built from its config, ``TrainingArguments(
deepspeed=<ZeRO-2 bf16 dict with "auto" values>)``, ``Trainer.train()`` without ``resume_from_checkpoint``. Real
transformers and accelerate (the test extra), DeepSpeed on the CPU accelerator, 2 ranks on 2 simulated nodes,
a real SIGKILL at step 5; the same command restarted finishes with the losses and weights of an uninterrupted
run of the script without the block, and its second attempt started right after the restored step (no start
over). The dataset is 24 samples (3 optimizer steps per epoch at 2 ranks x 4): the restores land on an epoch
boundary (v=3) and inside an epoch (v=2, v=4), so the epoch skip, the batch skip of HF's resume and the seeded
sampler's epoch are all on the path; GPT-2's dropout makes the RNG part of what must match.
"""
import os
import sys
import uuid

import pytest

from shardsafe.launch import PRELOAD_HF, LaunchConfig
from shardsafe.runcheck import compare_runs, losses_by_attempt

from .helpers import PLAIN_HF, ROOT, launch, reference_preload, restores, resumed_without_start_over, trainer_logs

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(ROOT, "examples", "hf_trainer_gpt.py")
STEPS = 10
SAMPLES = 24


def hf_job(run_dir, *, inject="", max_restarts=1, protected=True, extra=(), cold=False):
    """Protected runs fork their trainers from a server with `--preload hf`'s modules; unprotected ones (references)
    from one with the frameworks only (helpers.PLAIN_HF), or start cold."""
    cfg = LaunchConfig(nodes=2, nproc_per_node=1, job_id=f"h{uuid.uuid4().hex[:8]}", run_dir=str(run_dir),
                       inject=inject, max_restarts=max_restarts, memory_budget_gb=0.5, start_holders=protected,
                       holder_dir=str(run_dir / "holders"), attempt_timeout_s=300,
                       env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"})
    cmd = [sys.executable, SCRIPT, "--steps", str(STEPS), "--samples", str(SAMPLES), "--out", str(run_dir)] + \
        ([] if protected else ["--no-shardsafe"]) + list(extra)
    return launch(cfg, cmd, preload=PRELOAD_HF if protected else reference_preload(PLAIN_HF, cold))


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf-ref")
    res = hf_job(d, max_restarts=0, protected=False, cold=True)   # cold: what a Trainer alone imports is checked
    assert res.ok, trainer_logs(str(d))[-3000:]
    return d


@pytest.mark.parametrize("kill_at", [5, 4])
def test_hf_trainer_killed_mid_run_resumes_at_the_snapshot_bit_exact(tmp_path, hf_reference, kill_at):
    """Killed before step 5's optimizer step: restored 4 (inside epoch 1: one batch skipped) or 3 (the snapshot
    of 4 was still copying). Killed at 4: restored 3 (epoch 1 starts: epoch 0 not run, no batch skipped) or 2."""
    res = hf_job(tmp_path, inject=f"kill-rank:1@{kill_at}")
    assert res.ok and res.attempts == 2, (res, trainer_logs(str(tmp_path))[-4000:])
    got = restores(tmp_path)
    assert got[0] == -1 and got[1] in (kill_at - 2, kill_at - 1), got
    v = got[1]
    logs = trainer_logs(str(tmp_path))
    assert "this DeepSpeed engine is protected" in logs and "automatic activation" in logs, logs[-3000:]
    assert f"HF Trainer resumed from snapshot version {v} without resume_from_checkpoint being passed" in logs, \
        logs[-3000:]
    assert f"continues at global step {v}" in logs
    resumed_without_start_over(tmp_path, v, STEPS)
    assert f"train() done at global step {STEPS}" in logs
    cmp = compare_runs(str(tmp_path), str(hf_reference), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)


def killed_at_5_resumes_as_its_reference(tmp_path, extra: list[str]):
    """The script with ``extra`` unprotected (the reference), then protected with rank 1 SIGKILLed before step 5:
    restored 3 or 4, continued right after it, every loss and the final state bit-identical. Returns the run."""
    ref = tmp_path / "ref"
    ref.mkdir()
    assert hf_job(ref, max_restarts=0, protected=False, extra=extra).ok, trainer_logs(str(ref))[-3000:]
    run = tmp_path / "run"
    run.mkdir()
    res = hf_job(run, inject="kill-rank:1@5", extra=extra)
    assert res.ok and res.attempts == 2, (res, trainer_logs(str(run))[-4000:])
    got = restores(run)
    assert got[0] == -1 and got[1] in (3, 4), got
    resumed_without_start_over(run, got[1], STEPS)
    cmp = compare_runs(str(run), str(ref), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)
    return run


HF_OWN_OPTIMIZERS = [
    # (TrainingArguments.optim, ZeRO stage, who steps the schedule)
    ("adamw_torch_fused", 2, "hf"),   # transformers 5's default, with HF's linear warmup schedule
    ("adamw_torch", 1, "hf"),
    ("adafactor", 3, "hf"),
    ("sgd", 2, "deepspeed"),          # a "scheduler" block: DeepSpeed's WarmupDecayLR, stepped by the engine
    ("adamw_torch_fused", 3, "deepspeed"),
]


@pytest.mark.parametrize("optim,stage,schedule", HF_OWN_OPTIMIZERS, ids=[f"{o}-z{z}-{s}" for o, z, s in HF_OWN_OPTIMIZERS])
def test_hf_trainer_building_its_own_optimizer_resumes_bit_exact(tmp_path, optim, stage, schedule):
    """A DeepSpeed config without an "optimizer" block: HF builds the optimizer itself (``optim``, weight-decay and
    no-decay groups), passes it to ``deepspeed.initialize`` without a scheduler, builds its LambdaLR afterwards
    over the wrapped optimizer and steps it itself after every ``engine.step()``. That scheduler's constructor
    wrote step 0's learning rate (0 in the warmup) over the restored one: step v+1 ran at lr 0, its loss (computed
    before the step) still matched, every later loss and the final state did not. Now the program's scheduler is
    in the snapshot and put back before step v+1. The final state includes what DeepSpeed and HF report (module and
    optimizer ``state_dict``, counters, HF's scheduler ``state_dict``)."""
    extra = ["--optim", optim, "--zero-stage", str(stage)] + (["--ds-scheduler"] if schedule == "deepspeed" else [])
    run = killed_at_5_resumes_as_its_reference(tmp_path, extra)
    logs = trainer_logs(str(run))
    assert "NOT restored" not in logs, logs[-3000:]
    from shardsafe.payload.manifest import load_tensors
    final = load_tensors(os.path.join(str(run), "final_rank0"))
    assert any(k.startswith("fw/optimizer/") for k in final) and any(k.startswith("fw/module/") for k in final)
    assert any(k.startswith("fw/program_scheduler/0/") for k in final), sorted(final)[:20]


def test_hf_trainer_with_gradient_accumulation_resumes_bit_exact(tmp_path):
    """gradient_accumulation_steps=2: an optimizer step is two micro-batches, so the restored step v skips
    ``(v % updates_per_epoch) * 2`` batches of its epoch (24 samples: 1 step per epoch at 2 ranks x 4 x 2 would
    be too few; 48 samples make 3 steps per epoch). Reference: the same script without the block."""
    killed_at_5_resumes_as_its_reference(tmp_path, ["--gas", "2", "--samples", "48"])


def test_hf_trainer_resuming_from_its_last_checkpoint_takes_the_newer_snapshot(tmp_path, hf_reference):
    """HF's example-script resume: checkpoints every 3 steps, and ``train(resume_from_checkpoint=
    get_last_checkpoint(output_dir))`` at start. Killed before step 6: the restart finds checkpoint-3 and passes
    it, but the snapshot (version 4 or 5) is newer: the engine's ``load_checkpoint`` keeps the snapshot, HF's
    own state counters continue at it, and the run ends as the uninterrupted one (which saved no checkpoints:
    saving one changes nothing of the training)."""
    res = hf_job(tmp_path, inject="kill-rank:1@6", extra=["--save-steps", "3", "--resume-last"])
    assert res.ok and res.attempts == 2, (res, trainer_logs(str(tmp_path))[-4000:])
    got = restores(tmp_path)
    assert got[0] == -1 and got[1] in (4, 5), got
    v = got[1]
    logs = trainer_logs(str(tmp_path))
    ckpt = os.path.join(str(tmp_path), "hf_output", "checkpoint-3")
    assert f"train(resume_from_checkpoint={ckpt})" in logs, logs[-3000:]
    assert f"snapshot version {v} is newer than disk checkpoint global_step3 (step 3)" in logs, logs[-3000:]
    assert (f"HF Trainer resumed from snapshot version {v} instead of resume_from_checkpoint={ckpt} (step 3, "
            "older)") in logs, logs[-3000:]
    resumed_without_start_over(tmp_path, v, STEPS)
    cmp = compare_runs(str(tmp_path), str(hf_reference), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)


def test_without_the_block_the_trainer_imports_nothing_of_shardsafe_beyond_the_hook(hf_reference):
    import json
    for r in range(2):
        with open(os.path.join(str(hf_reference), f"modules_rank{r}.json")) as f:
            # the activation and, from deepspeed.initialize on, its reader of the config (stdlib only)
            assert json.load(f) == ["shardsafe", "shardsafe.adapters", "shardsafe.adapters.autoload",
                                    "shardsafe.adapters.ds_config", "shardsafe.env",
                                    "shardsafe.errors"]
    assert "protected" not in trainer_logs(str(hf_reference))


def _restores_by_engine(run_dir):
    """(attempt, engine scope) -> restored version (min over ranks); "" is the process's first engine."""
    from shardsafe.runcheck import read_jsonl
    out = {}
    for e in read_jsonl(os.path.join(str(run_dir), "events.jsonl")):
        if e.get("kind") == "restore_end":
            k = (int(e.get("attempt") or 0), e.get("engine", ""))
            out[k] = min(out.get(k, e["version"]), e["version"])
    return out


def test_hf_hyperparameter_search_resumes_the_trial_that_crashed_from_its_own_snapshot(tmp_path):
    """``Trainer.hyperparameter_search`` (optuna, a seeded random sampler over the learning rate, 2 trials): HF
    builds a new engine for each trial over a fresh ``model_init`` model. Killed at step 4 of trial 1: before
    engine scopes, trial 1's engine (same layout) restored trial 0's last snapshot, so it started "done" at
    step 10 with trial 0's weights: a silent wrong state. Now the restarted search's trial 0 restores its own
    engine's last version (HF finds its last step done, trains nothing, evaluates the same weights), trial 1
    restores its own (2 or 3), and every loss of both trials and trial 1's final state equal an uninterrupted
    search's."""
    pytest.importorskip("optuna")
    hp = ["--hp-trials", "2"]
    ref = tmp_path / "ref"
    ref.mkdir()
    assert hf_job(ref, max_restarts=0, protected=False, extra=hp).ok, trainer_logs(str(ref))[-3000:]
    run = tmp_path / "run"
    run.mkdir()
    res = hf_job(run, inject="kill-rank:1:engine1@4", extra=hp)
    assert res.ok and res.attempts == 2, (res, trainer_logs(str(run))[-4000:])
    got = _restores_by_engine(run)
    assert got[(0, "")] == -1 and got[(0, "engine1")] == -1, got
    assert got[(1, "")] == STEPS and got[(1, "engine1")] in (2, 3), got
    v = got[(1, "engine1")]
    logs = trainer_logs(str(run))
    assert "engine 1 of this process" in logs, logs[-3000:]
    assert f"HF Trainer resumed from snapshot version {STEPS} " in logs and \
        f"HF Trainer resumed from snapshot version {v} " in logs, logs[-3000:]
    ref_logs = trainer_logs(str(ref))
    for t in range(2):   # the same trials (seeded sampler), each ending where the uninterrupted search's did
        lrs = {line.split("learning_rate ")[1].split(",")[0] for line in ref_logs.splitlines()
               if f"trial {t}: learning_rate" in line}
        assert len(lrs) == 1 and all(f"trial {t}: learning_rate {lr}" in logs for lr in lrs), (t, lrs)
    for r in range(2):   # attempt 1 trained neither trial 0 again nor trial 1 from its start
        by = losses_by_attempt(str(run), r)
        assert set(range(1, STEPS + 4)) <= set(by[0]) and min(by[1]) == STEPS + v + 1, (r, v, by)
        assert max(by[1]) == 2 * STEPS, (r, by)
    cmp = compare_runs(str(run), str(ref), 2, 2 * STEPS, offsets={"engine1": STEPS})
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)
