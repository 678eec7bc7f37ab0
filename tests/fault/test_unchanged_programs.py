"""Programs protected without a code change: the DeepSpeed config's "shardsafe" block alone (issue 16).

examples/ds_plain_gpt.py imports nothing of shardsafe: it calls ``deepspeed.initialize`` itself, resumes with
``engine.load_checkpoint(dir)`` and loops from ``engine.global_steps``. The automatic activation
(adapters/autoload.py, installed as site-packages/shardsafe-autoload.pth) protects it because its config has
the block. Real processes, SIGKILL, bit-exact against an uninterrupted run of the same script without the
block, and proof that the restarted attempt continued from the restored version (step 1 ran once per rank).
"""
import json
import os

import pytest

from shardsafe.runcheck import compare_runs, losses_by_attempt, read_jsonl

from .helpers import PLAIN_STEPS as STEPS, plain_config as config, plain_job, restores, trainer_logs

pytestmark = pytest.mark.slow
# The hook: the activation (imported at interpreter start) and, once the program calls deepspeed.initialize, the
# reader that looks for the block in its config (adapters/ds_config.py, standard library only).
HOOK_ONLY = ["shardsafe", "shardsafe.adapters", "shardsafe.adapters.autoload", "shardsafe.adapters.ds_config",
             "shardsafe.env", "shardsafe.errors"]


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


