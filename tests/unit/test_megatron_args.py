"""--shardsafe-* flags: argument group, defaults, conversion to ShardsafeConfig, and bad values."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from shardsafe.adapters.megatron.args import add_arguments, compose_extra_args_provider, config_from_args
from shardsafe.config import ConfigError, ShardsafeConfig


def parse(*argv: str) -> argparse.Namespace:
    return add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_flags_live_in_their_own_group_and_provider_returns_parser():
    p = argparse.ArgumentParser()
    assert add_arguments(p) is p  # Megatron does `parser = extra_args_provider(parser)`
    group = next(g for g in p._action_groups if g.title == "shardsafe")
    flags = {s for a in group._group_actions for s in a.option_strings}
    assert {"--shardsafe", "--shardsafe-interval", "--shardsafe-memory-budget-gb", "--shardsafe-parity-shards",
            "--shardsafe-parity-group-size", "--shardsafe-holder-dir", "--shardsafe-job-id", "--shardsafe-node",
            "--shardsafe-timeout-s", "--shardsafe-run-dir", "--shardsafe-no-restore",
            "--shardsafe-no-start-holder"} <= flags


def test_off_by_default_and_defaults_come_from_the_config():
    cfg = config_from_args(parse())
    assert cfg.enabled is False
    d = ShardsafeConfig()
    assert (cfg.interval, cfg.parity_shards, cfg.parity_group_size, cfg.restore, cfg.start_holder) == \
        (d.interval, d.parity_shards, d.parity_group_size, True, True)


def test_values_reach_the_config():
    cfg = config_from_args(parse("--shardsafe", "--shardsafe-interval", "5", "--shardsafe-memory-budget-gb", "2.5",
                                 "--shardsafe-parity-shards", "2", "--shardsafe-parity-group-size", "6",
                                 "--shardsafe-holder-dir", "/tmp/h", "--shardsafe-job-id", "j42",
                                 "--shardsafe-node", "n3", "--shardsafe-timeout-s", "7",
                                 "--shardsafe-no-restore", "--shardsafe-no-start-holder"))
    assert cfg == ShardsafeConfig(enabled=True, interval=5, memory_budget_gb=2.5, parity_shards=2,
                                  parity_group_size=6, holder_dir="/tmp/h", job_id="j42", node="n3", timeout_s=7.0,
                                  restore=False, start_holder=False, run_dir=cfg.run_dir)


def test_persistent_tier_flags_reach_the_config():
    cfg = config_from_args(parse("--shardsafe", "--shardsafe-persist-dir", "/ckpt/ss", "--shardsafe-persist-every", "5",
                                 "--shardsafe-persist-keep", "3", "--shardsafe-persist-mbps", "200"))
    assert (cfg.persist_dir, cfg.persist_every, cfg.persist_keep, cfg.persist_mbps) == ("/ckpt/ss", 5, 3, 200.0)
    assert config_from_args(parse("--shardsafe")).persist_dir == ShardsafeConfig().persist_dir
    assert config_from_args(parse("--shardsafe", "--shardsafe-hash-threads", "4")).hash_threads == 4


def test_parity_transport_flag_takes_host_or_device():
    assert config_from_args(parse("--shardsafe")).parity_transport == "host"
    assert config_from_args(parse("--shardsafe", "--shardsafe-parity-transport", "device")).parity_transport == "device"
    with pytest.raises(SystemExit):   # argparse names the choices
        parse("--shardsafe-parity-transport", "nccl")


@pytest.mark.parametrize("argv, flag", [
    (["--shardsafe-interval", "0"], "--shardsafe-interval"),
    (["--shardsafe-interval", "-3"], "--shardsafe-interval"),
    (["--shardsafe-memory-budget-gb", "-1"], "--shardsafe-memory-budget-gb"),
    (["--shardsafe-parity-shards", "0"], "--shardsafe-parity-shards"),
    (["--shardsafe-parity-group-size", "-2"], "--shardsafe-parity-group-size"),
    (["--shardsafe-timeout-s", "0"], "--shardsafe-timeout-s"),
    (["--shardsafe-job-id", "a/b"], "--shardsafe-job-id"),
    (["--shardsafe-persist-every", "0"], "--shardsafe-persist-every"),
    (["--shardsafe-persist-mbps", "-1"], "--shardsafe-persist-mbps"),
])
def test_bad_values_raise_config_error_naming_the_flag(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        config_from_args(parse("--shardsafe", *argv))


def test_non_numeric_value_is_an_argparse_error():
    with pytest.raises(SystemExit):
        parse("--shardsafe-interval", "often")


def test_missing_flags_say_how_to_add_them():
    with pytest.raises(ConfigError, match="extra_args_provider"):
        config_from_args(argparse.Namespace(lr=1e-3))


def test_composed_provider_keeps_user_flags_and_is_idempotent():
    def user(p):
        p.add_argument("--my-flag", type=int, default=1)
        return p

    p = compose_extra_args_provider(user)(argparse.ArgumentParser())
    p = compose_extra_args_provider(None)(p)  # flags already there (user added them): not added twice
    ns = p.parse_args(["--my-flag", "3", "--shardsafe", "--shardsafe-interval", "2"])
    assert ns.my_flag == 3 and config_from_args(ns).interval == 2


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MCORE_017 = os.environ.get("SHARDSAFE_TEST_MCORE_LM") or os.path.join(_ROOT, ".venv", "mcore-0.17.1")
_PARSE = """
import json, sys, typing
if not hasattr(typing, "override"):   # megatron.training >= 0.18 on Python 3.11
    typing.override = lambda f: f
from megatron.training import arguments
import megatron.core
from shardsafe.adapters.megatron.args import add_arguments, config_from_args
sys.argv = ["pretrain_gpt.py", "--shardsafe", "--shardsafe-interval", "4"]
cfg = config_from_args(arguments.parse_args(extra_args_provider=add_arguments))
print(json.dumps({"version": megatron.core.__version__, "enabled": cfg.enabled, "interval": cfg.interval}))
"""


def _megatron_lm_env() -> dict | None:
    """An environment whose python imports megatron.training (megatron-core >= 0.17): the side folder
    .venv/mcore-0.17.1 first (docs/megatron.md), else whatever this venv has; None if neither."""
    if os.path.isdir(os.path.join(MCORE_017, "megatron", "training")):
        return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (MCORE_017, os.environ.get("PYTHONPATH")) if p)}
    ok = subprocess.run([sys.executable, "-c", "import megatron.training.arguments"], capture_output=True).returncode
    return dict(os.environ) if ok == 0 else None


def test_megatron_lm_parse_args_accepts_the_provider():
    """Megatron-LM's own parse_args (in a subprocess: this process may hold megatron-core 0.16.1)."""
    env = _megatron_lm_env()
    if env is None:
        pytest.skip(f"megatron.training ships in megatron-core >= 0.17 only; none in {MCORE_017} or this venv "
                    "(docs/megatron.md)")
    r = subprocess.run([sys.executable, "-c", _PARSE], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["enabled"] is True and got["interval"] == 4 and got["version"] >= "0.17", got
