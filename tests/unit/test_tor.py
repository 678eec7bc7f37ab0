"""TOR accounting against hand-computed traces (docs/tor.md is the spec these numbers come from).

Every expected number below is worked out by hand in the comments from the trace's timestamps, or tallied by a
trace generator while it builds the trace; none is copied from the implementation's output.
"""
from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import os
import random
import zlib

import pytest

from shardsafe import tor
from shardsafe.tor import EventLog, RunningTor, compute_tor, read_events, report_dict, report_text
from shardsafe.tor import cli as tor_cli, events as tor_events
from shardsafe.tor.errors import TorError
from shardsafe.tor.events import NullEventLog
from shardsafe.tor.model import predict_tor, young_interval
from shardsafe.tor.records import CATEGORIES

SRC = {"job_start": "launcher", "job_end": "launcher", "attempt_start": "launcher", "attempt_end": "launcher",
       "failure_detected": "launcher", "restart": "launcher", "holder_start": "holder", "holder_stop": "holder",
       "flush": "holder", "baseline_checkpoint": "bench"}


def E(t, kind, attempt=None, rank=None, node=None, **fields):
    """One event as EventLog writes it; trainer events default to rank 0, others to no rank."""
    src = SRC.get(kind, "trainer")
    if rank is None and src == "trainer":
        rank = 0
    ev = {"t": float(t), "kind": kind, "source": src, "rank": rank, "node": node, "attempt": attempt}
    ev.update(fields)
    return ev


def iters(attempt, first, times, seconds=1.0, rank=0):
    """Iteration events: iteration first+k ends at times[k]."""
    return [E(t, "iteration", attempt, rank=rank, iteration=first + k, seconds=seconds) for k, t in enumerate(times)]


def assert_breakdown(rep, expected):
    for c in CATEGORIES:
        assert rep.breakdown[c] == pytest.approx(expected.get(c, 0.0), abs=1e-9), c
    assert math.fsum(rep.breakdown.values()) == pytest.approx(rep.t_obs - rep.t_opt, abs=1e-9)


# --------------------------------------------------------------------------------------------------------------
# Hand-computed traces
# --------------------------------------------------------------------------------------------------------------

def clean_trace():
    # startup 0..3; iterations 1..10 of 1 s; snapshot v5 stalls 0.2 s inside iteration 6, the final
    # snapshot v10 stalls 0.2 s after iteration 10; shutdown 13.4..15.2.
    ev = [E(0, "job_start"), E(1.0, "trainer_start", 0), E(2.0, "restore_end", 0, tier="none", version=None,
                                                          seconds=0.1, bytes=0),
          E(3.0, "train_ready", 0, iteration=1)]
    ev += iters(0, 1, [4, 5, 6, 7, 8])
    ev += [E(8.2, "snapshot", 0, version=5, stall_s=0.2, copy_s=0.5, bytes=100)]
    ev += iters(0, 6, [9.2, 10.2, 11.2, 12.2, 13.2])
    ev += [E(13.4, "snapshot", 0, version=10, stall_s=0.2, copy_s=0.5, bytes=100), E(15.2, "job_end", ok=True)]
    return ev


def test_clean_run():
    rep = compute_tor(clean_trace())
    assert rep.t_obs == pytest.approx(15.2)
    assert rep.iterations == 10 and rep.ideal_iteration_s == pytest.approx(1.0)
    assert rep.t_opt == pytest.approx(10.0)
    assert rep.tor == pytest.approx(10.0 / 15.2)
    # 0..3 startup (the tier-"none" restore is startup), 0.2 + 0.2 stalls, 13.4..15.2 shutdown; nothing else.
    assert_breakdown(rep, {"startup": 3.0, "snapshot_stall": 0.4, "shutdown": 1.8})
    assert rep.failures == [] and rep.mtbf is None and rep.model.optimal_interval_s is None
    assert rep.ok is True and rep.snapshots == 2


def test_clean_run_with_given_ideal_iteration_time():
    rep = compute_tor(clean_trace(), ideal_iteration_s=0.8)
    # T_opt = 10 * 0.8; the 10 iterations took 10 s, so 2 s of slowdown.
    assert rep.t_opt == pytest.approx(8.0)
    assert_breakdown(rep, {"startup": 3.0, "snapshot_stall": 0.4, "shutdown": 1.8, "slowdown": 2.0})


def one_failure_trace(*, detected=True, attempts=True):
    a0, a1 = (0, 1) if attempts else (None, None)
    ev = [E(0, "job_start"), E(0.1, "attempt_start", attempt=0), E(0.5, "trainer_start", a0),
          E(1.5, "restore_end", a0, tier="none", version=None, seconds=0.05, bytes=0),
          E(2.0, "train_ready", a0, iteration=1)]
    ev += iters(a0, 1, [3, 4, 5, 6, 7])
    ev += [E(7.5, "snapshot", a0, version=5, stall_s=0.5, copy_s=0.3, bytes=10)]
    ev += iters(a0, 6, [8.5, 9.5])
    # rank 1 dies at 10.0 (mid iteration 8); the launcher notices at 11.0
    if detected:
        ev += [E(11.0, "failure_detected", attempt=0, cause="rank_exit", rank=1, t_fault=10.0)]
    ev += [E(11.0, "attempt_end", attempt=0, rc=1, cause="rank_exit"), E(11.1, "restart", attempt=1),
           E(11.2, "attempt_start", attempt=1),
           E(13.0, "trainer_start", a1), E(13.5, "restore_start", a1),
           E(14.3, "restore_end", a1, tier="memory", version=5, seconds=0.8, bytes=10),
           E(14.5, "train_ready", a1, iteration=6)]
    ev += iters(a1, 6, [15.5, 16.5, 17.5, 18.5, 19.5])
    ev += [E(20.5, "job_end", ok=True)]
    return ev


# startup: 0..2 (launch + init) + 13..13.5 + 14.3..14.5 = 2.7; detection 10..11; restart 11..13;
# restore 13.5..14.3 from memory; attempt 0 kept iterations 1..5 (attempt 1 resumed at 6): from iteration 5's end
# (7.0) to the fault (10.0) is 3.0 s, of which 0.5 s is the stall of the kept snapshot v5 -> lost 2.5;
# shutdown 19.5..20.5. T_obs 20.5, T_opt 10 x 1.0.
ONE_FAILURE = {"startup": 2.7, "detection": 1.0, "restart": 2.0, "restore_memory": 0.8, "lost_progress": 2.5,
               "snapshot_stall": 0.5, "shutdown": 1.0}


def test_one_failure_restored_from_memory():
    rep = compute_tor(one_failure_trace())
    assert rep.t_obs == pytest.approx(20.5) and rep.t_opt == pytest.approx(10.0)
    assert rep.tor == pytest.approx(10.0 / 20.5)
    assert_breakdown(rep, ONE_FAILURE)
    assert len(rep.failures) == 1 and rep.failures[0].cause == "rank_exit" and rep.failures[0].rank == 1
    a0, a1 = rep.attempts
    assert (a0.failed, a0.kept_iterations, a0.lost_iterations) == (True, 5, 2)
    assert (a1.failed, a1.restore_tier, a1.restore_version, a1.resume_iteration) == (False, "memory", 5, 6)
    assert rep.lost_spans == [(7.0, 10.0)]
    assert rep.mtbf == pytest.approx(20.5)


def test_attempt_numbers_inferred_when_missing():
    # Same trace, no attempt field on trainer events: attempts are split at detected failures.
    rep = compute_tor(one_failure_trace(attempts=False))
    assert_breakdown(rep, ONE_FAILURE)
    assert [a.failed for a in rep.attempts] == [True, False]


def test_failure_without_failure_detected_is_inferred_from_attempt_end():
    rep = compute_tor(one_failure_trace(detected=False))
    # No t_fault: attempt 0 counts as training until attempt_end at 11.0: lost 11 - 7 - 0.5 = 3.5, no detection.
    expected = dict(ONE_FAILURE, detection=0.0, lost_progress=3.5)
    assert_breakdown(rep, expected)
    assert len(rep.failures) == 1 and rep.failures[0].synthesized and rep.failures[0].cause == "rank_exit"
    assert any("failure_detected" in w for w in rep.warnings)


def test_fault_time_from_the_injectors_fault_injected_event():
    ev = one_failure_trace()
    ev = [dict(e, t_fault=None) if e["kind"] == "failure_detected" else e for e in ev]
    # ranks 1 and 3 die (1 first); a stale injection record from before is not this failure's
    ev += [E(10.0, "fault_injected", 0, rank=1, fault="kill", step=8, t_fault=10.0),
           E(10.2, "fault_injected", 0, rank=3, fault="kill", step=8, t_fault=10.2)]
    rep = compute_tor(ev)
    assert rep.failures[0].t_fault == 10.0
    assert_breakdown(rep, ONE_FAILURE)


def test_train_ready_off_by_one_is_flagged_and_the_iteration_events_win():
    ev = [dict(e, iteration=e["iteration"] - 1) if e["kind"] == "train_ready" else e for e in one_failure_trace()]
    rep = compute_tor(ev)
    assert rep.iterations == 10
    assert_breakdown(rep, ONE_FAILURE)
    assert any("train_ready" in w for w in rep.warnings)


def test_duplicate_reports_of_one_incident_count_once():
    ev = one_failure_trace()
    ev.append(E(11.05, "failure_detected", attempt=0, cause="rank_exit", rank=1, t_fault=10.0))  # 2nd launcher
    rep = compute_tor(ev)
    assert len(rep.failures) == 1
    assert_breakdown(rep, ONE_FAILURE)


def test_multi_rank_events_use_the_slowest_rank():
    ev = [E(0, "job_start"), E(0, "trainer_start", 0, rank=0), E(0.02, "trainer_start", 0, rank=1),
          E(1.0, "train_ready", 0, rank=0, iteration=1), E(1.05, "train_ready", 0, rank=1, iteration=1)]
    ev += iters(0, 1, [2.0, 3.0, 4.0], seconds=1.0, rank=0) + iters(0, 1, [2.15, 3.25, 4.35], seconds=1.1, rank=1)
    ev += [E(5.0, "job_end", ok=True)]
    rep = compute_tor(ev)
    # The job is ready when its last rank is (1.05) and an iteration takes its slowest rank's 1.1 s.
    assert rep.ideal_iteration_s == pytest.approx(1.1) and rep.t_opt == pytest.approx(3.3)
    assert_breakdown(rep, {"startup": 1.05, "shutdown": 0.65})


def test_ranks_taking_turns_to_be_late_are_not_counted_twice():
    """Ranks that meet in collectives take turns being late: the one that finished iteration i-1 early
    reports the wait as part of i. The largest seconds per iteration (1.05 + 1.0 + 1.1) would exceed the
    3.05 s the iterations took; an iteration never takes the job longer than the gap between its completion
    and the previous one's (or the job being ready)."""
    ev = [E(0, "job_start"), E(0, "trainer_start", 0, rank=0), E(0.02, "trainer_start", 0, rank=1),
          E(1.0, "train_ready", 0, rank=0, iteration=1), E(1.05, "train_ready", 0, rank=1, iteration=1)]
    ev += iters(0, 1, [2.0, 3.0, 4.0], seconds=1.0, rank=0)
    ev += [E(t, "iteration", 0, rank=1, iteration=i, seconds=s) for i, t, s in [(1, 2.1, 1.05), (2, 3.0, 0.9),
                                                                              (3, 4.1, 1.1)]]
    ev += [E(5.0, "job_end", ok=True)]
    rep = compute_tor(ev)
    # job: ready 1.05, iterations end 2.1, 3.0, 4.1 -> 1.05, 0.9, 1.1 s; t_iter = median 1.05
    assert rep.ideal_iteration_s == pytest.approx(1.05) and rep.t_opt == pytest.approx(3.15)
    assert_breakdown(rep, {"startup": 1.05, "slowdown": -0.1, "shutdown": 0.9})


def test_overlapping_failures_second_during_restart():
    ev = [E(0, "job_start"), E(0, "trainer_start", 0), E(1.0, "train_ready", 0, iteration=1)]
    ev += iters(0, 1, [2, 3, 4, 5])
    ev += [E(3.0, "snapshot", 0, version=2, stall_s=0.0, copy_s=0.1, bytes=1),
           E(5.0, "snapshot", 0, version=4, stall_s=0.0, copy_s=0.1, bytes=1),
           E(6.0, "failure_detected", attempt=0, cause="node_loss", node="n1", t_fault=5.5),
           E(6.5, "attempt_start", attempt=1),
           # while attempt 1 is being launched, a second node dies
           E(8.0, "failure_detected", attempt=1, cause="node_loss", node="n2", t_fault=7.0),
           E(10.0, "trainer_start", 2), E(10.5, "restore_start", 2),
           E(11.5, "restore_end", 2, tier="parity", version=4, seconds=1.0, bytes=1),
           E(12.0, "train_ready", 2, iteration=5)]
    ev += iters(2, 5, [13, 14, 15, 16])
    ev += [E(17.0, "job_end", ok=True)]
    rep = compute_tor(ev)
    # detection 5.5..6 and 7..8; restart 6..7 and 8..10; startup 0..1, 10..10.5, 11.5..12; restore 10.5..11.5;
    # lost: iteration 4 ended at 5.0, fault at 5.5; shutdown 16..17. T_opt = 8 x 1.
    assert rep.t_opt == pytest.approx(8.0) and rep.t_obs == pytest.approx(17.0)
    assert_breakdown(rep, {"startup": 2.0, "detection": 1.5, "restart": 3.0, "restore_parity": 1.0,
                           "lost_progress": 0.5, "shutdown": 1.0})
    assert len(rep.failures) == 2 and rep.mtbf == pytest.approx(8.5)


def test_second_fault_at_the_instant_of_the_first_detection_is_detection():
    ev = [E(0, "job_start"), E(0, "trainer_start", 0), E(1.0, "train_ready", 0, iteration=1)]
    ev += iters(0, 1, [2, 3])
    ev += [E(3.0, "snapshot", 0, version=2, stall_s=0.0, copy_s=0.1, bytes=1),
           E(4.0, "failure_detected", attempt=0, cause="rank_exit", rank=0, t_fault=3.5),
           E(6.0, "failure_detected", attempt=1, cause="node_loss", node="n2", t_fault=4.0),
           E(7.0, "trainer_start", 2), E(7.0, "restore_end", 2, tier="parity", version=2, seconds=0.0, bytes=1),
           E(7.0, "train_ready", 2, iteration=3)]
    ev += iters(2, 3, [8]) + [E(8.0, "job_end", ok=True)]
    rep = compute_tor(ev)
    # The fault at 4.0 coincides with the first detection: a fault wins ties, so 3.5..6 is all detection and
    # restart is 6..7. lost 3..3.5; startup 0..1.
    assert_breakdown(rep, {"startup": 1.0, "detection": 2.5, "restart": 1.0, "lost_progress": 0.5})


def test_restore_time_is_the_slowest_ranks_restore_end_seconds():
    ev = [E(0, "job_start"), E(0, "trainer_start", 0), E(1.0, "train_ready", 0, iteration=1)]
    ev += iters(0, 1, [2, 3])
    ev += [E(3.0, "snapshot", 0, version=2, stall_s=0.0, copy_s=0.1, bytes=1),
           E(4.0, "failure_detected", attempt=0, cause="node_loss", node="n1", t_fault=3.5),
           E(5.0, "trainer_start", 1, rank=0), E(5.1, "trainer_start", 1, rank=1),
           E(5.2, "restore_start", 1, rank=0), E(5.3, "restore_start", 1, rank=1),
           # rank 0 reads its own holder; rank 1 lived on the lost node and rebuilds from parity, slower
           E(5.9, "restore_end", 1, rank=0, tier="memory", version=2, seconds=0.7, bytes=1),
           E(6.5, "restore_end", 1, rank=1, tier="parity", version=2, seconds=1.1, bytes=1),
           E(6.6, "train_ready", 1, rank=0, iteration=3), E(6.7, "train_ready", 1, rank=1, iteration=3)]
    ev += iters(1, 3, [7.7, 8.7]) + [E(9.0, "job_end", ok=True)]
    rep = compute_tor(ev)
    # Restore: the last rank's restore_end (6.5) minus its seconds (1.1) -> 5.4..6.5, from parity.
    # startup 0..1 + 5..5.4 + 6.5..6.7 = 1.6; detection 0.5; restart 4..5; lost 3..3.5; shutdown 8.7..9.
    assert_breakdown(rep, {"startup": 1.6, "restore_parity": 1.1, "detection": 0.5, "restart": 1.0,
                           "lost_progress": 0.5, "shutdown": 0.3})
    assert rep.attempts[1].restore_tier == "parity"


def restore_failure_trace(tier_hint=None):
    ev = [E(0, "job_start"), E(0, "trainer_start", 0), E(1.0, "train_ready", 0, iteration=1)]
    ev += iters(0, 1, [2, 3, 4])
    ev += [E(4.2, "snapshot", 0, version=3, stall_s=0.2, copy_s=0.1, bytes=1)]
    ev += iters(0, 4, [5.2, 6.2, 7.2])
    ev += [E(8.0, "failure_detected", attempt=0, cause="rank_exit", rank=0, t_fault=7.7),
           E(9.0, "trainer_start", 1),
           E(9.5, "restore_start", 1, **({"tier": tier_hint} if tier_hint else {})),
           # the holder of node n3 dies while attempt 1 restores
           E(11.0, "failure_detected", attempt=1, cause="node_loss", node="n3", t_fault=10.5),
           E(12.0, "trainer_start", 2), E(12.2, "restore_start", 2),
           E(13.2, "restore_end", 2, tier="parity", version=3, seconds=1.0, bytes=1),
           E(13.5, "train_ready", 2, iteration=4)]
    ev += iters(2, 4, [14.5, 15.5, 16.5, 17.5, 18.5])
    ev += [E(19.0, "job_end", ok=True)]
    return ev


# attempt 0 keeps 1..3 (attempt 2 resumes at 4): lost = fault 7.7 - iteration 3's end 4.0 - kept stall 0.2 = 3.5;
# startup 0..1 + 9..9.5 + 12..12.2 + 13.2..13.5 = 2.0; aborted restore 9.5..10.5 = 1.0; detection 0.3 + 0.5;
# restart 8..9 + 11..12; restore of attempt 2: 1.0 from parity; shutdown 18.5..19. T_opt = 8.
RESTORE_FAILURE = {"startup": 2.0, "detection": 0.8, "restart": 2.0, "lost_progress": 3.5, "snapshot_stall": 0.2,
                   "shutdown": 0.5}


def test_failure_during_restore_charged_to_the_tier_used_next():
    rep = compute_tor(restore_failure_trace())
    assert rep.t_opt == pytest.approx(8.0)
    assert_breakdown(rep, dict(RESTORE_FAILURE, restore_parity=2.0))
    assert [a.failed for a in rep.attempts] == [True, True, False]


def test_failure_during_restore_charged_to_the_tier_it_was_trying():
    rep = compute_tor(restore_failure_trace(tier_hint="memory"))
    assert_breakdown(rep, dict(RESTORE_FAILURE, restore_memory=1.0, restore_parity=1.0))


def test_fail_slow_period_is_slowdown():
    s = [1, 1, 1, 3, 3, 3, 3, 1, 1, 1]
    t, ends = 1.0, []
    for x in s:
        t += x
        ends.append(t)
    ev = [E(0, "job_start"), E(0, "trainer_start", 0), E(1.0, "train_ready", 0, iteration=1)]
    ev += [E(te, "iteration", 0, iteration=k + 1, seconds=x) for k, (te, x) in enumerate(zip(ends, s))]
    ev += [E(ends[-1] + 0.5, "job_end", ok=True)]
    rep = compute_tor(ev)
    # median of six 1 s and four 3 s iterations is 1 s; the slow four cost 4 x 2 s.
    assert rep.ideal_iteration_s == pytest.approx(1.0)
    assert rep.t_obs == pytest.approx(19.5) and rep.t_opt == pytest.approx(10.0)
    assert_breakdown(rep, {"startup": 1.0, "slowdown": 8.0, "shutdown": 0.5})
    assert rep.model.slowdown_fraction == pytest.approx(8.0 / 19.5)


def persistent_fallback_trace():
    ev = [E(0, "job_start"), E(0, "trainer_start", 0), E(1.0, "train_ready", 0, iteration=1)]
    t, times = 1.0, {}
    for i in range(1, 11):
        t += 1.0
        ev.append(E(t, "iteration", 0, iteration=i, seconds=1.0))
        times[i] = t
        if i % 2 == 0 and i <= 8:
            t += 0.1
            ev.append(E(t, "snapshot", 0, version=i, stall_s=0.1, copy_s=0.05, bytes=1))
    assert times[10] == pytest.approx(11.4)
    ev += [E(12.4, "failure_detected", attempt=0, cause="node_loss", node="n1,n2", t_fault=11.9),
           E(13.0, "trainer_start", 1), E(13.5, "restore_start", 1),
           E(16.0, "restore_end", 1, tier="persistent", version=4, seconds=2.5, bytes=1),
           E(16.5, "train_ready", 1, iteration=5)]
    ev += iters(1, 5, [17.5 + k for k in range(8)])
    ev += [E(25.0, "job_end", ok=True)]
    return ev


def test_lost_progress_after_fallback_to_an_older_persistent_version():
    rep = compute_tor(persistent_fallback_trace())
    # Two nodes lost: only version 4 survives on disk. Attempt 0 keeps 1..4 (iteration 4 ends 5.1); its v4 stall
    # (5.1..5.2) counts, v6 and v8 stalls were lost work: lost = 11.9 - 5.1 - 0.1 = 6.7; stall = v2 + v4 = 0.2.
    # startup 0..1 + 13..13.5 + 16..16.5; restore 2.5; detection 11.9..12.4; restart 12.4..13; shutdown 24.5..25.
    assert rep.iterations == 12 and rep.t_opt == pytest.approx(12.0) and rep.t_obs == pytest.approx(25.0)
    assert_breakdown(rep, {"startup": 2.0, "restore_persistent": 2.5, "detection": 0.5, "restart": 0.6,
                           "lost_progress": 6.7, "snapshot_stall": 0.2, "shutdown": 0.5})
    a0 = rep.attempts[0]
    assert (a0.kept_iterations, a0.lost_iterations) == (4, 6)


def test_job_that_gives_up_after_a_failure():
    ev = [E(0, "job_start"), E(0, "trainer_start", 0), E(1.0, "train_ready", 0, iteration=1)]
    ev += iters(0, 1, [2, 3, 4])
    ev += [E(5.0, "failure_detected", attempt=0, cause="hang", t_fault=4.5), E(6.0, "job_end", ok=False)]
    rep = compute_tor(ev)
    # Nothing re-executed the iterations: all 3 count; 4..4.5 is the half-done iteration 4 (lost);
    # 4.5..5 detection; after detection nothing restarted: shutdown 5..6.
    assert rep.t_opt == pytest.approx(3.0) and rep.ok is False
    assert_breakdown(rep, {"startup": 1.0, "lost_progress": 0.5, "detection": 0.5, "shutdown": 1.0})


# --------------------------------------------------------------------------------------------------------------
# Seeded random traces: the generator tallies where its time went while it builds the trace
# --------------------------------------------------------------------------------------------------------------

def random_trace(seed):
    rng = random.Random(seed)
    ev, exp = [], {c: 0.0 for c in CATEGORIES}
    n_fail = 0
    t = 0.0
    ev.append(E(t, "job_start"))
    t += rng.uniform(0.1, 0.5)
    exp["startup"] += t
    interval = rng.randint(2, 5)
    target = rng.randint(15, 40)
    committed, resume, attempt = 0, 1, 0
    kept_s = {}  # iteration -> seconds of its kept execution
    fails_left = rng.randint(0, 3)
    while True:
        ev.append(E(t, "trainer_start", attempt))
        d = rng.uniform(0.2, 1.0)
        t += d
        exp["startup"] += d
        fault = None
        if attempt > 0:
            tier = rng.choice(tor_events.TIERS)
            ev.append(E(t, "restore_start", attempt, tier=tier))
            d = rng.uniform(0.1, 2.0)
            if fails_left and rng.random() < 0.2:  # dies while restoring
                fault = t + d * rng.random()
                exp["restore_" + tier] += fault - t
            else:
                t += d
                exp["restore_" + tier] += d
                ev.append(E(t, "restore_end", attempt, tier=tier, version=committed, seconds=d, bytes=1))
        if fault is None:
            d = rng.uniform(0.0, 0.3)
            t += d
            exp["startup"] += d
            ev.append(E(t, "train_ready", attempt, iteration=resume))
            fault_after = rng.randint(resume, target + 3) if fails_left else None
            t_keep_end = t  # where this attempt's kept work ends
            execs = {}
            i = resume
            while i <= target:
                s = rng.uniform(0.8, 1.2) if rng.random() > 0.1 else rng.uniform(2.0, 3.0)  # some fail-slow
                t += s
                ev.append(E(t, "iteration", attempt, iteration=i, seconds=s))
                execs[i] = s
                if i % interval == 0:
                    st = rng.uniform(0.0, 0.2)
                    t += st
                    ev.append(E(t, "snapshot", attempt, version=i, stall_s=st, copy_s=0.1, bytes=1))
                    exp["snapshot_stall"] += st
                    committed = i
                    t_keep_end = t
                if fault_after is not None and i >= fault_after:
                    break
                i += 1
            else:
                fault_after = None  # reached the target: this attempt finishes the job
            if fault_after is None:
                kept_s.update(execs)
                d = rng.uniform(0.1, 1.0)
                ev.append(E(t + d, "job_end", ok=True))
                exp["shutdown"] += d
                return ev, exp, kept_s, n_fail
            fault = t + rng.uniform(0.0, 0.5) * rng.random()
            kept_s.update({k: v for k, v in execs.items() if k <= committed})
            exp["lost_progress"] += fault - t_keep_end
        # detection and restart, possibly with a second failure while restarting
        fails_left -= 1
        n_fail += 1
        detect = fault + rng.uniform(0.0, 1.0)
        exp["detection"] += detect - fault
        ev.append(E(detect, "failure_detected", attempt=attempt, cause="rank_exit", rank=0, t_fault=fault))
        restart_end = detect + rng.uniform(0.5, 2.0)
        if fails_left and rng.random() < 0.3:
            f2 = rng.uniform(detect, restart_end)
            d2 = f2 + rng.uniform(0.1, 1.0)
            exp["restart"] += f2 - detect
            exp["detection"] += d2 - f2
            ev.append(E(d2, "failure_detected", attempt=attempt, cause="node_loss", node="n9", t_fault=f2))
            fails_left -= 1
            n_fail += 1
            detect, restart_end = d2, d2 + rng.uniform(0.5, 2.0)
        exp["restart"] += restart_end - detect
        t = restart_end
        attempt += 1
        resume = committed + 1


@pytest.mark.parametrize("seed", range(40))
def test_random_traces_match_the_generators_tally(seed):
    ev, exp, kept_s, n_fail = random_trace(seed)
    random.Random(seed).shuffle(ev)  # order in the file must not matter
    rep = compute_tor(ev, ideal_iteration_s=1.0)
    n = max(kept_s)
    assert sorted(kept_s) == list(range(1, n + 1))
    assert rep.iterations == n and rep.t_opt == pytest.approx(n * 1.0)
    exp["slowdown"] = math.fsum(kept_s.values()) - n * 1.0
    assert_breakdown(rep, exp)
    assert len(rep.failures) == n_fail
    assert math.fsum(s.t1 - s.t0 for s in rep.segments) == pytest.approx(rep.t_obs, abs=1e-9)
    assert rep.tor == pytest.approx(rep.t_opt / rep.t_obs)


# --------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------

def test_young_interval_and_model_equation():
    assert young_interval(2.0, 100.0) == pytest.approx(20.0)  # sqrt(2 * 2 * 100)
    # tau 10, C 1, M 100, R 5, f 0.1, s 0.05: (1 - 0.1 - 0.05 - (5 + 5)/100) * 10/11
    assert predict_tor(interval_s=10, snapshot_cost_s=1, mtbf_s=100, recovery_s=5, fixed_fraction=0.1,
                       slowdown_fraction=0.05) == pytest.approx(0.75 * 10 / 11)
    assert predict_tor(interval_s=10, snapshot_cost_s=0, mtbf_s=None) == pytest.approx(1.0)
    assert predict_tor(interval_s=100, snapshot_cost_s=0, mtbf_s=10, recovery_s=50) == 0.0  # clamped
    with pytest.raises(ValueError, match="mtbf_s"):
        young_interval(1.0, 0.0)


def test_model_for_one_failure_run():
    ev = one_failure_trace() + [E(20.6, "baseline_checkpoint", save_s=2.0, load_s=3.0)]
    ev[-2], ev[-1] = ev[-1], ev[-2]  # keep job_end last
    rep = compute_tor(ev, snapshot_interval=5)
    m = rep.model
    # M = 20.5 (one failure). one-time: startup before the fault 2.0 + shutdown 1.0 = 3.0.
    # per failure: detection 1 + restart 2 + startup 0.7 + restore 0.8 = 4.5. tau = 5 x 1 s; C = 0.5 (one snapshot).
    assert m.mtbf_s == pytest.approx(20.5) and m.fixed_s == pytest.approx(3.0)
    assert m.recovery_s == pytest.approx({"detection": 1.0, "restart": 2.0, "startup": 0.7, "restore": 0.8})
    assert m.snapshot_cost_s == pytest.approx(0.5) and m.snapshot_interval_s == pytest.approx(5.0)
    assert rep.predicted_tor == pytest.approx((1 - 3 / 20.5 - (4.5 + 2.5) / 20.5) * 5 / 5.5)
    opt = math.sqrt(2 * 0.5 * 20.5)
    assert rep.optimal_interval == pytest.approx(opt) and m.optimal_interval_iterations == 5
    assert m.predicted_tor_at_optimal == pytest.approx((1 - 3 / 20.5 - (4.5 + opt / 2) / 20.5) * opt / (opt + 0.5))
    # Baseline: same recovery but a 3 s disk load instead of the 0.8 s restore; its own Young interval.
    tb = math.sqrt(2 * 2.0 * 20.5)
    assert m.baseline_interval_s == pytest.approx(tb) and m.baseline_source == "events"
    assert rep.baseline_tor == pytest.approx((1 - 3 / 20.5 - (4.5 - 0.8 + 3.0 + tb / 2) / 20.5) * tb / (tb + 2.0))
    # arguments override the events
    rep2 = compute_tor(ev, snapshot_interval=5, ckpt_save_s=8.0, ckpt_load_s=3.0)
    tb = math.sqrt(2 * 8.0 * 20.5)
    assert rep2.baseline_tor == pytest.approx((1 - 3 / 20.5 - (6.7 + tb / 2) / 20.5) * tb / (tb + 8.0))
    assert rep2.model.baseline_source == "arguments"


def test_model_interval_from_snapshot_versions_and_given_mtbf():
    rep = compute_tor(clean_trace(), mtbf_s=1000.0, ckpt_save_s=4.0, ckpt_load_s=4.0)
    m = rep.model
    # snapshots at versions 5 and 10 -> interval 5 it = 5 s; C = 0.2; no failure: recovery 0 (noted).
    # one-time: startup 3 + shutdown 1.8 = 4.8 of 15.2.
    assert m.snapshot_interval_iterations == 5 and m.snapshot_cost_s == pytest.approx(0.2)
    f = 4.8 / 15.2
    assert rep.predicted_tor == pytest.approx((1 - f - 2.5 / 1000) * 5 / 5.2)
    assert rep.optimal_interval == pytest.approx(math.sqrt(2 * 0.2 * 1000))
    tb = math.sqrt(2 * 4.0 * 1000)
    assert rep.baseline_tor == pytest.approx((1 - f - (4.0 + tb / 2) / 1000) * tb / (tb + 4.0))
    assert any("no failures" in n for n in m.notes)


def test_no_failures_means_no_mtbf_interval_or_baseline():
    rep = compute_tor(clean_trace(), ckpt_save_s=4.0, ckpt_load_s=4.0)
    assert rep.mtbf is None and rep.optimal_interval is None and rep.baseline_tor is None
    assert rep.predicted_tor == pytest.approx((1 - 4.8 / 15.2) * 5 / 5.2)


def test_options_are_checked():
    with pytest.raises(ValueError, match="ideal_iteration_s"):
        compute_tor(clean_trace(), ideal_iteration_s=0)
    with pytest.raises(ValueError, match="snapshot_interval"):
        compute_tor(clean_trace(), snapshot_interval=0)
    with pytest.raises(TorError, match="no events"):
        compute_tor([])


# --------------------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------------------

def test_report_dict_shape_and_json():
    rep = compute_tor(one_failure_trace(), snapshot_interval=5, ckpt_save_s=2.0, ckpt_load_s=3.0)
    d = json.loads(json.dumps(report_dict(rep), allow_nan=False))
    for k in ("tor", "t_opt", "t_obs", "breakdown", "mtbf", "predicted_tor", "optimal_interval", "baseline_tor",
              "failures", "attempts", "segments", "warnings"):
        assert k in d, k
    assert list(d["breakdown"]) == list(CATEGORIES)
    assert sum(d["breakdown"].values()) == pytest.approx(d["t_obs"] - d["t_opt"], abs=1e-5)
    assert d["tor"] == pytest.approx(10 / 20.5, abs=1e-6)
    assert set(d["optimal_interval"]) == {"seconds", "iterations", "predicted_tor"}
    assert d["failures"][0]["t_fault"] == pytest.approx(10.0) and d["failures"][0]["t_detect"] == pytest.approx(11.0)
    # launch (no attempt yet), then attempt 0's own startup
    assert d["segments"][:2] == [[0.0, 0.5, "startup", None], [0.5, 2.0, "startup", 0]]


def test_report_text_names_every_category():
    text = report_text(compute_tor(one_failure_trace(), snapshot_interval=5))
    for c in CATEGORIES:
        assert c in text
    assert "TOR" in text and "0.4878" in text  # 10 / 20.5


def test_plot_file_written_and_non_trivial(tmp_path):
    ev = one_failure_trace() + [E(12.0, "flush", version=5, seconds=0.4, bytes=10)]
    rep = compute_tor(ev)
    from shardsafe.tor.plot import plot_timeline
    out = plot_timeline(ev, rep, tmp_path / "timeline.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import matplotlib.image as mpimg
    img = mpimg.imread(str(out))
    assert img.shape[0] > 400 and img.shape[1] > 800
    colors = {tuple(px) for px in img.reshape(-1, img.shape[-1])[::97].round(2).tolist()}
    assert len(colors) > 20


# --------------------------------------------------------------------------------------------------------------
# Event log
# --------------------------------------------------------------------------------------------------------------

def test_emit_writes_one_json_line_with_the_envelope(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("SHARDSAFE_ATTEMPT", "2")
    monkeypatch.setenv("SHARDSAFE_NODE", "n7")
    log = EventLog(tmp_path / "run", source="trainer")
    assert log.emit("iteration", iteration=5, seconds=0.25)
    launcher = EventLog(tmp_path / "run", source="launcher", attempt=1)
    assert launcher.emit("failure_detected", cause="node_loss", node="n2", rank=4, t_fault=1.5)
    lines = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    a, b = (json.loads(x) for x in lines)
    assert (a["kind"], a["source"], a["rank"], a["node"], a["attempt"], a["iteration"], a["seconds"]) == \
        ("iteration", "trainer", 3, "n7", 2, 5, 0.25)
    assert (b["source"], b["rank"], b["node"], b["attempt"], b["cause"]) == ("launcher", 4, "n2", 1, "node_loss")
    assert abs(a["t"] - b["t"]) < 60
    assert tor.check_event(a) == [] and tor.check_event(b) == []
    assert any("seconds" in p for p in tor.check_event({"t": 1.0, "kind": "iteration", "source": "trainer",
                                                         "iteration": 1}))
    assert any("tier" in p for p in tor.check_event(dict(a, kind="restore_end", tier="ram", version=1,
                                                         seconds=1.0, bytes=1)))
    with pytest.raises(ValueError, match="source"):
        EventLog(tmp_path, source="worker")


def test_foreign_values_do_not_break_the_accounting():
    ev = one_failure_trace()
    ev.append(E(11.0, "failure_detected", attempt=[0], cause={"x": 1}, node=["n1"]))  # wrong types
    ev.append(E(3.5, "iteration", 0, iteration="seven", seconds=1.0))  # unusable: skipped
    rep = compute_tor(ev)
    assert len(rep.failures) == 2
    assert math.fsum(rep.breakdown.values()) == pytest.approx(rep.t_obs - rep.t_opt, abs=1e-9)


def test_emit_sanitises_and_truncates(tmp_path):
    log = EventLog(tmp_path, source="bench", rank=0)
    assert log.emit("baseline_checkpoint", save_s=float("nan"), load_s=1.0, t=5)  # t is reserved: dropped
    assert log.emit("snapshot_skipped", version=3, reason="x" * 10_000, detail="y" * 100)
    raw = (tmp_path / "events.jsonl").read_bytes().split(b"\n")
    assert all(len(x) + 1 <= tor_events.MAX_LINE_BYTES for x in raw)
    a, b = (json.loads(x) for x in raw if x)
    assert a["save_s"] is None and a["t"] != 5
    assert b["version"] == 3 and "reason" not in b and b["truncated"] == ["reason"] and b["detail"] == "y" * 100


def test_emit_never_raises_and_warns_once(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = EventLog(blocker / "run", source="trainer", rank=0)  # a directory under a regular file: ENOTDIR
    with caplog.at_level(logging.WARNING, logger="shardsafe.tor"):
        assert log.emit("iteration", iteration=1, seconds=1.0) is False
        assert log.emit("iteration", iteration=2, seconds=1.0) is False
    assert len([r for r in caplog.records if "cannot append" in r.getMessage()]) == 1


def test_short_write_is_terminated_and_the_log_recovers(tmp_path, monkeypatch):
    log = EventLog(tmp_path, source="trainer", rank=0, attempt=0)
    real_write = os.write
    calls = []

    def half_write(fd, data):  # the disk fills up mid-line once
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, data[: len(data) // 2])
        return real_write(fd, data)

    monkeypatch.setattr(tor_events.os, "write", half_write)
    assert log.emit("iteration", iteration=1, seconds=1.0) is False
    assert log.emit("iteration", iteration=2, seconds=1.0) is True
    assert [e["iteration"] for e in read_events(tmp_path)] == [2]  # the torn line ended with its own newline


def test_read_events_tolerates_a_torn_last_line(tmp_path):
    log = EventLog(tmp_path, source="trainer", rank=0, attempt=0)
    for i in range(3):
        log.emit("iteration", iteration=i, seconds=1.0)
    with open(tmp_path / "events.jsonl", "ab") as fh:
        fh.write(b'{"t": 1.0, "kind": "iterat')  # writer killed mid-line
    evs = read_events(tmp_path)
    assert [e["iteration"] for e in evs] == [0, 1, 2]
    # a garbage line in the middle is skipped too, and the file path works as well as the directory
    with open(tmp_path / "events.jsonl", "ab") as fh:
        fh.write(b'\n{"t": 2.0, "kind": "iteration", "iteration": 9, "seconds": 1}\n')
    assert [e["iteration"] for e in read_events(tmp_path / "events.jsonl")] == [0, 1, 2, 9]
    with pytest.raises(FileNotFoundError, match="events.jsonl"):
        read_events(tmp_path / "missing")


def _writer(run_dir, wid, n):
    log = EventLog(run_dir, source="trainer", rank=wid, attempt=0)
    rng = random.Random(wid)
    for k in range(n):
        payload = "".join(chr(97 + (wid + k) % 26) for _ in range(rng.randint(1, 3500)))
        log.emit("snapshot_skipped", version=k, reason=payload, crc=zlib.crc32(payload.encode()))
    os._exit(0)


def test_concurrent_appends_from_forked_processes_give_whole_lines(tmp_path):
    ctx = mp.get_context("fork")
    n_proc, n_ev = 4, 150
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, n_ev)) for w in range(n_proc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    lines = (tmp_path / "events.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b""
    seen = {w: [] for w in range(n_proc)}
    for line in lines[:-1]:
        ev = json.loads(line)  # raises on any interleaved or torn line
        assert zlib.crc32(ev["reason"].encode()) == ev["crc"]
        seen[ev["rank"]].append(ev["version"])
    assert all(v == list(range(n_ev)) for v in seen.values())


# --------------------------------------------------------------------------------------------------------------
# Running TOR and the CLI
# --------------------------------------------------------------------------------------------------------------

def test_running_tor(tmp_path):
    boot = EventLog(tmp_path, source="launcher")
    boot.emit("job_start")
    job_t = read_events(tmp_path)[0]["t"]
    now = [job_t + 10.0]
    log = EventLog(tmp_path, source="trainer", rank=0, attempt=0)
    rt = RunningTor(log, every=2, ideal_iteration_s=1.0, first_iteration=1, clock=lambda: now[0])
    assert rt.job_start_t == job_t  # found in the log
    assert rt.update(1, 1.0) is None  # window starts at job_t + 9 (iteration 1 began then)
    now[0] = job_t + 12.0
    # 2 iterations x 1 s ideal over 12 s since job start; window: 2 iterations in 3 s
    assert rt.update(2, 2.0) == pytest.approx(2 / 12)
    ev = [e for e in read_events(tmp_path) if e["kind"] == "running_tor"]
    assert len(ev) == 1 and ev[0]["tor"] == pytest.approx(2 / 12) and ev[0]["window_tor"] == pytest.approx(2 / 3)


def test_running_tor_without_a_run_directory_logs_nothing_and_never_raises():
    """A trainer started without SHARDSAFE_RUN_DIR (plain torchrun) has a NullEventLog: the running TOR has no log
    head to read and writes nothing, and training goes on (it used to open(None) at construction)."""
    now = [100.0]
    rt = RunningTor(NullEventLog(), every=1, ideal_iteration_s=1.0, clock=lambda: now[0])
    now[0] = 102.0
    rt.update(1, 1.0)
    assert rt.update(2, 1.0) is not None   # computed, though there is nowhere to log it


def test_cli_json_prints_exactly_one_object(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in one_failure_trace()))
    plot = tmp_path / "t.png"
    rc = tor_cli.main(["report", str(tmp_path), "--json", "--plot", str(plot), "--ckpt-save-s", "2",
                   "--ckpt-load-s", "3", "--snapshot-interval", "5"])
    out = capsys.readouterr().out
    assert rc == 0 and plot.stat().st_size > 10_000
    d = json.loads(out)  # one object, nothing else on stdout
    assert d["tor"] == pytest.approx(10 / 20.5, abs=1e-6) and d["baseline_tor"] is not None
    assert tor_cli.main(["report", str(tmp_path)]) == 0
    assert "restore_memory" in capsys.readouterr().out


def test_cli_errors_and_registration(tmp_path, capsys):
    assert tor_cli.main(["report", str(tmp_path / "nope")]) == 2
    assert "events.jsonl" in capsys.readouterr().err
    import argparse
    parser = argparse.ArgumentParser(prog="shardsafe")
    register = parser.add_subparsers(dest="command")
    tor.register_cli(register)
    args = parser.parse_args(["tor", "report", "RUN", "--ideal-iteration-s", "0.5"])
    assert args.func is not None and args.ideal_iteration_s == 0.5 and args.run_dir == "RUN"
    with pytest.raises(SystemExit):
        parser.parse_args(["tor", "report", "RUN", "--ideal-iteration-s", "abc"])


def test_by_class_of_one_failure_matches_the_breakdown():
    # The one failure was restored from memory: its parts are the breakdown's recovery categories after the
    # fault (startup 13..13.5 + 14.3..14.5 = 0.7; lost 2.5, not the 3.0 s lost span, which holds the kept stall).
    rep = compute_tor(one_failure_trace())
    assert set(rep.by_class) == {"memory"}
    got = rep.by_class["memory"]
    assert got["failures"] == 1
    for k, v in {"detection": 1.0, "restart": 2.0, "startup": 0.7, "restore": 0.8, "lost_progress": 2.5}.items():
        assert got[k] == pytest.approx(v), k
    assert got["seconds"] == pytest.approx(7.0)
    assert report_dict(rep)["by_class"]["memory"]["lost_progress"] == pytest.approx(2.5)
