"""Programs protected without a code change: the DeepSpeed config's "shardsafe" block alone (issue 16).

examples/ds_plain_gpt.py imports nothing of shardsafe: it calls ``deepspeed.initialize`` itself, resumes with
``engine.load_checkpoint(dir)`` and loops from ``engine.global_steps``. The automatic activation
(adapters/autoload.py, installed as site-packages/shardsafe-autoload.pth) protects it because its config has
the block. Real processes, SIGKILL, bit-exact against an uninterrupted run of the same script without the
block, and proof that the restarted attempt continued from the restored version (step 1 ran once per rank).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid

import pytest

from shardsafe.launch import PRELOAD_DEEPSPEED, LaunchConfig
from shardsafe.launch.discovery import free_port
from shardsafe.runcheck import compare_runs, losses_by_attempt, read_jsonl

from .helpers import ROOT, launch, restores, trainer_logs

pytestmark = pytest.mark.slow
PLAIN = os.path.join(ROOT, "examples", "ds_plain_gpt.py")
BASE = os.path.join(ROOT, "configs", "deepspeed", "plain_zero2_bf16.json")
STEPS = 10
# The hook: the activation (imported at interpreter start) and, once the program calls deepspeed.initialize, the
# reader that looks for the block in its config (adapters/ds_config.py, standard library only).
HOOK_ONLY = ["shardsafe", "shardsafe.adapters", "shardsafe.adapters.autoload", "shardsafe.adapters.ds_config",
             "shardsafe.env", "shardsafe.errors"]


def config(path, *, block=True, **shardsafe):
    with open(BASE) as f:
        cfg = json.load(f)
    if block:
        cfg["shardsafe"].update(shardsafe)
    else:
        del cfg["shardsafe"]
    with open(path, "w") as f:
        json.dump(cfg, f)
    return str(path)


def plain_job(run_dir, cfg_path, *, inject="", max_restarts=1, ckpt="", save_every=0, config_as="path",
              protected=True, client_state="step"):
    cfg = LaunchConfig(nodes=2, nproc_per_node=1, job_id=f"p{uuid.uuid4().hex[:8]}", run_dir=str(run_dir),
                       inject=inject, max_restarts=max_restarts, memory_budget_gb=0.5, start_holders=protected,
                       holder_dir=str(run_dir / "holders"), attempt_timeout_s=300)
    cmd = [sys.executable, PLAIN, "--config", cfg_path, "--config-as", config_as, "--steps", str(STEPS),
           "--out", str(run_dir), "--client-state", client_state] + \
        (["--ckpt-dir", ckpt, "--save-every", str(save_every)] if ckpt else [])
    return launch(cfg, cmd, preload=PRELOAD_DEEPSPEED if protected else ())


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory):
    """The same script, its config without the block: plain DeepSpeed, and nothing of shardsafe beyond the hook."""
    d = tmp_path_factory.mktemp("plain-ref")
    res = plain_job(d, config(d / "ds.json", block=False), max_restarts=0, protected=False)
    assert res.ok, trainer_logs(str(d))[-3000:]
    return d


def modules(run_dir, rank):
    with open(os.path.join(str(run_dir), f"modules_rank{rank}.json")) as f:
        return json.load(f)


def _resumed_once(run_dir, restored):
    """Every rank: attempt 1 started right after the restored version, and step 1 ran in attempt 0 only."""
    for r in range(2):
        by = losses_by_attempt(str(run_dir), r)
        assert min(by[1]) == restored + 1 and 1 in by[0] and 1 not in by[1], (r, restored, by)


def test_without_the_block_nothing_of_shardsafe_runs(plain_reference):
    for r in range(2):
        assert modules(plain_reference, r) == HOOK_ONLY, modules(plain_reference, r)
    assert not os.path.exists(plain_reference / "holders") or not os.listdir(plain_reference / "holders")
    assert not os.path.exists(plain_reference / "events.jsonl") or not any(
        e.get("kind") in ("restore_end", "snapshot") for e in read_jsonl(str(plain_reference / "events.jsonl")))
    assert "protected" not in trainer_logs(str(plain_reference))


@pytest.mark.parametrize("config_as", ["path", "args"])
def test_the_block_alone_protects_a_plain_script_under_shardsafe_launch(tmp_path, plain_reference, config_as):
    """A rank SIGKILLed at step 5; the script's load_checkpoint finds no disk checkpoint (as DeepSpeed says:
    (None, None)) and the engine continues from the snapshot restored at initialize."""
    ckpt = tmp_path / "ckpt"
    res = plain_job(tmp_path, config(tmp_path / "ds.json"), inject="kill-rank:1@5", ckpt=str(ckpt),
                    config_as=config_as)
    assert res.ok and res.attempts == 2, (res, trainer_logs(str(tmp_path))[-3000:])
    got = restores(tmp_path)
    assert got[0] == -1 and got[1] in (3, 4), got
    logs = trainer_logs(str(tmp_path))
    assert "this DeepSpeed engine is protected" in logs and "automatic activation" in logs, logs[-3000:]
    assert "SHARDSAFE_AUTO=0" in logs
    assert f"load_checkpoint({ckpt}) -> None" in logs and "no checkpoint there" in logs
    _resumed_once(tmp_path, got[1])
    cmp = compare_runs(str(tmp_path), str(plain_reference), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)
    assert "shardsafe.runtime" in modules(tmp_path, 0)


@pytest.mark.parametrize("client_state", ["step", "neox", "megatron-deepspeed"])
def test_an_older_disk_checkpoint_loses_to_the_newer_snapshot(tmp_path, plain_reference, client_state):
    """The script saves a DeepSpeed checkpoint every 3 steps and loads it at start: after the kill at step 8
    the newest checkpoint is step 6 and the snapshot is 7 (or 6); the snapshot wins, the checkpoint's client
    state comes back as of the snapshot. With GPT-NeoX's client state the script then sets its iteration and
    RNG from it, with Megatron-DeepSpeed's also its data position (``args.consumed_train_samples``, from which
    it picks its batches): the checkpoint's own values (step 6) would replay step 7's dropout and data."""
    ckpt = tmp_path / "ckpt"
    res = plain_job(tmp_path, config(tmp_path / "ds.json"), inject="kill-rank:1@8", ckpt=str(ckpt), save_every=3,
                    client_state=client_state)
    assert res.ok and res.attempts == 2, (res, trainer_logs(str(tmp_path))[-3000:])
    v = restores(tmp_path)[1]
    assert v in (6, 7), restores(tmp_path)
    logs = trainer_logs(str(tmp_path))
    if v > 6:
        assert f"snapshot version {v} is newer than disk checkpoint global_step6 (step 6)" in logs, logs[-3000:]
        changed = {"step": "step", "neox": "iteration, random_rng_state, np_rng_state, torch_rng_state",
                   "megatron-deepspeed": "iteration, args.consumed_train_samples, rng_state[0].random_rng_state, "
                                         "rng_state[0].np_rng_state, rng_state[0].torch_rng_state"}[client_state]
        assert f"client state is returned as of the snapshot: {changed}" in logs, logs[-3000:]
        if client_state != "step":
            assert f"iteration {v} from the client state" in logs
    assert f"continuing after step {v}" in logs
    _resumed_once(tmp_path, v)
    # the reference never saved a checkpoint; saving changes nothing in the training, so the runs agree bit for bit
    cmp = compare_runs(str(tmp_path), str(plain_reference), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)


@pytest.mark.parametrize("client_state", ["neox", "megatron-deepspeed"])
def test_a_crash_before_the_first_disk_checkpoint_resumes_the_programs_own_counters(tmp_path, plain_reference,
                                                                                  client_state):
    """GPT-NeoX and Megatron-DeepSpeed count their iterations (and Megatron-DeepSpeed its data position) from the
    client state load_checkpoint returns, and from 0 when it returns none. Killed at step 5 before any disk
    checkpoint: the restarted script's load_checkpoint finds an empty directory, and shardsafe answers with the
    client state that program would have saved at the snapshot (recognised from the ``args`` it gave
    deepspeed.initialize), so it continues at the snapshot's iteration instead of counting from 0 (which would
    train steps 1..10 once more on the restored weights: more losses than the reference, and other ones)."""
    ckpt = tmp_path / "ckpt"
    res = plain_job(tmp_path, config(tmp_path / "ds.json"), inject="kill-rank:1@5", ckpt=str(ckpt),
                    client_state=client_state)
    assert res.ok and res.attempts == 2, (res, trainer_logs(str(tmp_path))[-3000:])
    v = restores(tmp_path)[1]
    assert v in (3, 4), restores(tmp_path)
    logs = trainer_logs(str(tmp_path))
    keys = {"neox": "iteration, np_rng_state, random_rng_state, torch_rng_state",
            "megatron-deepspeed": "args, checkpoint_version, iteration, rng_state"}[client_state]
    assert (f"no checkpoint there; the engine continues from snapshot version {v}, and the call returns a "
            f"{client_state} client state as of it ({keys}) so the program continues at iteration {v}") in logs, \
        logs[-3000:]
    assert f"iteration {v} from the client state" in logs, logs[-3000:]
    assert not ckpt.exists() or not os.listdir(ckpt)   # no disk checkpoint was ever written
    _resumed_once(tmp_path, v)
    cmp = compare_runs(str(tmp_path), str(plain_reference), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)


def test_a_newer_disk_checkpoint_wins_over_the_snapshot(tmp_path):
    """Snapshots every 4 steps, a checkpoint every step: killed at step 7, the snapshot is version 4 and the
    disk holds step 6. The program's load_checkpoint of the newer checkpoint is honoured (and said so), and
    training continues after step 6. (DeepSpeed's checkpoint carries no RNG state, so this run is not compared
    bit for bit: what is checked is which state it continued from.)"""
    ckpt = tmp_path / "ckpt"
    res = plain_job(tmp_path, config(tmp_path / "ds.json", interval=4), inject="kill-rank:1@7", ckpt=str(ckpt),
                    save_every=1)
    assert res.ok and res.attempts == 2, (res, trainer_logs(str(tmp_path))[-3000:])
    assert restores(tmp_path)[1] == 4, restores(tmp_path)
    logs = trainer_logs(str(tmp_path))
    assert "disk checkpoint global_step6 (step 6) is newer than the snapshot (version 4): loading it" in logs, \
        logs[-3000:]
    assert "continuing after step 6" in logs
    for r in range(2):
        assert min(losses_by_attempt(str(tmp_path), r)[1]) == 7


def test_plain_torchrun_job_killed_and_resubmitted_by_the_same_command(tmp_path, plain_reference):
    """What a user of plain torchrun does: the job dies (a rank SIGKILLed; torchrun's in-place restart is not
    used: with gloo on this CPU machine it can hang in connectFullMesh), and the same command is submitted
    again. The trainers start the node's holder themselves; the second submission restores from it."""
    cfg_path = config(tmp_path / "ds.json", parity_group_size=1)   # one node: no parity group possible
    port = free_port()
    # short: DIR/shardsafe-UID/cmd-<16 hex>/NODE.sock must fit AF_UNIX's 108 bytes (pytest's tmp_path is long)
    holders = tempfile.mkdtemp(prefix="ss-")

    def torchrun(attempt, inject=""):
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "2",
               "--master-port", str(port), PLAIN, "--config", cfg_path, "--steps", str(STEPS), "--out", str(tmp_path)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSAFE_") and k not in ("SLURM_JOB_ID",)}
        env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", SHARDSAFE_HOLDER_DIR=holders,
                   SHARDSAFE_RUN_DIR=str(tmp_path), SHARDSAFE_ATTEMPT=str(attempt))
        if inject:
            env["SHARDSAFE_INJECT"] = inject
        with open(tmp_path / "torchrun.log", "ab") as log:
            return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    procs = []
    try:
        procs.append(torchrun(0, inject="kill-rank:1@5"))
        assert procs[-1].wait(timeout=300) != 0
        procs.append(torchrun(1))
        assert procs[-1].wait(timeout=300) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        from .test_two_jobs import stop_job_holders
        stop_job_holders(holders)
        shutil.rmtree(holders, ignore_errors=True)
    got = restores(tmp_path)
    assert got[1] in (3, 4), got
    _resumed_once(tmp_path, got[1])
    cmp = compare_runs(str(tmp_path), str(plain_reference), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)
