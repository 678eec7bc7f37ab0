"""The launchers' rule for lost, spare and returning nodes (shardsafe/launch/resize.py): which nodes the next attempt
runs on and at which data-parallel size."""
import json

import pytest

from shardsafe.errors import ConfigError
from shardsafe.launch.resize import GROW, RUN, SHRINK, WAIT, CommitWatch, Membership
from shardsafe.launch.shrink import Shape

NODES = ["n0", "n1", "n2", "n3"]


def members(shape=Shape(dp=4, global_batch=48, micro_batch=4), **kw):
    return Membership(NODES[:shape.nodes_at(shape.dp)], shape, **{"spares": 0, "shrink_after_s": 10.0, **kw})


def test_a_lost_node_waits_then_shrinks_onto_the_first_survivors_in_slot_order():
    m = members(Shape(dp=4, global_batch=48, micro_batch=4))
    assert m.lose(["n1"]) == ["n1"] and m.live == ["n0", "n2", "n3"]
    p = m.plan(waited_s=2.0)
    assert p.action == WAIT and not p.refused and "waiting up to 10 s for a node to join" in p.reason
    p = m.plan(waited_s=10.0)
    assert (p.action, p.dp, p.nodes) == (SHRINK, 3, ("n0", "n2", "n3")) and "keeps the global batch of 48" in p.reason
    m.apply(p)
    assert m.rank_nodes() == ["n0", "n2", "n3"] and m.world() == 3 and m.world(m.full_dp) == 4


def test_a_node_that_joins_takes_the_lowest_empty_slot_and_the_job_grows_back():
    m = members()
    m.lose(["n1"])
    m.apply(m.plan(waited_s=10.0))
    assert (m.dp, m.active) == (3, ["n0", "n2", "n3"])
    assert m.grow_plan() is None
    assert m.join("n1") and not m.join("n1")
    g = m.grow_plan()
    assert (g.action, g.dp, g.nodes) == (GROW, 4, ("n0", "n1", "n2", "n3"))
    m.apply(g)
    assert m.rank_nodes() == NODES and m.grow_plan() is None and not m.join("n9")   # every slot is taken


def test_a_node_back_before_the_wait_ends_runs_the_full_size_again():
    m = members()
    m.lose(["n2"])
    m.join("n2")
    p = m.plan(waited_s=0.0)
    assert (p.action, p.dp, p.nodes) == (RUN, 4, tuple(NODES))


def test_spares_take_the_lost_places_under_their_own_names_until_they_run_out():
    m = members(spares=1, spare_name=lambda lost: f"spare-for-{lost}")
    m.lose(["n3"])
    assert m.take_spares() == ["spare-for-n3"] and m.spares == 0
    p = m.plan(waited_s=0.0)
    assert (p.action, p.nodes) == (RUN, ("n0", "n1", "n2", "spare-for-n3"))
    m.lose(["n0"])
    assert m.take_spares() == [] and m.plan(0.0).action == WAIT
    unlimited = members(spares=None)
    unlimited.lose(["n1", "n2"])
    assert unlimited.take_spares() == ["n1", "n2"] and unlimited.plan(0.0).action == RUN


def test_no_survivor_is_left_idle_and_a_node_that_joins_at_the_smaller_size_takes_a_lost_place():
    idle = members(Shape(dp=4, global_batch=16, micro_batch=4))   # 16 / 4 divides at 2, not at 3
    idle.lose(["n3"])
    p = idle.plan(10.0)
    assert p.action == WAIT and p.refused and "would leave 1 surviving node(s) idle" in p.reason
    m = members()
    m.lose(["n3"])
    m.apply(m.plan(10.0))                      # 3 on n0, n1, n2
    assert m.lose(["n1"]) == ["n1"]
    m.join("n5")                               # joins slot 1
    p = m.plan(0.0)
    assert (p.action, p.dp, p.nodes) == (RUN, 3, ("n0", "n5", "n2"))


def test_no_shrink_when_it_is_off_or_no_smaller_size_fits_and_the_reason_says_so():
    off = members(shrink_after_s=0.0)
    off.lose(["n1"])
    p = off.plan(1e9)
    assert p.action == WAIT and "shrinking is off (shrink_after_s 0)" in p.reason and not p.refused
    tp2 = members(Shape(dp=2, model_parallel=2, global_batch=4, micro_batch=2))   # a replica spans two nodes
    tp2.lose(["n1", "n2", "n3"])
    p = tp2.plan(1e9)
    assert p.action == WAIT and p.refused
    assert "divides only at data-parallel sizes 1 (on 2 node(s)); waiting for a spare node" in p.reason
    unknown = members(Shape(dp=4))
    unknown.lose(["n0"])
    assert "global batch and micro-batch are not known" in unknown.plan(1e9).reason


def test_ranks_per_node_and_model_parallel_keep_whole_nodes():
    shape = Shape(dp=4, model_parallel=2, ranks_per_node=4, global_batch=8, micro_batch=2)
    m = Membership(["a", "b"], shape, spares=0, shrink_after_s=1.0)
    assert m.rank_nodes() == ["a"] * 4 + ["b"] * 4
    m.lose(["a"])
    p = m.plan(1.0)
    assert (p.dp, p.nodes) == (2, ("b",))
    m.apply(p)
    assert m.rank_nodes() == ["b"] * 4 and m.world() == 4
    with pytest.raises(ConfigError, match="expected 2 whole nodes"):
        Membership(["a"], shape)


def test_commit_watch_counts_versions_every_rank_committed_after_it_was_armed(tmp_path):
    path = tmp_path / "events.jsonl"

    def snap(rank, version, attempt=1, committed=True):
        with open(path, "a") as f:
            f.write(json.dumps({"t": 1.0, "kind": "snapshot", "source": "trainer", "rank": rank, "attempt": attempt,
                                "version": version, "committed": committed}) + "\n")

    w = CommitWatch(str(tmp_path), attempt=1, world=2)
    snap(0, 2), snap(1, 2)
    w.arm()                                   # version 2 was committed before: not the next one
    assert w.committed() is None
    snap(0, 4), snap(1, 4, committed=False), snap(1, 4, attempt=0)
    assert w.committed() is None              # rank 1 did not commit 4 in this attempt
    snap(0, 6), snap(1, 6)
    assert w.committed() == 6


# ---- what the launchers and the controller add around the rule ------------------------------------------------

def test_a_grow_ends_the_attempt_without_a_failure_and_nothing_after_counts():
    from shardsafe.launch.incidents import Evidence, IncidentBook
    book = IncidentBook(world_size=2, max_restarts=0, grace_s=0.0)
    book.started(1, node="n0", ranks=[0, 1], t=1.0, now=1.0)
    assert book.stopped(1, t=2.0, cause="grow", version=4) == \
        [("attempt_end", 2.0, {"attempt": 1, "rc": None, "cause": "grow", "version": 4})]
    assert book.evidence(Evidence(t=2.1, cause="rank_signal", rank=0, rc=-9), 1, now=2.1) == []
    out = book.started(2, node="n0", ranks=[0, 1, 2, 3], t=3.0, now=3.0)
    assert [k for k, _, _ in out] == ["attempt_start"] and book.failures == [] and book.tick(9.0) == []


def test_the_controller_writes_the_resize_a_script_notified_and_expects_the_new_world(tmp_path):
    from shardsafe.launch import markers
    from shardsafe.launch.controller import Controller
    from shardsafe.tor.events import check_event, read_events
    ctl = Controller(run_dir=str(tmp_path), job_id="jr", world_size=4)
    try:
        markers.notify(str(tmp_path), "resize", from_dp=4, to_dp=3, world_size=3, nodes=["a", "b", "c"], reason="r")
        markers.notify(str(tmp_path), "resize", from_dp=3, to_dp=3, world_size=3)   # no change: ignored
        ctl.poll()
        (ev,) = [e for e in read_events(str(tmp_path)) if e["kind"] in ("shrink", "grow")]
        assert (ev["kind"], ev["from_dp"], ev["to_dp"], ev["nodes"], check_event(ev)) == ("shrink", 4, 3,
                                                                                       ["a", "b", "c"], [])
        assert ctl.book.world_size == 3
    finally:
        ctl.close()
        ctl.store = None


def test_agents_of_a_reformed_job_get_a_new_rendezvous_and_the_full_world_size():
    from shardsafe.launch.agent import AgentOptions
    o = AgentOptions(node="n1", control="h:1", nnodes="2:2", job_id="j", rdzv_id="j.g1", full_world_size=8)
    argv = o.torchrun_argv(["t.py"])
    assert argv[argv.index("--rdzv-id") + 1] == "j.g1" and o.worker_env()["SHARDSAFE_FULL_WORLD_SIZE"] == "8"
    plain = AgentOptions(node="n1", control="h:1", nnodes="2:2", job_id="j")
    assert plain.torchrun_argv(["t.py"])[plain.torchrun_argv(["t.py"]).index("--rdzv-id") + 1] == "j"
    assert "SHARDSAFE_FULL_WORLD_SIZE" not in plain.worker_env()


def test_launcher_settings_for_lost_nodes_are_checked_up_front(tmp_path):
    from shardsafe.faults import FaultKind, parse
    from shardsafe.launch.elastic import ElasticConfig
    from shardsafe.launch.errors import LaunchError
    from shardsafe.launch.local import LaunchConfig
    assert [(f.kind, f.target, f.step, f.attempt) for f in parse("kill-node:node1@3;add-node:node1@0")] == \
        [(FaultKind.KILL_NODE, "node1", 3, 0), (FaultKind.ADD_NODE, "node1", 0, 1)]
    with pytest.raises(ConfigError, match="add-node target 'gpu7': local nodes are named node0..node1"):
        LaunchConfig(nodes=2, job_id="j", run_dir=str(tmp_path), inject="add-node:gpu7@2")
    with pytest.raises(ConfigError, match="spares must be >= 0"):
        LaunchConfig(nodes=2, job_id="j", run_dir=str(tmp_path), spares=-1)
    with pytest.raises(ConfigError, match="does not divide the job's 4 ranks"):
        LaunchConfig(nodes=2, nproc_per_node=2, job_id="j", run_dir=str(tmp_path), model_parallel=3)
    assert LaunchConfig(nodes=2, job_id="j", run_dir=str(tmp_path)).shrink_after_s == 180.0
    with pytest.raises(LaunchError, match="must be below the rendezvous join timeout"):
        ElasticConfig(nodes=2, run_dir=str(tmp_path), spares=0, shrink_after_s=400, join_timeout_s=300)
    with pytest.raises(LaunchError, match="go together"):
        ElasticConfig(nodes=2, run_dir=str(tmp_path), global_batch=8)


def test_shardsafe_launch_takes_the_resize_options_and_control_plans_a_shrink(tmp_path, capsys):
    from shardsafe.cliargs import Parser
    from shardsafe.launch import cli
    p = Parser(prog="t")
    cli.register_cli(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["launch", "--spares", "0", "--shrink-after-s", "30", "--model-parallel", "2", "--global-batch",
                      "32", "--micro-batch", "2", "t.py"])
    assert (a.spares, a.shrink_after_s, a.model_parallel, a.global_batch, a.micro_batch) == (0, 30.0, 2, 32, 2)
    assert p.parse_args(["launch", "t.py"]).spares is None
    a = p.parse_args(["control", "shrink-plan", "--nnodes", "4", "--nodes-left", "3", "--global-batch", "48",
                      "--micro-batch", "4"])
    assert a.func(a) == 0 and capsys.readouterr().out.split() == ["3", "3"]
    a = p.parse_args(["control", "shrink-plan", "--nnodes", "4", "--nodes-left", "3"])
    assert a.func(a) == 3 and "not known" in capsys.readouterr().err
    # a Megatron-LM command: its batch flags are read; a replica size the script does not count is refused
    lm = ["--", "pretrain_gpt.py", "--micro-batch-size", "2", "--global-batch-size", "24"]
    a = p.parse_args(["control", "shrink-plan", "--nnodes", "4", "--nodes-left", "3", *lm])
    assert a.func(a) == 0 and capsys.readouterr().out.split() == ["3", "3"]
    a = p.parse_args(["control", "shrink-plan", "--nnodes", "4", "--nproc-per-node", "2", "--nodes-left", "3", *lm,
                      "--tensor-model-parallel-size", "2"])
    assert a.func(a) == 3 and "set SS_MODEL_PARALLEL=2" in capsys.readouterr().err
