"""A job continues on fewer nodes and grows back, end to end through `shardsafe launch` (issue 44).

The ZeRO-3 test runs `shardsafe launch` (torch elastic), the others `shardsafe demo --shrink`
(shardsafe/demo_shrink.py, the local launcher); all use the demo's oracle. Each DeepSpeed test is a protected job of
examples/ds_pretrain_gpt.py on 4 simulated nodes (of one rank; the pipeline's of one rank per stage), no spare,
DeepSpeed's default FusedAdam from the config (its CPU build), bf16, WarmupLR, gradient clipping, a global batch of
24 samples (micro-batch 2 x accumulation 3 x D = 4). A node is SIGKILLed with its holder; the launcher re-forms the
job at D' = 3 (accumulation 4), whose restore re-partitions the committed version, the lost rank rebuilt from
parity; the node returns and the job grows back to 4 from the newest version taken at 3. The oracle is DeepSpeed's
own reshard: plain runs of the same program chained through universal checkpoints (``ds_to_universal``,
``load_universal``) of the versions the protected job re-formed at. Every loss each stretch kept is compared
(float.hex) and every rank's final state (torch.equal), and every restarted attempt must have continued from the
version it restored (its first logged step is that version + 1).

ZeRO-2 runs in tests/fault/test_demo.py::test_demo_shrink_json. A layout that cannot shrink (the global batch
divides at no smaller size) waits for a spare and says why: tests/fault/test_resize_launch.py::
test_a_layout_that_cannot_shrink_waits_for_a_node_and_says_why.

The pipeline layout (PipelineModule, PP = 2, D changes and PP stays) has DeepSpeed's universal checkpoint as its
oracle too: ``ds_to_universal`` converts a PipelineEngine's ZeRO-1 checkpoint and ``load_universal`` loads it at
another data-parallel size with the same stages. It runs in fp32 (ZeRO-1): with bf16 the demo's pipeline uses
BF16_Optimizer, whose pipeline checkpoint ``ds_to_universal`` refuses ("param_shapes must contain dictionaries");
that combination's re-partition is checked against DeepSpeed's per-parameter accessors in
tests/dist/test_ds_pipeline_bf16_reshard_oracle.py (its shrink and grow themselves run the same way).

Megatron's DistributedOptimizer with TP = 2 runs the same demo with Megatron's own reshard as the oracle: a
dist_checkpointing save with the fully reshardable optimizer format at one size, loaded at the next.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from shardsafe import demo, demo_shrink
from shardsafe.demo import EXAMPLES
from shardsafe.demo_shrink import SHRINK_GAS, SHRINK_MICRO
from shardsafe.runcheck import read_jsonl, resume_problems

from .helpers import committed_everywhere

pytestmark = pytest.mark.slow

EXAMPLE = EXAMPLES / "ds_pretrain_gpt.py"


def shrink_demo(tmp_path, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-m", "shardsafe.cli", "demo", "--shrink", "--optimizer", "fused-adamw",
                        "--steps", "10", "--json", "--run-dir", str(tmp_path), *args],
                       capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stdout + r.stderr[-3000:]
    out = json.loads(lines[0])
    print(json.dumps({k: out.get(k) for k in ("data_parallel_sizes", "attempts", "restored_versions",
                                              "restore_tiers", "oracle", "wall_s")}))
    assert r.returncode == 0, (out.get("mismatches"), out.get("resume_problems"), r.stderr[-3000:])
    return out


def check_bit_exact_and_resumed(out: dict, sizes: list[int]) -> None:
    assert out["data_parallel_sizes"] == sizes and (out["shrinks"], out["grows"]) == (1, 1), out
    assert out["oracle"]["ran"] and out["oracle"]["error"] is None, out["oracle"]
    assert out["bit_identical"] is True and out["mismatches"] == [], out["mismatches"]
    assert out["resumed"] is True and out["resume_problems"] == [], out["resume_problems"]
    assert out["node_losses"] == 1 and out["restore_tiers"][0] == "parity", out


def attempt_sizes(run_dir: str) -> list[int]:
    """Each attempt's data-parallel size (one rank per node): the ranks whose trainer started in it."""
    ranks: dict[int, set] = {}
    for e in read_jsonl(os.path.join(run_dir, "events.jsonl")):
        if e.get("source") == "trainer" and e.get("kind") == "trainer_start":
            ranks.setdefault(int(e.get("attempt") or 0), set()).add(e["rank"])
    return [len(ranks[a]) for a in sorted(ranks)]


def test_zero3_under_shardsafe_launch_shrinks_from_memory_and_grows_back_bit_exact(tmp_path):
    """ZeRO-3 through `shardsafe launch` (torch elastic agents, a rendezvous per size): node3 is lost at step 4
    (version 3 or 4 committed), the launcher re-forms the job on 3 nodes, whose restore rebuilds node3's partition from
    parity and re-partitions every parameter; node3 returns after step 6 and the job grows back at the next committed
    version, re-partitioning the D' = 3 copies in memory. Workers are forked from each node's fork server (``--preload
    deepspeed``, as the docs advise), the returning node's started anew. The oracle and the checks are the demo's
    (shardsafe/demo_shrink.py: universal checkpoints of the versions the job re-formed at)."""
    run_dir, steps = str(tmp_path / "run"), 10
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    program = ["--steps", str(steps), "--zero-stage", "3", "--dtype", "bf16", "--optimizer", "fused-adamw"]
    r = subprocess.run([sys.executable, "-m", "shardsafe.cli", "launch", "--nnodes", "4", "--spares", "0",
                        "--shrink-after-s", "1", "--preload", "deepspeed", "--global-batch",
                        str(SHRINK_MICRO * SHRINK_GAS * 4), "--micro-batch", str(SHRINK_MICRO), "--max-restarts", "3",
                        "--timeout-s", "500", "--inject", "kill-node:node3@4;add-node:node3@6", "--run-dir", run_dir, "--json", str(EXAMPLE), *program,
                        "--micro-batch", str(SHRINK_MICRO), "--gas", str(SHRINK_GAS), "--out", run_dir,
                        # a pause per step after the node's return: the launcher sees a commit before the last step
                        "--step-sleep", "0.25", "--step-sleep-after", "6"],
                       capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert r.returncode == 0 and len(lines) == 1, r.stdout + r.stderr[-3000:]
    out = json.loads(lines[0])
    assert out["ok"] and out["data_parallel_sizes"] == [4, 3, 4], out
    assert [f["cause"] for f in out["failures"]] == ["node_loss"], out
    sizes = attempt_sizes(run_dir)
    assert sizes == [4, 3, 4], sizes
    logs = "".join(open(os.path.join(run_dir, "logs", f), errors="replace").read()
                   for f in sorted(os.listdir(os.path.join(run_dir, "logs"))) if f.startswith("agent_"))
    assert "workers are forked from the fork server" in logs and "workers start cold" not in logs, logs[-3000:]
    tiers = {int(e.get("attempt") or 0): (e["tier"], int(e["version"]))
             for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e.get("kind") == "restore_end"}
    # the node dies once the launcher sees step 4, and the others may finish a step or so more before they block on
    # it: attempt 1 restores the newest version every rank committed in attempt 0 (or the one after it, sealed
    # everywhere while its vote was still out), at least 3
    committed = committed_everywhere(run_dir, 4)
    assert tiers[1][0] == "parity" and 3 <= tiers[1][1] and committed <= tiers[1][1] <= committed + 1 \
        and tiers[2][0] == "memory", (tiers, committed)
    assert resume_problems(run_dir, 4) == []

    a = argparse.Namespace(engine="deepspeed", zero_stage=3, dtype="bf16", optimizer="fused-adamw", steps=steps, pp=1,
                           tp=1, nodes=4, nproc_per_node=1, kill_at=0, inject="", memory_budget_gb=1.0)
    plan = demo._resolve(a)
    segs = demo_shrink._kept_segments(run_dir, sizes, steps)
    assert [(s["dp"], s["first"]) for s in segs] == [(4, 0), (3, tiers[1][1]), (4, tiers[2][1])], segs
    prev = ""
    forks = demo_shrink.oracle_fork_server(str(tmp_path))
    assert forks is not None
    try:
        for i, seg in enumerate(segs):
            seg["save"], seg["dir"] = i + 1 < len(segs), str(tmp_path / f"oracle{i}")
            prev = demo_shrink._oracle_run(a, plan, seg, prev, seg["dir"], f"e2e{os.getpid()}", 4, forks=forks)
    finally:
        forks.close()
    assert demo_shrink._compare_segments(run_dir, segs, steps) == []


def test_zero1_a_rank_killed_before_the_first_commit_at_the_smaller_size_restores_again(tmp_path):
    """ZeRO-1, two more failures inside the shrink: node3 is lost at step 4 (version 3 committed, or 4 when its commit
    beat the kill); in the first attempt at D' = 3, rank 1 is SIGKILLed halfway through writing the re-partitioned
    state into its live tensors (kill-restore-apply); in the second, at the first step it runs (4 or 5: both are
    armed), before any version of the new size commits. Each next attempt (still at 3: no node came back) must
    re-partition the same version again from the old size's copies (the survivors' and node3's rebuilt from parity),
    which no D' attempt may have dropped. Then node3 returns and the job grows back."""
    out = shrink_demo(tmp_path, "--zero-stage", "1", "--inject",
                      "kill-node:node3@4;kill-restore-apply:1@0;kill-rank:1@4&kill-rank:1@5;add-node:node3@6")
    check_bit_exact_and_resumed(out, [4, 3, 4])
    assert out["attempts"] == 5 and out["failures_injected"] == 3, out
    v = out["restored_versions"]
    assert v[0] in (3, 4) and v[1] == v[0] and out["restore_tiers"][:2] == ["parity", "parity"], out
    assert [s["dp"] for s in out["oracle"]["segments"]] == [4, 3, 4], out["oracle"]
    # the kill hit the re-partition's apply: rank 1 of attempt 1 died there, and no rank of attempt 1 trained
    evs = read_jsonl(os.path.join(out["run_dir"], "events.jsonl"))
    assert [(e["rank"], e["fault"]) for e in evs if e.get("kind") == "fault_injected" and e.get("attempt") == 1] \
        == [(1, "kill-restore-apply:1@0")], evs[-20:]
    assert not [e for e in evs if e.get("kind") == "iteration" and e.get("attempt") == 1]


def test_pipeline_pp2_shrinks_and_grows_back_with_the_stages_kept_bit_exact(tmp_path):
    """PipelineModule PP = 2 x D = 4 on 4 nodes of 2 ranks (one per stage; ZeRO-1, fp32, tied embedding):
    node3 is lost (a rank of each stage), the job continues at D' = 3 with both stages on every node left (each
    stage's lost rank rebuilt from its own parity group), and grows back to 4. The stages' copies of the tied
    embedding drift apart in the last bits as DeepSpeed trains; the re-partition keeps each stage's own, and so does
    the oracle (examples/ds_pretrain_gpt.py puts them back after load_universal, which has one copy per name)."""
    out = shrink_demo(tmp_path, "--engine", "deepspeed-3d", "--dtype", "fp32")
    check_bit_exact_and_resumed(out, [4, 3, 4])
    assert out["ranks"] == 8 and "PP2" in out["layout"], out


def test_megatron_distopt_tp2_shrinks_and_grows_back_as_megatrons_reshardable_checkpoint(tmp_path):
    """megatron-core's DistributedOptimizer, TP = 2 x D = 4 on 4 nodes of one TP pair each (examples/
    megatron_pretrain_gpt.py: bf16, torch Adam, cosine LR with warmup, gradient clipping, dropout): node3 is lost
    (data-parallel rank 3 of both TP ranks, each rebuilt from its own parity group), the job continues at D' = 3 with
    4 micro-batches per rank instead of 3, and grows back to 4. The oracle is Megatron's own reshard: plain runs
    chained through dist_checkpointing saves with the fully reshardable optimizer format
    (examples/megatron_dist_ckpt.py), loaded at the next size; every RNG at D' is data-parallel rank 0's, as
    Megatron-LM's load gives it."""
    out = shrink_demo(tmp_path, "--engine", "megatron")
    check_bit_exact_and_resumed(out, [4, 3, 4])
    assert out["ranks"] == 8 and "TP2" in out["layout"] and "DistributedOptimizer" in out["layout"], out
    assert out["oracle"]["kind"].startswith("Megatron dist_checkpointing"), out["oracle"]
    oracle1 = "".join(open(tmp_path / "oracle1" / f"trainer_rank{r}.log", errors="replace").read() for r in range(6))
    assert oracle1.count("loaded Megatron's checkpoint") == 6, oracle1[-3000:]
