"""A Megatron-LM job the launcher re-formed at another data-parallel size keeps its global batch (issue 44).

Megatron-LM runs ``global_batch_size / (micro_batch_size x data-parallel size)`` micro-batches per step. With
``--global-batch-size`` the batch is kept by itself; without it Megatron defaults the batch to ``micro_batch_size x``
the data-parallel size it starts at, so a job continued at D' < D would train with another batch (another run, whose
snapshots the restore refuses). ``keep_global_batch`` (run by shardsafe's extra_args_provider right after Megatron's
parser parses) sets it from SHARDSAFE_FULL_WORLD_SIZE, and refuses a batch D' cannot split, naming the sizes that
can. The live refusal of a changed global batch by the run fingerprint is in
tests/dist/test_megatron_reshard_restore.py.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from shardsafe.adapters.megatron.args import compose_extra_args_provider, keep_global_batch
from shardsafe.config import ConfigError

from .test_megatron_args import MCORE_017, _megatron_lm_env


def _args(**kw) -> argparse.Namespace:
    base = {"micro_batch_size": 2, "global_batch_size": None, "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 1, "context_parallel_size": 1}
    return argparse.Namespace(**{**base, **kw})


def _env(world: int, full: int | None) -> dict:
    return {"WORLD_SIZE": str(world), "RANK": "0", **({"SHARDSAFE_FULL_WORLD_SIZE": str(full)} if full else {})}


def test_a_job_not_reformed_is_left_alone():
    for environ in (_env(4, None), _env(8, 8)):   # no variable (a job started as it is), or the full size
        assert keep_global_batch(_args(), environ).global_batch_size is None   # Megatron's default stands


def test_without_global_batch_size_the_full_size_jobs_batch_is_set():
    # TP 2: 8 ranks were data-parallel 4 (a batch of 2 x 4 = 8), now 4 ranks are data-parallel 2: 2 micro-batches
    args = keep_global_batch(_args(), _env(4, 8))
    assert args.global_batch_size == 8 and args.global_batch_size // (args.micro_batch_size * 2) == 2
    # growing back to the full size: the same batch, by Megatron's own default
    assert keep_global_batch(_args(), _env(8, 8)).global_batch_size is None


def test_a_given_global_batch_size_is_kept_and_checked():
    assert keep_global_batch(_args(global_batch_size=12), _env(4, 6)).global_batch_size == 12   # DP 3 -> 2: 3 each
    with pytest.raises(ConfigError) as e:   # TP 2, DP 4 -> 3: 16 samples in micro-batches of 2 over 3 ranks
        keep_global_batch(_args(global_batch_size=16), _env(6, 8))
    msg = str(e.value)
    assert "runs 6 of its 8 ranks" in msg and "global batch of 16 samples" in msg and "--micro-batch-size 2 x 3" in msg
    assert "Data-parallel sizes that keep it: [1, 2, 4] (world sizes [2, 4, 8])" in msg, msg


def test_megatrons_default_batch_that_the_smaller_size_cannot_split_is_refused():
    # TP 2, DP 3 -> 2 without --global-batch-size: Megatron's batch was 2 x 3 = 6, which 2 x 2 does not divide
    with pytest.raises(ConfigError, match=r"global batch of 6 samples .* Data-parallel sizes that keep it: \[1, 3\]"):
        keep_global_batch(_args(), _env(4, 6))


def test_a_model_parallel_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ConfigError, match="model-parallel size .* = 2.* does not divide both"):
        keep_global_batch(_args(), _env(3, 8))


def test_the_provider_adjusts_right_after_megatrons_parser_parses(monkeypatch):
    """What Megatron-LM's parse_args does with the provider: ``parser = provider(parser)``, then parse."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("SHARDSAFE_FULL_WORLD_SIZE", "8")
    p = argparse.ArgumentParser()
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p = compose_extra_args_provider(None)(p)
    p = compose_extra_args_provider(None)(p)   # Megatron may build its parser twice: adjusted once
    assert p.parse_args(["--micro-batch-size", "2", "--tensor-model-parallel-size", "2"]).global_batch_size == 8
    ns, _ = p.parse_known_args(["--micro-batch-size", "2", "--tensor-model-parallel-size", "2", "--other"])
    assert ns.global_batch_size == 8


_PARSE = """
import json, os, sys, typing
if not hasattr(typing, "override"):   # megatron.training >= 0.18 on Python 3.11
    typing.override = lambda f: f
from megatron.training import arguments
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator, get_num_microbatches
from shardsafe.adapters.megatron.args import compose_extra_args_provider
from shardsafe.config import ConfigError
out = {}
for world, gbs in (("4", None), ("4", "12"), ("2", "6")):
    os.environ["WORLD_SIZE"] = world
    sys.argv = ["pretrain_gpt.py", "--micro-batch-size", "2", "--tensor-model-parallel-size", "2", "--shardsafe"]
    sys.argv += ["--global-batch-size", gbs] if gbs else []
    try:
        args = arguments.parse_args(extra_args_provider=compose_extra_args_provider(None))
    except ConfigError as e:
        out[world + "/" + str(gbs)] = "refused: " + str(e)
        continue
    dp = int(world) // 2
    init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size, dp)
    out[world + "/" + str(gbs)] = [args.global_batch_size, get_num_microbatches()]
    from megatron.core import num_microbatches_calculator as nmc
    nmc.destroy_num_microbatches_calculator()
print(json.dumps(out))
"""


def test_megatron_lm_parse_args_keeps_the_global_batch():
    """Megatron-LM's own parse_args with shardsafe's provider (in a subprocess: this process may hold megatron-core
    0.16.1), and Megatron's num-microbatches calculator fed from it, for a TP2 job of 6 ranks (DP 3)."""
    env = _megatron_lm_env()
    if env is None:
        pytest.skip(f"megatron.training ships in megatron-core >= 0.17 only; none in {MCORE_017} or this venv "
                    "(docs/megatron.md)")
    env["SHARDSAFE_FULL_WORLD_SIZE"] = "6"
    r = subprocess.run([sys.executable, "-c", _PARSE], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # at DP 2 without --global-batch-size Megatron's default (2 x 2 = 4) would be another run: 2 x 3 = 6 is refused,
    # since DP 2 cannot split 6 samples in micro-batches of 2; a given 12 is kept with 3 micro-batches per rank
    assert got["4/None"].startswith("refused: ") and "global batch of 6 samples" in got["4/None"], got
    assert got["4/12"] == [12, 3], got
    assert got["2/6"] == [6, 3], got   # DP 1 of 3: the full size's default batch, given, in 3 micro-batches
