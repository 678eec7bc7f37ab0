"""DeepSpeed 3D layouts after real SIGKILLs: a PipelineModule (PipelineEngine, train_batch) of two stages x two
data-parallel ranks, the token embedding tied across the first and last stage, every rank on its own simulated
node (parity groups: the two data-parallel ranks of one stage).

Every effective loss, every loss any attempt computed, and every rank's final state (fp32 masters, Adam
moments and step, low-precision params, RNG) must be torch.equal to an uninterrupted run of plain DeepSpeed,
and each restarted attempt must have continued from the version it restored (compare_runs' resume check).
"""
import json
import os

import pytest

from shardsafe.runcheck import compare_runs, read_jsonl

from .helpers import restores, run_job, trainer_logs

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
    """The ranks the last attempt rebuilt from parity; every rank of it must have restored from that tier."""
    ends = [e for e in read_jsonl(f"{run_dir}/events.jsonl") if e.get("kind") == "restore_end"]
    last = max(int(e.get("attempt") or 0) for e in ends)
    ends = [e for e in ends if int(e.get("attempt") or 0) == last]
    assert last > 0 and {e["tier"] for e in ends} == {"parity"}, ends
    return {e["rank"] for e in ends if e.get("rebuilt_bytes")}


def _bit_exact(run_dir, ref, world=4):
    cmp = compare_runs(str(run_dir), str(ref), world, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (
        cmp.resume_problems, cmp.loss_mismatches, cmp.state_mismatches, cmp.replayed_losses_equal)


@pytest.mark.parametrize("stage, dtype, optimizer, extra", [
    # ZeRO-1 under a pipeline: DeepSpeedZeroOptimizer partitions each stage's fp32 state over its 2 DP ranks.
    (1, "fp32", "DeepSpeedZeroOptimizer", ["--partition-method", "parameters"]),
    # bf16 with stage 0 under a pipeline is DeepSpeed's BF16_Optimizer (fp32 masters partitioned over DP);
    # two micro-batches per train_batch, stages cut at the transformer blocks.
    (0, "bf16", "BF16_Optimizer", ["--gas", "2", "--partition-method", "type:Block"]),
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
    dp 1, both slices) is lost: ranks 2 and 3 are rebuilt, each in its own (tp, pp) parity group."""
    args = [*TP2, *PP2]
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


def test_moe_node_loss_rebuilt_from_parity(tmp_path, reference):
    """node1's experts exist nowhere else: rebuilt from node0's payload and parity (RS(1, 1) over the two
    data-parallel ranks, whose payloads have equal size). ZeRO-1 fp32."""
    ref = reference(1, "fp32", STEPS, extra=MOE, world=2)
    res = run_job(tmp_path, stage=1, dtype="fp32", steps=STEPS, nodes=2, nproc=1, extra=MOE,
                  inject="kill-node:node1@6")
    assert res.ok and res.attempts == 2 and res.failures[0]["cause"] == "node_loss", res
    assert _rebuilt_from_parity(tmp_path) == {1}
    _bit_exact(tmp_path, ref, world=2)


def test_pipeline_config_file_is_what_the_docs_say():
    """configs/deepspeed/pipeline_bf16_shardsafe.json: bf16 with stage 0 (BF16_Optimizer under a PipelineModule)
    and an enabled block the config dataclass accepts."""
    from shardsafe.adapters.deepspeed import config_from_ds
    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "deepspeed", "pipeline_bf16_shardsafe.json")
    with open(path) as f:
        cfg = json.load(f)
    assert cfg["bf16"]["enabled"] and cfg["zero_optimization"]["stage"] == 0
    assert config_from_ds(cfg).enabled
