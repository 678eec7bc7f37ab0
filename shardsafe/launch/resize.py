"""Which nodes the next attempt runs on, at which data-parallel size: the launchers' one rule for lost, spare and
returning nodes (docs/operations.md, "Continuing on fewer nodes").

The full-size job has one **slot** per node it needs; slot i holds node i at the start. A lost node empties its
slot. A spare, while the job has any (``spares``: None = as many as it needs, which is what a launcher without
the policy does), takes the emptied slot at once. A node that joins later (a repaired node, a spare arriving late)
takes the lowest empty slot. An attempt at data-parallel size d runs on the first ``shape.nodes_at(d)`` occupied
slots, in slot order, ``ranks_per_node`` ranks each: rank r on the (r // ranks_per_node)-th of them. So the rank to
node map is stable (the same nodes in the same order while nothing changes), and after a shrink target rank r
runs where source rank r ran whenever that node is still there, which is where its own snapshot is.

After a loss (:meth:`Membership.plan`): run at the current size when the live nodes hold it (spares taken, or a
a node that joined at the smaller size); else wait ``shrink_after_s`` for a node to join; then continue at the
largest size below that the live nodes run and that keeps the global batch (:func:`.shrink.shrink_target`). A
layout with no such size, or ``shrink_after_s`` 0, waits for a node. While a job runs below its full size, a node
that joins makes a larger size possible (:meth:`Membership.grow_plan`); the launcher then stops the attempt at its
next committed version (:class:`CommitWatch`) and starts the next one at that size. Pure logic over names, no
processes: both launchers (:mod:`.local`, :mod:`.elastic`) drive it.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..errors import ConfigError, InternalError
from ..tor.events import JsonlTail
from .shrink import Shape, grow_target, shrink_target

RUN, WAIT, SHRINK, GROW = "run", "wait", "shrink", "grow"


@dataclass(frozen=True)
class Plan:
    """What the next attempt does: ``action`` RUN (same size), SHRINK or GROW (another size: the launcher emits the
    event of that name) on ``nodes`` in rank order at data-parallel size ``dp``; or WAIT for a node (``nodes``
    empty), ``refused`` when waiting because no smaller size works (the reason says why)."""

    action: str
    dp: int
    nodes: tuple[str, ...] = ()
    reason: str = ""
    refused: bool = False


class Membership:
    """The job's nodes and its data-parallel size (see the module docstring).

    Args:
        nodes: the full-size job's nodes in slot order (its ``shape.nodes_at(shape.dp)`` nodes).
        shape: the full-size job (``shape.dp`` is D).
        spares: spare nodes that take a lost node's place at once (None: always one, today's behaviour of a
            launcher that replaces every lost node).
        shrink_after_s: how long to wait for a node before shrinking (0: never shrink, wait for a node).
        spare_name: the name of the spare that takes the place of a lost node (the local launcher's spare is a fresh
            node under the lost one's name; the elastic launcher's gets a new name).
    """

    def __init__(self, nodes: Sequence[str], shape: Shape, *, spares: Optional[int] = None,
                 shrink_after_s: float = 0.0, spare_name: Callable[[str], str] = lambda lost: lost):
        if len(nodes) != shape.nodes_at(shape.dp) or not shape.fits(shape.dp, len(nodes)):
            raise ConfigError(f"{len(nodes)} node(s) of {shape.ranks_per_node} ranks do not hold data-parallel size "
                              f"{shape.dp} x model-parallel {shape.model_parallel} exactly: expected "
                              f"{shape.nodes_at(shape.dp)} whole nodes")
        if spares is not None and spares < 0:
            raise ConfigError(f"spares must be >= 0 (or None: a lost node is always replaced); got {spares}")
        self.shape, self.spares, self.shrink_after_s = shape, spares, shrink_after_s
        self.slots: list[Optional[str]] = list(nodes)
        self.last: list[str] = list(nodes)        # the last node of each slot (a local spare takes its name)
        self.lost: list[str] = []
        self.dp = shape.dp
        self.spare_name = spare_name

    # ---- the nodes --------------------------------------------------------------------------------------
    @property
    def full_dp(self) -> int:
        return self.shape.dp

    @property
    def live(self) -> list[str]:
        """The job's nodes that are up, in slot order."""
        return [n for n in self.slots if n is not None]

    @property
    def active(self) -> list[str]:
        """The nodes an attempt at the current size runs on, in rank order."""
        return self.live[:self.shape.nodes_at(self.dp)]

    def world(self, dp: Optional[int] = None) -> int:
        return (self.dp if dp is None else dp) * self.shape.model_parallel

    def rank_nodes(self, nodes: Optional[Sequence[str]] = None) -> list[str]:
        """The node of every rank: rank r on ``nodes[r // ranks_per_node]`` (default: the active nodes)."""
        nodes = self.active if nodes is None else list(nodes)
        return [n for n in nodes for _ in range(self.shape.ranks_per_node)]

    def lose(self, nodes: Sequence[str]) -> list[str]:
        """Nodes gone (their memory with them); returns those of them the current attempt ran on."""
        ran = [n for n in nodes if n in self.active]
        for n in nodes:
            if n in self.slots:
                self.slots[self.slots.index(n)] = None
                self.lost.append(n)
        return ran

    def join(self, node: str) -> bool:
        """A node (back, or a spare arriving late) takes the lowest empty slot; False when it cannot: it is in the
        job already, or every slot is taken (the job is at full size)."""
        if node in self.slots or None not in self.slots:
            return False
        i = self.slots.index(None)
        self.slots[i], self.last[i] = node, node
        if node in self.lost:
            self.lost.remove(node)
        return True

    def take_spares(self) -> list[str]:
        """Spares take the empty slots, as many as there are spares; returns them (each needs an empty holder)."""
        fresh = []
        for i, n in enumerate(self.slots):
            if n is None and (self.spares is None or self.spares > 0):
                name = self.spare_name(self.last[i])
                self.slots[i], self.last[i] = name, name
                if name in self.lost:
                    self.lost.remove(name)
                if self.spares is not None:
                    self.spares -= 1
                fresh.append(name)
        return fresh

    # ---- the decisions ----------------------------------------------------------------------------------
    def plan(self, waited_s: float) -> Plan:
        """The next attempt after a loss, ``waited_s`` seconds after it (see the module docstring)."""
        live = len(self.live)
        up = grow_target(self.shape, self.dp, live)
        if up is not None:   # nodes joined while the job waited: a larger size than the current one
            return Plan(GROW, up.dp, tuple(self.live[:up.nodes]), up.reason)
        if self.shape.fits(self.dp, live):   # spares, or nodes that joined, took the empty slots
            return Plan(RUN, self.dp, tuple(self.live[:self.shape.nodes_at(self.dp)]))
        short = f"{live} of the {self.shape.nodes_at(self.dp)} node(s) data-parallel size {self.dp} needs are up"
        if self.shrink_after_s <= 0:
            return Plan(WAIT, self.dp, reason=f"{short}; shrinking is off (shrink_after_s 0): waiting for a node to "
                                              "join")
        if waited_s < self.shrink_after_s:
            return Plan(WAIT, self.dp, reason=f"{short}; waiting up to {self.shrink_after_s:g} s for a node to join "
                                              "before continuing at a smaller data-parallel size")
        try:
            d = shrink_target(dataclasses.replace(self.shape, dp=self.dp), live)
        except ConfigError as e:
            return Plan(WAIT, self.dp, reason=f"{short}; {e}", refused=True)
        return Plan(SHRINK, d.dp, tuple(self.live[:d.nodes]), d.reason)

    def grow_plan(self) -> Optional[Plan]:
        """While below full size: the larger size the live nodes now run (None: none yet)."""
        if self.dp >= self.shape.dp:
            return None
        up = grow_target(self.shape, self.dp, len(self.live))
        return None if up is None else Plan(GROW, up.dp, tuple(self.live[:up.nodes]), up.reason)

    def apply(self, plan: Plan) -> None:
        """The next attempt runs as ``plan`` says."""
        if plan.action == WAIT:
            raise InternalError("Membership.apply: a WAIT plan runs nothing; expected RUN, SHRINK or GROW")
        if list(plan.nodes) != self.live[:len(plan.nodes)]:
            raise InternalError(f"Membership.apply: plan nodes {list(plan.nodes)} are not the first live nodes "
                                f"{self.live}; expected a plan made by this membership since its last change")
        self.dp = plan.dp


class CommitWatch:
    """Follows ``RUN_DIR/events.jsonl`` for the newest version that every rank of one attempt committed (a
    ``snapshot`` event with ``committed`` true from each of its ``world`` ranks), counting from the last
    :meth:`arm`: the moment a grow can stop the attempt without losing committed work."""

    def __init__(self, run_dir: str, attempt: int, world: int):
        self._tail = JsonlTail(os.path.join(run_dir, "events.jsonl"), contains=b'"snapshot"')
        self.attempt, self.world = attempt, world
        self._by_version: dict[int, set[int]] = {}

    def arm(self) -> None:
        """Count commits from now on only: the versions committed before a node joined are not "the next"."""
        self._tail.poll()
        self._by_version.clear()

    def committed(self) -> Optional[int]:
        """The newest version every rank of the attempt committed since :meth:`arm` (None: none yet)."""
        for ev in self._tail.poll():
            if ev.get("kind") != "snapshot" or not ev.get("committed") or ev.get("attempt") != self.attempt:
                continue
            r, v = ev.get("rank"), ev.get("version")
            if isinstance(r, int) and isinstance(v, int):
                self._by_version.setdefault(v, set()).add(r)
        done = [v for v, ranks in self._by_version.items() if len(ranks) >= self.world]
        return max(done) if done else None
