"""When a lost node's place stays empty: the data-parallel size to continue at, and when to decide.

A job of ``world`` ranks is ``D`` data-parallel replicas of a model-parallel slice of ``model_parallel`` ranks
(TP x PP). When a node is lost and no spare joins within ``shrink_after_s``, the launcher re-forms the job on the
remaining nodes at the largest data-parallel size D' < D that

* fits the ranks left (``D' * model_parallel`` ranks on the nodes that remain, whole nodes only), and
* keeps the global batch: ``global_batch`` is a multiple of ``micro_batch * D'`` (gradient accumulation grows from
  G to G * D / D', so the sequence of samples a step consumes is the run's own),

and the restore re-partitions the committed version from D to D' ranks (shardsafe.snapshot.reshard). When a node
returns, the job grows back to D at the next committed version the same way. :func:`shrink_target` is the rule;
a layout with no such D' is refused with the sizes that would work, and the launcher waits for a spare instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

DEFAULT_SHRINK_AFTER_RENDEZVOUS = 3
"""``shrink_after_s`` defaults to this many rendezvous timeouts: long enough for a spare that is booting, short
against the hours a replacement node can take."""


@dataclass(frozen=True)
class Shape:
    """A job's size: ``dp`` data-parallel replicas of ``model_parallel`` ranks each, ``ranks_per_node`` per node;
    the global batch of ``global_batch`` samples in micro-batches of ``micro_batch`` per rank."""

    dp: int
    model_parallel: int = 1
    ranks_per_node: int = 1
    global_batch: int = 0
    micro_batch: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.model_parallel

    def accumulation(self, dp: int) -> Optional[int]:
        """Gradient accumulation steps at data-parallel size ``dp`` for this global batch (None: does not divide)."""
        if self.global_batch <= 0:
            return None
        per_step = self.micro_batch * dp
        return self.global_batch // per_step if self.global_batch % per_step == 0 else None


@dataclass(frozen=True)
class ShrinkDecision:
    dp: int                 # the data-parallel size to continue at
    accumulation: int       # gradient accumulation steps at it (the global batch kept)
    nodes: int              # nodes the job uses at it
    reason: str             # what was chosen and why, for the launcher's log and the TOR event


def shrink_target(shape: Shape, nodes_left: int) -> ShrinkDecision:
    """The largest data-parallel size below ``shape.dp`` that ``nodes_left`` whole nodes can run and that keeps the
    global batch.

    Raises:
        ConfigError: no such size (the message names the sizes that would keep the batch, and the nodes each needs);
            the launcher then waits for a spare.
    """
    if shape.dp < 2:
        raise ConfigError(f"the job runs {shape.dp} data-parallel replica(s): there is nothing to shrink; waiting for "
                          "a spare node")
    if shape.global_batch <= 0 or shape.micro_batch <= 0:
        raise ConfigError("shrinking keeps the global batch, and the job's global batch and micro-batch are not known "
                          f"(global_batch={shape.global_batch}, micro_batch={shape.micro_batch}); waiting for a spare")
    capacity = nodes_left * shape.ranks_per_node // shape.model_parallel   # replicas the remaining ranks hold
    keeps_batch = [d for d in range(shape.dp - 1, 0, -1) if shape.accumulation(d) is not None]
    for d in keeps_batch:
        if d <= capacity and (d * shape.model_parallel) % shape.ranks_per_node == 0:
            nodes = d * shape.model_parallel // shape.ranks_per_node
            g0, g = shape.accumulation(shape.dp), shape.accumulation(d)
            return ShrinkDecision(d, g, nodes, f"continuing at data-parallel size {d} instead of {shape.dp} on {nodes} "
                                               f"node(s): gradient accumulation {g0} -> {g} keeps the global batch of "
                                               f"{shape.global_batch} samples")
    need = ", ".join(f"{d} (on {-(-d * shape.model_parallel // shape.ranks_per_node)} node(s))" for d in keeps_batch)
    raise ConfigError(
        f"cannot continue on {nodes_left} node(s): the global batch of {shape.global_batch} samples in micro-batches of "
        f"{shape.micro_batch} divides only at data-parallel sizes {need or 'none below ' + str(shape.dp)}; waiting for "
        "a spare node (or set a global batch that a smaller size divides)")


def shrink_after_s(configured: Optional[float], rendezvous_timeout_s: float) -> float:
    """How long the launcher waits for a spare before it shrinks: ``configured`` (0 disables shrinking), else a few
    rendezvous timeouts."""
    if configured is None:
        return DEFAULT_SHRINK_AFTER_RENDEZVOUS * rendezvous_timeout_s
    if configured < 0:
        raise ConfigError(f"shrink_after_s must be >= 0 seconds (0 = never shrink, wait for a spare); got {configured}")
    return float(configured)
