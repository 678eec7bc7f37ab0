"""The data-parallel size a job continues at when a lost node's place stays empty (shardsafe/launch/shrink.py)."""
import json

import pytest

from shardsafe.errors import ConfigError
from shardsafe.launch.shrink import (Shape, batch_from_ds_config, ds_config_in, grow_target, job_shape,
                                     megatron_layout_in, shrink_after_s, shrink_target)


def test_the_largest_size_that_fits_the_nodes_left_and_keeps_the_global_batch():
    # 4 nodes x 1 rank, global batch 48 in micro-batches of 4: D=4 (G=3); one node lost -> 3 nodes, G=4
    got = shrink_target(Shape(dp=4, global_batch=48, micro_batch=4), nodes_left=3)
    assert (got.dp, got.accumulation, got.nodes) == (3, 4, 3)
    assert "gradient accumulation 3 -> 4 keeps the global batch of 48" in got.reason
    # two lost: 2 nodes, G=6
    got = shrink_target(Shape(dp=4, global_batch=48, micro_batch=4), nodes_left=2)
    assert (got.dp, got.accumulation, got.nodes) == (2, 6, 2)


def test_no_surviving_node_is_left_idle_its_holder_is_needed():
    # 16 / 4 does not divide at 3; size 2 would run on 2 of the 3 survivors, and the third's memory (its old ranks'
    # shards) would be unreachable: one lost node plus one idle survivor is more than one parity shard rebuilds
    with pytest.raises(ConfigError, match=r"divides only at data-parallel sizes 2 \(on 2 node\(s\)\), 1 \(on 1 node"
                                          r"\(s\)\), and data-parallel size 2 would leave 1 surviving node\(s\) idle, "
                                          r"whose holders' memory the restore needs .*waiting for a spare"):
        shrink_target(Shape(dp=4, global_batch=16, micro_batch=4), nodes_left=3)


def test_model_parallel_slices_stay_whole_and_nodes_stay_whole():
    # TP2 x PP2 = 4 ranks per replica, 8 ranks per node, D=4 on 2 nodes; one node lost -> D'=2 on 1 node
    got = shrink_target(Shape(dp=4, model_parallel=4, ranks_per_node=8, global_batch=64, micro_batch=2), nodes_left=1)
    assert (got.dp, got.nodes, got.accumulation) == (2, 1, 16)
    # 8 ranks per node, model parallel 8: one replica per node
    got = shrink_target(Shape(dp=8, model_parallel=8, ranks_per_node=8, global_batch=8 * 6, micro_batch=1),
                        nodes_left=6)
    assert (got.dp, got.nodes, got.accumulation) == (6, 6, 8)
    with pytest.raises(ConfigError, match="would leave 1 surviving node"):   # 5 does not divide 48; 4 idles one
        shrink_target(Shape(dp=8, model_parallel=8, ranks_per_node=8, global_batch=8 * 6, micro_batch=1), nodes_left=5)


def test_a_layout_that_cannot_shrink_says_which_sizes_would():
    with pytest.raises(ConfigError, match=r"divides only at data-parallel sizes 2 \(on 2 node\(s\)\), 1 .*waiting "
                                          r"for a spare"):
        shrink_target(Shape(dp=4, global_batch=16, micro_batch=4), nodes_left=1 - 1)
    with pytest.raises(ConfigError, match="global batch and micro-batch are not known"):
        shrink_target(Shape(dp=4), nodes_left=3)
    with pytest.raises(ConfigError, match="nothing to shrink"):
        shrink_target(Shape(dp=1, global_batch=4, micro_batch=4), nodes_left=0)


def test_how_long_to_wait_for_a_spare():
    assert shrink_after_s(None, 60.0) == 180.0 and shrink_after_s(0, 60.0) == 0.0 and shrink_after_s(5, 60) == 5.0
    assert shrink_after_s(None) == 180.0   # 3 x the agents' rendezvous (read) timeout of 60 s
    with pytest.raises(ConfigError, match="shrink_after_s must be >= 0"):
        shrink_after_s(-1, 60.0)


def test_growing_back_takes_the_largest_size_the_nodes_up_run():
    shape = Shape(dp=4, global_batch=16, micro_batch=4)
    assert grow_target(shape, 2, nodes_live=3) is None            # 3 nodes: 3 does not keep the batch, 4 needs 4
    got = grow_target(shape, 2, nodes_live=4)
    assert (got.dp, got.accumulation, got.nodes) == (4, 1, 4) and "gradient accumulation 2 -> 1" in got.reason
    assert grow_target(Shape(dp=4, global_batch=48, micro_batch=4), 2, nodes_live=3).dp == 3   # part of the way back
    assert grow_target(shape, 4, nodes_live=8) is None             # at full size already


def test_the_batch_from_the_arguments_or_the_programs_deepspeed_config(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}))
    for argv in (["--deepspeed_config", str(cfg)], [f"--deepspeed-config={cfg}"], ["x.py", "--ds-config", str(cfg)]):
        assert ds_config_in(argv) == str(cfg)
    got = job_shape(nodes=2, ranks_per_node=2, command=["train.py", "--deepspeed_config", str(cfg)])
    assert (got.dp, got.global_batch, got.micro_batch) == (4, 24, 2)   # micro x gas x dp, as DeepSpeed derives it
    assert job_shape(nodes=2, ranks_per_node=2, global_batch=8, micro_batch=1, command=["--ds-config", str(cfg)]) \
        .global_batch == 8   # the arguments win
    assert batch_from_ds_config({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4) == (32, 4)
    assert batch_from_ds_config({"train_batch_size": "auto"}, 4) is None
    unknown = job_shape(nodes=4, ranks_per_node=1, command=["train.py"])
    assert unknown.global_batch == 0 and unknown.dp == 4
    tp2 = job_shape(nodes=2, ranks_per_node=4, model_parallel=2, global_batch=8, micro_batch=2)
    assert (tp2.dp, tp2.world, tp2.nodes_at(2)) == (4, 8, 1)


def test_the_layout_and_batch_from_a_megatron_lm_command(tmp_path):
    """A Megatron-LM command under the launcher: TP x PP x CP and the batch come from its flags (also from a first
    @FILE argument), so a job shrinks without the launcher's --model-parallel / --global-batch options."""
    args = tmp_path / "lm.args"
    args.write_text("--num-layers 2\n--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2\n"
                    "--micro-batch-size 2 --global-batch-size 24\n")
    got = job_shape(nodes=4, ranks_per_node=4, command=["pretrain_gpt.py", f"@{args}", "--train-iters", "10"])
    assert (got.model_parallel, got.dp, got.global_batch, got.micro_batch) == (4, 4, 24, 2)
    assert megatron_layout_in(["x.py", "--tensor-model-parallel-size=2", "--context-parallel-size", "2"]) == \
        {"tp": 2, "cp": 2}
    # no --global-batch-size: Megatron's one micro-batch per replica at the full size
    got = job_shape(nodes=2, ranks_per_node=2, command=["x.py", "--tensor-model-parallel-size", "2",
                                                        "--micro-batch-size", "3"])
    assert (got.model_parallel, got.dp, got.global_batch, got.micro_batch) == (2, 2, 6, 3)
    # the launcher's options win for the batch; a model-parallel size that contradicts the flags is refused
    assert job_shape(nodes=2, ranks_per_node=2, global_batch=8, micro_batch=1,
                     command=["x.py", "--micro-batch-size", "3"]).global_batch == 8
    assert job_shape(nodes=2, ranks_per_node=2, model_parallel=2, command=["x.py", "--tensor-model-parallel-size",
                                                                           "2"]).model_parallel == 2
    with pytest.raises(ConfigError, match="model_parallel is 4 but the command's Megatron-LM flags make a replica of 2"):
        job_shape(nodes=2, ranks_per_node=4, model_parallel=4, command=["x.py", "--tensor-model-parallel-size", "2"])
    assert megatron_layout_in(["x.py", "@/nonexistent/args"]) == {}
    assert megatron_layout_in(["x.py", "--micro-batch-size", "two"]) == {}


@pytest.mark.parametrize("kw, words", [
    ({"model_parallel": 3}, "model_parallel 3 does not divide the job's 4 ranks"),
    ({"global_batch": 8}, "go together: give both, in samples, or neither"),
    ({"global_batch": 6, "micro_batch": 1}, "global batch 6 is not a multiple of micro-batch 1 x data-parallel size 4"),
])
def test_a_job_shape_that_does_not_add_up_is_refused_with_what_to_pass(kw, words):
    with pytest.raises(ConfigError) as e:
        job_shape(nodes=2, ranks_per_node=2, **kw)
    assert words in str(e.value)
