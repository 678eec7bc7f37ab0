"""TOR at cluster scale: the closed form per failure class against hand-computed values, the simulator against the
closed form, published profiles, the costs a run measured, and the ``project``/``simulate`` command line.

Expected numbers are worked out in the comments from docs/tor.md's equations, not copied from the output.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest

from shardsafe.tor.classes import Cluster, Costs, Rates
from shardsafe.tor.cli import main
from shardsafe.tor.inputs import costs_from_mapping, resolve_run_dir
from shardsafe.tor.profiles import LLAMA3_CAUSES, PROFILES, get_profile
from shardsafe.tor.project import (FIRST_ORDER_LIMIT, at_scale, away_distribution, class_costs, flush_every,
                                   optimal_interval, p_beyond_m, p_no_spare, project, recommend, sweep, tor_at)
from shardsafe.tor.projection_report import Refiner, projection_dict, projection_text
from shardsafe.tor.simulate import simulate

from .test_tor import E, iters

# Round costs so the hand arithmetic stays readable; no replacement wait unless a test wants one.
COSTS = dict(detect_s=10.0, restart_s=20.0, startup_s=30.0, restore_memory_s=5.0, restore_parity_s=15.0,
             restore_persistent_s=100.0, snapshot_stall_s=1.0, persist_interval_s=1000.0, disk_save_s=20.0,
             disk_load_s=60.0, replace_wait_s=500.0, repair_h=10.0, slow_detect_s=200.0, slowdown=0.5)


def costs(**kw):
    return Costs(**{**COSTS, **kw})


def cluster(**kw):
    base = dict(nodes=16, gpus_per_node=8, rack_nodes=4, group_nodes=4, parity_m=1, spares=0)
    return Cluster(**{**base, **kw})


# ---------------------------------------------------------------------------------------------------------------
# Closed form, class by class
# ---------------------------------------------------------------------------------------------------------------

def test_process_class_by_hand():
    # 16 nodes x 0.01 per node-hour = 0.16 failures/h. A process failure: detect 10 + restart 20 + startup 30 +
    # memory restore 5 + half a cycle (99 + 1) / 2 = 50 lost -> D = 115 s. Eq. (P):
    # TOR = (1 - 0.16/3600 x 115) x 99/100 = (1 - 0.00511111) x 0.99 = 0.98494000
    rates = Rates(process=0.01)
    cc = class_costs("shardsafe", cluster(), rates, costs(), interval_s=99.0, stall_s=1.0)["process"]
    assert cc.tiers == {"memory": 1.0}
    assert cc.parts["lost_work"] == pytest.approx(50.0) and cc.seconds == pytest.approx(115.0)
    assert cc.fraction == pytest.approx(0.16 / 3600 * 115)
    assert tor_at("shardsafe", cluster(), rates, costs(), 99.0) == pytest.approx(0.98494, abs=1e-6)
    p = project("shardsafe", cluster(), rates, costs(), interval_s=99.0)
    assert p.tor == pytest.approx(0.98494, abs=1e-6)
    assert p.mtbf_s == pytest.approx(3600 / 0.16)
    # The breakdown's fractions and TOR account for all of T_obs.
    assert math.fsum(p.breakdown().values()) + p.tor == pytest.approx(1.0)
    assert p.breakdown()["snapshot_stall"] == pytest.approx((1 - 0.16 / 3600 * 115) * 1 / 100)


def test_node_class_parity_and_beyond_m_by_hand():
    # Only node losses, 0.02 per node-hour; spares=0: every loss waits 500 s for a replacement.
    # Healing window = detect 10 + restart 20 + startup 30 + parity restore 15 + wait 500 + next snapshot (99+1)
    # = 675 s. A node leaves at 0.02/3600 per second: q = 1 - exp(-0.02/3600 x 675) = 1 - exp(-0.00375).
    # m = 1 and the group has 3 other members: P(beyond m) = 1 - (1 - q)^3.
    rates = Rates(node=0.02)
    q = 1 - math.exp(-0.00375)
    pb = 1 - (1 - q) ** 3
    assert p_beyond_m(cluster(), rates, 675.0) == pytest.approx(pb, rel=1e-12)
    cc = class_costs("shardsafe", cluster(), rates, costs(), interval_s=99.0, stall_s=1.0)["node"]
    assert cc.p_no_spare == 1.0 and cc.parts["replacement_wait"] == pytest.approx(500.0)
    assert cc.p_beyond_m == pytest.approx(pb)
    assert cc.tiers["parity"] == pytest.approx(1 - pb) and cc.tiers["persistent"] == pytest.approx(pb)
    # Parity path: 10+20+30+15+500 + 50 lost = 625. Persistent path: 10+20+30+100+500 + lost half of the flush
    # cadence: k = ceil(1000/99) = 11 snapshots -> 11 x 100 / 2 = 550 -> 1210.
    assert flush_every(costs(), 99.0) == 11
    assert cc.seconds == pytest.approx((1 - pb) * 625 + pb * 1210)
    # m = 2: a second loss in the window is still parity; needs two of the three others: P(Bin(3, q) >= 2).
    pb2 = 3 * q ** 2 * (1 - q) + q ** 3
    assert p_beyond_m(cluster(parity_m=2), rates, 675.0) == pytest.approx(pb2, rel=1e-9)


def test_memory_only_sends_every_node_loss_to_the_persistent_tier():
    rates = Rates(node=0.02)
    cc = class_costs("memory_only", cluster(), rates, costs(), interval_s=99.0, stall_s=1.0)["node"]
    assert cc.tiers == {"parity": 0.0, "persistent": 1.0} and cc.p_beyond_m == 1.0
    assert cc.seconds == pytest.approx(10 + 20 + 30 + 100 + 500 + 550)


def test_rack_class_with_and_without_the_placement_rule():
    rates = Rates(rack=0.01)
    sp = cluster(spares=1000)  # spares never run out: P(no spare) is ~0 here
    # Spread: a rack holds one member of each of 4 groups; each group is beyond m only if another member leaves
    # in the window (10+20+30+15 + ~0 wait + 100 = 175 s). A node is hit by its rack's events: 4 x 0.01 per h.
    spread = class_costs("shardsafe", sp, rates, costs(), interval_s=99.0, stall_s=1.0)["rack"]
    q = 1 - math.exp(-4 * 0.01 / 3600 * 175)
    p_group = 1 - (1 - q) ** 3
    assert spread.p_no_spare < 1e-12
    assert spread.p_beyond_m == pytest.approx(1 - (1 - p_group) ** 4, rel=1e-6)
    # Not spread: a group of 4 consecutive nodes sits in one rack of 4: a rack event takes all 4 > m.
    packed = class_costs("shardsafe", cluster(spares=1000, spread=False), rates, costs(), interval_s=99.0,
                         stall_s=1.0)["rack"]
    assert packed.p_beyond_m == 1.0 and packed.tiers["persistent"] == 1.0
    assert packed.seconds == pytest.approx(10 + 20 + 30 + 100 + 550, abs=1e-6)


def test_slow_class_is_a_slowdown_until_detected_then_an_eviction():
    # 50 % slower for the 200 s to detection, then until the next snapshot commits: half a cycle of effective
    # time, (99 + 1)/2 = 50 s, takes 50/(1 - 0.5) = 100 s of wall time -> 0.5 x 300 = 150 s lost to the slowdown;
    # eviction right after a commit loses no work, and the node is rebuilt from parity (1000 spares: no wait),
    # unless another member leaves within the 10+20+30+15+100 = 175 s window (evicted nodes leave at 0.01/h):
    # then the persistent tier, which loses half the flush cadence, 550 s.
    rates = Rates(slow=0.01)
    cc = class_costs("shardsafe", cluster(spares=1000), rates, costs(), interval_s=99.0, stall_s=1.0)["slow"]
    ps = 1 - math.exp(-0.01 / 3600 * 175 * 3)
    assert cc.p_beyond_m == pytest.approx(ps, rel=1e-3)
    assert cc.parts["slowdown"] == pytest.approx(150.0)
    assert cc.parts["lost_work"] == pytest.approx(ps * 550, rel=1e-3)
    assert cc.parts["restore"] == pytest.approx((1 - ps) * 15 + ps * 100, rel=1e-6)
    assert cc.seconds == pytest.approx((1 - ps) * (60 + 15 + 150) + ps * (60 + 100 + 550 + 150), rel=1e-6)


def test_disk_strategy_loads_a_checkpoint_for_every_class():
    # Checkpoints every 580 s with a 20 s save: lost (580 + 20)/2 = 300; D = 10 + 20 + 30 + 60 + 300 = 420.
    # TOR = (1 - 0.16/3600 x 420) x 580/600 = (1 - 0.0186667) x 0.9666667 = 0.94862222
    rates = Rates(process=0.005, node=0.005)
    cc = class_costs("disk", cluster(spares=1000), rates, costs(), interval_s=580.0, stall_s=20.0)
    assert cc["process"].tiers == {"disk": 1.0} and cc["node"].tiers == {"disk": 1.0}
    assert cc["process"].seconds == pytest.approx(420.0)
    assert cc["node"].seconds == pytest.approx(420.0, rel=1e-9)
    assert tor_at("disk", cluster(spares=1000), rates, costs(), 580.0) == pytest.approx(0.9486222, abs=1e-6)


def test_spares_are_a_compound_poisson_queue():
    # mu1 = 16 nodes x 0.02/h x 10 h = 3.2 nodes away on average; one spare: a loss waits when >= 1 is away.
    rates = Rates(node=0.02)
    assert p_no_spare(cluster(spares=1), rates, costs()) == pytest.approx(1 - math.exp(-3.2))
    assert p_no_spare(cluster(spares=0), rates, costs()) == 1.0
    # Racks of 2 (batches of 2): P(2 away) = e^-(mu1 + mur) (mu1^2/2 + mur), mur = 16 x 0.01 x 10 = 1.6 events.
    rr = Rates(node=0.02, rack=0.01)
    p = away_distribution(cluster(rack_nodes=2), rr, costs(), 2)
    assert p[2] == pytest.approx(math.exp(-4.8) * (3.2 ** 2 / 2 + 1.6))
    assert p[1] == pytest.approx(math.exp(-4.8) * 3.2)


def test_optimal_interval_maximises_tor_and_is_near_young():
    rates, cl, co = Rates(process=0.01), cluster(spares=1000), costs()
    tau = optimal_interval("shardsafe", cl, rates, co)
    best = tor_at("shardsafe", cl, rates, co, tau)
    assert best >= tor_at("shardsafe", cl, rates, co, tau * 1.05)
    assert best >= tor_at("shardsafe", cl, rates, co, tau / 1.05)
    # Only lost work and stalls depend on tau here: Young's sqrt(2 C M) = sqrt(2 x 1 x 22500) = 212 s.
    assert tau == pytest.approx(math.sqrt(2 * 22500), rel=0.02)


def test_recommend_finds_the_smallest_setup_reaching_the_target():
    rates, cl, co = Rates(node=0.002, rack=0.0005), cluster(nodes=64, rack_nodes=8, group_nodes=8), costs()
    rec = recommend(cl, rates, co, 0.97)
    assert rec["reached"] and rec["tor"] >= 0.97
    # The smallest m first, then the fewest spares: with no spares at that m the target is missed.
    assert rec["spares"] > 0
    assert project("shardsafe", dataclasses.replace(cl, parity_m=rec["parity_m"], spares=0), rates, co).tor < 0.97
    again = project("shardsafe", dataclasses.replace(cl, parity_m=rec["parity_m"], spares=rec["spares"]), rates, co)
    assert again.tor == pytest.approx(rec["tor"])
    assert not recommend(cl, rates, co, 0.999)["reached"]
    with pytest.raises(ValueError, match="fraction in"):
        recommend(cl, rates, co, 1.5)


def test_checks_say_what_was_expected():
    with pytest.raises(ValueError, match="at least one failure rate"):
        Rates()
    with pytest.raises(ValueError, match=r"parity_m=4.*expected m < group size 4"):
        cluster(parity_m=4)
    with pytest.raises(ValueError, match=r"slowdown=1.0.*\[0, 1\)"):
        costs(slowdown=1.0)
    with pytest.raises(ValueError, match="unknown key"):
        Rates.from_mapping({"nodes": 0.1}, source="t")
    # Per GPU-hour rates times 8 GPUs per node.
    assert Rates.from_mapping({"per": "gpu-hour", "gpus_per_node": 8, "node": 0.001}, source="t").node == 0.008


# ---------------------------------------------------------------------------------------------------------------
# Published profiles
# ---------------------------------------------------------------------------------------------------------------

def test_llama3_profile_arithmetic():
    # 419 interruptions / (2048 nodes x 54 days x 24 h) per node-hour; the classes split the 419 counts.
    assert sum(n for n, _ in LLAMA3_CAUSES.values()) == 419
    r = get_profile("llama3").rates()
    assert r.total() == pytest.approx(419 / (2048 * 54 * 24))
    assert (r.process, r.node, r.rack, r.slow) == pytest.approx(
        tuple(x / (2048 * 54 * 24) for x in (63, 315, 35, 6)))
    # One interruption every 54 x 24 / 419 = 3.09 h at 16,384 GPUs, as the paper says ("about every 3 h").
    assert 1 / (2048 * r.total()) == pytest.approx(3.093, abs=1e-3)


def test_meta_rsc1_anchors():
    # 6.50 failures per 1,000 node-days: 16,384 GPUs = 2048 nodes -> MTTF 24 / (2.048 x 6.5) = 1.80 h (paper: 1.8 h).
    r = get_profile("meta-rsc1").rates()
    assert 1 / (2048 * r.total()) == pytest.approx(1.8, abs=0.01)
    r = Rates(node=r.total())  # Meta's model has one class: every failure costs u0 + half an interval
    # Meta's expected ETTR with 5-minute checkpoints: u0 = 5 min of restart overhead, negligible save cost:
    # 1 - (300 + 150)/(3600 x 1.8029 h) = 0.9307 (paper: ~0.93). Equation (P), disk strategy, only u0 as cost:
    co = Costs(detect_s=0, restart_s=0, startup_s=300, disk_load_s=0, disk_save_s=1e-6, replace_wait_s=0,
               slow_detect_s=0, slowdown=0.0)
    tor = tor_at("disk", Cluster(nodes=2048, spares=0), r, co, 300.0)
    assert tor == pytest.approx(1 - 2048 * 6.5 / 1000 / 24 * 450 / 3600, abs=1e-6) and round(tor, 2) == 0.93
    assert PROFILES["meta-rsc1"].anchors["ettr_5min_checkpoints_at_16384_gpus"] == 0.93
    assert PROFILES["byterobust"].anchors["ettr"] == 0.97


# ---------------------------------------------------------------------------------------------------------------
# The simulator against the closed form
# ---------------------------------------------------------------------------------------------------------------

SIM_CLUSTER = dict(nodes=64, gpus_per_node=8, rack_nodes=8, group_nodes=8, parity_m=1, spares=8)
SIM_RATES = Rates(process=0.0007, node=0.002, rack=0.00013, slow=0.00017)


@pytest.mark.parametrize("strategy", ["shardsafe", "memory_only", "disk"])
def test_simulator_agrees_with_closed_form_where_failures_are_rare(strategy):
    # 64 nodes x 0.003/h = 0.19 failures/h (MTBF 5.2 h) against minutes of recovery: failures take 1.5-4 % of
    # the wall time, first order holds, so the closed form must fall inside the simulator's 95 % CI (fixed seed:
    # deterministic; at 10 % of the wall time the two part by ~0.01, see the next test and docs/tor.md).
    cl, co = Cluster(**SIM_CLUSTER), costs(repair_h=4.0)
    p = project(strategy, cl, SIM_RATES, co)
    r = simulate(strategy, cl, SIM_RATES, co, interval_s=p.interval_s, horizon_s=20 * 86400.0, replicas=12, seed=9)
    assert sum(r.events.values()) > 1000      # enough failures that the check means something
    assert 0 < r.ci95 < 0.01
    assert abs(p.tor - r.tor) <= r.ci95, (p.tor, r.tor, r.ci95)


def test_first_order_form_breaks_when_the_mtbf_nears_the_recovery_time():
    # 64 nodes x 0.3/h: MTBF 188 s against 60 s of detection+restart+startup: many failures land during a
    # recovery, which (P) charges in full; the simulator is the value to use and it is well above (P).
    rates = Rates(process=0.3)
    cl, co = Cluster(**SIM_CLUSTER), costs()
    p = project("shardsafe", cl, rates, co)
    r = simulate("shardsafe", cl, rates, co, interval_s=p.interval_s, horizon_s=86400.0, replicas=8, seed=3)
    assert r.during_recovery > 100
    assert r.tor - p.tor > max(0.05, 5 * r.ci95)
    assert any("simulate" in n for n in p.notes)


def test_simulator_is_seeded_and_checks_its_arguments():
    cl, co = Cluster(**SIM_CLUSTER), costs()
    a = simulate("disk", cl, SIM_RATES, co, interval_s=600.0, horizon_s=86400.0, replicas=3, seed=5)
    b = simulate("disk", cl, SIM_RATES, co, interval_s=600.0, horizon_s=86400.0, replicas=3, seed=5)
    assert a.tors == b.tors
    with pytest.raises(ValueError, match="replicas"):
        simulate("disk", cl, SIM_RATES, co, interval_s=600.0, replicas=1)
    with pytest.raises(ValueError, match="strategy"):
        simulate("tape", cl, SIM_RATES, co, interval_s=600.0)


def test_sweep_scales_nodes_and_spares():
    rows = sweep(Cluster(**SIM_CLUSTER), SIM_RATES, costs(), [512, 1024])
    assert [(r["gpus"], r["nodes"], r["spares"]) for r in rows] == [(512, 64, 8), (1024, 128, 16)]
    assert rows[1]["shardsafe"] < rows[0]["shardsafe"]     # twice the nodes, twice the failures
    # Without a refiner every point is (P) alone.
    for r in rows:
        assert all(pt["tor_source"] == "closed" and pt["tor"] == pt["tor_closed"] == r[s] and pt["ci95"] is None
                   for s, pt in r["points"].items())


# ---------------------------------------------------------------------------------------------------------------
# Where (P) breaks, the projection reports the simulator's value
# ---------------------------------------------------------------------------------------------------------------

# 64 nodes at SIM_RATES: failures take 1.5-4 % of the wall time, (P) holds; 512 nodes: 8x that, 12-24 % for
# memory-only and disk, past the 10 % limit, but 6 % for shardsafe. Few replicas, fixed seed: ~1 s in all.
SWEEP_KW = dict(sweep_gpus=[512, 4096], sim_replicas=4, sim_seed=7)


@pytest.fixture(scope="module")
def refined():
    cl, co = Cluster(**SIM_CLUSTER), costs()
    return cl, co, projection_dict(cl, SIM_RATES, co, **SWEEP_KW)


def test_flagged_points_report_the_simulators_value(refined):
    cl, co, d = refined
    assert d["simulation"] == {"enabled": True, "limit_failure_fraction": FIRST_ORDER_LIMIT, "replicas": 4,
                               "seed": 7, "failures_per_replica": 400}
    flagged = 0
    for row in d["sweep"]:
        at = at_scale(cl, row["gpus"])
        for s, pt in row["points"].items():
            p = project(s, at, SIM_RATES, co)
            assert pt["tor_closed"] == pytest.approx(p.tor, abs=1e-12)
            assert pt["failure_fraction"] == pytest.approx(p.failure_fraction)
            assert row[s] == pt["tor"]
            if p.first_order_ok:          # (P) holds: it stays the value
                assert row["gpus"] == 512 or s in ("shardsafe", "shardsafe_shrink")
                assert pt["tor_source"] == "closed" and pt["tor"] == pt["tor_closed"]
                assert pt["ci95"] is None and pt["ci"] is None and pt["simulation"] is None
                continue
            flagged += 1
            assert row["gpus"] == 4096 and s not in ("shardsafe", "shardsafe_shrink")
            assert pt["tor_source"] == "simulated" and 0 < pt["ci95"] < 0.02
            assert pt["ci"] == pytest.approx([pt["tor"] - pt["ci95"], pt["tor"] + pt["ci95"]])
            sim = pt["simulation"]
            assert sim["replicas"] == 4 and sim["seed"] == 7 and sim["interval_s"] == p.interval_s
            assert sim["failures"] >= 4 * 400 and sim["horizon_s"] % 86400 == 0
            # A direct simulate() with the same seed, replicas and horizon gives the same value; another seed
            # lands within the two CIs.
            r = simulate(s, at, SIM_RATES, co, interval_s=p.interval_s, horizon_s=sim["horizon_s"], replicas=4,
                         seed=7)
            assert abs(r.tor - pt["tor"]) <= pt["ci95"] and r.tor == pytest.approx(pt["tor"], abs=1e-12)
            r2 = simulate(s, at, SIM_RATES, co, interval_s=p.interval_s, horizon_s=sim["horizon_s"], replicas=4,
                          seed=8)
            assert abs(r2.tor - pt["tor"]) <= pt["ci95"] + r2.ci95
            # (P) is pessimistic there.
            assert pt["tor"] > pt["tor_closed"]
    assert flagged == 2


def test_single_point_and_legend(refined):
    cl, co, d = refined
    text = projection_text(d)
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\s+(4096|512)\s+\d+\s+\d+.*$", text, re.M)}
    assert rows["4096"].count("*") == 2 and "*" not in rows["512"]
    pt = d["sweep"][1]["points"]["memory_only"]
    assert f"{pt['tor']:.4f}* ±{pt['ci95']:.4f}  {pt['tor_closed']:.4f}" in rows["4096"]
    assert "* simulated: failures take > 10% of the wall time here, where the first-order form (P) drifts" in text
    assert "closed = the closed form (P) it replaces" in text and "4 replicas" in text
    # The single point (64 nodes) holds: (P), no star in the strategy table, the old notes.
    for s, p in d["strategies"].items():
        assert p["tor_source"] == "closed" and p["tor"] == p["tor_closed"] and p["ci95"] is None
        assert math.fsum(p["breakdown"].values()) + p["tor_closed"] == pytest.approx(1.0)
    # At 512 nodes the strategy table is simulated too, with its note saying so.
    big = projection_dict(at_scale(cl, 4096), SIM_RATES, co, sim_replicas=4, sim_seed=7)
    mo = big["strategies"]["memory_only"]
    assert mo["tor_source"] == "simulated" and mo["tor"] == d["sweep"][1]["points"]["memory_only"]["tor"]
    assert any("TOR here is the simulator's" in n for n in mo["notes"])
    assert math.fsum(mo["breakdown"].values()) + mo["tor_closed"] == pytest.approx(1.0)
    line = next(x for x in projection_text(big).splitlines() if x.startswith("  memory-only"))
    assert f"{mo['tor']:.4f}* ±{mo['ci95']:.4f}  {mo['tor_closed']:.4f}" in line


def test_refiner_caches_and_can_be_off():
    cl, co = at_scale(Cluster(**SIM_CLUSTER), 4096), costs()
    p = project("disk", cl, SIM_RATES, co)
    r = Refiner(replicas=3, seed=1, rates=SIM_RATES, costs=co)
    a, b = r(cl, p), r(cl, p)
    assert a == b and r.simulated == 1 and a["tor_source"] == "simulated"
    off = Refiner(enabled=False, rates=SIM_RATES, costs=co)(cl, p)
    assert off["tor_source"] == "closed" and off["tor"] == p.tor


def test_recommendation_uses_the_simulated_value_where_p_breaks():
    # Only process failures (m and spares change nothing): 64 x 0.3/h, MTBF 188 s against 65 s of recovery.
    # (P) says ~0.57, the simulator ~0.63: a target between them is out of (P)'s reach, within the simulator's.
    cl, co, rates = Cluster(**SIM_CLUSTER), costs(), Rates(process=0.3)
    p = project("shardsafe", cl, rates, co)
    ref = Refiner(replicas=4, seed=1, rates=rates, costs=co)
    sim = ref(cl, p)["tor"]
    assert sim - p.tor > 0.03
    target = (p.tor + sim) / 2
    assert not recommend(cl, rates, co, target)["reached"]
    rec = recommend(cl, rates, co, target, refine=ref)
    assert rec["reached"] and rec["tor_source"] == "simulated" and rec["tor"] == sim
    assert rec["tor_closed"] == pytest.approx(p.tor, abs=1e-9) and rec["parity_m"] == 0 and rec["spares"] == 0
    # Out of reach of both: the best found still reports the better value.
    rec = recommend(cl, rates, co, 0.99, refine=ref)
    assert not rec["reached"] and rec["tor_source"] == "simulated" and rec["tor"] > rec["tor_closed"]


# ---------------------------------------------------------------------------------------------------------------
# A run's measured costs -> project --from
# ---------------------------------------------------------------------------------------------------------------

def two_failure_trace():
    """A memory restore (process failure), then a parity restore (node loss). By hand:
    memory: detection 7.7->8.7 = 1.0, restart 8.7->10.0 = 1.3, startup 10.0->10.2 + 10.6->10.8 = 0.4,
            restore 10.2->10.6 = 0.4, lost from iteration 4's end (5.0) to the fault (7.7) less the kept
            snapshot's 0.2 s stall = 2.5;
    parity: detection 16.5->18.5 = 2.0, restart 18.5->21.0 = 2.5, startup 21.0->21.5 + 23.5->24.0 = 1.0,
            restore 21.5->23.5 = 2.0, lost 14.8->16.5 less 0.2 = 1.5."""
    ev = [E(0, "job_start"), E(0, "attempt_start", attempt=0), E(0.5, "trainer_start", 0),
          E(1.0, "restore_end", 0, tier="none", version=None, seconds=0.0, bytes=0),
          E(1.0, "train_ready", 0, iteration=1)]
    ev += iters(0, 1, [2, 3, 4, 5]) + [E(5.2, "snapshot", 0, version=4, stall_s=0.2, copy_s=0.1, bytes=8)]
    ev += iters(0, 5, [6.2, 7.2])
    ev += [E(8.7, "failure_detected", attempt=0, cause="rank_exit", rank=1, t_fault=7.7),
           E(8.7, "attempt_end", attempt=0, rc=1, cause="rank_exit"), E(8.8, "restart", attempt=1),
           E(8.8, "attempt_start", attempt=1), E(10.0, "trainer_start", 1), E(10.2, "restore_start", 1),
           E(10.6, "restore_end", 1, tier="memory", version=4, seconds=0.4, bytes=8),
           E(10.8, "train_ready", 1, iteration=5)]
    ev += iters(1, 5, [11.8, 12.8, 13.8, 14.8]) + [E(15.0, "snapshot", 1, version=8, stall_s=0.2, copy_s=0.1, bytes=8)]
    ev += iters(1, 9, [16.0])
    ev += [E(18.5, "failure_detected", attempt=1, cause="node_lost", node="node1", t_fault=16.5),
           E(18.5, "attempt_end", attempt=1, rc=1, cause="node_lost"), E(18.6, "restart", attempt=2),
           E(18.6, "attempt_start", attempt=2), E(21.0, "trainer_start", 2), E(21.5, "restore_start", 2),
           E(23.5, "restore_end", 2, tier="parity", version=8, seconds=2.0, bytes=8),
           E(24.0, "train_ready", 2, iteration=9)]
    ev += iters(2, 9, [25, 26, 27, 28]) + [E(29, "job_end", ok=True)]
    return ev


def write_run(path, events):
    path.mkdir(parents=True, exist_ok=True)
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


BY_HAND = {"memory": dict(detection=1.0, restart=1.3, startup=0.4, restore=0.4, lost_progress=2.5),
           "parity": dict(detection=2.0, restart=2.5, startup=1.0, restore=2.0, lost_progress=1.5)}


def test_report_breaks_the_runs_failures_down_by_class():
    from shardsafe.tor import compute_tor
    rep = compute_tor(two_failure_trace())
    assert set(rep.by_class) == {"memory", "parity"}
    for tier, parts in BY_HAND.items():
        assert rep.by_class[tier]["failures"] == 1
        for k, v in parts.items():
            assert rep.by_class[tier][k] == pytest.approx(v), (tier, k)
    # The parts of all failures add up to the breakdown's own categories.
    assert rep.breakdown["lost_progress"] == pytest.approx(2.5 + 1.5)
    assert rep.breakdown["detection"] == pytest.approx(3.0)


def test_project_from_a_run_uses_the_costs_the_report_prints(tmp_path, capsys):
    run = write_run(tmp_path / "run", two_failure_trace())
    assert main(["report", str(run)]) == 0
    text = capsys.readouterr().out
    printed = {}
    for tier in ("memory", "parity"):
        m = re.search(rf"^\s+{tier} \(\w+\)\s+1" + r"\s+([\d.]+)" * 6, text, re.M)
        assert m, text
        printed[tier] = dict(zip(("detection", "restart", "startup", "restore", "lost_progress"),
                                 map(float, m.groups()[:5])))
        assert printed[tier] == pytest.approx(BY_HAND[tier])
    assert main(["project", "--from", str(run), "--gpus", "1024", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    meas = d["costs"]["measured"]
    assert meas["restore_memory_s"] == pytest.approx(printed["memory"]["restore"])
    assert meas["restore_parity_s"] == pytest.approx(printed["parity"]["restore"])
    for part, field in (("detection", "detect_s"), ("restart", "restart_s"), ("startup", "startup_s")):
        mean = (printed["memory"][part] + printed["parity"][part]) / 2
        assert meas[field] == pytest.approx(mean) and d["costs"][field] == pytest.approx(mean)
    assert meas["snapshot_stall_s"] == pytest.approx(0.2)
    assert "restore_persistent_s" not in meas and d["costs"]["restore_persistent_s"] == Costs().restore_persistent_s
    assert "run " in d["costs"]["source"]
    # A flag still overrides what the run measured.
    assert main(["project", "--from", str(run), "--gpus", "1024", "--detect-s", "7", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["costs"]["detect_s"] == 7.0


def test_report_on_a_demo_run_dir_finds_the_protected_run(tmp_path, capsys):
    # shardsafe demo --run-dir D keeps D/reference and D/run; only D/run is the protected, failing run.
    write_run(tmp_path / "run", two_failure_trace())
    write_run(tmp_path / "reference", [E(0, "job_start"), E(1, "job_end", ok=True)])
    assert resolve_run_dir(tmp_path) == tmp_path / "run"
    assert main(["report", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr()
    assert "reporting the protected run" in out.err
    assert len(json.loads(out.out)["failures"]) == 2
    assert main(["project", "--from", str(tmp_path), "--json", "--no-simulate"]) == 0
    assert json.loads(capsys.readouterr().out)["costs"]["measured"]["restore_parity_s"] == pytest.approx(2.0)
    # An empty directory still fails with the message that says what to pass.
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "no TOR event log" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# The command line: --json schema, the plot, bad input
# ---------------------------------------------------------------------------------------------------------------

def test_project_json_schema(capsys):
    assert main(["project", "--gpus", "16384", "--spares", "64", "--disk-interval-s", "1800", "--target-tor", "0.9",
                 "--sweep", "1024,16384", "--json", "--no-simulate"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["simulation"]["enabled"] is False
    assert d["schema"] == "shardsafe.tor.project/1"
    assert set(d) >= {"cluster", "rates", "costs", "profile", "strategies", "recommendation", "sweep"}
    assert d["cluster"]["gpus"] == 16384 and d["cluster"]["nodes"] == 2048
    assert d["profile"]["name"] == "llama3" and "arXiv 2407.21783" in d["rates"]["source"]
    assert set(d["strategies"]) == {"shardsafe", "shardsafe_shrink", "memory_only", "disk"}   # --policy both
    for s, p in d["strategies"].items():
        assert 0 <= p["tor"] <= 1
        # --no-simulate: (P) everywhere, even past the limit, where the note says to simulate (the old output).
        assert p["tor_source"] == "closed" and p["tor"] == p["tor_closed"] and p["ci95"] is None
        assert (p["failure_fraction"] > FIRST_ORDER_LIMIT) == any("use `shardsafe tor simulate`" in n
                                                                  for n in p["notes"])
        assert set(p["classes"]) == {"process", "node", "rack", "slow"}
        assert math.fsum(p["breakdown"].values()) + p["tor"] == pytest.approx(1.0)
        for cc in p["classes"].values():
            assert set(cc) >= {"per_hour", "tiers", "seconds_per_event", "parts_s", "fraction", "p_no_spare",
                               "p_beyond_m"}
            assert math.fsum(cc["tiers"].values()) == pytest.approx(1.0)
    assert d["strategies"]["disk"]["interval_s"] == 1800.0
    assert d["strategies"]["shardsafe"]["tor"] > d["strategies"]["disk"]["tor"]
    assert d["recommendation"]["reached"] and d["recommendation"]["tor"] >= 0.9
    assert [r["gpus"] for r in d["sweep"]] == [1024, 16384]
    assert all(pt["tor_source"] == "closed" for r in d["sweep"] for pt in r["points"].values())
    assert d["strategies"]["memory_only"]["failure_fraction"] > FIRST_ORDER_LIMIT   # so it did keep (P) there


def test_project_command_simulates_flagged_points(capsys):
    argv = ["project", "--nodes", "64", "--rack-nodes", "8", "--spares", "8", "--rate-node", "0.02",
            "--rate-process", "0.005", "--repair-h", "10"]
    assert main([*argv, "--sim-replicas", "3", "--sim-seed", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["simulation"]["replicas"] == 3 and d["simulation"]["seed"] == 2
    src = {s: p["tor_source"] for s, p in d["strategies"].items()}
    assert "simulated" in src.values()
    for s, p in d["strategies"].items():
        assert (src[s] == "simulated") == (p["failure_fraction"] > FIRST_ORDER_LIMIT)
        assert set(p) >= {"tor", "tor_closed", "tor_source", "ci95", "ci", "simulation"}
    # The text shows the same numbers, the legend; --no-simulate is the closed form alone, as before.
    assert main([*argv, "--sim-replicas", "3", "--sim-seed", "2"]) == 0
    text = capsys.readouterr().out
    assert "* simulated: failures take > 10% of the wall time here" in text
    assert main([*argv, "--no-simulate"]) == 0
    old = capsys.readouterr().out
    assert "*" not in old and "use `shardsafe tor simulate`" in old
    for s in ("memory_only",):
        assert f"{d['strategies'][s]['tor_closed']:.4f}" in old
    assert main([*argv, "--no-simulate", "--sim-replicas", "3"]) == 2
    assert "not both" in capsys.readouterr().err


def test_project_text_and_plot(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    assert main(["project", "--profile", "meta-rsc1", "--gpus", "16384", "--plot", str(png),
                 "--sweep", "1024,8192,65536", "--sim-replicas", "2"]) == 0
    out = capsys.readouterr()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "sweep plot written" in out.err
    assert "TOR projection" in out.out and "MTBF 1.80 h" in out.out
    assert re.search(r"^\s+65536\s+8192.*\*", out.out, re.M)      # simulated there, with its error bars


def test_simulate_command_json(capsys):
    assert main(["simulate", "--nodes", "64", "--rack-nodes", "8", "--spares", "8", "--rate-node", "0.006",
                 "--rate-process", "0.002", "--replicas", "4", "--horizon-days", "2", "--strategy", "shardsafe",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schema"] == "shardsafe.tor.simulate/1" and d["rates"]["source"].startswith("flags")
    (pt,) = d["points"]
    assert pt["strategy"] == "shardsafe" and pt["ci"][0] <= pt["simulated"] <= pt["ci"][1]
    assert set(pt) >= {"closed_form", "simulated", "ci95", "delta", "within_ci", "failures_during_recovery"}


@pytest.mark.parametrize("argv, message", [
    (["project", "--profile", "nope"], "expected one of llama3"),
    (["project", "--target-tor", "2"], "expected a fraction in (0, 1)"),
    (["project", "--gpus", "128", "--group-nodes", "8", "--parity-m", "8"], "expected m < group size"),
    (["project", "--gpus", "8", "--nodes", "1"], "not both"),
    (["project", "--slowdown", "1"], "[0, 1)"),
])
def test_bad_input_is_a_message_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_rates_and_costs_files(tmp_path, capsys):
    (tmp_path / "r.json").write_text(json.dumps({"node": 0.001, "process": 0.0005}))
    (tmp_path / "bad.json").write_text(json.dumps({"nod": 0.001}))
    (tmp_path / "bench.json").write_text(json.dumps({"stall_ms_median": 12.0, "restore_s": 0.3, "model": "x"}))
    assert main(["project", "--rates", str(tmp_path / "r.json"), "--costs", str(tmp_path / "bench.json"),
                 "--json", "--no-simulate"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["rates"]["per_node_hour"]["node"] == 0.001 and d["profile"] is None
    assert d["costs"]["snapshot_stall_s"] == pytest.approx(0.012) and d["costs"]["restore_memory_s"] == 0.3
    assert main(["project", "--rates", str(tmp_path / "bad.json")]) == 2
    assert "unknown key(s) ['nod']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown key"):
        costs_from_mapping({"detect_s": 1, "detetc_s": 2}, "t")
