"""The DeepSpeed config as shardsafe reads it (adapters/ds_config.py) must never take anything from DeepSpeed: a
config that can be read only once (a pipe, ``<(...)``) is left to DeepSpeed with one warning, and a base64 config
string (which DeepSpeed accepts) is read like DeepSpeed reads it instead of being silently unprotected."""
import base64
import json
import logging
import os
import threading

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
