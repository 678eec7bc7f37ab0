"""DeepSpeed 3D layouts after real SIGKILLs: a PipelineModule (PipelineEngine, train_batch) of two stages x two
data-parallel ranks, the token embedding tied across the first and last stage, every rank on its own simulated
node (parity groups: the two data-parallel ranks of one stage).

Every effective loss, every loss any attempt computed, and every rank's final state (fp32 masters, Adam
moments and step, low-precision params, RNG) must be torch.equal to an uninterrupted run of plain DeepSpeed,
and each restarted attempt must have continued from the version it restored (compare_runs' resume check).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from shardsafe.launch import PRELOAD_DEEPSPEED
from shardsafe.payload.manifest import load_tensors
from shardsafe.runcheck import compare_runs, effective_losses, read_jsonl

from .helpers import PLAIN_DEEPSPEED, reference_preload, restores, run_job, trainer_logs

STEPS = 10
PP2 = ["--pp", "2"]
pytestmark = pytest.mark.slow


def _engines(run_dir):
    """The (engine, optimizer) pairs the trainers reported, e.g. {("PipelineEngine", "BF16_Optimizer")}."""
    out = set()
    for ln in trainer_logs(str(run_dir)).splitlines():
        if " with " in ln and "Engine" in ln and ln.startswith("[rank"):
            eng, _, opt = ln.split("] ", 1)[1].partition(" with ")
            out.add((eng.strip(), opt.strip()))
    return out


def _rebuilt_from_parity(run_dir):
    """The ranks the last attempt rebuilt from parity; every rank of it must have restored from that tier.

    A survivor is rebuilt too where its own copy of the restored version is gone for the reason the run recorded:
    the node was lost during that version's commit vote, the survivor's vote failed (its copy stays uncommitted),
    and its next snapshot took that slot (the last committed version is the one a holder keeps). Such a rank is
    left out of the set returned, after checking that its snapshot event says so."""
    evs = read_jsonl(f"{run_dir}/events.jsonl")
    ends = [e for e in evs if e.get("kind") == "restore_end"]
    last = max(int(e.get("attempt") or 0) for e in ends)
    ends = [e for e in ends if int(e.get("attempt") or 0) == last]
    assert last > 0 and {e["tier"] for e in ends} == {"parity"}, ends
    rebuilt = {e["rank"] for e in ends if e.get("rebuilt_bytes")}
    version = ends[0]["version"]
    vote_failed = {e["rank"] for e in evs if e.get("kind") == "snapshot" and e.get("version") == version
                   and int(e.get("attempt") or 0) == last - 1 and not e.get("committed")
                   and str(e.get("error", "")).startswith("agreement failed")}
    lost_node = {f["node"] for f in evs if f.get("kind") == "failure_detected"
                 and f.get("cause") == "node_loss" and int(f.get("attempt") or 0) == last - 1}
    on_lost = {e["rank"] for e in evs if e.get("kind") == "trainer_start" and int(e.get("attempt") or 0) == last - 1
               and e.get("node") in lost_node}
    extra = rebuilt - on_lost
    assert extra <= vote_failed, (sorted(rebuilt), sorted(on_lost), sorted(vote_failed))
    return rebuilt - extra


def _bit_exact(run_dir, ref, world=4):
    cmp = compare_runs(str(run_dir), str(ref), world, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (
        cmp.resume_problems, cmp.loss_mismatches, cmp.state_mismatches, cmp.replayed_losses_equal)


@pytest.mark.parametrize("stage, dtype, optimizer, extra", [
    # ZeRO-1 under a pipeline: DeepSpeedZeroOptimizer partitions each stage's fp32 state over its 2 DP ranks.
    (1, "fp32", "DeepSpeedZeroOptimizer", ["--partition-method", "parameters"]),
    # bf16 with stage 0 under a pipeline is DeepSpeed's BF16_Optimizer (fp32 masters partitioned over DP);
    # two micro-batches per train_batch, stages cut at the transformer blocks; DeepSpeed's default FusedAdam.
    (0, "bf16", "BF16_Optimizer", ["--gas", "2", "--partition-method", "type:Block", "--optimizer", "fused-adamw"]),
])
def test_pipeline_kill_rank_then_kill_during_copy(tmp_path, reference, stage, dtype, optimizer, extra):
    args = [*PP2, *extra]
    ref = reference(stage, dtype, STEPS, extra=args, world=4)
    # rank 2 (stage 1, dp 0) dies at the start of step 5; then rank 1 (stage 0, dp 1) halfway through copying 8.
    res = run_job(tmp_path, stage=stage, dtype=dtype, steps=STEPS, nodes=4, nproc=1, extra=args,
                  inject="kill-rank:2@5;kill-copy:1@8")
    assert res.ok and res.attempts == 3, res
    assert [f["rank"] for f in res.failures] == [2, 1] and all(f["rc"] == -9 for f in res.failures)
    assert _engines(tmp_path) == {("PipelineEngine", optimizer)}
    got = restores(tmp_path)
    assert got[0] == -1 and got[1] in (3, 4) and got[2] == 7, got   # the torn v8 is never restored
    _bit_exact(tmp_path, ref)


def test_bf16_optimizer_without_a_pipeline(tmp_path, reference):
    """BF16_Optimizer outside a pipeline: bf16, ZeRO-1 and `data_types.grad_accum_dtype: fp32` (what DeepSpeed
    picks for Megatron-DeepSpeed's non-pipeline bf16 runs), 2 ranks on 2 nodes: kill, then kill during the copy."""
    args = ["--grad-accum-dtype", "fp32"]
    ref = reference(1, "bf16", STEPS, extra=args, world=2)
    res = run_job(tmp_path, stage=1, dtype="bf16", steps=STEPS, nodes=2, nproc=1, extra=args,
                  inject="kill-rank:1@5;kill-copy:0@8")
    assert res.ok and res.attempts == 3, res
    assert _engines(tmp_path) == {("DeepSpeedEngine", "BF16_Optimizer")}
    assert restores(tmp_path)[2] == 7
    _bit_exact(tmp_path, ref, world=2)


def test_pipeline_fp16_with_dynamic_loss_scaler(tmp_path, reference, monkeypatch):
    """fp16 ZeRO-1 under a PipelineModule: the loss scaler (scale, growth and hysteresis counters) comes back with
    every stage's snapshot. A 2**20 initial scale overflows and a 3-step window grows it again; every step's
    scale, and every loss, equals the uninterrupted run's (DeepSpeed refuses fp16 on this CPU: the example's
    test-only switch lifts that refusal)."""
    monkeypatch.setenv("SHARDSAFE_TEST_FORCE_FP16", "1")
    args = [*PP2, "--fp16-scale-power", "20", "--fp16-scale-window", "3", "--fp16-hysteresis", "1"]
    ref = reference(1, "fp16", STEPS, extra=args, world=4)
    res = run_job(tmp_path, stage=1, dtype="fp16", steps=STEPS, nodes=4, nproc=1, extra=args,
                  inject="kill-rank:2@5;kill-copy:1@8")
    assert res.ok and res.attempts == 3, res
    assert _engines(tmp_path) == {("PipelineEngine", "DeepSpeedZeroOptimizer")}
    assert restores(tmp_path)[2] == 7
    _bit_exact(tmp_path, ref)
    want = _scales(ref)
    moves = [b / a for a, b in zip(want, want[1:])]
    assert any(x < 1 for x in moves) and any(x > 1 for x in moves), want   # overflowed and grew back
    assert _scales(tmp_path) == want


def _scales(run_dir) -> list:
    """Rank 0's loss scale per step, the last record of each step (a replayed step logs again)."""
    got = {int(rec["step"]): rec["loss_scale"] for rec in read_jsonl(os.path.join(str(run_dir), "losses_rank0.jsonl"))}
    return [got[s] for s in range(1, STEPS + 1)]


def test_pipeline_node_loss_rebuilt_from_parity(tmp_path, reference):
    """node1 (stage 0, dp 1) lost with its holder and shared memory: rebuilt from rank 0's payload and the
    parity rank 0 holds; stage 1's parity group is untouched. bf16, BF16_Optimizer."""
    ref = reference(0, "bf16", STEPS, extra=PP2, world=4)
    res = run_job(tmp_path, stage=0, dtype="bf16", steps=STEPS, nodes=4, nproc=1, extra=PP2,
                  inject="kill-node:node1@6")
    assert res.ok and res.attempts == 2 and res.failures[0]["cause"] == "node_loss", res
    assert _rebuilt_from_parity(tmp_path) == {1}
    done = max(e["iteration"] for e in read_jsonl(f"{tmp_path}/events.jsonl")
               if e.get("kind") == "iteration" and not e.get("attempt"))
    assert 4 <= restores(tmp_path)[1] <= done
    _bit_exact(tmp_path, ref)


TP2 = ["--tp", "2"]


def test_tensor_parallel_mpu_kill_rank_then_kill_during_copy(tmp_path, reference):
    """TP2 x DP2 through a Megatron-style mpu (examples/_ds_tensor_parallel.py): column/row-parallel MLPs, their
    dropout under DeepSpeed's model-parallel RNG tracker (one stream per tensor-parallel rank, restored from
    the snapshot: without it the losses after the restore differ), ZeRO-1 bf16. Two ranks per node, tensor
    innermost (a tensor-parallel pair shares a node); parity groups are the data-parallel pairs across nodes."""
    ref = reference(1, "bf16", STEPS, extra=TP2, world=4)
    res = run_job(tmp_path, stage=1, dtype="bf16", steps=STEPS, nodes=2, nproc=2, extra=TP2,
                  inject="kill-rank:1@5;kill-copy:2@8")
    assert res.ok and res.attempts == 3, res
    assert _engines(tmp_path) == {("DeepSpeedEngine", "DeepSpeedZeroOptimizer")}
    got = restores(tmp_path)
    assert got[1] in (3, 4) and got[2] == 7, got
    _bit_exact(tmp_path, ref)


def test_tensor_parallel_node_loss_rebuilt_from_parity(tmp_path, reference):
    """node1 holds ranks 2 and 3 (tensor-parallel slices 0 and 1 of data-parallel rank 1): each is the lost
    member of its own parity group ({0, 2} and {1, 3}), so one parity shard per group rebuilds both. ZeRO-2
    fp32."""
    ref = reference(2, "fp32", STEPS, extra=TP2, world=4)
    res = run_job(tmp_path, stage=2, dtype="fp32", steps=STEPS, nodes=2, nproc=2, extra=TP2,
                  inject="kill-node:node1@6")
    assert res.ok and res.attempts == 2 and res.failures[0]["cause"] == "node_loss", res
    assert _rebuilt_from_parity(tmp_path) == {2, 3}
    _bit_exact(tmp_path, ref)


def test_tensor_pipeline_data_parallel_8_ranks(tmp_path, reference):
    """TP2 x PP2 x DP2 on 4 nodes x 2 ranks: DeepSpeed's PipelineParallelGrid over a pipe x data x model topology
    (tensor innermost: a node holds both slices of one (stage, dp) pair), tensor-parallel MLPs over the grid's
    slice group, bf16 with stage 0 (BF16_Optimizer). Rank 5 (stage 1) is killed at step 4, then node1 (stage 0,
    dp 1, both slices) is lost: ranks 2 and 3 are rebuilt, each in its own (tp, pp) parity group. DeepSpeed's
    default optimizer (FusedAdam: "AdamW" without torch_adam)."""
    args = [*TP2, *PP2, "--optimizer", "fused-adamw"]
    ref = reference(0, "bf16", STEPS, extra=args, world=8)
    res = run_job(tmp_path, stage=0, dtype="bf16", steps=STEPS, nodes=4, nproc=2, extra=args,
                  inject="kill-rank:5@4;kill-node:node1@7")
    assert res.ok and res.attempts == 3, res
    assert [f["cause"] for f in res.failures] == ["rank_exit", "node_loss"], res.failures
    assert _engines(tmp_path) == {("PipelineEngine", "BF16_Optimizer")}
    got = restores(tmp_path)
    assert got[1] in (2, 3) and 5 <= got[2] <= 8, got
    assert _rebuilt_from_parity(tmp_path) == {2, 3}
    _bit_exact(tmp_path, ref, world=8)


def test_deepspeed_autotp_training(tmp_path, reference):
    """DeepSpeed's own training tensor parallelism (`"tensor_parallel": {"autotp_size": 2}`) on a tiny transformers
    Llama: AutoTP shards its projections, the engine's mpu is deepspeed.utils.groups. TP2 x DP2 on 2 nodes x 2,
    ZeRO-1 bf16: rank 1 killed at step 4, then node1 (both tensor slices of dp rank 1) lost, rebuilt from parity."""
    args = ["--autotp", "2"]
    ref = reference(1, "bf16", STEPS, extra=args, world=4)
    res = run_job(tmp_path, stage=1, dtype="bf16", steps=STEPS, nodes=2, nproc=2, extra=args,
                  inject="kill-rank:1@4;kill-node:node1@7")
    assert res.ok and res.attempts == 3 and [f["cause"] for f in res.failures] == ["rank_exit", "node_loss"], res
    assert _rebuilt_from_parity(tmp_path) == {2, 3}
    _bit_exact(tmp_path, ref)


MOE = ["--moe", "2"]


def test_moe_expert_parallel_kill_rank_then_kill_during_copy(tmp_path, reference):
    """deepspeed.moe.layer.MoE in every block, 2 experts, expert parallel 2 over 2 data-parallel ranks: each rank
    holds one expert per layer, whose fp32 masters and moments exist on that rank alone (its expert-data-parallel
    group is itself). ZeRO-2 bf16, top-1 gating with random token selection (RNG)."""
    ref = reference(2, "bf16", STEPS, extra=MOE, world=2)
    res = run_job(tmp_path, stage=2, dtype="bf16", steps=STEPS, nodes=2, nproc=1, extra=MOE,
                  inject="kill-rank:1@5;kill-copy:0@8")
    assert res.ok and res.attempts == 3, res
    got = restores(tmp_path)
    assert got[1] in (3, 4) and got[2] == 7, got
    _bit_exact(tmp_path, ref, world=2)


def test_moe_expert_data_parallel_node_loss_rebuilt_from_parity(tmp_path, reference):
    """2 experts, expert parallel 2 over 4 data-parallel ranks: each expert lives on 2 ranks (its expert-data-
    parallel group), which partition its optimizer state between them (ZeRO-1 fp32). Rank 3 is killed at step 4,
    then node1 (rank 1) is lost: rank 1's partition of the shared layers and of its expert is rebuilt from
    parity."""
    ref = reference(1, "fp32", STEPS, extra=MOE, world=4)
    res = run_job(tmp_path, stage=1, dtype="fp32", steps=STEPS, nodes=4, nproc=1, extra=MOE,
                  inject="kill-rank:3@4;kill-node:node1@7")
    assert res.ok and res.attempts == 3 and [f["cause"] for f in res.failures] == ["rank_exit", "node_loss"], res
    assert _rebuilt_from_parity(tmp_path) == {1}
    _bit_exact(tmp_path, ref)


@pytest.mark.parametrize("stage", [1, 0])
def test_pipeline_export_equals_save_checkpoint_and_resumes_bit_exact(tmp_path, stage):
    """`shardsafe export --format deepspeed SRC DST -- COMMAND` for PP2 x DP2 bf16: the job's own command, run once
    more, restores version 6 from the persistent tier and writes it with DeepSpeed's save_checkpoint. Every file
    (pipeline layer files, mp_rank model states per stage, bf16_zero optimizer files per rank) equals the one a
    plain run saved at step 6, tensor for tensor.

    ZeRO-1: a plain job that load_checkpoint()s the export goes on with the plain run's losses 7..10 and final
    state (RNG from the export's per-rank files). BF16_Optimizer (stage 0): the files are compared only. DeepSpeed
    0.19.8's load_checkpoint cannot read its own stage-0 BF16_Optimizer checkpoint (it passes the model-states
    file's optimizer dict to BF16_Optimizer.load_state_dict, which indexes it by data-parallel rank: KeyError 0),
    for the plain run's checkpoint as for the export."""
    from .helpers import SCRIPT
    from .test_export import _cmp
    ref, vanilla = tmp_path / "ref", tmp_path / "vanilla_ckpt"
    res = run_job(ref, stage=stage, dtype="bf16", steps=STEPS, shardsafe=False, max_restarts=0, nodes=4, nproc=1,
                  extra=[*PP2, "--save-dir", str(vanilla), "--save-at", "6"],
                  preload=reference_preload(PLAIN_DEEPSPEED, cold=False))
    assert res.ok, trainer_logs(str(ref))[-3000:]
    disk, prot = tmp_path / "persist", tmp_path / "protected"
    job = f"exp3d{stage}"
    res = run_job(prot, stage=stage, dtype="bf16", steps=6, nodes=4, nproc=1, job_id=job,
                  extra=[*PP2, "--shardsafe-json", json.dumps({"persist_dir": str(disk), "persist_every": 2})])
    assert res.ok, trainer_logs(str(prot))[-3000:]

    # The job's command as a user runs it: plain torchrun (started cold) for ZeRO-1, `shardsafe launch --preload
    # deepspeed` for stage 0 (forked trainers, their output in its run directory).
    out, replay = tmp_path / "exported", tmp_path / "replay"
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"] if stage else
                [sys.executable, "-m", "shardsafe.cli", "launch", "--nproc-per-node", "4", "--preload", "deepspeed",
                 "--run-dir", str(replay), "--max-restarts", "0", "--"])
    command = [*launcher, SCRIPT, "--steps", "6", "--zero-stage", str(stage), "--dtype", "bf16", *PP2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    p = subprocess.run([sys.executable, "-m", "shardsafe.cli", "export", "--format", "deepspeed", str(disk / job),
                        str(out), "--", *command], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    said = p.stdout if stage else "".join(f.read_text(errors="replace")
                                          for f in sorted((replay / "logs").glob("agent_*")))
    assert "shardsafe: exported version 6" in said, said[-3000:]
    tag = "global_step6"
    assert (out / "latest").read_text().strip() == tag
    want = sorted(f for f in os.listdir(vanilla / tag) if f.endswith(".pt"))
    got = sorted(f for f in os.listdir(out / tag) if f.endswith(".pt") and not f.startswith("shardsafe_rank"))
    assert got == want and any(f.startswith("layer_") for f in want) and any("bf16_zero" in f for f in want), got
    assert sorted(f for f in os.listdir(out / tag) if f.startswith("shardsafe_rank")) == \
        [f"shardsafe_rank{r}.pt" for r in range(4)]
    for f in want:
        a = torch.load(out / tag / f, weights_only=False)
        b = torch.load(vanilla / tag / f, weights_only=False)
        if isinstance(a, dict):
            a.pop("shardsafe", None)                           # our client state
            if isinstance(a.get("ds_config"), dict):
                a["ds_config"].pop("shardsafe", None)          # the protected job's config has the block
        diffs = []
        _cmp(a, b, f, diffs)
        assert not diffs, diffs[:10]
    if stage == 0:
        # DeepSpeed cannot load_checkpoint a stage-0 BF16_Optimizer checkpoint, its own included (docstring). When a
        # DeepSpeed version can, this fails: then continue from the export as for ZeRO-1.
        plain = tmp_path / "plain_load"
        res = run_job(plain, stage=stage, dtype="bf16", steps=STEPS, shardsafe=False, max_restarts=0, nodes=4,
                      nproc=1, extra=[*PP2, "--load", str(vanilla)], preload=PRELOAD_DEEPSPEED)
        assert not res.ok and "KeyError: 0" in trainer_logs(str(plain)), trainer_logs(str(plain))[-3000:]
        return

    cont = tmp_path / "continued"
    res = run_job(cont, stage=stage, dtype="bf16", steps=STEPS, shardsafe=False, max_restarts=0, nodes=4, nproc=1,
                  extra=[*PP2, "--load", str(out)], preload=PRELOAD_DEEPSPEED)
    assert res.ok, trainer_logs(str(cont))[-3000:]
    for r in range(4):
        got_l, ref_l = effective_losses(str(cont), r), effective_losses(str(ref), r)
        assert sorted(got_l) == list(range(7, STEPS + 1)), sorted(got_l)
        assert all(got_l[s] == ref_l[s] for s in got_l), {s: (got_l[s], ref_l[s])
                                                          for s in got_l if got_l[s] != ref_l[s]}
        a, b = load_tensors(str(cont / f"final_rank{r}")), load_tensors(str(ref / f"final_rank{r}"))
        assert a.keys() == b.keys() and not [k for k in a if not torch.equal(a[k], b[k])]


def test_pipeline_ranks_moved_by_torch_elastic(tmp_path, reference):
    """PP2 x DP2 under `shardsafe launch`'s torch elastic agents, one rank per node. node1 (rank 1: stage 0,
    dp 1) is lost at step 6 and a fresh node4 joins. Torch elastic's next round orders the nodes by address
    (node0, node2, node3, node4), so ranks 1-3 each run on another node than before, across stages: rank 1 (stage
    0) lands on node2, which held rank 2's (stage 1) snapshots, and is rebuilt from parity there; ranks 2 and 3
    find their snapshots on the nodes they left and move them (data and parity) to where they run now."""
    from shardsafe.launch.elastic import ElasticConfig, ElasticLauncher
    from .helpers import SCRIPT
    from .test_launch import by_attempt
    ref = reference(1, "bf16", STEPS, extra=PP2, world=4)
    cfg = ElasticConfig(nodes=4, nproc_per_node=1, run_dir=str(tmp_path), inject="kill-node:node1@6",
                        memory_budget_gb=0.5, max_restarts=3, keep_alive_s=2, keep_alive_misses=3, timeout_s=420,
                        preload=PRELOAD_DEEPSPEED)
    res = ElasticLauncher(cfg).run([SCRIPT, "--steps", str(STEPS), "--zero-stage", "1", "--dtype", "bf16", *PP2])
    assert res.ok and res.attempts == 2 and res.failures[0]["cause"] == "node_loss", res
    evs = read_jsonl(os.path.join(str(tmp_path), "events.jsonl"))
    placed = {e["rank"]: e["node"] for e in by_attempt(evs, "trainer_start")[1]}
    assert placed == {0: "node0", 1: "node2", 2: "node3", 3: "node4"}, placed
    ends = {e["rank"]: e for e in by_attempt(evs, "restore_end")[1]}
    assert {e["tier"] for e in ends.values()} == {"parity"}, ends
    assert ends[2].get("migrated_slots", 0) > 0 and ends[3].get("migrated_slots", 0) > 0, ends
    assert ends[1].get("rebuilt_bytes", 0) > 0, ends[1]
    _bit_exact(tmp_path, ref)


def test_pipeline_config_file_is_what_the_docs_say():
    """configs/deepspeed/pipeline_bf16_shardsafe.json: bf16 with stage 0 (BF16_Optimizer under a PipelineModule)
    and an enabled block the config dataclass accepts."""
    from shardsafe.adapters.deepspeed import config_from_ds
    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "deepspeed", "pipeline_bf16_shardsafe.json")
    with open(path) as f:
        cfg = json.load(f)
    assert cfg["bf16"]["enabled"] and cfg["zero_optimization"]["stage"] == 0
    assert config_from_ds(cfg).enabled
