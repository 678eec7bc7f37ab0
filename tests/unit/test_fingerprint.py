"""Run identity (shardsafe/fingerprint.py): what counts as the same run, and how a difference is named."""
import dataclasses
import enum
import functools
import json

import torch

from shardsafe import fingerprint as fp


class Kind(enum.Enum):
    A = "a"


@dataclasses.dataclass
class ModelConfig:
    hidden: int = 64
    init: object = None
    act: object = None
    dtype: object = torch.bfloat16
    kind: Kind = Kind.A


def test_plain_values_are_the_same_in_every_process_no_memory_address():
    cfg = ModelConfig(init=functools.partial(torch.nn.init.normal_, std=0.02), act=torch.nn.functional.gelu)
    got = fp.plain({"m": cfg, "o": object(), "s": {3, 1}, "f": float("nan"), "t": (1, 2)})
    text = json.dumps(got)
    assert "0x" not in text
    assert got["m"]["init"] == {"partial": "torch.nn.init.normal_", "args": [], "kwargs": {"std": 0.02}}
    assert got["m"]["act"].endswith(".gelu") and got["m"]["dtype"] == "torch.bfloat16" and got["m"]["kind"] == "a"
    assert got["o"] == "<builtins.object>" and got["s"] == [1, 3] and got["f"] == "nan" and got["t"] == [1, 2]


def _fields(lr=1e-3, total=1000, steps_per_print=10, params=None, stage=2):
    config = {"train_batch_size": 8, "zero_optimization": {"stage": stage}, "steps_per_print": steps_per_print,
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": lr, "total_num_steps": total}},
              "shardsafe": {"interval": 1}}
    return {"config": fp.strip_volatile(config),
            "model": params or [["w", [4, 4], "float32", True], ["b", [4], "float32", True]],
            "layout": {"tp": 0, "tp_size": 1, "zero_stage": stage},
            "optimizer": {"class": "AdamW", "param_groups": [{"lr": lr, "weight_decay": 0.01}]}}


def test_a_longer_schedule_and_other_logging_are_the_same_run():
    then = fp.make(_fields())
    assert fp.differences(then, fp.make(_fields(total=5000, steps_per_print=1))) == []


def test_a_changed_lr_model_or_stage_is_another_run_named_down_to_the_key():
    then = fp.make(_fields())
    diff = fp.differences(then, fp.make(_fields(lr=2e-3)))
    assert diff[0] == "config: scheduler.params.warmup_max_lr was 0.001, now 0.002"
    assert diff[-1].startswith("optimizer: param_groups.0.lr was 0.001, now 0.002")
    diff = fp.differences(then, fp.make(_fields(params=[["w", [4, 8], "float32", True]])))
    assert diff == ["model: the list had 2 entries, now 1"]
    assert fp.differences(then, fp.make(_fields(stage=3)))[0] == "config: zero_optimization.stage was 2, now 3"


def test_a_large_field_is_kept_as_a_digest_with_a_summary():
    big = [[f"layer{i}.weight", [1024, 1024], "bfloat16", True] for i in range(400)]
    then, now = fp.make(_fields(params=big)), fp.make(_fields(params=big[:-1]))
    assert "value" not in then["model"] and then["model"]["summary"] == "400 entries"
    assert fp.differences(then, now) == ["model: 400 entries in the snapshot, 399 entries now"]


def test_a_snapshot_without_a_fingerprint_is_not_taken_for_this_run():
    assert fp.differences(None, fp.make(_fields()))[0].startswith("the snapshot carries no run fingerprint")
    assert fp.differences(None, {}) == []   # an adapter that gives none compares nothing


# ---- another data-parallel size: the same run when the global batch is kept ------------------------------------

def _sized(dp, gas, mb=2, stage=2, lr=1e-3, batch=True):
    """A DeepSpeed run's fields at data-parallel size ``dp`` with accumulation ``gas`` (global batch mb x gas x dp)."""
    f = _fields(lr=lr, stage=stage)
    f["config"] = fp.strip_volatile({"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas,
                                     "zero_optimization": {"stage": stage}, "shardsafe": {"interval": 1}})
    f["layout"] = {"tp": 0, "tp_size": 1, "zero_stage": stage, "dp_world_size": dp, "optimizer_wrapper": "Z"}
    if batch:
        f["batch"] = {"global_batch_size": mb * gas * dp, "micro_batch_size": mb}
    return f


def test_another_data_parallel_size_with_the_global_batch_kept_is_the_same_run():
    then = fp.make(_sized(4, 3))
    assert fp.differences(then, fp.make(_sized(3, 4))) == []     # shrunk: 4 x 3 = 3 x 4 micro-batches
    assert fp.differences(then, fp.make(_sized(2, 6))) == []
    assert fp.differences(fp.make(_sized(3, 4)), fp.make(_sized(4, 3))) == []   # and grown back


def test_another_global_batch_micro_batch_or_setting_is_another_run_named():
    then = fp.make(_sized(4, 3))
    assert fp.differences(then, fp.make(_sized(3, 3))) == ["batch: global_batch_size was 24, now 18"]
    assert fp.differences(then, fp.make(_sized(3, 8, mb=1))) == [
        "config: train_micro_batch_size_per_gpu was 2, now 1", "batch: micro_batch_size was 2, now 1"]
    assert fp.differences(then, fp.make(_sized(3, 4, stage=3)))[0] == "config: zero_optimization.stage was 2, now 3"
    assert fp.differences(then, fp.make(_sized(3, 4, lr=2e-3)))[-1].startswith("optimizer: param_groups.0.lr")
    diff = fp.differences(then, fp.make({**_sized(3, 4), "layout": {"tp": 0, "tp_size": 2, "zero_stage": 2,
                                                                    "dp_world_size": 3, "optimizer_wrapper": "Z"}}))
    assert diff == ["layout: tp_size was 1, now 2"]


def test_without_the_global_batch_on_both_sides_the_size_is_compared_as_before():
    """A snapshot (or an adapter) that does not record the global batch: another size is another run, as it was."""
    old = fp.make(_sized(4, 3, batch=False))
    assert fp.differences(old, fp.make(_sized(3, 4))) == ["config: gradient_accumulation_steps was 3, now 4",
                                                          "layout: dp_world_size was 4, now 3"]
    assert fp.differences(old, fp.make(_sized(4, 3))) == []   # the same size: the batch it lacks is not asked for
