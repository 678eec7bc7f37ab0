"""The data-parallel size a job continues at when a lost node's place stays empty (shardsafe/launch/shrink.py)."""
import pytest

from shardsafe.errors import ConfigError
from shardsafe.launch.shrink import Shape, shrink_after_s, shrink_target


def test_the_largest_size_that_fits_the_nodes_left_and_keeps_the_global_batch():
    # 4 nodes x 1 rank, global batch 16 in micro-batches of 4: D=4 (G=1); one node lost -> 3 does not divide 16/4
    got = shrink_target(Shape(dp=4, global_batch=16, micro_batch=4), nodes_left=3)
    assert (got.dp, got.accumulation, got.nodes) == (2, 2, 2)
    assert "gradient accumulation 1 -> 2 keeps the global batch of 16" in got.reason
    # a batch that 3 divides: continue on all 3 nodes left
    got = shrink_target(Shape(dp=4, global_batch=48, micro_batch=4), nodes_left=3)
    assert (got.dp, got.accumulation, got.nodes) == (3, 4, 3)


def test_model_parallel_slices_stay_whole_and_nodes_stay_whole():
    # TP2 x PP2 = 4 ranks per replica, 8 ranks per node, D=4 on 2 nodes; one node lost -> D'=2 on 1 node
    got = shrink_target(Shape(dp=4, model_parallel=4, ranks_per_node=8, global_batch=64, micro_batch=2), nodes_left=1)
    assert (got.dp, got.nodes, got.accumulation) == (2, 1, 16)
    # 8 ranks per node, model parallel 8: one replica per node
    got = shrink_target(Shape(dp=8, model_parallel=8, ranks_per_node=8, global_batch=8 * 6, micro_batch=1),
                        nodes_left=5)
    assert (got.dp, got.nodes) == (4, 4)   # 5 does not divide 48 / 1... 6 would, but only 5 nodes are left


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
    with pytest.raises(ConfigError, match="shrink_after_s must be >= 0"):
        shrink_after_s(-1, 60.0)
