"""The launchers continue at a smaller data-parallel size when a lost node's place stays empty, and grow back when a
node joins (shardsafe.launch.resize, docs/operations.md "Continuing on fewer nodes"): the local launcher, and
`shardsafe launch` under torch elastic (the sbatch scripts: tests/slurm/test_slurm.py).

Real processes: a holder per simulated node and a stand-in trainer (_size_trainer.py) that records what the launcher
gave each rank (RANK, WORLD_SIZE, SHARDSAFE_NODE, SHARDSAFE_FULL_WORLD_SIZE, which holders exist) and drives the
launcher through the event log (iterations for the node faults, committed snapshots for the grow). Whether the
trainers restore bit-exactly at the new size is the trainer side's test; these pin the launcher's decisions.
"""
import json
import logging
import os
import sys
import time
import uuid

import pytest

from shardsafe.launch.local import LaunchConfig
from shardsafe.tor import compute_tor
from shardsafe.tor.events import check_event, read_events

from . import helpers

TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_size_trainer.py")


def launch(tmp_path, inject, *, steps=6, interval=2, step_s=0.1, **kw):
    kw = {"nodes": 4, "spares": 0, "shrink_after_s": 0.2, "global_batch": 48, "micro_batch": 4, "max_restarts": 2,
          **kw}
    cfg = LaunchConfig(job_id=f"rs{uuid.uuid4().hex[:8]}", run_dir=str(tmp_path), inject=inject,
                       memory_budget_gb=0.05, attempt_timeout_s=60, **kw)
    t0 = time.monotonic()
    # --barrier: every rank has started (and written its placement) before any step, so a node the launcher kills at
    # a step never takes a rank that had not started yet (a loaded machine starts them far apart)
    # the ranks are forked from the package's shared server with torch.distributed imported (the barrier's), as
    # every attempt of every test here starts them again
    res = helpers.launch(cfg, [sys.executable, TRAINER, "--steps", str(steps), "--interval", str(interval),
                               "--step-s", str(step_s), "--barrier"], preload=("torch.distributed",))
    return res, time.monotonic() - t0


def placement(tmp_path):
    """attempt -> the records of its ranks, by rank."""
    out = {}
    for line in open(tmp_path / "placement.jsonl"):
        r = json.loads(line)
        out.setdefault(r["attempt"], {})[r["rank"]] = r
    return out


def launcher_events(tmp_path, *kinds):
    return [e for e in read_events(str(tmp_path)) if e["source"] == "launcher" and e["kind"] in kinds]


def first(tmp_path, kind, attempt, source="trainer"):
    return min(e["t"] for e in read_events(str(tmp_path))
               if e["kind"] == kind and e.get("attempt") == attempt and e["source"] == source)


@pytest.mark.parametrize("batch, lose, to_dp, nodes", [
    ((48, 4), "node1", 3, ["node0", "node2", "node3"]),   # 48 / 4 divides at 3: every survivor, rank 1 moves
    ((16, 4), "node1+node3", 2, ["node0", "node2"]),      # two lost: both survivors, rank 1 moves
])
def test_a_lost_node_with_no_spare_shrinks_to_the_largest_size_that_keeps_the_batch(tmp_path, batch, lose, to_dp,
                                                                                   nodes):
    res, _ = launch(tmp_path, f"kill-node:{lose}@3", global_batch=batch[0], micro_batch=batch[1])
    assert res.ok and res.data_parallel_sizes == [4, to_dp], res
    assert [f["cause"] for f in res.failures] == ["node_loss"]
    (shrink,) = launcher_events(tmp_path, "shrink", "grow")
    assert check_event(shrink) == [] and (shrink["from_dp"], shrink["to_dp"]) == (4, to_dp)
    assert shrink["nodes"] == nodes and "keeps the global batch" in shrink["reason"]
    assert first(tmp_path, "failure_detected", 0, "launcher") <= shrink["t"] < first(tmp_path, "trainer_start", 1)
    after = placement(tmp_path)[1]
    assert sorted(after) == list(range(to_dp))
    assert [after[r]["node"] for r in range(to_dp)] == nodes   # rank r on the r-th node in use, in slot order
    for r, rec in after.items():
        assert (rec["world"], rec["full_world"], rec["group_rank"], rec["group_world"]) == (to_dp, "4", r, to_dp)
        assert rec["own_holder"] and not set(lose.split("+")) & set(rec["holders"]), rec   # no fresh holder for lost
    assert all(rec["full_world"] == "4" and rec["world"] == 4 for rec in placement(tmp_path)[0].values())


def test_a_node_back_within_shrink_after_s_is_used_instead_of_shrinking(tmp_path):
    res, wall = launch(tmp_path, "kill-node:node1@3;add-node:node1@0", shrink_after_s=30)
    assert res.ok and res.attempt_sizes == [4, 4] and res.data_parallel_sizes == [4] and wall < 30, (res, wall)
    assert launcher_events(tmp_path, "shrink", "grow") == []
    after = placement(tmp_path)[1]
    assert [after[r]["node"] for r in range(4)] == ["node0", "node1", "node2", "node3"]
    assert after[1]["own_holder"]   # the node came back with a fresh holder


def test_spares_replace_lost_nodes_until_they_run_out(tmp_path):
    # one spare: the first loss is replaced at once (a fresh node under the lost one's name), the second shrinks
    res, _ = launch(tmp_path, "kill-node:node1@2;kill-node:node2@2", spares=1)
    assert res.ok and res.attempt_sizes == [4, 4, 3] and res.data_parallel_sizes == [4, 3], res
    p = placement(tmp_path)
    assert [p[1][r]["node"] for r in range(4)] == ["node0", "node1", "node2", "node3"] and p[1][1]["own_holder"]
    assert [p[2][r]["node"] for r in range(3)] == ["node0", "node1", "node3"]
    assert [(e["from_dp"], e["to_dp"]) for e in launcher_events(tmp_path, "shrink", "grow")] == [(4, 3)]


def test_by_default_a_lost_node_is_replaced_at_once(tmp_path):
    res, _ = launch(tmp_path, "kill-node:node2@2", spares=None, global_batch=0, micro_batch=0, shrink_after_s=None)
    assert res.ok and res.attempt_sizes == [4, 4] and res.data_parallel_sizes == [4], res
    assert placement(tmp_path)[1][2]["node"] == "node2" and placement(tmp_path)[1][2]["own_holder"]


def test_a_layout_that_cannot_shrink_waits_for_a_node_and_says_why(tmp_path, caplog):
    # model-parallel 2 over nodes of one rank: a replica needs 2 nodes, and 3 of the 4 are lost
    caplog.set_level(logging.WARNING, logger="shardsafe.launch.local")
    res, wall = launch(tmp_path, "kill-node:node1+node2+node3@2", model_parallel=2, global_batch=4, micro_batch=2,
                       join_timeout_s=1.0)
    assert not res.ok and res.data_parallel_sizes == [2] and 1.0 <= wall < 20, (res, wall)
    assert launcher_events(tmp_path, "shrink", "grow") == []
    text = caplog.text
    assert "cannot continue on 1 node(s): the global batch of 4 samples in micro-batches of 2 divides only at " \
           "data-parallel sizes 1 (on 2 node(s)); waiting for a spare node" in text, text
    assert "no node joined within join_timeout_s=1 s" in text, text


def test_grows_back_at_the_next_committed_version_once_a_node_joins(tmp_path):
    # attempt 0 at 4 loses node3 -> attempt 1 at 3 (node0..node2); node3 joins at its step 3 -> the launcher stops
    # attempt 1 once every rank committed a version after that, and attempt 2 runs at 4 again on node0..node3
    res, _ = launch(tmp_path, "kill-node:node3@2;add-node:node3@3", steps=10, step_s=0.15, max_restarts=1)
    assert res.ok and res.attempt_sizes == res.data_parallel_sizes == [4, 3, 4], res
    assert [f["cause"] for f in res.failures] == ["node_loss"]   # the grow is no failure, nor a restart counted
    shrink, grow = launcher_events(tmp_path, "shrink", "grow")
    assert (grow["kind"], grow["from_dp"], grow["to_dp"], check_event(grow)) == ("grow", 3, 4, [])
    (end1,) = [e for e in launcher_events(tmp_path, "attempt_end") if e["attempt"] == 1]
    assert end1["cause"] == "grow" and end1["version"] >= 4 and end1["version"] % 2 == 0, end1
    assert grow["t"] <= end1["t"] and grow["t"] < first(tmp_path, "trainer_start", 2)
    commit = min(e["t"] for e in read_events(str(tmp_path)) if e["kind"] == "snapshot" and e["attempt"] == 1
                 and e["version"] == end1["version"])
    assert grow["t"] >= commit
    p = placement(tmp_path)
    assert [p[2][r]["node"] for r in range(4)] == ["node0", "node1", "node2", "node3"]
    assert p[2][3]["own_holder"] and all(r["world"] == 4 for r in p[2].values())
    # TOR reads the attempt the grow stopped as no failure, and each attempt's size from the events
    rep = compute_tor(read_events(str(tmp_path)))
    assert [a.data_parallel for a in rep.attempts] == [4, 3, 4] and len(rep.failures) == 1
    assert (rep.degraded.shrinks, rep.degraded.grows) == (1, 1)


def test_shardsafe_launch_shrinks_onto_a_new_rendezvous_and_grows_back(tmp_path):
    # torch elastic: attempt 0 on 3 agents loses node2 at step 2 (its peers fail at their next barrier and wait for
    # a third node); no spare: after 1 s the launcher stops them and starts agents on node0, node1 in a rendezvous
    # of 2 nodes (6 samples in micro-batches of 1 keep at 2); node2 joins at step 3 of attempt 1; at the next commit
    # the job goes back to 3 agents
    from shardsafe.launch.elastic import ElasticConfig, ElasticLauncher
    cfg = ElasticConfig(nodes=3, run_dir=str(tmp_path), inject="kill-node:node2@2;add-node:node2@3",
                        memory_budget_gb=0.05, max_restarts=1, spares=0, shrink_after_s=1.0, global_batch=6,
                        micro_batch=1, timeout_s=240, keep_alive_s=1, keep_alive_misses=2)
    res = ElasticLauncher(cfg).run([TRAINER, "--steps", "10", "--interval", "2", "--step-s", "0.2", "--barrier"])
    assert res.ok and res.data_parallel_sizes == [3, 2, 3], (res, helpers.agent_log_tails(tmp_path))
    assert [f["cause"] for f in res.failures] == ["node_loss"] and res.attempts == 3, res
    resizes = launcher_events(tmp_path, "shrink", "grow")
    assert [(e["kind"], e["from_dp"], e["to_dp"]) for e in resizes] == [("shrink", 3, 2), ("grow", 2, 3)]
    assert all(check_event(e) == [] for e in resizes)
    (end1,) = [e for e in launcher_events(tmp_path, "attempt_end") if e["attempt"] == 1]
    assert end1["cause"] == "grow" and resizes[1]["t"] <= end1["t"] < first(tmp_path, "trainer_start", 2)
    p = placement(tmp_path)
    assert sorted(r["node"] for r in p[1].values()) == ["node0", "node1"]
    assert all((r["world"], r["full_world"]) == (2, "3") for r in p[1].values())
    assert sorted(r["node"] for r in p[2].values()) == ["node0", "node1", "node2"]
    assert all((r["world"], r["full_world"]) == (3, "3") for r in p[2].values())
    rep = compute_tor(read_events(str(tmp_path)))
    assert [a.data_parallel for a in rep.attempts] == [3, 2, 3] and len(rep.failures) == 1
