"""adapters/ds_client_state.py: which program's client state a DeepSpeed job keeps, and the one a load_checkpoint
without a checkpoint returns after a restore (the fault tests run it: tests/fault/test_unchanged_programs.py)."""
import argparse

import pytest

from shardsafe.adapters.ds_client_state import client_state_without_checkpoint, program_layout
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


def test_the_setting_is_checked():
    assert ShardsafeConfig(enabled=False).resume_client_state == "auto"
    with pytest.raises(ConfigError, match="resume_client_state must be one of 'auto', 'neox', 'megatron-deepspeed'"):
        ShardsafeConfig(enabled=False, resume_client_state="megatron")
