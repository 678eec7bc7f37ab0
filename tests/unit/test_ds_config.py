"""The DeepSpeed config as shardsafe reads it (adapters/ds_config.py) must never take anything from DeepSpeed: a
config that can be read only once (a pipe, ``<(...)``) is left to DeepSpeed with one warning, and a base64 config
string (which DeepSpeed accepts) is read like DeepSpeed reads it instead of being silently unprotected."""
import base64
import json
import logging
import os
import threading

import pytest

from shardsafe.adapters.ds_config import read_config, wants_protection

CFG = {"train_micro_batch_size_per_gpu": 2, "shardsafe": {"interval": 1}}


def test_a_base64_config_is_read_as_deepspeed_reads_it():
    text = base64.urlsafe_b64encode(json.dumps(CFG).encode()).decode()
    assert read_config(text) == CFG
    assert wants_protection((), {"config": text})
    assert read_config("not/a/path/and/not/base64!") is None


def test_a_pipe_is_left_to_deepspeed_unread_and_said_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="shardsafe.adapters.ds_config")
    fifo = str(tmp_path / "ds_config.fifo")
    os.mkfifo(fifo)
    text = json.dumps(CFG)
    writer = threading.Thread(target=lambda: open(fifo, "w").write(text), daemon=True)
    writer.start()
    assert read_config(fifo) is None and not wants_protection((), {"config": fifo})
    with open(fifo) as f:   # DeepSpeed's own read still gets every byte
        assert json.loads(f.read()) == CFG
    writer.join(5)
    said = [r.getMessage() for r in caplog.records if "not a regular file" in r.getMessage()]
    assert len(said) == 1 and "NOT protected" in said[0]


# ---- a job the launcher re-formed at another world size keeps its global batch -----------------------------------

def _kept(cfg, full, world, **where):
    """The config DeepSpeed gets at ``world`` of ``full`` ranks (``where``: args/kwargs of deepspeed.initialize)."""
    from shardsafe.adapters.ds_config import config_source, keep_global_batch
    env = {"SHARDSAFE_FULL_WORLD_SIZE": str(full), "WORLD_SIZE": str(world), "RANK": "1"}
    args, kwargs = keep_global_batch(where.get("args", ()), where.get("kwargs", {"config": cfg}), env)
    return read_config(config_source(args, kwargs))


def test_the_accumulation_grows_by_full_over_world_size():
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    assert _kept(base, 4, 3)["gradient_accumulation_steps"] == 4
    assert _kept(base, 4, 2)["gradient_accumulation_steps"] == 6
    assert _kept({**base, "train_batch_size": 24}, 4, 3) == {**base, "train_batch_size": 24,
                                                             "gradient_accumulation_steps": 4}
    assert _kept({"train_batch_size": 24}, 4, 2)["gradient_accumulation_steps"] == 2   # the micro-batch stays 6
    assert _kept({"train_micro_batch_size_per_gpu": 2}, 4, 2)["gradient_accumulation_steps"] == 2
    assert base["gradient_accumulation_steps"] == 3   # the program's own dict is never changed


def test_unchanged_at_full_size_or_when_deepspeed_keeps_the_batch_itself(tmp_path):
    from shardsafe.adapters.ds_config import keep_global_batch
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    same = ((), {"config": cfg})
    assert keep_global_batch(*same, {"SHARDSAFE_FULL_WORLD_SIZE": "4", "WORLD_SIZE": "4"}) == same
    assert keep_global_batch(*same, {"WORLD_SIZE": "3"}) == same
    derived = ((), {"config": {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2}})
    assert keep_global_batch(*derived, {"SHARDSAFE_FULL_WORLD_SIZE": "4", "WORLD_SIZE": "3"}) == derived


def test_the_config_is_found_where_deepspeed_looks_and_replaced_there(tmp_path):
    import argparse
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}))
    ns = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    got = _kept(None, 4, 3, args=(ns,))
    assert got["gradient_accumulation_steps"] == 4 and ns.deepspeed_config == str(path)   # a copy of the namespace
    assert _kept(None, 4, 3, kwargs={"config": str(path)})["gradient_accumulation_steps"] == 4
    assert _kept(None, 4, 3, kwargs={"config_params": json.loads(path.read_text())})["gradient_accumulation_steps"] == 4


def test_a_global_batch_the_smaller_size_cannot_split_is_refused_with_the_sizes_that_can():
    from shardsafe.adapters.ds_config import keep_global_batch
    from shardsafe.errors import ConfigError
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    with pytest.raises(ConfigError, match=r"runs 3 of its 4 ranks.*1 x 4 / 3, which is no integer.*keep it: \[1, 2, 4\]"):
        keep_global_batch((), {"config": cfg}, {"SHARDSAFE_FULL_WORLD_SIZE": "4", "WORLD_SIZE": "3"})


def test_rank_0_says_it_once(caplog):
    from shardsafe.adapters.ds_config import keep_global_batch
    caplog.set_level(logging.WARNING, logger="shardsafe.adapters.ds_config")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 5}
    for _ in range(2):
        keep_global_batch((), {"config": cfg}, {"SHARDSAFE_FULL_WORLD_SIZE": "8", "WORLD_SIZE": "4", "RANK": "0"})
    said = [r.getMessage() for r in caplog.records if "keeps the global batch" in r.getMessage()]
    assert said == ["shardsafe: this job runs 4 of its 8 ranks (SHARDSAFE_FULL_WORLD_SIZE): gradient_accumulation_steps"
                    " 5 -> 10 keeps the global batch"]
