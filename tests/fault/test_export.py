"""`shardsafe export --format deepspeed`: a flushed snapshot becomes the checkpoint plain DeepSpeed
writes, and a vanilla ``engine.load_checkpoint`` of it continues bit-exact.

Per ZeRO stage: a plain (unprotected) run of 10 steps saves a vanilla checkpoint at step 6; a
protected run of 6 steps flushes its snapshots to disk; the export of version 6 must equal the
vanilla checkpoint file for file, tensor for tensor (torch.equal), and a fresh *unprotected* job
that loads the export must produce losses 7..10 and a final state torch.equal to the plain run.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from shardsafe.launch import PRELOAD_DEEPSPEED
from shardsafe.payload.manifest import load_tensors
from shardsafe.runcheck import effective_losses

from .helpers import PLAIN_DEEPSPEED, ROOT, reference_preload, run_job, trainer_logs

pytestmark = pytest.mark.slow
SAVE_AT, STEPS = 6, 10


def _cmp(x, y, path, diffs):
    """Structural equality of two loaded checkpoint objects; tensors with torch.equal."""
    if torch.is_tensor(x) or torch.is_tensor(y):
        if not (torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape
                and torch.equal(x, y)):
            diffs.append(f"tensor {path}")
    elif isinstance(x, dict) and isinstance(y, dict):
        if set(x) != set(y):
            diffs.append(f"keys {path}: {sorted(map(str, set(x) ^ set(y)))}")
        for k in set(x) & set(y):
            _cmp(x[k], y[k], f"{path}/{k}", diffs)
    elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        if type(x) is not type(y) or len(x) != len(y):
            diffs.append(f"sequence {path}: {type(x).__name__}[{len(x)}] vs {type(y).__name__}[{len(y)}]")
        for i, (u, v) in enumerate(zip(x, y)):
            _cmp(u, v, f"{path}[{i}]", diffs)
    elif type(x) is not type(y):
        diffs.append(f"type {path}: {type(x).__name__} vs {type(y).__name__}")
    elif hasattr(x, "__dict__") and not isinstance(x, type):
        _cmp(vars(x), vars(y), f"{path}.__dict__", diffs)
    elif x != y:
        diffs.append(f"value {path}: {x!r} vs {y!r}")


def _persist_story(run_dir):
    """What the protected run's snapshots and flushes did (for a failure message)."""
    ev = [json.loads(x) for x in open(run_dir / "events.jsonl")]
    keep = ("version", "rank", "committed", "ok", "error", "reason", "seconds")
    return [{"kind": e["kind"], **{k: e[k] for k in keep if k in e}} for e in ev
            if e.get("kind") in ("snapshot", "snapshot_skipped", "flush", "holder_stop")] + [trainer_logs(run_dir)[-3000:]]


def _export(src, dst, *args):
    return subprocess.run([sys.executable, "-m", "shardsafe.cli", "export", *args, src, dst], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_export_equals_vanilla_checkpoint_and_resumes_bit_exact(tmp_path, stage):
    ref = tmp_path / "ref"
    vanilla = tmp_path / "vanilla_ckpt"
    res = run_job(ref, stage=stage, dtype="bf16", steps=STEPS, shardsafe=False, max_restarts=0,
                  extra=["--save-dir", str(vanilla), "--save-at", str(SAVE_AT)],
                  preload=reference_preload(PLAIN_DEEPSPEED, cold=False))
    assert res.ok, f"plain run failed; see {ref}"
    disk = tmp_path / "persist"
    prot = tmp_path / "protected"
    res = run_job(prot, stage=stage, dtype="bf16", steps=SAVE_AT, job_id=f"exp{stage}",
                  extra=["--shardsafe-json", json.dumps({"persist_dir": str(disk), "persist_every": 2})])
    assert res.ok, f"protected run failed; see {prot}"

    out = tmp_path / "exported"
    p = _export(str(disk / f"exp{stage}"), str(out), "--format", "deepspeed")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "exported version 6 (2 ranks)" in p.stdout, (p.stdout, _persist_story(prot))
    tag = f"global_step{SAVE_AT}"
    assert (out / "latest").read_text() == tag
    want = sorted(f for f in os.listdir(vanilla / tag) if f.endswith(".pt"))
    assert sorted(f for f in os.listdir(out / tag) if f.endswith(".pt")) == want
    for f in want:
        a = torch.load(out / tag / f, weights_only=False)
        b = torch.load(vanilla / tag / f, weights_only=False)
        a.pop("shardsafe", None)            # our client state (RNG per rank, micro_steps)
        a["ds_config"].pop("shardsafe")     # the protected job's config has the block, the plain one not
        diffs = []
        _cmp(a, b, f, diffs)
        assert not diffs, diffs[:10]

    # A fresh, unprotected job loads the export with plain engine.load_checkpoint and goes on (its trainers forked
    # like the plain run's: helpers.reference_preload).
    cont = tmp_path / "continued"
    res = run_job(cont, stage=stage, dtype="bf16", steps=STEPS, shardsafe=False, max_restarts=0,
                  extra=["--load", str(out)], preload=PRELOAD_DEEPSPEED)
    assert res.ok, f"continued run failed; see {cont}"
    for r in range(2):
        got, ref_l = effective_losses(str(cont), r), effective_losses(str(ref), r)
        assert sorted(got) == list(range(SAVE_AT + 1, STEPS + 1)), sorted(got)
        assert all(got[s] == ref_l[s] for s in got), {s: (got[s], ref_l[s]) for s in got if got[s] != ref_l[s]}
        a, b = load_tensors(str(cont / f"final_rank{r}")), load_tensors(str(ref / f"final_rank{r}"))
        assert a.keys() == b.keys()
        bad = [k for k in a if not torch.equal(a[k], b[k])]
        assert not bad, bad


def test_export_refuses_corrupt_or_incomplete_snapshots(tmp_path):
    disk = tmp_path / "persist"
    res = run_job(tmp_path / "run", stage=2, dtype="fp32", steps=4, job_id="expbad",
                  extra=["--shardsafe-json", json.dumps({"persist_dir": str(disk), "persist_every": 2})])
    assert res.ok
    job = disk / "expbad"
    # Flip one byte of rank 1's newest payload: the export names the rank and segment, writes nothing.
    newest = sorted(os.listdir(job))[-1]
    with open(job / newest / "rank000001.bin", "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    p = _export(str(job), str(tmp_path / "out"), "--format", "deepspeed")
    assert p.returncode == 2 and "rank 1 of version 4" in p.stderr and "fails its checksums" in p.stderr, p.stderr
    assert not (tmp_path / "out").exists()
    # An older, intact version can still be exported; a missing rank is named.
    p = _export(str(job), str(tmp_path / "out2"), "--format", "deepspeed", "--version", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    os.unlink(job / newest / "rank000000.json")
    p = _export(str(job), str(tmp_path / "out3"), "--format", "deepspeed", "--version", "4")
    assert p.returncode == 2 and "missing or incomplete" in p.stderr, p.stderr
    p = _export(str(tmp_path / "nowhere"), str(tmp_path / "out4"), "--format", "deepspeed")
    assert p.returncode == 2 and "not a directory" in p.stderr, p.stderr
