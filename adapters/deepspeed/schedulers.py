"""LR schedulers the program steps itself on a protected engine's optimizer, snapshotted and restored with it.

DeepSpeed steps ``engine.lr_scheduler`` inside the optimizer step, so its state is part of every snapshot. A
program may instead build a torch scheduler over the optimizer and step it itself: HF's ``Trainer`` does exactly
that when the DeepSpeed config has no ``"optimizer"`` block (it builds ``adamw_torch_fused`` / ``adamw_torch`` /
``adafactor`` ..., calls ``deepspeed.initialize`` without a scheduler, then ``create_scheduler`` on the wrapped
optimizer, and calls ``lr_scheduler.step()`` after every ``engine.step()``). Such a scheduler does not exist yet
when the restore runs (inside ``deepspeed.initialize``), and when the program builds it, its constructor writes
step 0's learning rate into the optimizer's ``param_groups``: the next optimizer step would run at the wrong
rate, and every step after it drifts.

:class:`ProgramSchedulers` finds such schedulers (a torch ``LRScheduler`` whose ``optimizer.param_groups`` is this
engine's base optimizer's list, other than the engine's own), records each one's state in every snapshot, and
counts how often the program steps it between a snapshot (taken at the end of ``engine.step``) and the next
optimizer step: one for HF and for loops that call ``scheduler.step()`` once per iteration, before or after the
optimizer step. After a restore to version v, right before the first optimizer step (v+1), it puts back the
scheduler's state and the optimizer's hyperparameters as they were at v, then steps the scheduler that many
times: what the program itself did between v's snapshot and step v+1 in the run that failed.
"""
from __future__ import annotations

import gc
import logging
import weakref
from typing import Any, Optional

from .checks import scheduler_state

log = logging.getLogger(__name__)

DEFAULT_STEPS_AFTER = 1
"""Steps between a snapshot and the next optimizer step before one was observed (the first snapshot): torch's
documented order, ``optimizer.step()`` then ``scheduler.step()``, once per iteration."""


def _top_level(found: list) -> list:
    """Schedulers that no other found scheduler drives (SequentialLR / ChainedScheduler keep children bound to
    the same optimizer in ``_schedulers``; the program steps the parent, whose state holds the children's)."""
    children = {id(c) for s in found for c in (getattr(s, "_schedulers", None) or ())}
    return [s for s in found if id(s) not in children]


def find_program_schedulers(param_groups: list, exclude: Any = None) -> list:
    """Every live torch LR scheduler over ``param_groups`` (identity of the list: HF binds its scheduler to
    accelerate's optimizer wrapper, whose ``param_groups`` is DeepSpeed's, which is the base optimizer's), other
    than ``exclude``. One scan of the garbage collector's objects: run once per engine."""
    from torch.optim.lr_scheduler import LRScheduler
    found = []
    for o in gc.get_objects():
        if issubclass(type(o), LRScheduler) and o is not exclude:   # type(): no __class__ lookup (deprecation proxies warn)
            opt = getattr(o, "optimizer", None)
            try:
                if opt is not None and opt.param_groups is param_groups:
                    found.append(o)
            except Exception:  # noqa: BLE001 - a half-built wrapper: not ours
                continue
    return _top_level(found)


def _counter(s: Any) -> int:
    return int(getattr(s, "last_epoch", 0))


def _is_plateau(s: Any) -> bool:
    return type(s).__name__ == "ReduceLROnPlateau"


class ProgramSchedulers:
    """The program-stepped schedulers of one engine (see the module docstring).

    Args:
        base_optimizer: the torch optimizer DeepSpeed wraps (its ``param_groups`` identify the schedulers).
        engine_scheduler: a callable returning the engine's own scheduler (excluded: it is snapshotted apart).
        rank: for log lines.
    """

    def __init__(self, base_optimizer: Any, engine_scheduler: Any, *, rank: int = 0):
        self._groups = base_optimizer.param_groups
        self._engine_scheduler = engine_scheduler
        self.rank = rank
        self._refs: Optional[list] = None          # weak references, once searched
        self._at_capture: list[int] = []           # each scheduler's step counter at the last snapshot
        self._steps_after: list[Optional[int]] = []   # observed program steps between a snapshot and the next step
        self._varies: list[bool] = []
        self._pending: Optional[tuple[list, list]] = None   # (saved entries, saved param_groups) after a restore
        self._observe = False   # the next optimizer step is the first since a snapshot
        # Searched at the first snapshot after the first optimizer step: the restore's own look at the live state
        # comes before the program built its scheduler (HF builds it after deepspeed.initialize returns).
        self._stepped = False
        self.notes: dict[str, Any] = {}

    def _live(self) -> list:
        if self._refs is None:
            found = find_program_schedulers(self._groups, exclude=self._engine_scheduler())
            self._refs = [weakref.ref(s) for s in found]
            self._at_capture = [_counter(s) for s in found]
            self._steps_after = [None] * len(found)
            self._varies = [False] * len(found)
        return [r() for r in self._refs]

    def capture(self) -> Optional[list]:
        """Each scheduler's state at this snapshot (None: the program steps none itself)."""
        if not self._stepped:
            return None
        live = self._live()
        if not live:
            return None
        out = []
        for i, s in enumerate(live):
            if s is None:
                out.append(None)
                continue
            self._at_capture[i] = _counter(s)
            self._observe = True
            seen = self._steps_after[i]
            out.append({"class": type(s).__name__, "state": scheduler_state(s),
                        "steps_after": DEFAULT_STEPS_AFTER if seen is None else seen,
                        "observed": seen is not None, "varies": self._varies[i]})
        return out

    def before_step(self) -> None:
        """Right before an optimizer step: apply a pending restore, then count the program's steps since the
        last snapshot."""
        self._stepped = True
        if self._pending is not None:
            self._apply_pending()
        if not self._observe:
            return   # counted once per snapshot: with interval > 1 the steps between two snapshots are not counted
        self._observe = False
        for i, r in enumerate(self._refs):
            s = r()
            if s is None:
                continue
            n = _counter(s) - self._at_capture[i]
            if self._steps_after[i] is not None and self._steps_after[i] != n:
                self._varies[i] = True
            self._steps_after[i] = n

    def restore(self, saved: Optional[list], param_groups: list) -> None:
        """After the restore put version v's state back: the program's schedulers get theirs at the next
        optimizer step (they may not exist yet)."""
        self.notes = {}
        # also without saved schedulers: the first step checks that the program steps none either
        self._pending = (list(saved or []), [dict(g) for g in param_groups])

    def _apply_pending(self) -> None:
        saved, groups = self._pending
        self._pending = None
        self._refs = None   # the program built its schedulers after the restore: search now
        live = self._live()
        if not saved and not live:
            return
        if len(saved) != len(live) or any(e is None or s is None or e["class"] != type(s).__name__
                                             for e, s in zip(saved, live)):
            have = [type(s).__name__ for s in live if s is not None]
            then = [e["class"] for e in saved if e is not None]
            log.warning("[rank %d] shardsafe: the snapshot holds the state of %s LR scheduler(s) the program steps "
                        "itself, and the program now has %s over this engine's optimizer: the schedule is NOT "
                        "restored and the learning rate continues from the snapshot's param_groups; the run is not "
                        "the uninterrupted run's. Build the same scheduler as before (or pass it to "
                        "deepspeed.initialize as lr_scheduler).", self.rank, then or "no", have or "none")
            self.notes["program_schedulers"] = f"mismatch: snapshot {then}, program {have}"
            return
        for g, s in zip(self._groups, groups):   # the program's new scheduler wrote step 0's lr over them
            g.update(s)
        done = []
        for i, (e, s) in enumerate(zip(saved, live)):
            s.load_state_dict(e["state"])
            steps = int(e["steps_after"])
            if _is_plateau(s):
                steps = 0   # stepped with a metric at evaluation: nothing to replay between two steps
            for _ in range(steps):
                s.step()
            self._at_capture[i] = _counter(s) - steps
            self._steps_after[i] = steps
            self._observe = True
            if e.get("varies") or not e.get("observed"):
                log.warning("[rank %d] shardsafe: the program's LR scheduler %s was restored and stepped %d time(s) "
                            "as the program %s; if it steps a different number of times after this step (an "
                            "epoch-end schedule), pass it to deepspeed.initialize as lr_scheduler so the engine "
                            "steps and snapshots it", self.rank, e["class"], steps,
                            "stepped it between earlier snapshots and optimizer steps (a varying count)"
                            if e.get("varies") else "had not been observed yet (torch's documented order)")
            done.append(f"{e['class']}+{steps}")
        self.notes["program_schedulers"] = ", ".join(done)
        if self.rank == 0:
            log.info("shardsafe: restored the LR scheduler(s) the program steps itself: %s", ", ".join(done))
