"""Megatron on a real GPU: kill a rank right before an optimizer step, restart, restore bit-exactly.

One GPU, one rank (NCCL), megatron-core's own loop (examples/megatron_pretrain_gpt.py, bf16
DistributedOptimizer) under the local launcher with one holder: the snapshot pipeline's CUDA path
(D2H on a side stream into the holder's registered memory, the optimizer step's stream waiting on
the copy), CUDA RNG tracker states, and restore into CUDA tensors; with Transformer Engine or Apex
installed, their fused Adam (``step`` in ``param_groups``). Every loss and the final state (optimizer
shards and state, RNGs, model params) must be ``torch.equal`` to an uninterrupted run without shardsafe.
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

from shardsafe.launch import LaunchConfig, LocalLauncher
from shardsafe.runcheck import compare_runs, read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "megatron_pretrain_gpt.py")
STEPS = 7


def _has_megatron() -> bool:
    return subprocess.run([sys.executable, "-c", "import megatron.core.models.gpt"], capture_output=True).returncode == 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run by scripts/gpu_check.sh on a GPU)"),
    # only probed on a GPU machine: importing megatron.core costs seconds of every collection
    pytest.mark.skipif(torch.cuda.is_available() and not _has_megatron(),
                       reason="megatron-core is not importable (put it on PYTHONPATH)"),
]


def _run(run_dir: str, *, shardsafe: bool, inject: str = ""):
    cfg = LaunchConfig(nodes=1, nproc_per_node=1, job_id=f"mg{uuid.uuid4().hex[:8]}", run_dir=run_dir, inject=inject,
                       max_restarts=1 if shardsafe else 0, memory_budget_gb=2.0, start_holders=shardsafe,
                       attempt_timeout_s=240)
    cmd = [sys.executable, SCRIPT, "--bf16", "--steps", str(STEPS), "--num-layers", "4", "--hidden-size", "256",
           "--num-attention-heads", "8", "--vocab-size", "1024", "--seq-length", "64", "--out", run_dir]
    if shardsafe:
        cmd.append("--shardsafe")
    return LocalLauncher(cfg).run(cmd)


def _logs(run_dir: str) -> str:
    with open(os.path.join(run_dir, "trainer_rank0.log"), errors="replace") as f:
        return f.read()[-4000:]


@pytest.mark.timeout(400)
def test_megatron_kill_and_resume_on_gpu(tmp_path):
    ref, run = str(tmp_path / "ref"), str(tmp_path / "run")
    r = _run(ref, shardsafe=False)
    assert r.ok, _logs(ref)
    res = _run(run, shardsafe=True, inject="kill-rank:0@4")
    assert res.ok and res.attempts == 2 and res.failures[0]["rc"] == -9, (res, _logs(run))
    ev = read_jsonl(os.path.join(run, "events.jsonl"))
    restored = {int(e.get("attempt") or 0): e for e in ev if e.get("kind") == "restore_end"}
    assert restored[0]["version"] == -1 and restored[1]["version"] in (2, 3) and restored[1]["tier"] == "memory"
    snaps = [e for e in ev if e.get("kind") == "snapshot"]
    assert snaps and all(e["committed"] for e in snaps), snaps
    print(f"\nGPU Megatron: restored version {restored[1]['version']} in {restored[1]['seconds']:.3f} s; "
          f"{len(snaps)} snapshots of {snaps[-1]['bytes'] / 2**20:.1f} MiB, stall median "
          f"{sorted(e['stall_s'] for e in snaps)[len(snaps) // 2] * 1e3:.3f} ms")
    cmp = compare_runs(run, ref, 1, STEPS)
    assert cmp.bit_identical, (cmp.loss_mismatches, cmp.state_mismatches, cmp.replayed_losses_equal)
