"""TOR with the shrink policy: a node loss with no spare continues at a smaller data-parallel size D' and grows back.

The accounting of a run that shrank and grew, the closed form per failure class, the simulator on failures given
by hand, the simulator against the closed form, the spares-or-shrink comparison and the command line. Expected
numbers are worked out in the comments (docs/tor.md, "Continuing at a smaller data-parallel size"), not copied from
the output.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from shardsafe.tor import check_event, compute_tor, report_dict, report_text
from shardsafe.tor.classes import Cluster, Costs, Rates
from shardsafe.tor.cli import main
from shardsafe.tor.inputs import costs_from_report
from shardsafe.tor.policy import compare_policies, strategies_for
from shardsafe.tor.project import class_costs, p_beyond_m, p_no_spare, project, recommend
from shardsafe.tor.projection_report import Refiner
from shardsafe.tor.shrink import SHRINK, dp_after_loss, idle_shortfall, throughput_after_loss
from shardsafe.tor.simulate import replay, simulate

from .test_tor import E, assert_breakdown, iters
from .test_tor_project import COSTS, SIM_CLUSTER, SIM_RATES


def L(t, kind, attempt=None, **fields):
    """A launcher event (attempt in the envelope, as the controller writes it)."""
    return {"t": float(t), "kind": kind, "source": "launcher", "rank": None, "node": None, "attempt": attempt,
            **fields}


# --------------------------------------------------------------------------------------------------------------
# The run's accounting
# --------------------------------------------------------------------------------------------------------------

def shrink_trace(degraded_seconds=(2.0, 2.0, 2.0, 2.0), grow_rc=0):
    """D = 4: iterations 1..6 of 1 s; node n3 lost at 7.7 (detected 8.7); no spare: the launcher shrinks to D' = 2
    at 10.0; attempt 1 restores version 4 from parity (re-partitioned, 1 s) and runs iterations 5..8 at D' = 2
    (2 s each: the same global batch on half the ranks); a node returns, the launcher grows back (t - 1.3), the
    next snapshot (v8) commits and attempt 1 stops; attempt 2 restores v8 from memory at D = 4 and runs 9..12."""
    ev = [E(0, "job_start"), E(0.5, "trainer_start", 0),
          E(1.0, "restore_end", 0, tier="none", version=None, seconds=0.0, bytes=0),
          E(1.0, "train_ready", 0, iteration=1)]
    ev += iters(0, 1, [2, 3, 4, 5]) + [E(5.2, "snapshot", 0, version=4, stall_s=0.2, copy_s=0.1, bytes=8)]
    ev += iters(0, 5, [6.2, 7.2])
    ev += [E(8.7, "failure_detected", attempt=0, cause="node_loss", node="n3", t_fault=7.7),
           E(8.7, "attempt_end", attempt=0, rc=1, cause="node_loss"),
           L(10.0, "shrink", 1, from_dp=4, to_dp=2), L(10.0, "restart", attempt=1),
           E(10.5, "trainer_start", 1), E(10.6, "restore_start", 1),
           E(11.6, "restore_end", 1, tier="parity", version=4, seconds=1.0, bytes=8),
           E(11.8, "train_ready", 1, iteration=5)]
    t = 11.8
    for k, s in enumerate(degraded_seconds):
        t += s
        ev.append(E(t, "iteration", 1, iteration=5 + k, seconds=s))
    ev += [L(t - 1.3, "grow", 2, from_dp=2, to_dp=4),
           E(t + 0.2, "snapshot", 1, version=8, stall_s=0.2, copy_s=0.1, bytes=8),
           L(t + 0.5, "attempt_end", attempt=1, rc=grow_rc, cause="grow"), L(t + 0.5, "restart", attempt=2)]
    b = t + 1.2
    ev += [E(b, "trainer_start", 2), E(b + 0.2, "restore_start", 2),
           E(b + 0.7, "restore_end", 2, tier="memory", version=8, seconds=0.5, bytes=8),
           E(b + 1.0, "train_ready", 2, iteration=9)]
    ev += iters(2, 9, [b + 2, b + 3, b + 4, b + 5]) + [E(b + 6, "job_end", ok=True)]
    return ev


# startup 0..1 + 10.5..10.6 + 11.6..11.8 + 21.0..21.2 + 21.7..22.0 = 1.8; detection 7.7..8.7; restart 8.7..10.5
# (the launcher's 1.3 s wait for a spare, then the re-forming) + 20.0..21.0 (the grow: attempt 1 stopped after its
# last snapshot) = 2.8; restore parity 1.0 (shrink), memory 0.5 (grow); lost 5.0..7.7 less v4's 0.2 s stall = 2.5;
# stalls 0.2 + 0.2; shutdown 26..27. T_opt = 12 x 1.0 (the ideal: attempt 2, the clean full-size one; attempt 1
# ran at D' and does not count). degraded = 4 kept iterations x (2.0 s at D' - 1.0 s at D) = 4.0.
SHRUNK = {"startup": 1.8, "detection": 1.0, "restart": 2.8, "restore_parity": 1.0, "restore_memory": 0.5,
          "lost_progress": 2.5, "snapshot_stall": 0.4, "degraded": 4.0, "shutdown": 1.0}


def test_shrink_and_grow_by_hand():
    rep = compute_tor(shrink_trace())
    assert rep.t_obs == pytest.approx(27.0) and rep.t_opt == pytest.approx(12.0)
    assert rep.tor == pytest.approx(12.0 / 27.0) and rep.ideal_iteration_s == pytest.approx(1.0)
    assert_breakdown(rep, SHRUNK)
    # The grow ended attempt 1 on purpose: one failure only, and no warning that one was inferred.
    assert len(rep.failures) == 1 and [a.failed for a in rep.attempts] == [True, False, False]
    assert not any("failure_detected" in w for w in rep.warnings), rep.warnings
    assert [a.data_parallel for a in rep.attempts] == [4, 2, 4]
    assert [(s.t0, s.t1, s.label) for s in rep.segments if s.t0 >= 19.8 and s.t1 <= 21.0] == [(20.0, 21.0, "restart")]
    d = rep.degraded
    assert (d.full_data_parallel, d.shrinks, d.grows) == (4, 1, 1)
    (p,) = d.periods
    assert (p.attempt, p.data_parallel, p.kept_iterations) == (1, 2, 4)
    assert p.wall_s == pytest.approx(20.0 - 11.8) and p.iteration_s == pytest.approx(2.0)
    assert p.lost_s == pytest.approx(4.0) and p.throughput_assumed == 0.5
    assert d.resize_restore_s == [1.0, 0.5] and d.shrink_waits_s == [pytest.approx(1.3)]
    # The model: g = degraded / T_obs, measured like the slowdown.
    assert rep.model.degraded_fraction == pytest.approx(4.0 / 27.0)


def test_reduced_size_iterations_beyond_the_ratio_are_slowdown():
    # The first iteration at D' takes 2.5 s (warm-up): the median at D' is still 2.0, so degraded stays 4 x 1.0 and
    # the extra 0.5 s is slowdown; everything after it is 0.5 s later.
    rep = compute_tor(shrink_trace(degraded_seconds=(2.5, 2.0, 2.0, 2.0)))
    assert rep.t_obs == pytest.approx(27.5)
    assert_breakdown(rep, dict(SHRUNK, slowdown=0.5))


def test_a_grow_that_stops_the_trainers_by_signal_is_not_a_failure():
    rep = compute_tor(shrink_trace(grow_rc=-15))
    assert len(rep.failures) == 1 and not rep.attempts[1].failed
    assert_breakdown(rep, SHRUNK)


def test_the_failure_before_a_shrink_is_inferred_when_unreported():
    # A shrink follows a lost node: without failure_detected, attempt 0's rc=1 still makes it a failure (only a grow
    # ends an attempt on purpose).
    rep = compute_tor([e for e in shrink_trace() if e["kind"] != "failure_detected"])
    assert len(rep.failures) == 1 and rep.failures[0].synthesized and rep.attempts[0].failed
    assert not rep.attempts[1].failed


def test_a_job_that_ends_at_the_reduced_size():
    # No grow: attempt 1 runs to the end at D' = 2. The only full-size attempt failed, so the ideal is the median
    # of its kept iterations (1.0 s), with a warning that says so.
    ev = [e for e in shrink_trace() if e["kind"] != "grow" and not (e.get("attempt") == 2 or e["t"] > 20.0)]
    ev += [E(21.0, "job_end", ok=True)]
    rep = compute_tor(ev)
    assert rep.ideal_iteration_s == pytest.approx(1.0) and rep.t_opt == pytest.approx(8.0)
    assert any("every full-size attempt failed" in w for w in rep.warnings)
    # 20.0..21.0 is shutdown now; iterations 1..8 kept, 5..8 at D' = 2.
    assert rep.breakdown["degraded"] == pytest.approx(4.0) and rep.breakdown["shutdown"] == pytest.approx(1.0)
    assert math.fsum(rep.breakdown.values()) == pytest.approx(rep.t_obs - rep.t_opt)


def test_without_resizes_nothing_is_degraded():
    rep = compute_tor([e for e in shrink_trace() if e["kind"] not in ("shrink", "grow")])
    assert rep.degraded.full_data_parallel is None and rep.degraded.periods == []
    assert rep.breakdown["degraded"] == 0.0 and all(a.data_parallel is None for a in rep.attempts)


def test_resize_events_are_checked():
    good = L(1.0, "shrink", 1, from_dp=4, to_dp=3)
    assert check_event(good) == []
    assert check_event(L(1.0, "grow", 2, from_dp=3, to_dp=4)) == []
    assert "expected to_dp < from_dp" in check_event(L(1.0, "shrink", 1, from_dp=3, to_dp=4))[0]
    assert "ints >= 1" in check_event(L(1.0, "grow", 1, from_dp=3, to_dp=4.5))[0]
    assert "missing field 'to_dp'" in " ".join(check_event(L(1.0, "grow", 1, from_dp=3)))
    # A malformed one is ignored by the accounting, with a warning.
    rep = compute_tor([*shrink_trace(), L(25.0, "grow", 3, from_dp=4, to_dp=4)])
    assert any("grow at t=25.000 ignored" in w for w in rep.warnings)


def test_report_json_text_and_measured_costs():
    rep = compute_tor(shrink_trace())
    d = json.loads(json.dumps(report_dict(rep)))
    assert d["breakdown"]["degraded"] == pytest.approx(4.0)
    deg = d["degraded"]
    assert deg["full_data_parallel"] == 4 and deg["lost_s"] == pytest.approx(4.0)
    (p,) = deg["periods"]
    assert p["t0"] == pytest.approx(11.8) and p["throughput"] == pytest.approx(0.5)
    assert [a["data_parallel"] for a in d["attempts"]] == [4, 2, 4]
    text = report_text(rep)
    assert "degraded" in text and "attempt 1 at D' = 2" in text and "throughput 0.500 (D'/D 0.500)" in text
    assert "g degraded 14.81%" in text
    # For `tor project --from`: the restore at a new size (mean of 1.0 and 0.5), the launcher's wait before the
    # shrink (1.3 s), taken out of the restart (8.7..10.5 = 1.8 s, the run's one failure).
    c = costs_from_report(rep)
    assert c["reshard_restore_s"] == pytest.approx(0.75) and c["shrink_after_s"] == pytest.approx(1.3)
    assert c["restart_s"] == pytest.approx(0.5)


# --------------------------------------------------------------------------------------------------------------
# The closed form
# --------------------------------------------------------------------------------------------------------------

def costs(**kw):
    return Costs(**{**COSTS, "shrink_after_s": 50.0, "reshard_restore_s": 40.0, **kw})


def cluster(**kw):
    return Cluster(**{**dict(nodes=16, gpus_per_node=8, rack_nodes=4, group_nodes=4, parity_m=1, spares=0), **kw})


def test_reduced_sizes_follow_the_layout_and_the_batch():
    assert cluster().dp == 16 and dp_after_loss(cluster(), 1) == 15 and dp_after_loss(cluster(), 4) == 12
    # Replicas of 2 nodes: D = 8; without one node 7 replicas fit; a global batch of 64 micro-batches needs a
    # divisor: 4 (half the throughput). 48 micro-batches: 6 divides it.
    two = cluster(model_parallel_gpus=16, global_batch=64)
    assert two.dp == 8 and dp_after_loss(two, 1) == 4 and throughput_after_loss(two, 1) == 0.5
    assert dp_after_loss(cluster(model_parallel_gpus=16, global_batch=48), 1) == 6
    # Half a node per replica: a lost node takes two.
    assert cluster(model_parallel_gpus=4).dp == 32 and dp_after_loss(cluster(model_parallel_gpus=4), 1) == 30
    with pytest.raises(ValueError, match=r"global_batch=60.*multiple of the data-parallel size D = 8"):
        cluster(model_parallel_gpus=16, global_batch=60)
    with pytest.raises(ValueError, match="smaller --model-parallel-gpus"):
        cluster(model_parallel_gpus=256)


def test_node_class_under_the_shrink_policy_by_hand():
    # No spares: every node loss shrinks from D = 16 to D' = 15 (theta = 15/16). Snapshot every 99 s + 1 s stall.
    # Shrink path from parity: detect 10 + wait for a spare 50 + restart 20 + startup 30 + reshard restore 40 + half a
    # cycle lost 50; the replacement comes 500 s after detection, training at D' started 50+20+30+40 = 140 s after
    # it: g = 360 + the next commit, half a cycle at 15/16 speed, 100 / (2 x 15/16) = 53.33 -> 413.33 s at D', which
    # lose 1/16 of it = 25.83; grow back: restart 20 + startup 30 + reshard restore 40 = 90. Sum 315.83.
    # Beyond m (restore from the persistent tier, 100 s): g = 500 - 200 + 53.33 = 353.33, lose 22.08; lost half the
    # flush cadence, 11 x 100 / 2 = 550: 10 + 50 + 20 + 30 + 100 + 550 + 22.08 + 90 = 872.08.
    # Healing window: 10 + 50 + 20 + 30 + 40 + 100 = 250 s (no 500 s wait, unlike the spares policy's 675 s).
    rates = Rates(node=0.02)
    pb = p_beyond_m(cluster(), rates, 250.0)
    assert pb == pytest.approx(1 - math.exp(-0.02 / 3600 * 250 * 3), rel=1e-9)
    cc = class_costs(SHRINK, cluster(), rates, costs(), interval_s=99.0, stall_s=1.0)["node"]
    par, per = 315.0 + 5 / 6, 872.0 + 1 / 12
    assert cc.p_no_spare == 1.0 and cc.p_shrink == 1.0 and cc.p_beyond_m == pytest.approx(pb)
    assert cc.seconds == pytest.approx((1 - pb) * par + pb * per)
    assert cc.parts["degraded"] == pytest.approx((1 - pb) * 25.0 + (1 - pb) * 5 / 6 + pb * (22.0 + 1 / 12))
    assert cc.parts["grow"] == pytest.approx(90.0) and cc.parts["replacement_wait"] == pytest.approx(50.0)
    assert cc.degraded_wall_s == pytest.approx((1 - pb) * (413.0 + 1 / 3) + pb * (353.0 + 1 / 3))
    # The spares policy waits the 500 s instead: 625 s per loss on the parity path (test_tor_project).
    spares = class_costs("shardsafe", cluster(), rates, costs(), interval_s=99.0, stall_s=1.0)["node"]
    assert spares.seconds > cc.seconds + 300
    # Process failures lose no node: the same under both policies.
    both = [class_costs(s, cluster(), Rates(process=0.01), costs(), interval_s=99.0, stall_s=1.0)["process"].seconds
            for s in ("shardsafe", SHRINK)]
    assert both == [pytest.approx(115.0)] * 2


def test_replacement_before_the_shrink_starts_waits_one_full_cycle_at_d_prime():
    # W = 100 < 140 s to train at D': the replacement is there when D' starts; the job grows at D''s first commit,
    # a whole cycle later: g = 100 / (15/16) = 106.67 s, losing 6.67 (from the persistent tier too: 200 s > 100).
    cc = class_costs(SHRINK, cluster(), Rates(node=0.02), costs(replace_wait_s=100.0), interval_s=99.0,
                     stall_s=1.0)["node"]
    assert cc.degraded_wall_s == pytest.approx(100 / (15 / 16))
    assert cc.parts["degraded"] == pytest.approx(100 / (15 / 16) / 16)


@pytest.mark.parametrize("why", ["fast replacement", "turned off", "no smaller size"])
def test_where_it_cannot_or_need_not_shrink_it_waits_as_before(why):
    # A replacement within the launcher's wait (W 40 s <= 50 s), shrink_after_s 0 (off, as the launcher's option),
    # or a job of one replica (nothing to shrink to): the shrink policy is the spares policy, and says why.
    co, cl = {"fast replacement": (costs(replace_wait_s=40.0), cluster()),
              "turned off": (costs(shrink_after_s=0.0), cluster()),
              "no smaller size": (costs(), Cluster(nodes=2, gpus_per_node=8, rack_nodes=2, group_nodes=2,
                                                   model_parallel_gpus=16))}[why]
    rates = Rates(node=0.02, process=0.01)
    a, b = project("shardsafe", cl, rates, co, interval_s=99.0), project(SHRINK, cl, rates, co, interval_s=99.0)
    assert b.tor == pytest.approx(a.tor, abs=1e-12) and b.classes["node"].p_shrink == 0.0
    assert any(x in n for n in b.notes for x in ("never shrinks", "turns shrinking off", "cannot re-form"))
    r = replay(SHRINK, cl, co, interval_s=99.0, horizon_s=5000.0, failures=[(1000.5, "node", [1])])
    assert r.shrinks == 0 and r.waits == 1


def test_a_rack_short_of_spares_shrinks_by_what_is_missing():
    # 2 spares, a rack of 4 nodes: it finds 2, 1 or 0 idle and is short of 2, 3 or 4 nodes. With mu = 16 x 0.02 x 10
    # = 3.2 nodes away (node losses only): P(0 away) = e^-3.2 -> 2 idle; P(1 away) -> 1 idle; else 0 idle.
    rates = Rates(node=0.02, rack=1e-12)
    short = idle_shortfall(cluster(spares=2), rates, costs(), 4)
    p0, p1 = math.exp(-3.2), 3.2 * math.exp(-3.2)
    assert short == pytest.approx({2: p0, 3: p1, 4: 1 - p0 - p1})
    assert math.fsum(short.values()) == pytest.approx(p_no_spare(cluster(spares=2), rates, costs(), 4))
    cc = class_costs(SHRINK, cluster(spares=2), rates, costs(), interval_s=99.0, stall_s=1.0)["rack"]
    # theta = 14/16, 13/16, 12/16: g = 500 - 140 + 50 / theta (the next commit), or 500 - 200 + 50 / theta from the
    # persistent tier, which a rack takes when any of the 4 groups it hits loses another member in the 250 s window.
    pr = 1 - (1 - p_beyond_m(cluster(spares=2), rates, 250.0, 1)) ** 4
    expect = math.fsum(w * (1 - th) * ((1 - pr) * (360 + 50 / th) + pr * (300 + 50 / th))
                       for k, w in short.items() for th in [(16 - k) / 16])
    assert cc.parts["degraded"] == pytest.approx(expect, rel=1e-9) 
    assert cc.p_shrink == pytest.approx(math.fsum(short.values()))


def test_projection_of_the_shrink_policy_sums_and_reports_its_shares():
    cl, co = cluster(spares=1), costs()
    p = project(SHRINK, cl, SIM_RATES, co)
    assert math.fsum(p.breakdown().values()) + p.tor == pytest.approx(1.0)
    sh = p.shrink
    assert (sh["dp"], sh["dp_after_node"], sh["dp_after_rack"]) == (16, 15, 12)
    wall = math.fsum(cc.per_hour / 3600 * cc.degraded_wall_s for cc in p.classes.values())
    assert sh["degraded_wall_fraction"] == pytest.approx(wall) and 0 < sh["degraded_fraction"] < wall
    d = p.as_dict()
    assert d["policy"] == "shrink" and d["classes"]["node"]["p_shrink"] == pytest.approx(p.classes["node"].p_shrink)
    assert project("shardsafe", cl, SIM_RATES, co).as_dict()["policy"] == "spares"


def test_recommend_with_the_shrink_policy_needs_fewer_spares():
    rates, cl, co = Rates(node=0.002, rack=0.0005), Cluster(nodes=64, rack_nodes=8, group_nodes=8), costs()
    wait, shrink = recommend(cl, rates, co, 0.97), recommend(cl, rates, co, 0.97, strategy=SHRINK)
    assert wait["reached"] and shrink["reached"] and shrink["policy"] == "shrink" and wait["policy"] == "spares"
    assert shrink["spares"] < wait["spares"]


# --------------------------------------------------------------------------------------------------------------
# The simulator, on failures given by hand
# --------------------------------------------------------------------------------------------------------------

HAND = Costs(detect_s=10, restart_s=20, startup_s=30, restore_memory_s=5, restore_parity_s=15,
             restore_persistent_s=100, snapshot_stall_s=1, persist_interval_s=1000, replace_wait_s=1000, repair_h=10,
             shrink_after_s=50, reshard_restore_s=40)
HAND_CLUSTER = Cluster(nodes=4, gpus_per_node=8, rack_nodes=4, group_nodes=4, parity_m=1, spares=0)


def test_replay_one_node_loss_by_hand():
    # D = 4 -> D' = 3 (0.75). Snapshots every 99 s + 1 s stall (cycles of 100 s). Node 2 lost at 1000.5: 10 cycles
    # committed, 990 s kept. Shrink recovery 10 + 50 + 20 + 30 + 40 = 150 -> D' trains from 1150.5. The replacement
    # arrives at 1000.5 + 10 + 1000 = 2010.5; by then 860 s at 0.75 = 645 s of effective time; the next commit is at
    # 700, (700 - 645) / 0.75 = 73.33 s later: grow at 2083.83 with 7 cycles = 693 s more kept (1683). Grow 20 + 30
    # + 40 = 90 -> full size from 2173.83 to the horizon 10000: 7826.17 s = 78 cycles (7722) + 26.17 -> TOR
    # (1683 + 7748.17) / 10000. At D' 2083.83 - 1150.5 = 933.33 s, losing a quarter of them.
    r = replay(SHRINK, HAND_CLUSTER, HAND, interval_s=99.0, horizon_s=10000.0, failures=[(1000.5, "node", [2])])
    assert r.tor == pytest.approx((1683 + 7748 + 1 / 6) / 10000, abs=1e-12)
    assert (r.shrinks, r.grows, r.waits, r.tiers) == (1, 1, 0, {"parity": 1})
    assert r.degraded_fraction == pytest.approx((933 + 1 / 3) / 10000)
    assert r.degraded_s == pytest.approx(933 + 1 / 3) and r.degraded_lost_s == pytest.approx((933 + 1 / 3) / 4)
    # The spares policy waits: 10 + 20 + 30 + 15 + 1000 = 1075 -> full size from 2075.5: 7924.5 s = 79 cycles
    # (7821) + 24.5 -> (990 + 7845.5) / 10000.
    w = replay("shardsafe", HAND_CLUSTER, HAND, interval_s=99.0, horizon_s=10000.0, failures=[(1000.5, "node", [2])])
    assert w.tor == pytest.approx(0.88355, abs=1e-12) and (w.waits, w.shrinks) == (1, 0)


def test_replay_a_process_failure_while_degraded():
    # As above, and a trainer crashes at 1500.5, at D': 350 s x 0.75 = 262.5 effective -> 2 cycles (198) kept since
    # the shrink (1188 in all); memory restore at D' (no change of size): 10 + 20 + 30 + 5 = 65 -> D' from 1565.5.
    # The replacement at 2010.5 finds 445 x 0.75 = 333.75 effective; next commit at 400: 88.33 s later, grow at
    # 2098.83 with 4 cycles (396 -> 1584). Full size from 2188.83: 7811.17 s = 78 cycles (7722) + 11.17.
    r = replay(SHRINK, HAND_CLUSTER, HAND, interval_s=99.0, horizon_s=10000.0,
               failures=[(1000.5, "node", [2]), (1500.5, "process", [])])
    assert r.tor == pytest.approx((1584 + 7733 + 1 / 6) / 10000, abs=1e-12)
    assert r.degraded_s == pytest.approx(350 + 533 + 1 / 3) and (r.shrinks, r.grows) == (1, 1)
    assert r.tiers == {"parity": 1, "memory": 1}


def test_replay_a_replacement_that_comes_during_the_shrink():
    # W = 100: the replacement arrives at 1110.5, before D' trains (1150.5); the job grows at D''s first commit,
    # 100 / 0.75 = 133.33 s later (1283.83), keeping one cycle more (1089); full size from 1373.83: 8626.17 s =
    # 86 cycles (8514) + 26.17.
    r = replay(SHRINK, HAND_CLUSTER, dataclasses.replace(HAND, replace_wait_s=100.0), interval_s=99.0,
               horizon_s=10000.0, failures=[(1000.5, "node", [2])])
    assert r.tor == pytest.approx((1089 + 8540 + 1 / 6) / 10000, abs=1e-12)
    assert r.degraded_s == pytest.approx(133 + 1 / 3)


def test_replay_checks_its_failures():
    with pytest.raises(ValueError, match="expected \\(seconds, class, node ids\\)"):
        replay(SHRINK, HAND_CLUSTER, HAND, interval_s=99.0, horizon_s=100.0, failures=[(1.0, "node", [])])


# --------------------------------------------------------------------------------------------------------------
# The simulator against the closed form
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spares, wait", [(8, 1800.0), (0, 1800.0), (0, 3000.0), (2, 3000.0)])
def test_simulator_agrees_with_the_closed_form_for_the_shrink_policy(spares, wait):
    # 64 nodes, failures take 1-2 % of the wall time and the job spends up to 12 % of it at D' = 63/64: first order
    # holds, so (P) falls inside the simulator's 95 % CI (fixed seed), and so do the shares at reduced size to 10 %.
    cl, co = Cluster(**{**SIM_CLUSTER, "spares": spares}), costs(repair_h=4.0, replace_wait_s=wait)
    p = project(SHRINK, cl, SIM_RATES, co)
    assert p.first_order_ok
    r = simulate(SHRINK, cl, SIM_RATES, co, interval_s=p.interval_s, horizon_s=20 * 86400.0, replicas=12, seed=9)
    assert sum(r.events.values()) > 1000 and r.shrinks > 10 and r.grows > 10
    assert abs(p.tor - r.tor) <= r.ci95, (p.tor, r.tor, r.ci95)
    assert r.degraded_fraction == pytest.approx(p.shrink["degraded_wall_fraction"], rel=0.1)
    # The same failures under the spares policy (same seed) cost more whenever a loss finds no spare.
    w = simulate("shardsafe", cl, SIM_RATES, co, interval_s=p.interval_s, horizon_s=20 * 86400.0, replicas=12, seed=9)
    assert r.tor > w.tor


def test_where_degraded_periods_overlap_the_projection_simulates():
    # Replicas of 4 nodes and a power-of-two batch: one lost node halves the throughput (D 16 -> 8), and the job
    # spends ~12 % of the time at D': a second loss while degraded costs nothing more, which (P) charges again.
    cl = Cluster(**{**SIM_CLUSTER, "spares": 0, "model_parallel_gpus": 32, "global_batch": 64})
    co = costs(repair_h=4.0, replace_wait_s=3000.0)
    p = project(SHRINK, cl, SIM_RATES, co)
    assert p.failure_fraction < 0.1 and not p.first_order_ok
    assert any("reduced size" in n and "tor simulate" in n for n in p.notes)
    pt = Refiner(replicas=6, seed=2, rates=SIM_RATES, costs=co)(cl, p)
    assert pt["tor_source"] == "simulated" and pt["tor"] > p.tor


# --------------------------------------------------------------------------------------------------------------
# Spares or shrink, and the command line
# --------------------------------------------------------------------------------------------------------------

def test_compare_policies_recommends_per_node_held():
    rates = Rates(node=0.002, rack=0.0005, process=0.001)
    cl, co = Cluster(nodes=64, rack_nodes=8, group_nodes=8, spares=4), costs()
    d = compare_policies(cl, rates, co)
    spares = [r["spares"] for r in d["rows"]]
    assert spares[0] == 0 and 4 in spares and spares == sorted(spares)
    for r in d["rows"]:
        for pt in r["policies"].values():
            assert pt["tor_per_node"] == pytest.approx(pt["tor"] * 64 / (64 + r["spares"]))
        assert r["policies"]["shrink"]["tor"] >= r["policies"]["spares"]["tor"] - 1e-9
    best = max(pt["tor_per_node"] for r in d["rows"] for pt in r["policies"].values())
    assert d["recommended"]["tor_per_node"] >= best - 1e-3 and d["recommended"]["policy"] == "shrink"
    assert d["at_spares"]["spares"] == 4 and "shrink with" in d["summary"]
    # A replacement that comes quickly makes shrinking pointless: the grow costs more than the short wait.
    quick = compare_policies(cl, rates, costs(replace_wait_s=150.0))
    assert quick["recommended"]["policy"] == "spares"
    assert all(r["policies"]["shrink"]["tor"] < r["policies"]["spares"]["tor"] + 1e-9 for r in quick["rows"])


def test_policy_selects_the_strategies():
    assert strategies_for("spares") == ("shardsafe", "memory_only", "disk")
    assert strategies_for("shrink") == (SHRINK, "memory_only", "disk")
    assert strategies_for("both") == ("shardsafe", SHRINK, "memory_only", "disk")
    with pytest.raises(ValueError, match="expected one of spares, shrink, both"):
        strategies_for("never")


def test_project_command_with_each_policy(capsys):
    base = ["project", "--gpus", "16384", "--profile", "llama3", "--sim-replicas", "2"]
    assert main([*base, "--spares", "16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["policy"] == "both" and set(d["strategies"]) >= {"shardsafe", SHRINK}
    sh = d["strategies"][SHRINK]
    assert sh["policy"] == "shrink" and sh["shrink"]["dp"] == 2048 and sh["shrink"]["dp_after_node"] == 2047
    rows = {r["spares"]: r["policies"] for r in d["policies"]["rows"]}
    assert {0, 16, 64} <= set(rows)
    for s in (0, 16, 64):     # shrink beats waiting where a node loss can find no spare
        assert rows[s]["shrink"]["tor"] > rows[s]["spares"]["tor"]
    assert rows[16]["spares"]["tor"] == pytest.approx(d["strategies"]["shardsafe"]["tor"])
    assert d["policies"]["recommended"]["policy"] in ("spares", "shrink")
    assert main([*base, "--spares", "16"]) == 0
    text = capsys.readouterr().out
    assert "shardsafe+shrink (m=1)" in text and "recommended:" in text and "D' = 2047" in text
    assert main([*base, "--policy", "spares", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d["strategies"]) == {"shardsafe", "memory_only", "disk"} and d["policies"] is None
    assert main([*base[:-2], "--policy", "shrink", "--target-tor", "0.9", "--json", "--no-simulate"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d["strategies"]) == {SHRINK, "memory_only", "disk"} and d["recommendation"] is None
    assert d["recommendation_shrink"]["reached"] and d["recommendation_shrink"]["policy"] == "shrink"


def test_simulate_command_with_the_shrink_policy(capsys):
    argv = ["simulate", "--nodes", "64", "--rack-nodes", "8", "--spares", "0", "--rate-node", "0.006",
            "--rate-process", "0.002", "--replicas", "3", "--horizon-days", "2"]
    assert main([*argv, "--policy", "shrink", "--strategy", SHRINK, "--json"]) == 0
    (pt,) = json.loads(capsys.readouterr().out)["points"]
    assert pt["strategy"] == SHRINK and pt["shrink"]["shrinks"] > 0
    assert set(pt["shrink"]) >= {"degraded_wall_fraction", "degraded_fraction", "closed_degraded_wall_fraction"}
    assert main([*argv, "--policy", "both"]) == 0
    out = capsys.readouterr().out
    assert "shardsafe+shrink" in out and "at reduced size" in out
    assert main([*argv, "--policy", "shrink", "--strategy", "shardsafe"]) == 2
    assert "not shown with --policy shrink" in capsys.readouterr().err
