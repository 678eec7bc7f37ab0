"""Protection is never silent (shardsafe/protection.py): the state each rank keeps, what rank 0 says and how often,
the TOR events, ``on_unprotected: fail``, and the start-time budget check."""
import logging

import pytest

from shardsafe.protection import (Cause, Protection, UnprotectedError, bits_to_causes, budget_problem,
                                  causes_to_bits, stale_after)
from shardsafe.snapshot.pipeline import GlooAgreement, LocalAgreement


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(rank=0, interval=1, on_unprotected="warn", warn_interval_s=60.0):
    events, clock = [], Clock()
    p = Protection(rank=rank, interval=interval, on_unprotected=on_unprotected, warn_interval_s=warn_interval_s,
                   emit=lambda kind, **f: events.append((kind, f)), clock=clock)
    return p, events, clock


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "NOT protected" in r.getMessage()]


def test_commits_keep_a_rank_protected_and_a_stall_of_commits_lapses_it_loudly_at_a_bounded_rate(caplog):
    caplog.set_level(logging.WARNING, logger="shardsafe.protection")
    p, events, clock = make(warn_interval_s=10.0)
    p.started(-1)
    for step in range(1, 6):   # every step commits the one before
        p.observe(step, step - 1)
        assert p.protected and p.age == 1
    assert "protected (newest committed version 4, 1 step(s) old)" == p.describe()
    # version 5 and later never commit (the budget or another rank's failure): unprotected once max(3, 2) steps
    # have passed without a commit
    for step in range(5, 5 + stale_after(1)):
        clock.t += 1
        p.observe(step, 4)
        assert p.protected, step
    clock.t += 1
    p.observe(8, 4)
    assert not p.protected and p.lapsed and p.lapses == 1
    assert Cause.STALE in p.causes() and "no version committed for 4 steps (since version 4)" in p.describe()
    assert [k for k, _ in events] == ["protection_lapsed"]
    assert len(warnings(caplog)) == 1
    for step in range(9, 19):   # 1 s per step: said again after 10 s, not every step
        clock.t += 1
        p.observe(step, 4)
    assert len(warnings(caplog)) == 2
    assert "a failure now loses every step since version 4" in warnings(caplog)[-1]
    p.observe(20, 19)
    assert p.protected and [k for k, _ in events] == ["protection_lapsed", "protection_restored"]
    assert any("protection is back: version 19" in r.getMessage() for r in caplog.records)


def test_the_pipelines_causes_name_why_and_a_commit_clears_them():
    p, events, _ = make(interval=2)
    p.started(10)   # restored version 10
    assert p.describe().startswith("protected (newest committed version 10")
    p.report({Cause.BUDGET: "rank 3: holder budget"})
    for step in range(11, 15):
        p.observe(step, 10)
    assert p.protected   # within max(3, 2 * 2) = 4 steps of the commit: the promise still holds
    p.observe(15, 10)
    assert not p.protected and set(p.causes()) == {Cause.BUDGET}
    assert events[-1][1]["cause"] == "budget" and "rank 3: holder budget" in events[-1][1]["detail"]
    p.observe(16, 16)
    assert p.protected and not p.causes()


def test_a_program_that_resumes_past_the_restored_version_is_not_stale_at_its_first_step():
    p, _, _ = make()
    p.started(100)
    p.observe(5001, 100)   # its own load_checkpoint loaded a newer disk checkpoint
    assert p.protected and p.age == 1


def test_standing_causes_and_other_ranks_causes_at_start_make_the_banner_say_so():
    p, _, _ = make()
    p.stand(Cause.NO_HOLDER, "rank 0: no holder for job j on node n")
    assert p.startup_check().startswith("NOT protected: no_holder: rank 0: no holder")
    p.clear(Cause.NO_HOLDER)
    p.stand_until_commit(Cause.NO_HOLDER, "rank(s) [3] have no holder")
    assert not p.protected and "rank(s) [3] have no holder" in p.startup_check()
    p.started(-1)
    p.observe(1, -1)
    assert not p.protected
    p.observe(2, 1)   # a commit proves every rank has its holder
    assert p.protected


def test_on_unprotected_fail_raises_at_start_and_at_the_lapse():
    p, _, _ = make(on_unprotected="fail")
    p.stand(Cause.NO_HOLDER, "no holder")
    with pytest.raises(UnprotectedError, match="on_unprotected is \"fail\""):
        p.startup_check()
    p, events, _ = make(on_unprotected="fail")
    p.started(-1)
    p.startup_check()
    for step in range(1, 4):
        p.observe(step, -1)
    with pytest.raises(UnprotectedError, match="not protected at step 4"):
        p.observe(4, -1)
    assert events[-1][0] == "protection_lapsed"


def test_other_ranks_say_their_own_cause_once_per_lapse(caplog):
    caplog.set_level(logging.WARNING, logger="shardsafe.protection")
    p, _, clock = make(rank=2)
    p.stand(Cause.NO_HOLDER, "rank 2: no holder")
    for step in range(1, 5):
        clock.t += 100
        p.observe(step, -1)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("[rank 2] shardsafe: this rank is NOT protected (no_holder")


def test_cause_bits_round_trip_and_the_vote_carries_them():
    allc = set(Cause)
    assert bits_to_causes(causes_to_bits(allc)) == allc
    assert bits_to_causes(causes_to_bits({Cause.PARITY})) == {Cause.PARITY}
    b = causes_to_bits({Cause.BUDGET})
    assert LocalAgreement().vote(3, False, b, b) == (False, b, b)
    ok, union, standing = GlooAgreement().vote(7, True, causes_to_bits({Cause.SNAPSHOT, Cause.VOTE}), b)   # one rank
    assert ok and bits_to_causes(union) == {Cause.SNAPSHOT, Cause.VOTE} and bits_to_causes(standing) == {Cause.BUDGET}


def test_the_budget_check_sums_each_nodes_ranks_and_names_the_number():
    gib = 1 << 30
    nodes = ["a", "a", "b", "b"]
    assert budget_problem([gib] * 4, [2 * gib] * 4, [0] * 4, nodes) is None
    msg = budget_problem([gib, gib, gib, int(1.5 * gib)], [int(2.2 * gib)] * 4, [0] * 4, nodes)
    assert msg.startswith("the holder of node b has a budget of 2.200 GiB, but its 2 rank(s) need 2.500 GiB")
    assert "at least 2.500 GiB" in msg
    # what the holder keeps for the job's other engines counts too; a rank without a holder (-1) is not checked
    assert "node a" in budget_problem([gib] * 4, [2 * gib, 2 * gib, -1, -1], [gib, gib, 0, 0], nodes)
    assert budget_problem([gib] * 4, [-1] * 4, [0] * 4, nodes) is None


def test_the_reporter_sends_the_newest_state_off_the_posting_thread():
    """shardsafe status reads each rank's state from its holder; the runtime posts it to a Reporter, whose own thread
    sends it. A slow holder never holds the poster up, a state replaced before it was sent is never sent, close()
    sends what is pending, and nothing is sent after it."""
    import threading
    import time as _time
    from shardsafe.protection import Reporter
    sent, gate = [], threading.Event()

    def send(state):
        gate.wait(5)
        sent.append(state)
    r = Reporter(send)
    for i in range(50):
        r.post({"i": i})
    assert sent == []   # every post returned while the send is still blocked
    gate.set()
    r.close(timeout=5)
    assert sent[-1] == {"i": 49} and len(sent) <= 2, sent   # the first one taken, then only the newest
    r.post({"i": 99})
    _time.sleep(0.05)
    assert {"i": 99} not in sent


def test_the_reporter_goes_on_after_an_unexpected_send_error_and_says_so(caplog):
    """A send that fails with something other than a holder being away must not end the reporter silently: it
    warns once, and the next state is sent."""
    import logging
    import threading
    from shardsafe.protection import Reporter
    sent, failed = [], threading.Event()

    def send(state):
        if state["i"] == 0:
            failed.set()
            raise ValueError("not JSON")
        sent.append(state)
    r = Reporter(send, who="rank 3")
    with caplog.at_level(logging.WARNING, logger="shardsafe.protection"):
        r.post({"i": 0})
        assert failed.wait(5)
        r.post({"i": 1})
        r.close(timeout=5)   # sends what is pending, then stops
    assert sent == [{"i": 1}]
    assert any("rank 3" in m and "ValueError" in m for m in caplog.messages), caplog.messages
