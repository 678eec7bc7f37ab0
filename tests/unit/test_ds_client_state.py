"""adapters/deepspeed/client_state.py: which program's client state a DeepSpeed job keeps, and the one a load_checkpoint
without a checkpoint returns after a restore (the fault tests run it: tests/fault/test_unchanged_programs.py)."""
import argparse

import pytest

from shardsafe.adapters.deepspeed.client_state import client_state_at, client_state_without_checkpoint, program_layout
from shardsafe.config import ConfigError, ShardsafeConfig


class NeoXArgs(argparse.Namespace):
    """GPT-NeoX's arguments class has this name."""


def test_the_layout_is_recognised_from_the_args_given_to_initialize():
    megatron_ds = argparse.Namespace(deepspeed=True, consumed_train_samples=0, consumed_valid_samples=0, seq_length=8)
    assert program_layout("auto", NeoXArgs(x=1)) == "neox"
    assert program_layout("auto", megatron_ds) == "megatron-deepspeed"
    assert program_layout("auto", argparse.Namespace(deepspeed_config="ds.json", local_rank=0)) == "none"
    assert program_layout("auto", None) == "none"
    assert program_layout("none", megatron_ds) == "none" and program_layout("neox", None) == "neox"


def test_the_synthesized_client_state_is_the_programs_own_layout_at_v():
    rng = {"random_rng_state": (3, (1, 2), None), "torch_rng_state": "t"}
    assert client_state_without_checkpoint("none", v=7, program_args=None, live_samples=56, rng=rng, dp_world=2) is None
    assert client_state_without_checkpoint("neox", v=7, program_args=NeoXArgs(), live_samples=56, rng=rng,
                                           dp_world=2) == {"iteration": 7, **rng}
    live = argparse.Namespace(deepspeed=True, consumed_train_samples=0, consumed_valid_samples=0, seq_length=8)
    got = client_state_without_checkpoint("megatron-deepspeed", v=7, program_args=live, live_samples=56, rng=rng,
                                          dp_world=2)
    assert got["iteration"] == 7 and got["checkpoint_version"] == 3.0 and got["rng_state"] == [rng, rng]
    assert got["args"].consumed_train_samples == 56 and got["args"].seq_length == 8   # check_checkpoint_args agrees
    assert live.consumed_train_samples == 0 and got["args"] is not live   # the program's own args untouched


def _megatron_ds_args(**kw):
    """The counters and settings of Megatron-DeepSpeed's args that its loop derives its tokens and validation
    position from: 8 samples per step (global_batch_size), 16 tokens per sample, 2 eval iterations every 5."""
    base = dict(deepspeed=True, consumed_train_samples=0, consumed_valid_samples=0, consumed_train_tokens=0,
                seq_length=16, global_batch_size=8, eval_interval=5, eval_iters=2, curriculum_learning_legacy=False,
                data_efficiency_curriculum_learning=False, random_ltd=False, rampup_batch_size=None)
    return argparse.Namespace(**{**base, **kw})


def test_megatron_deepspeed_tokens_and_validation_position_follow_the_step():
    """Megatron-DeepSpeed's train() adds new_samples * seq_length tokens per step and evaluate() eval_iters global
    batches every eval_interval-th iteration: as of v=12 with 96 samples, 1536 tokens and 2 evaluations (32
    samples). Without a checkpoint they used to restart at 0 (a --lr-decay-tokens schedule restarted with them)."""
    got = client_state_without_checkpoint("megatron-deepspeed", v=12, program_args=_megatron_ds_args(),
                                          live_samples=96, rng={}, dp_world=1)
    a = got["args"]
    assert (a.consumed_train_samples, a.consumed_train_tokens, a.consumed_valid_samples) == (96, 1536, 32)
    # a varying sequence length or batch size: not a function of the step, left as the program started them
    a = client_state_without_checkpoint("megatron-deepspeed", v=12, program_args=_megatron_ds_args(
        curriculum_learning_legacy=True, rampup_batch_size=["4", "4", "100"]), live_samples=96, rng={},
        dp_world=1)["args"]
    assert (a.consumed_train_tokens, a.consumed_valid_samples) == (0, 0)
    # an older checkpoint (step 5: 40 samples, 640 tokens, one evaluation) moves to v=12 where its values are
    # the loop's, and only there
    old = {"iteration": 5, "args": _megatron_ds_args(consumed_train_samples=40, consumed_train_tokens=640,
                                                     consumed_valid_samples=16)}
    changed = client_state_at(old, step=5, v=12, samples=40, live_samples=96, rng=None, dp_rank=0)
    a = old["args"]
    assert (old["iteration"], a.consumed_train_samples, a.consumed_train_tokens, a.consumed_valid_samples) == \
        (12, 96, 1536, 32), changed
    odd = {"iteration": 5, "args": _megatron_ds_args(consumed_train_samples=40, consumed_train_tokens=600,
                                                     consumed_valid_samples=16)}
    client_state_at(odd, step=5, v=12, samples=40, live_samples=96, rng=None, dp_rank=0)
    assert odd["args"].consumed_train_tokens == 600   # not what the loop makes of step 5: not touched


def test_the_setting_is_checked():
    assert ShardsafeConfig(enabled=False).resume_client_state == "auto"
    with pytest.raises(ConfigError, match="resume_client_state must be one of 'auto', 'neox', 'megatron-deepspeed'"):
        ShardsafeConfig(enabled=False, resume_client_state="megatron")


def test_an_old_checkpoints_tracker_states_become_the_snapshots_and_the_program_draws_on_from_there():
    # Megatron-DeepSpeed keeps its model-parallel RNG tracker's states in rng_state[dp]['rng_tracker_states'] and
    # sets them after load_checkpoint: the old checkpoint's (step 4) must be replaced by the restored ones (v).
    import torch
    from deepspeed.runtime.activation_checkpointing import checkpointing as ck

    from shardsafe.adapters.deepspeed.client_state import client_state_at, live_rng
    tracker = ck.get_cuda_rng_tracker()
    tracker.reset()
    try:
        tracker.add("model-parallel-rng", 1234)
        at_step4 = {k: v.clone() for k, v in tracker.get_states().items()}
        with tracker.fork():
            torch.rand(5)                                   # training from step 4 to v draws from the tracker
        rng = live_rng()                                    # what the snapshot restored: the states at v
        with tracker.fork():
            want = torch.rand(8)                            # what an uninterrupted run draws next
        old = {"random_rng_state": None, "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": at_step4}
        client = {"iteration": 4, "rng_state": [dict(old), dict(old)]}
        changed = client_state_at(client, step=4, v=9, samples=None, live_samples=0, rng=rng, dp_rank=1)
        assert client["iteration"] == 9 and "rng_state[1].rng_tracker_states" in changed, changed
        # the restarted program: a freshly seeded tracker, then its own set_states from the client state
        tracker.reset()
        tracker.add("model-parallel-rng", 1234)
        tracker.set_states(client["rng_state"][1]["rng_tracker_states"])
        with tracker.fork():
            got = torch.rand(8)
        assert torch.equal(got, want)
        # the old checkpoint's states would have replayed steps 4..v instead
        tracker.set_states(at_step4)
        with tracker.fork():
            assert not torch.equal(torch.rand(8), want)
    finally:
        tracker.reset()
