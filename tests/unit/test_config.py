"""Malformed "shardsafe" blocks fail at initialize, before DeepSpeed builds anything."""
import pytest

from shardsafe.adapters.deepspeed import config_from_ds, initialize
from shardsafe.config import ConfigError, ShardsafeConfig


@pytest.mark.parametrize("block, words", [
    ({"intervl": 1}, ["unknown key", "intervl", "interval"]),
    ({"interval": "2"}, ["shardsafe.interval", "int", "'2'"]),
    ({"interval": -1}, ["shardsafe.interval", ">= 1", "-1"]),
    ({"interval": 0}, ["shardsafe.interval", ">= 1"]),
    ({"memory_budget_gb": -2}, ["memory_budget_gb", ">= 0"]),
    ({"enabled": "yes"}, ["shardsafe.enabled", "bool"]),
    ({"job_id": "a/b"}, ["job_id", "'/'"]),
    ({"parity_shards": 0}, ["parity_shards"]),
    ({"parity_transport": "nccl"}, ["shardsafe.parity_transport", "'host', 'device'", "'nccl'"]),
    ([1, 2], ["JSON object"]),
])
def test_bad_blocks(block, words):
    with pytest.raises(ConfigError) as e:
        config_from_ds({"shardsafe": block})
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_initialize_fails_before_deepspeed_runs():
    # No process group exists here: reaching deepspeed.initialize would fail differently.
    with pytest.raises(ConfigError, match="unknown key"):
        initialize(model=None, config={"train_batch_size": 1, "shardsafe": {"enable": True}})


def test_defaults_and_absent_block():
    assert config_from_ds({"train_batch_size": 4}).enabled is False
    cfg = config_from_ds({"shardsafe": {"interval": 5, "memory_budget_gb": 1.5}})
    assert cfg.enabled and cfg.interval == 5 and cfg.memory_budget_bytes == int(1.5 * 2**30)
    assert ShardsafeConfig().memory_budget_bytes > 0


def test_device_parity_transport_without_a_gpu_is_refused_before_any_group_exists():
    """No process group is initialized here: the check must come before ParityExchange creates groups, so
    no rank of a job is left waiting in new_group for one that cannot take part."""
    import torch

    from shardsafe.exchange import ExchangeError, ParityExchange
    from shardsafe.topology import RankPlace, build_parity_groups
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the device transport is usable here (tests/dist covers its CPU double)")
    plan = build_parity_groups([RankPlace(rank=r, dp=r, tp=0, pp=0, node=f"n{r}") for r in range(3)],
                               group_size=3, parity_shards=1)
    with pytest.raises(ExchangeError, match="needs a CUDA device.*use parity_transport 'host'"):
        ParityExchange(plan, 0, transport="device")
