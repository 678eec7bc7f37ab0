"""`shardsafe export --format megatron`: a flushed snapshot becomes the checkpoint Megatron-LM's own
``--save`` writes at that iteration.

Megatron checkpoints carry the live model's sharding metadata, so the export replays the job's own
command with ``--shardsafe-export-dir`` (restore from the persistent tier, Megatron's
``save_checkpoint``, exit). Checked here on Megatron-LM's loop (megatron-core 0.17.1, TP2 x DP2,
torch_dist):

- DistributedOptimizer: the exported checkpoint equals a plain ``--save`` of the same iteration
  item for item (every tensor byte for byte, every object -- RNG states, scheduler, counters --
  equal; only ``args`` differ by the flags). A vanilla ``--load`` of *either* fails on this CPU
  path inside Megatron (``DistributedOptimizer.state_dict``: ``assert len(steps) == 1`` on a fresh
  torch-Adam optimizer: Megatron's own bug on that path, its own checkpoints included), so continuing from it is not checked here.
- Float16OptimizerWithFloat16Params (no --use-distributed-optimizer), dropout off: the same
  equality, and a vanilla ``--load`` of the export continues bit-exact (losses and final model and
  optimizer state torch.equal to an uninterrupted run). The plain run that writes Megatron's own
  checkpoint at iteration AT runs on to the end and is that uninterrupted run.

Megatron's padded optimizer buffers contain never-written gaps; the trainers run with the test-only
SHARDSAFE_TEST_FILL_EMPTY=1 (torch.empty memory filled with NaN) so those gaps compare equal.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch

from shardsafe.launch import PRELOAD_MEGATRON, LaunchConfig
from shardsafe.runcheck import effective_losses

from .helpers import launch, trainer_logs
from .test_megatron_resume import LM_ARGS, MEGATRON_LM, ROOT, lm_env, needs_lm, run_megatron

pytestmark = [pytest.mark.slow, needs_lm]
ITERS, AT = 6, 4


def _trainer_env() -> dict[str, str]:
    """What the trainers get on top of this environment: megatron-core 0.17.1 first, NaN-filled torch.empty."""
    return {"SHARDSAFE_TEST_FILL_EMPTY": "1", **lm_env()}


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **_trainer_env())
    env.pop("SHARDSAFE_RUN_DIR", None)
    return env


def _command(args_file: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", MEGATRON_LM,
            f"@{args_file}", "--train-iters", str(ITERS)]


def _deep_equal(x, y, path: str, diffs: list[str]) -> None:
    if torch.is_tensor(x):
        ok = torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape and (
            torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8)))
        if not ok:
            diffs.append(f"tensor {path}")
    elif isinstance(x, np.ndarray):
        if not (isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()):
            diffs.append(f"array {path}")
    elif isinstance(x, io.BytesIO):
        _deep_equal(torch.load(io.BytesIO(x.getvalue()), weights_only=False),
                    torch.load(io.BytesIO(y.getvalue()), weights_only=False), path, diffs)
    elif isinstance(x, dict):
        if not isinstance(y, dict) or set(x) != set(y):
            diffs.append(f"keys {path}")
            return
        for k in x:
            _deep_equal(x[k], y[k], f"{path}/{k}", diffs)
    elif isinstance(x, (list, tuple)):
        if type(x) is not type(y) or len(x) != len(y):
            diffs.append(f"sequence {path}")
            return
        for i, (u, v) in enumerate(zip(x, y)):
            _deep_equal(u, v, f"{path}[{i}]", diffs)
    elif x != y and not (isinstance(x, float) and isinstance(y, float) and np.isnan(x) and np.isnan(y)):
        diffs.append(f"value {path}: {x!r} vs {y!r}")


def _checkpoint_items(ckpt_dir, scratch) -> dict:
    """Every item of a torch_dist checkpoint (tensors and objects) plus its common state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = os.path.join(scratch, os.path.basename(os.path.dirname(ckpt_dir)) + ".pt")
    dcp_to_torch_save(str(ckpt_dir), out)
    items = torch.load(out, weights_only=False)
    if os.path.exists(os.path.join(ckpt_dir, "common.pt")):   # megatron-core <= 0.17
        common = torch.load(os.path.join(ckpt_dir, "common.pt"), weights_only=False)
    else:   # >= 0.18 keeps the common state inside the distributed checkpoint
        key = next(k for k in items if k.startswith("common_state/"))
        common = items.pop(key)
        common = common[0] if isinstance(common, list) and len(common) == 1 else common
        if isinstance(common, io.BytesIO):
            common = torch.load(io.BytesIO(common.getvalue()), weights_only=False)
    common.pop("args")   # the export run's command line has the --shardsafe flags
    return {"items": items, "common": common}


def _export_and_compare(tmp_path, args_file: str, *, plain_runs_to_the_end: bool = False,
                        replay: str = "torchrun") -> tuple:
    """Plain run with ``--save`` at iteration AT, protected run, export of its flushed iteration AT, and
    the item-for-item comparison. ``plain_runs_to_the_end``: the plain run goes on to ITERS (Megatron
    saves at AT on its save interval, and at the end), so it is also the uninterrupted reference.

    The export replays the command a user runs: ``torchrun``, started cold, or (``replay="launch"``)
    ``shardsafe launch --preload megatron``, whose trainers are forked and write their output to its run
    directory. The plain run (one node x 4 ranks,
    as that command) and the protected run (2 simulated nodes x 2 ranks, one holder each) go through the local
    launcher, their trainers forked from the package's fork servers (helpers.reference_preload; Megatron-LM's
    cold reference in test_megatron_resume.py pins that a forked trainer computes what a cold one does)."""
    vanilla, disk, exported = tmp_path / "vanilla", tmp_path / "persist", tmp_path / "exported"
    replay_dir = tmp_path / "replay"
    base = (_command(args_file) if replay == "torchrun" else
            [sys.executable, "-m", "shardsafe.cli", "launch", "--nproc-per-node", "4", "--preload", "megatron",
             "--run-dir", str(replay_dir), "--max-restarts", "0", "--", MEGATRON_LM,
             f"@{args_file}", "--train-iters", str(ITERS)]) + ["--exit-interval", str(AT)]
    until = [] if plain_runs_to_the_end else ["--exit-interval", str(AT)]
    res = run_megatron(tmp_path / "plain", [f"@{args_file}", "--train-iters", str(ITERS), *until, "--save", str(vanilla),
                                            "--save-interval", str(AT)],
                       script=MEGATRON_LM, shardsafe=False, max_restarts=0, nodes=1, nproc=4, env=_trainer_env())
    assert res.ok, trainer_logs(str(tmp_path / "plain"))[-3000:]
    protected = tmp_path / "protected"
    res = run_megatron(protected, [f"@{args_file}", "--train-iters", str(ITERS), "--exit-interval", str(AT),
                                   "--shardsafe-persist-dir", str(disk), "--shardsafe-persist-every", "2",
                                   "--shardsafe-parity-group-size", "1"],
                       script=MEGATRON_LM, max_restarts=0, env=_trainer_env())
    assert res.ok, trainer_logs(str(protected))[-3000:]
    (job,) = os.listdir(disk)
    # The protected run's holders are gone with its job: the export starts its own and must read the disk.
    p = subprocess.run([sys.executable, "-m", "shardsafe.cli", "export", "--format", "megatron", str(disk / job),
                        str(exported), "--", *base], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout if replay == "torchrun" else "".join(
        f.read_text(errors="replace") for f in sorted((replay_dir / "logs").glob("agent_*.log")))
    assert f"shardsafe: exported iteration {AT} to {exported}" in out, out[-3000:]
    assert "from the persistent tier" in out, out[-3000:]   # fresh holders: memory had nothing
    tag = f"iter_{AT:07d}"
    assert (exported / "latest_checkpointed_iteration.txt").read_text().strip() == str(AT)
    diffs, n_items = _compare_checkpoints(exported / tag, vanilla / tag, tmp_path)
    assert not diffs, diffs[:10]
    assert n_items > 10
    return vanilla, exported


_COMPARE = """
import json, sys
from tests.fault.test_export_megatron import _checkpoint_items, _deep_equal
a, b = _checkpoint_items(sys.argv[1], sys.argv[3]), _checkpoint_items(sys.argv[2], sys.argv[3])
diffs = []
_deep_equal(a, b, "", diffs)
print(json.dumps({"diffs": diffs[:50], "items": len(a["items"])}))
"""


def _compare_checkpoints(a_dir, b_dir, scratch) -> tuple[list[str], int]:
    """Item-for-item comparison of two torch_dist checkpoints, in a process with the trainers' megatron-core
    (the checkpoints pickle its classes; this process may have imported another version)."""
    p = subprocess.run([sys.executable, "-c", _COMPARE, str(a_dir), str(b_dir), str(scratch)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    return got["diffs"], got["items"]


def test_megatron_export_distopt_equals_plain_save(tmp_path):
    _export_and_compare(tmp_path, LM_ARGS)


def test_megatron_export_fp16_optimizer_equals_plain_save_and_continues_bit_exact(tmp_path):
    """Non-distributed optimizer (Megatron's own --load works on this path) and dropout off: Megatron
    restores the RNGs and then builds the data iterators, whose DataLoader draws from the torch RNG,
    so with dropout its own resume is not bit-exact to an uninterrupted run (shardsafe's restore
    re-seats the RNGs right before the first step for that reason). Without dropout it is."""
    from shardsafe.payload.manifest import load_tensors
    args_file = tmp_path / "nodistopt.args"
    args_file.write_text(open(LM_ARGS).read().replace("--use-distributed-optimizer", "")
                         .replace("--hidden-dropout 0.1", "--hidden-dropout 0.0")
                         .replace("--attention-dropout 0.1", "--attention-dropout 0.0"))
    _, exported = _export_and_compare(tmp_path, str(args_file), plain_runs_to_the_end=True, replay="launch")
    # A vanilla Megatron-LM run (no shardsafe flags) forked from the package's fork server: it is not the
    # reference (the cold plain run is), so it may start warm.
    from_export = tmp_path / "from_export"
    cfg = LaunchConfig(nodes=2, nproc_per_node=2, job_id=f"mx{uuid.uuid4().hex[:8]}", run_dir=str(from_export),
                       max_restarts=0, start_holders=False, attempt_timeout_s=300, env=_trainer_env())
    res = launch(cfg, [sys.executable, MEGATRON_LM, f"@{args_file}", "--train-iters", str(ITERS),
                       "--load", str(exported), "--out", str(from_export)], preload=PRELOAD_MEGATRON)
    assert res.ok, trainer_logs(str(from_export))[-3000:]
    for r in range(4):
        ref = effective_losses(str(tmp_path / "plain"), r)   # ran 1..ITERS without a failure
        assert sorted(ref) == list(range(1, ITERS + 1)), sorted(ref)
        got = effective_losses(str(tmp_path / "from_export"), r)
        assert sorted(got) == list(range(AT + 1, ITERS + 1)), sorted(got)
        assert all(got[s] == ref[s] for s in got), {s: (got[s], ref[s]) for s in got}
        a = load_tensors(str(tmp_path / "from_export" / f"final_rank{r}"))
        b = load_tensors(str(tmp_path / "plain" / f"final_rank{r}"))
        # The RNG states differ by the DataLoader's draw after Megatron's load (not used: no dropout).
        keys = [k for k in b if not k.startswith("rng")]
        assert keys and all(k in a for k in keys)
        bad = [k for k in keys if not torch.equal(a[k], b[k])]
        assert not bad, bad[:10]
