"""The pure pieces of `shardsafe launch`: incident book, progress tail, placement plan, discovery,
markers/notifications, torchrun arguments, and the hook into torch elastic's agent."""
import json

import pytest

from shardsafe.launch import agent, cli, controller, discovery, elastic, markers
from shardsafe.launch.errors import LaunchError
from shardsafe.launch.incidents import Evidence, IncidentBook, exit_evidence
from shardsafe.parity.placement import (KINDS, Move, inventory_of, plan_migration, plan_migration_reference,
                                        settled)


# ---- incident book ---------------------------------------------------------------------------------------

def kinds(emits):
    return [k for k, _, _ in emits]


def test_one_incident_reported_once_with_the_most_specific_cause_dated_at_first_evidence():
    b = IncidentBook(world_size=3, max_restarts=3, grace_s=1.0)
    assert kinds(b.started(0, node="n0", ranks=[0], t=10.0, now=10.0)) == ["attempt_start"]
    assert b.started(0, node="n1", ranks=[1], t=10.1, now=10.1) == []
    # peers fail first with plain errors; the killed rank's signal exit arrives later
    for ev in exit_evidence({"0": 1}, node="n0", t=20.0):
        b.evidence(ev, 0, now=20.05)
    for ev in exit_evidence({"2": -9}, node="n2", t=20.2):
        b.evidence(ev, 0, now=20.3)
    assert b.tick(20.9) == []                       # still inside the grace period
    out = b.tick(21.1)
    assert kinds(out) == ["failure_detected", "attempt_end", "restart"]
    kind, at, f = out[0]
    assert at == 20.0 and f["cause"] == "rank_exit" and f["rank"] == 2 and f["rc"] == -9 and f["attempt"] == 0
    assert out[2][2] == {"attempt": 1}
    # later evidence of the same attempt is ignored; the next attempt starts normally
    for ev in exit_evidence({"1": 1}, node="n1", t=21.5):
        assert b.evidence(ev, 0, now=21.5) == []
    assert b.tick(30.0) == []
    assert kinds(b.started(1, node="n0", ranks=[0], t=25.0, now=25.0)) == ["attempt_start"]
    assert len(b.failures) == 1


def test_node_loss_beats_rank_exits_and_keeps_its_fault_time():
    b = IncidentBook(world_size=2, max_restarts=3, grace_s=2.0)
    b.started(0, node="n0", ranks=[0], t=0.0, now=0.0)
    for ev in exit_evidence({"0": 1}, node="n0", t=5.0):
        b.evidence(ev, 0, now=5.0)
    b.evidence(Evidence(t=6.0, cause="node_loss", node="n1", t_fault=4.5), 0, now=6.5)
    out = b.tick(7.1)
    f = out[0][2]
    assert out[0][1] == 5.0 and f["cause"] == "node_loss" and f["node"] == "n1" and f["t_fault"] == 4.5


def test_hang_names_the_stopped_rank_and_last_progress():
    b = IncidentBook(world_size=2, max_restarts=3, grace_s=1.0)
    b.started(3, node="n0", ranks=[0, 1], t=0.0, now=0.0)
    b.evidence(Evidence(t=50.0, cause="hang", t_fault=40.0), 3, now=50.0)
    b.hung(3, [1])
    for ev in exit_evidence({"0": -9, "1": -9}, node="n0", t=50.5):   # the watchdog's own SIGKILLs
        b.evidence(ev, 3, now=50.5)
    f = b.tick(51.0)[0][2]
    assert f["cause"] == "hang" and f["rank"] == 1 and f["t_fault"] == 40.0 and f["attempt"] == 3


def test_a_hang_waits_for_every_nodes_report_of_its_stopped_workers():
    """Agents scan for stopped workers when they kill a hung attempt; a loaded node reports after the grace period.
    The hang is reported once the rank is known or every node said it found none, and at the latest
    HANG_NAMING_S after the grace period, unnamed; dated at its first evidence in every case."""
    from shardsafe.launch.incidents import HANG_NAMING_S

    def book():
        b = IncidentBook(world_size=2, max_restarts=3, grace_s=1.0)
        b.started(0, node="n0", ranks=[0], t=0.0, now=0.0)
        b.started(0, node="n1", ranks=[1], t=0.0, now=0.0)
        b.evidence(Evidence(t=50.0, cause="hang", t_fault=40.0), 0, now=50.0)
        return b

    b = book()
    b.hung(0, [], node="n0")
    assert b.tick(53.0) == []                       # n1 has not reported yet
    b.hung(0, [1], node="n1")
    f = b.tick(53.5)[0][2]
    assert (f["cause"], f["rank"], f["t_fault"]) == ("hang", 1, 40.0) and b.failures[0]["t"] == 50.0
    b = book()
    b.hung(0, [], node="n0")
    b.hung(0, [], node="n1")                        # nothing stopped anywhere (a hang in a collective)
    f = b.tick(51.0)[0][2]
    assert (f["cause"], f["rank"]) == ("hang", None)
    b = book()
    assert b.tick(51.0 + HANG_NAMING_S - 0.1) == []
    f = b.tick(51.0 + HANG_NAMING_S)[0][2]          # no report at all: unnamed, not lost
    assert (f["cause"], f["rank"]) == ("hang", None) and b.failures[0]["t"] == 50.0


def test_success_needs_every_rank_and_no_restart_after_max_restarts():
    b = IncidentBook(world_size=2, max_restarts=0, grace_s=0.0)
    b.started(0, node="n0", ranks=[0], t=0.0, now=0.0)
    assert b.done(0, ranks=[0], t=5.0) == []
    assert b.done(0, ranks=[1], t=5.1) == [("attempt_end", 5.1, {"attempt": 0, "rc": 0, "cause": "finished"})]
    b2 = IncidentBook(world_size=1, max_restarts=0, grace_s=0.0)
    b2.started(0, node="n0", ranks=[0], t=0.0, now=0.0)
    b2.evidence(Evidence(t=1.0, cause="rank_exit", rank=0, rc=1), 0, now=1.0)
    assert kinds(b2.tick(1.0)) == ["failure_detected", "attempt_end"]   # no restart announced


def test_unexplained_new_round_reports_the_previous_attempt():
    b = IncidentBook(world_size=1, max_restarts=3, grace_s=5.0)
    b.started(0, node="n0", ranks=[0], t=0.0, now=0.0)
    out = b.started(1, node="n0", ranks=[0], t=9.0, now=9.0)
    assert kinds(out) == ["failure_detected", "attempt_end", "restart", "attempt_start"]
    assert out[0][2]["cause"] == "membership_change"
    # pending evidence is reported as soon as the next round starts, without waiting for the grace
    b.evidence(Evidence(t=10.0, cause="rank_exit", rank=0, rc=1), 1, now=10.0)
    out = b.started(2, node="n0", ranks=[0], t=10.5, now=10.5)
    assert kinds(out)[0] == "failure_detected" and out[0][2]["rank"] == 0


# ---- progress tail ----------------------------------------------------------------------------------------

def test_the_local_launcher_names_the_rank_a_signal_killed_when_several_are_found_dead():
    """A SIGKILLed rank's peers exit with rc 1 on the lost connection; a late poll sees them all dead at once. The
    signal is the cause, whatever the ranks' order; the others are listed; an error exit alone is reported as is."""
    from shardsafe.launch.local import rank_exit
    assert rank_exit([None, 0, None]) is None
    assert rank_exit([1, -9, None]) == {"rank": 1, "rc": -9, "also": [{"rank": 0, "rc": 1}]}
    assert rank_exit([-9, 1]) == {"rank": 0, "rc": -9, "also": [{"rank": 1, "rc": 1}]}
    assert rank_exit([0, 2, 1]) == {"rank": 1, "rc": 2, "also": [{"rank": 2, "rc": 1}]}
    assert rank_exit([None, -15, -9]) == {"rank": 1, "rc": -15, "also": [{"rank": 2, "rc": -9}]}


def test_the_local_launcher_serves_each_attempts_store_before_a_trainer_starts(tmp_path):
    """The attempt's c10d store is bound by the launcher (no other process can take its port before rank 0 would
    have bound it), a client connects to it, and the next attempt gets a new store."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from shardsafe.launch.local import LaunchConfig, LocalLauncher
    launcher = LocalLauncher(LaunchConfig(job_id="store", run_dir=str(tmp_path)))
    port = launcher._rendezvous_store()
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert launcher._store.get("k") == b"v"
    port2 = launcher._rendezvous_store()
    fresh = TCPStore("127.0.0.1", port2, is_master=False, timeout=timedelta(seconds=10))
    assert fresh.check(["k"]) is False   # no key of the previous attempt


def test_free_ports_are_drawn_below_the_ephemeral_range():
    lo, _ = discovery._ephemeral_range()
    ports = {discovery.free_port() for _ in range(5)}
    if lo > 20000 + 1024:
        assert all(20000 <= p < lo for p in ports), (lo, ports)
    else:
        print(f"ephemeral range starts at {lo}: free_port falls back to bind(0)")
        assert all(0 < p < 65536 for p in ports)


def test_progress_tail_per_attempt_and_torn_tail(tmp_path):
    p = tmp_path / "events.jsonl"
    p.write_text(json.dumps({"t": 1.0, "kind": "iteration", "attempt": 0, "iteration": 5, "seconds": 0.1}) + "\n"
                 + json.dumps({"t": 2.0, "kind": "iteration", "attempt": 1, "iteration": 3, "seconds": 0.1}) + "\n"
                 + '{"t": 3.0, "kind": "iteration", "att')
    tail = controller.ProgressTail(str(tmp_path))
    tail.poll()
    assert tail.max_iter == {0: 5, 1: 3} and tail.last_t == {0: 1.0, 1: 2.0}
    with open(p, "a") as f:
        f.write('empt": 1, "iteration": 4, "seconds": 0.1}\n')
    tail.poll()
    assert tail.max_iter[1] == 4 and tail.last_t[1] == 3.0


# ---- markers, notifications, attempt numbering across requeues ----------------------------------------------

def test_markers_and_notifications(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDSAFE_NODE", "n7")
    markers.mark_rank_done(str(tmp_path), 3)
    markers.mark_rank_done(str(tmp_path), 0)
    assert markers.done_ranks(str(tmp_path)) == {0, 3}
    assert json.loads((tmp_path / "markers" / "rank3.done").read_text())["node"] == "n7"
    path = markers.notify(str(tmp_path), "node_lost", node="node2")
    assert json.loads(open(path).read())["node"] == "node2"
    with pytest.raises(ValueError):
        markers.notify(str(tmp_path), "reboot")


def test_attempt_base_continues_after_requeue(tmp_path):
    assert controller.attempt_base_from_log(str(tmp_path)) == 0
    (tmp_path / "events.jsonl").write_text(
        "\n".join(json.dumps({"t": float(i), "kind": "iteration", "attempt": a, "iteration": 1, "seconds": 1})
                  for i, a in enumerate([0, 0, 2, 1])) + "\n")
    assert controller.attempt_base_from_log(str(tmp_path)) == 3


def test_torchrun_arguments_and_worker_env():
    o = agent.AgentOptions(node="node2", control="10.0.0.1:29400", nnodes="4:4", nproc_per_node=8, job_id="j1",
                           run_dir="/runs/j1", inject="kill-rank:1@3", local_addr="10.0.0.3", keep_alive_s=5,
                           job_start_t=12.5, torchrun_args=["--log-dir", "/tmp/l"])
    argv = o.torchrun_argv(["train.py", "--x", "1"])
    assert argv[:4] == ["--nnodes", "4:4", "--nproc-per-node", "8"]
    assert argv[argv.index("--rdzv-endpoint") + 1] == "10.0.0.1:29400" and argv[argv.index("--rdzv-id") + 1] == "j1"
    conf = argv[argv.index("--rdzv-conf") + 1]
    assert "is_host=false" in conf and "keep_alive_interval=5" in conf
    assert argv[-5:] == ["--log-dir", "/tmp/l", "train.py", "--x", "1"] and "--local-addr" in argv
    env = o.worker_env()
    assert env["SHARDSAFE_NODE"] == "node2" and env["SHARDSAFE_INJECT"] == "kill-rank:1@3"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and float(env["SHARDSAFE_JOB_START_T"]) == 12.5


def test_launchers_make_gloo_connect_lazily_unless_the_user_said_otherwise(monkeypatch, tmp_path):
    from shardsafe.collectives import LAZY_GLOO
    from shardsafe.launch import LaunchConfig
    from shardsafe.launch.local import trainer_env
    o = agent.AgentOptions(node="n0", control="127.0.0.1:1", nnodes="1", nproc_per_node=1, job_id="j")
    cfg = LaunchConfig(nodes=1, nproc_per_node=1, run_dir=str(tmp_path), job_id="j")
    monkeypatch.delenv(LAZY_GLOO, raising=False)
    assert o.worker_env()[LAZY_GLOO] == "1" and trainer_env(cfg)[LAZY_GLOO] == "1"
    monkeypatch.setenv(LAZY_GLOO, "0")   # the user's choice is kept, by both launchers
    assert o.worker_env()[LAZY_GLOO] == "0" and trainer_env(cfg)[LAZY_GLOO] == "0"


def test_a_full_mesh_at_scale_is_worth_a_warning_and_a_lazy_or_small_group_is_not():
    from shardsafe.collectives import LAZY_GLOO, MESH_ADVICE_RANKS, mesh_advice
    assert mesh_advice(MESH_ADVICE_RANKS - 1, {}) is None
    assert mesh_advice(16384, {LAZY_GLOO: "1"}) is None
    msg = mesh_advice(16384, {LAZY_GLOO: "0"})
    assert msg and f"export {LAZY_GLOO}=1" in msg and "16383 connections per rank" in msg
    assert mesh_advice(MESH_ADVICE_RANKS, {}) is not None


def test_launch_config_rejects_bad_settings(tmp_path):
    with pytest.raises(LaunchError):
        elastic.ElasticConfig(nodes=0, run_dir=str(tmp_path))
    with pytest.raises(LaunchError, match="node0..node1"):
        elastic.ElasticConfig(nodes=2, run_dir=str(tmp_path), inject="kill-node:gpu3@4")
    with pytest.raises(ValueError):
        elastic.ElasticConfig(nodes=2, run_dir=str(tmp_path), inject="explode:1@2")
    assert elastic.ElasticConfig(nodes=2, run_dir=str(tmp_path)).job_id.startswith("launch-")


def test_agent_hook_points_exist_in_this_torch():
    """ShardsafeAgent overrides these and torchrun's launch_agent instantiates this symbol: a torch
    upgrade that renames them must fail here, not silently lose the job-wide attempt numbers."""
    import inspect

    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerGroup
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    assert launcher_api.LocalElasticAgent is LocalElasticAgent
    assert "LocalElasticAgent(" in inspect.getsource(launcher_api.launch_agent)
    for name in ("_rendezvous", "_monitor_workers"):
        assert callable(getattr(SimpleElasticAgent, name, None)) or callable(getattr(LocalElasticAgent, name, None))
    src = inspect.getsource(SimpleElasticAgent._rendezvous)
    assert "worker_group.store = store" in src and "worker_group.group_rank" in src
    # _restart_on_peer_failure: the loop asks the handler it read from the spec, and a waiting node restarts
    # healthy workers without counting a restart
    run = inspect.getsource(SimpleElasticAgent._invoke_run)
    assert "rdzv_handler = spec.rdzv_handler" in run and "rdzv_handler.num_nodes_waiting()" in run
    wg = WorkerGroup(_spec())
    assert all(hasattr(wg, a) for a in ("store", "group_rank", "workers"))


def test_the_rendezvous_poll_follows_the_job_size():
    assert agent.rendezvous_poll_s("2:2") == 0.01 and agent.rendezvous_poll_s("4") == 0.01
    assert agent.rendezvous_poll_s("100") == pytest.approx(0.1) and agent.rendezvous_poll_s("16:1000") == 1.0
    assert agent.rendezvous_poll_s("20000") == 1.0 and agent.rendezvous_poll_s("2", 0.3) == 0.3


def test_the_rendezvous_wait_polls_at_the_tuned_rate_and_scales_the_first_rounds_skew(monkeypatch):
    """torch's op executor sleeps _delay(seconds=1) between reads of the round's state while it waits (a
    torch upgrade that drops that call fails here); the tuned poll replaces exactly that sleep, and the random
    skew before a first-round join shrinks with the poll."""
    import inspect
    import time as time_mod

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    assert "_delay(seconds=1)" in inspect.getsource(dr._DistributedRendezvousOpExecutor.run)
    assert "_delay(seconds=(0, 0.3))" in inspect.getsource(dr.DynamicRendezvousHandler.next_rendezvous)
    assert "_BackendRendezvousStateHolder(backend, settings)" in inspect.getsource(dr.DynamicRendezvousHandler)
    monkeypatch.setattr(dr, "_delay", dr._delay)   # restored after the test
    monkeypatch.setattr(dr._BackendRendezvousStateHolder, "__init__", dr._BackendRendezvousStateHolder.__init__)
    slept = []
    monkeypatch.setattr(time_mod, "sleep", slept.append)
    assert agent.tune_rendezvous_poll(0.05) and agent.tune_rendezvous_poll(0.07)   # re-tuning wraps torch's once
    dr._delay(seconds=1)
    dr._delay(seconds=(0.2, 0.2))   # torch draws uniformly from the range: a degenerate one is exact
    dr._delay(seconds=0.2)
    assert slept == [0.07, pytest.approx(0.2 * 0.07), 0.2], slept
    holder = dr._BackendRendezvousStateHolder(backend=None, settings=None)
    assert holder._cache_duration == 0.07   # torch's default 1 s cache of the round's state, shortened too


def test_a_long_rendezvous_wait_backs_off_to_torchs_poll(monkeypatch):
    """The first second of a wait polls at the tuned rate; then each read waits 1.5x longer, up to torch's 1 s; a
    wait that starts after a pause (the next restart) polls fast again."""
    import time as time_mod

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    monkeypatch.setattr(dr, "_delay", dr._delay)
    monkeypatch.setattr(dr._BackendRendezvousStateHolder, "__init__", dr._BackendRendezvousStateHolder.__init__)
    clock, slept = [1000.0], []

    def sleep(s):
        slept.append(s)
        clock[0] += s + 0.001   # and a millisecond for the store read that follows
    monkeypatch.setattr(time_mod, "sleep", sleep)
    monkeypatch.setattr(time_mod, "monotonic", lambda: clock[0])
    assert agent.tune_rendezvous_poll(0.01)
    while sum(slept) < 30:
        dr._delay(seconds=1)
    fast = [s for s in slept if s == 0.01]
    assert 0.9 <= sum(fast) <= 1.1, (len(fast), sum(fast))            # the first second at the tuned rate
    grow = slept[len(fast):]
    assert all(b == pytest.approx(min(1.0, a * 1.5)) for a, b in zip(grow, grow[1:])), grow[:20]
    assert slept[-1] == 1.0 and len(grow) < 50, len(grow)              # then torch's own, within a few seconds
    clock[0] += 60   # training; the next restart's wait
    slept.clear()
    dr._delay(seconds=1)
    assert slept == [0.01]


def test_rendezvous_events_are_named_without_walking_the_stack(monkeypatch):
    """torch's rendezvous names each event after the method that records it (``get_method_name()`` inside
    ``_record``, evaluated even when nothing records events); the agent's replacement gives the same names and
    never calls inspect.stack (which cost milliseconds of CPU per step of a round)."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    assert "get_method_name()" in inspect.getsource(dr.DynamicRendezvousHandler._record)
    torch_own = dr.get_method_name
    monkeypatch.setattr(dr, "get_method_name", torch_own)   # restored after the test

    def _record():
        return dr.get_method_name()

    def next_rendezvous():
        return _record()

    assert next_rendezvous() == "next_rendezvous"   # torch's own
    assert agent.cheap_rendezvous_event_names()

    def walked(*a, **k):
        raise AssertionError("inspect.stack called")
    monkeypatch.setattr(inspect, "stack", walked)
    assert next_rendezvous() == "next_rendezvous" and dr.get_method_name(0) == "get_method_name"
    assert dr.get_method_name(10 ** 6) == "no_method_name"


def _spec():
    from torch.distributed.elastic.agent.server.api import WorkerSpec

    class _Rdzv:
        def get_backend(self):
            return "static"
    return WorkerSpec(role="r", local_world_size=1, rdzv_handler=_Rdzv(), entrypoint="x")


# ---- placement plan ---------------------------------------------------------------------------------------

def inv(*slots):
    out = {}
    for rank, kind, version in slots:
        out.setdefault((rank, kind), {})[version] = {"nbytes": 100 + version, "capacity": 2 << 20, "committed": True}
    return out


def test_plan_moves_newest_versions_to_the_ranks_node_and_drops_stale_copies():
    # before: r0@a, r1@b, r2@c; after a loss of b: r0@a, r1@c, r2@d (d empty)
    inventories = {"a": inv((0, "data", 4), (0, "data", 5), (0, "parity", 5)),
                   "c": inv((2, "data", 4), (2, "data", 5), (2, "parity", 4), (2, "parity", 5)),
                   "d": {}}
    plan = plan_migration(["a", "c", "d"], inventories)
    assert plan.moved_ranks == [2]
    # sent by rank 1, the rank that runs on c now and so can read c's holder
    assert plan.moves == [Move(2, "data", 4, "c", "d", 1, 104), Move(2, "data", 5, "c", "d", 1, 105),
                          Move(2, "parity", 4, "c", "d", 1, 104), Move(2, "parity", 5, "c", "d", 1, 105)]
    assert plan.drop_after == {"c": [2]} and plan.clear_first == []


def test_plan_swaps_and_clears_older_versions_at_the_destination():
    inventories = {"a": inv((0, "data", 5), (1, "data", 2)), "b": inv((1, "data", 5), (0, "data", 3))}
    plan = plan_migration(["b", "a"], inventories)   # ranks swapped nodes
    assert sorted((m.rank, m.version, m.src, m.dst) for m in plan.moves) == [(0, 5, "a", "b"), (1, 5, "b", "a")]
    assert sorted(plan.clear_first) == [(0, "data"), (1, "data")]
    assert plan.drop_after == {"a": [0], "b": [1]}


def test_plan_is_empty_when_placement_is_unchanged_and_ignores_absent_nodes():
    inventories = {"a": inv((0, "data", 5), (1, "data", 5)), "b": inv((2, "data", 5))}
    assert not plan_migration(["a", "a", "b"], inventories).moves
    # a node without a rank now cannot serve (nobody can read its holder): no move from it
    plan = plan_migration(["a", "a"], {"a": inv((0, "data", 5)), "z": inv((1, "data", 9))})
    assert not plan.moves and plan.drop_after == {}


def test_linear_plan_equals_the_rank_by_node_plan_and_settled_says_when_it_is_empty():
    """Random placements before and after a restart (ranks shuffled, nodes lost and added, ranks beyond a
    shrunk world, equal newest versions on two nodes): the same moves, clears and drops as the spec, and every
    node with a rank settled exactly when there is nothing to do -- the vote migrate() takes instead of the
    listings' exchange."""
    import random
    rng = random.Random(20261204)
    empty = 0
    for _ in range(3000):
        world = rng.randint(1, 9)
        names = [f"n{i}" for i in range(rng.randint(1, 5))]
        before = [rng.choice(names) for _ in range(world + rng.randint(0, 2))]
        if rng.random() < 0.4:
            after = before[:world]
        else:
            after = [rng.choice(names + ["spare"]) for _ in range(world)]
        inventories = {n: {} for n in set(after)}
        for r, n in enumerate(before):
            if rng.random() < 0.15:
                continue   # that copy was lost
            for kind in KINDS:
                for v in rng.sample(range(1, 6), rng.randint(0, 2)):
                    inventories.setdefault(n, {}).setdefault((r, kind), {})[v] = {
                        "nbytes": 10 * v + r, "capacity": 64, "committed": True}
        if rng.random() < 0.2:   # an older copy left behind by an earlier placement
            n, r = rng.choice(names), rng.randrange(world)
            inventories.setdefault(n, {}).setdefault((r, "data"), {})[rng.randint(1, 6)] = {
                "nbytes": 7, "capacity": 64, "committed": True}
        got, want = plan_migration(after, inventories), plan_migration_reference(after, inventories)
        assert (got.moves, got.clear_first, got.drop_after) == (want.moves, want.clear_first, want.drop_after), \
            (after, inventories)
        nothing_to_do = not want.moves and not want.drop_after
        empty += nothing_to_do
        assert all(settled(after, n, inventories.get(n, {})) for n in set(after)) == nothing_to_do, \
            (after, inventories)
    assert 300 < empty < 2700   # both outcomes exercised


def test_inventory_of_keeps_sealed_slots_only():
    listing = {"3": {"data": [{"version": 7, "state": "sealed", "committed": True, "nbytes": 10, "capacity": 20},
                              {"version": 8, "state": "writing", "committed": False, "nbytes": 10, "capacity": 20}],
                     "parity": [], "manifest": [{"version": 7, "state": "sealed", "nbytes": 1}]}}
    assert inventory_of(listing) == {(3, "data"): {7: {"nbytes": 10, "capacity": 20, "committed": True}}}


# ---- discovery --------------------------------------------------------------------------------------------

def test_hostlist_expansion():
    assert discovery.expand_hostlist("node[1-3,7],gpu[01-02]x,login") == \
        ["node1", "node2", "node3", "node7", "gpu01x", "gpu02x", "login"]
    assert discovery.expand_hostlist("r[1-2]n[08-09]") == ["r1n08", "r1n09", "r2n08", "r2n09"]
    with pytest.raises(discovery.DiscoveryError):
        discovery.expand_hostlist("node[3-1]")


def test_torchrun_env_wins():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h0",
           "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0",
           "SHARDSAFE_NODE": "n1"}
    d = discovery.discover(env)
    assert (d.source, d.rank, d.world_size, d.local_rank, d.node) == ("torchrun", 3, 4, 1, "n1")


def test_plain_srun_tasks():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_STEP_NODELIST": "node[3-5]", "SLURMD_NODENAME": "node5",
           "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "4"}
    d = discovery.discover(env, node_addr=lambda n: {"node3": "127.0.1.3"}[n])
    assert (d.source, d.rank, d.world_size, d.local_rank, d.local_world_size) == ("slurm", 5, 6, 1, 2)
    assert (d.node, d.master_addr, d.master_port) == ("node5", "127.0.1.3", discovery.slurm_master_port(env))
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "6" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "127.0.1.3" and env["SHARDSAFE_NODE"] == "node5"


def test_batch_script_is_not_a_rank_and_single_process_fallback():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "9"}   # no SLURM_STEP_ID: the batch step
    d = discovery.discover(env, set_env=False)
    assert d.source == "single" and d.world_size == 1 and "RANK" not in env


class FakeComm:
    def __init__(self, rank, names):
        self.rank, self.names = rank, names

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return len(self.names)

    def allgather(self, x):
        return list(self.names)

    def bcast(self, x, root=0):
        return "10.1.1.1"


def test_mpi_discovery_like_deepspeed(monkeypatch):
    monkeypatch.setattr(discovery.socket, "gethostname", lambda: "hB")
    env = {}
    d = discovery.discover(env, comm=FakeComm(3, ["hA", "hA", "hB", "hB"]))
    assert (d.source, d.rank, d.world_size, d.local_rank, d.local_world_size) == ("mpi", 3, 4, 1, 2)
    assert env["MASTER_ADDR"] == "10.1.1.1" and env["MASTER_PORT"] == str(discovery.DEFAULT_PORT)
    env = {"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "m"}
    d = discovery.discover(env, comm=FakeComm(4, ["x"] * 8))
    assert (d.local_rank, d.local_world_size, d.master_addr) == (0, 4, "m")


def test_mpi_variables_without_mpi4py_say_what_to_install(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_mpi(name, *a, **k):
        if name.startswith("mpi4py"):
            raise ImportError(name)
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_mpi)
    with pytest.raises(discovery.DiscoveryError, match="pip install mpi4py"):
        discovery.discover({"OMPI_COMM_WORLD_RANK": "0"})


def test_cli_registers_launch_agent_control():
    from shardsafe.cli import build_parser
    p = build_parser()
    a = p.parse_args(["launch", "--nodes", "3", "--inject", "kill-node:node1@5", "train.py", "--steps", "4"])
    assert a.nodes == 3 and a.script == ["train.py", "--steps", "4"]
    a = p.parse_args(["agent", "--control", "h:1", "--nnodes", "2:2", "--", "t.py"])
    assert cli._script(a) == ["t.py"]
    a = p.parse_args(["control", "notify", "node-lost", "--run-dir", "/r", "--node", "n2"])
    assert a.action == "notify" and a.what == "node-lost"


def test_event_log_dates_a_backdated_event(tmp_path):
    from shardsafe.tor import EventLog, read_events
    log = EventLog(str(tmp_path), source="launcher")
    assert log.emit("failure_detected", at=123.5, cause="hang", attempt=2)
    assert log.emit("restart", at="soon", attempt=3)   # not a time: dated now, never raises
    evs = read_events(str(tmp_path))
    assert evs[0]["t"] == 123.5 and evs[0]["attempt"] == 2 and "at" not in evs[0]
    assert evs[1]["t"] > 1e9


# ---- launcher arguments, holder start failures, signals ------------------------------------------------------

@pytest.mark.parametrize("budget, words", [(-1, [">= 0 GiB", "-1"]), (float("nan"), [">= 0 GiB"]),
                                           (10 ** 6, ["more than this node's RAM"])])
def test_launchers_refuse_a_bad_memory_budget_before_any_holder_starts(tmp_path, budget, words):
    """Issue 15: `shardsafe launch --memory-budget-gb -1` only said "holder did not start"."""
    from shardsafe.launch.local import LaunchConfig
    with pytest.raises(LaunchError) as e:
        elastic.ElasticConfig(nodes=1, run_dir=str(tmp_path), memory_budget_gb=budget)
    with pytest.raises(ValueError) as e2:
        LaunchConfig(job_id="j", run_dir=str(tmp_path), memory_budget_gb=budget)
    for w in words:
        assert w in str(e.value) and w in str(e2.value), (str(e.value), str(e2.value))
    assert "--memory-budget-gb" in str(e.value) and "LaunchConfig.memory_budget_gb" in str(e2.value)
    assert not list(tmp_path.iterdir())   # nothing started, nothing written


def test_shardsafe_launch_cli_names_the_bad_argument_and_exits_2(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    for args, want in ((["--memory-budget-gb", "-1"], "--memory-budget-gb must be >= 0"),
                       (["--hang-timeout-s", "-5"], "argument --hang-timeout-s: '-5': expected seconds, a finite number >= 0"),
                       (["--hang-timeout", "-5"], "argument --hang-timeout: '-5'"),   # the former spelling
                       (["--nnodes", "0"], "nodes >= 1"), (["--nodes", "0"], "nodes >= 1")):
        r = subprocess.run([sys.executable, "-m", "shardsafe.launch", "launch", "--run-dir", str(tmp_path / "run"),
                            *args, str(script)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and want in r.stderr and "did not start" not in r.stderr, (args, r.returncode, r.stderr)
        assert len(r.stderr.splitlines()) == 1, r.stderr   # one line: no usage block, no traceback
    r = subprocess.run([sys.executable, "-m", "shardsafe.launch", "launch", str(tmp_path / "missing.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "missing.py' not found" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_a_holder_that_does_not_start_is_reported_with_its_own_words(tmp_path):
    from shardsafe.launch.holders import holder_failure
    log = tmp_path / "holder_node0.log"
    log.write_text("INFO starting\nERROR cannot bind /x/node0.sock: Permission denied\n")
    msg = holder_failure("node0", 1, str(log))
    assert "did not start (exit 1)" in msg and "Permission denied" in msg and str(log) in msg
    assert "logged nothing" in holder_failure("node1", -9, str(tmp_path / "absent.log"))


def test_signal_stop_turns_sigterm_into_a_flag_and_restores_the_handlers():
    import os
    import signal
    from shardsafe.launch.signals import SignalStop
    before = signal.getsignal(signal.SIGTERM)
    with SignalStop() as stop:
        assert stop.received is None and stop.exit_code is None
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)   # the first signal counts
        assert stop.received == signal.SIGTERM and stop.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_running_holder_for_the_job_id_stops_a_launcher_from_starting_its_own(tmp_path):
    import socket
    from shardsafe.holder.paths import HolderPaths
    from shardsafe.launch.holders import holder_running
    p = HolderPaths(str(tmp_path / "h"), "job1", "node0")
    p.ensure_dir()
    assert not holder_running(p)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(p.socket)
        srv.listen(1)
        assert holder_running(p)
        launcher = elastic.ElasticLauncher(elastic.ElasticConfig(nodes=1, run_dir=str(tmp_path / "run"),
                                                                 job_id="job1", holder_dir=p.root))
        with pytest.raises(LaunchError, match="already running.*another job uses this id"):
            launcher.start_holders(["node0"])
    assert not holder_running(p)   # a stale socket file is not a holder


def test_a_forked_worker_waits_for_rank0s_store_before_torch_connects(monkeypatch):
    # torch's TCPStore client retries ~0.5 s after a refused connect; the probe lets its first try succeed. It runs
    # inside the store client's creation only (a trainer without torch.distributed is never held up), not for
    # rank 0 (it hosts the store), and at most for the store's timeout.
    import importlib
    import inspect
    import socket
    import threading
    from datetime import timedelta

    rdzv = importlib.import_module("torch.distributed.rendezvous")   # the package's `rendezvous` is the function
    for handler in (rdzv._env_rendezvous_handler, rdzv._tcp_rendezvous_handler):   # the calls the hook wraps
        assert "_create_c10d_store(" in inspect.getsource(handler)
    assert list(inspect.signature(rdzv._create_c10d_store).parameters)[:5] == \
        ["hostname", "port", "rank", "world_size", "timeout"]
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    try:
        assert discovery.wait_for_store("127.0.0.1", port, 0.1) >= 0.1   # nobody listening: gives up, torch waits
        threading.Timer(0.15, s.listen).start()                          # "rank 0" comes up 150 ms later
        assert discovery.wait_for_store("127.0.0.1", port, 10) >= 0.1
    finally:
        s.close()

    monkeypatch.setattr(rdzv, "_create_c10d_store", rdzv._create_c10d_store)   # restored after the test
    probed, made = [], []
    monkeypatch.setattr(discovery, "wait_for_store", lambda h, p, t: probed.append((h, p, t)) or 0.0)
    monkeypatch.setattr(rdzv._create_c10d_store, "__wrapped__", lambda *a, **k: made.append(a) or "store",
                        raising=False)
    assert discovery.wait_before_store_connect() and discovery.wait_before_store_connect()   # wraps torch's once
    t = timedelta(seconds=30)
    assert rdzv._create_c10d_store("h", 5, 1, 4, t, True) == "store"
    assert rdzv._create_c10d_store("h", 5, 0, 4, t, True) == "store"
    assert probed == [("h", 5, 30.0)] and [m[2] for m in made] == [1, 0]


def test_a_healthy_agent_sees_a_peer_failure_as_a_waiting_node():
    # The failed node's agent marks the attempt failed in the controller's store; the others count it as a
    # node waiting, torch elastic's own restart path for healthy workers (no restart counted).
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    ep = f"127.0.0.1:{server.port}"
    failed = agent._AgentHooks(agent.AgentOptions(node="node1", control=ep, nnodes="2:2", job_id="jp"))
    healthy = agent._AgentHooks(agent.AgentOptions(node="node0", control=ep, nnodes="2:2", job_id="jp"))
    try:
        healthy.peer_check_s = 0.0

        class Handler:
            calls = 0

            def num_nodes_waiting(self):
                Handler.calls += 1
                return 0

        h = Handler()
        agent._restart_on_peer_failure(h, healthy)
        assert h.num_nodes_waiting() == 0                         # no attempt yet
        failed.attempt = healthy.attempt = 3
        assert h.num_nodes_waiting() == 0 and Handler.calls == 2   # torch's own answer is still asked
        failed._mark_failed(3)
        deadline = time.monotonic() + 5   # a TCPStore set is not acknowledged: another client sees it soon after
        while h.num_nodes_waiting() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert h.num_nodes_waiting() == 1
        healthy.attempt = 4                                      # the next attempt is not failed
        assert h.num_nodes_waiting() == 0
        healthy.peer_check_s = 60.0                              # rate limit: one store read per interval
        healthy._peer_checked = time.monotonic()
        healthy.attempt = 3
        assert not healthy.peer_failed()
    finally:
        failed.close()
        healthy.close()
