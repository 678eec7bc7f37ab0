"""Lightning's DeepSpeed strategy protected by its DeepSpeed config's "shardsafe" block alone (issue 16).

examples/lightning_gpt.py is a plain Lightning script: a tiny GPT ``LightningModule``, ``Trainer(strategy=
DeepSpeedStrategy(config=<ZeRO-2 bf16 dict, DeepSpeed's AdamW and WarmupLR, gradient clipping>))``, ``fit``
without ``ckpt_path``. Real Lightning 2.6.6 (the test extra) and DeepSpeed on its CPU accelerator; the one test
double is the GPU: Lightning refuses its DeepSpeed strategy without a ``CUDAAccelerator``, so the script runs
with examples/_lightning_cpu_shims.py's CPU stand-in for it. 2 ranks on 2 simulated nodes, a real SIGKILL at
step 5 or 4; the same command restarted finishes with the losses and weights of an uninterrupted run of the
script without the block, and the restarted attempt's first step is the restored version + 1. 24 samples make 3
steps per epoch (12 per rank, batches of 4): the restores land inside an epoch (v=2, v=4) and on its last batch
(v=3), so Lightning's restart stages, the data skip and the sampler's epoch are on the path; the model's dropout
makes the RNG part of what must match, and WarmupLR the LR schedule (which Lightning steps itself).
"""
import json
import os
import sys
import uuid

import pytest

from shardsafe.launch import PRELOAD_DEEPSPEED, LaunchConfig
from shardsafe.runcheck import compare_runs

from .helpers import ROOT, launch, restores, resumed_without_start_over, trainer_logs

pytest.importorskip("lightning")

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(ROOT, "examples", "lightning_gpt.py")
STEPS = 10


def lt_job(run_dir, *, inject="", max_restarts=1, protected=True):
    cfg = LaunchConfig(nodes=2, nproc_per_node=1, job_id=f"l{uuid.uuid4().hex[:8]}", run_dir=str(run_dir),
                       inject=inject, max_restarts=max_restarts, memory_budget_gb=0.5, start_holders=protected,
                       holder_dir=str(run_dir / "holders"), attempt_timeout_s=300)
    cmd = [sys.executable, SCRIPT, "--steps", str(STEPS), "--samples", "24", "--cpu", "--out", str(run_dir)] + \
        ([] if protected else ["--no-shardsafe"])
    return launch(cfg, cmd, preload=PRELOAD_DEEPSPEED if protected else ())


@pytest.fixture(scope="module")
def lt_reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("lt-ref")
    res = lt_job(d, max_restarts=0, protected=False)
    assert res.ok, trainer_logs(str(d))[-3000:]
    return d


@pytest.mark.parametrize("kill_at", [5, 4])
def test_lightning_fit_killed_mid_run_resumes_at_the_snapshot_bit_exact(tmp_path, lt_reference, kill_at):
    res = lt_job(tmp_path, inject=f"kill-rank:1@{kill_at}")
    assert res.ok and res.attempts == 2, (res, trainer_logs(str(tmp_path))[-4000:])
    got = restores(tmp_path)
    assert got[0] == -1 and got[1] in (kill_at - 2, kill_at - 1), got
    v = got[1]
    logs = trainer_logs(str(tmp_path))
    assert "this DeepSpeed engine is protected" in logs and "automatic activation" in logs, logs[-3000:]
    assert f"Lightning fit resumed from snapshot version {v} without ckpt_path" in logs, logs[-3000:]
    resumed_without_start_over(tmp_path, v, STEPS)
    assert f"fit() done at global step {STEPS}" in logs
    cmp = compare_runs(str(tmp_path), str(lt_reference), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)


def test_without_the_block_lightning_imports_nothing_of_shardsafe_beyond_the_hook(lt_reference):
    for r in range(2):
        with open(os.path.join(str(lt_reference), f"modules_rank{r}.json")) as f:
            assert json.load(f) == ["shardsafe", "shardsafe.adapters", "shardsafe.adapters.autoload",
                                    "shardsafe.adapters.ds_config", "shardsafe.env",
                                    "shardsafe.errors"]
    assert "protected" not in trainer_logs(str(lt_reference))
