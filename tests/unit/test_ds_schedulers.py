"""The LR schedulers a program steps itself (adapters/deepspeed/schedulers.py), with torch alone: HF's Trainer builds its
LambdaLR over accelerate's optimizer wrapper, whose ``param_groups`` is the wrapped optimizer's list."""
import logging

import torch

from shardsafe.adapters.deepspeed.schedulers import ProgramSchedulers, find_program_schedulers


class Wrapper(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: param_groups is the inner optimizer's list."""

    def __init__(self, inner):   # noqa: super().__init__ deliberately not called, as accelerate's
        self.inner = inner
        self.defaults = inner.defaults

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self, closure=None):
        return self.inner.step(closure)


def _setup(warmup=4):
    w = torch.nn.Parameter(torch.ones(4))
    base = torch.optim.AdamW([{"params": [w], "weight_decay": 0.0}], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(Wrapper(base), lambda i: min(1.0, (i + 1) / warmup))
    return w, base, sched


def _train(base, sched, w, tracker, steps, *, snap_every=1, snaps=None):
    """The HF loop's order: [before_step] optimizer step, snapshot (end of engine.step), then scheduler.step()."""
    for s in range(1, steps + 1):
        tracker.before_step()
        w.grad = torch.full_like(w, 0.1 * s)
        sched.optimizer.step()   # through the wrapper, as the program's loop does
        if s % snap_every == 0 and snaps is not None:
            snaps[s] = ([dict((k, v) for k, v in g.items() if k != "params") for g in base.param_groups],
                        tracker.capture())
        sched.step()


def test_the_program_scheduler_is_found_through_a_wrapper_and_not_the_engines_own():
    _, base, sched = _setup()
    engine_own = torch.optim.lr_scheduler.LambdaLR(base, lambda i: 1.0)
    assert find_program_schedulers(base.param_groups, exclude=engine_own) == [sched]
    seq = torch.optim.lr_scheduler.SequentialLR(base, [torch.optim.lr_scheduler.ConstantLR(base),
                                                       torch.optim.lr_scheduler.LinearLR(base)], milestones=[2])
    found = find_program_schedulers(base.param_groups, exclude=engine_own)
    assert seq in found and not any(c in found for c in seq._schedulers)   # the parent, not its children


def test_a_restore_puts_the_schedule_back_before_the_next_step_bit_exact():
    w, base, sched = _setup()
    t = ProgramSchedulers(base, lambda: None)
    snaps = {}
    _train(base, sched, w, t, 8, snaps=snaps)
    want = [g["lr"] for g in base.param_groups], sched.state_dict()
    # a restarted program at version 5: fresh optimizer and scheduler (its constructor writes step 0's lr)
    w2, base2, sched2 = _setup()
    t2 = ProgramSchedulers(base2, lambda: None)
    groups, saved = snaps[5]
    assert saved[0]["class"] == "LambdaLR" and saved[0]["steps_after"] == 1 and saved[0]["observed"]
    for g, s in zip(base2.param_groups, groups):
        g.update(s)
    sched2 = torch.optim.lr_scheduler.LambdaLR(Wrapper(base2), lambda i: min(1.0, (i + 1) / 4))
    assert base2.param_groups[0]["lr"] != groups[0]["lr"]   # what the bug left for step 6
    t2.restore(saved, groups)
    t2.before_step()
    assert sched2.state_dict()["last_epoch"] == 5 and base2.param_groups[0]["lr"] == 1e-2
    w2.data.copy_(w.data)   # the rest of the loop from 6 on, as the first program would have run it
    for s in range(6, 9):
        if s > 6:
            t2.before_step()
        w2.grad = torch.full_like(w2, 0.1 * s)
        sched2.optimizer.step()
        sched2.step()
    assert [g["lr"] for g in base2.param_groups] == want[0] and sched2.state_dict()["last_epoch"] == \
        want[1]["last_epoch"]


def test_steps_are_counted_once_per_snapshot_and_a_varying_count_is_flagged():
    w, base, sched = _setup()
    t = ProgramSchedulers(base, lambda: None)
    snaps = {}
    _train(base, sched, w, t, 8, snap_every=2, snaps=snaps)   # interval 2: one scheduler step after each snapshot
    assert all(e[0]["steps_after"] == 1 and not e[0]["varies"] for _, (_, e) in snaps.items() if e[0]["observed"])
    t.capture()
    sched.optimizer.step()
    sched.step()
    sched.step()   # two this time
    t.before_step()
    assert t.capture()[0]["varies"]


def test_a_mismatch_is_said_loudly(caplog):
    caplog.set_level(logging.WARNING)
    _, base, sched = _setup()
    t = ProgramSchedulers(base, lambda: None)
    t.restore([], [dict((k, v) for k, v in g.items() if k != "params") for g in base.param_groups])
    t.before_step()   # the program has a scheduler the snapshot did not hold
    assert "the schedule is NOT restored" in caplog.text and "mismatch" in t.notes["program_schedulers"]
