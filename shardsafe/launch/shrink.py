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

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from ..errors import ConfigError

RENDEZVOUS_TIMEOUT_S = 60.0
"""The rendezvous timeout of shardsafe's torch elastic agents (the c10d ``read_timeout`` of :mod:`.agent`); the
local launcher, which has no rendezvous, takes the same figure for its default wait."""

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

    def __post_init__(self) -> None:
        if self.dp < 1 or self.model_parallel < 1 or self.ranks_per_node < 1 or self.micro_batch < 1 \
                or self.global_batch < 0:
            raise ConfigError(f"job shape {self}: expected dp, model_parallel, ranks_per_node and micro_batch >= 1 and "
                              "global_batch >= 0 (0 = not known)")

    @property
    def world(self) -> int:
        return self.dp * self.model_parallel

    def nodes_at(self, dp: int) -> int:
        """Nodes ``dp`` replicas occupy (the last one partly filled when they do not fill whole nodes)."""
        return -(-dp * self.model_parallel // self.ranks_per_node)

    def fits(self, dp: int, nodes: int) -> bool:
        """Whether ``dp`` replicas run on ``nodes`` whole nodes: enough ranks, and every node it uses full."""
        ranks = dp * self.model_parallel
        return ranks <= nodes * self.ranks_per_node and ranks % self.ranks_per_node == 0

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
    keeps_batch = [d for d in range(shape.dp - 1, 0, -1) if shape.accumulation(d) is not None]
    fitting = [d for d in keeps_batch if shape.fits(d, nodes_left)]
    # Every surviving node must run ranks: its holder's memory is read only by the ranks on its node, so a survivor
    # left idle would count as lost at the restore, on top of the lost nodes that parity rebuilds.
    for d in fitting:
        if shape.nodes_at(d) == nodes_left:
            return _decision(shape, shape.dp, d, "continuing")
    need = ", ".join(f"{d} (on {shape.nodes_at(d)} node(s))" for d in keeps_batch)
    if fitting:
        raise ConfigError(
            f"cannot continue on {nodes_left} node(s): the global batch of {shape.global_batch} samples in "
            f"micro-batches of {shape.micro_batch} divides only at data-parallel sizes {need}, and data-parallel size "
            f"{fitting[0]} would leave {nodes_left - shape.nodes_at(fitting[0])} surviving node(s) idle, whose holders' "
            "memory the restore needs (only ranks on a node read its holder); waiting for a spare node (or set a "
            f"global batch that a data-parallel size on all {nodes_left} node(s) divides)")
    raise ConfigError(
        f"cannot continue on {nodes_left} node(s): the global batch of {shape.global_batch} samples in micro-batches of "
        f"{shape.micro_batch} divides only at data-parallel sizes {need or 'none below ' + str(shape.dp)}; waiting for "
        "a spare node (or set a global batch that a smaller size divides)")


def grow_target(shape: Shape, dp_now: int, nodes_live: int) -> Optional[ShrinkDecision]:
    """The largest data-parallel size above ``dp_now``, up to the full ``shape.dp``, that ``nodes_live`` whole nodes run
    and that keeps the global batch; None while there is none (not enough nodes back yet)."""
    for d in range(shape.dp, dp_now, -1):
        if shape.fits(d, nodes_live) and (d == shape.dp or shape.accumulation(d) is not None):
            return _decision(shape, dp_now, d, "growing back")
    return None


def _decision(shape: Shape, dp_from: int, d: int, what: str) -> ShrinkDecision:
    g0, g = shape.accumulation(dp_from), shape.accumulation(d)
    nodes = shape.nodes_at(d)
    if g0 is None or g is None:   # back to the full size of a job whose batch is not known: nothing to keep
        return ShrinkDecision(d, g or 0, nodes, f"{what} to data-parallel size {d} from {dp_from} on {nodes} node(s)")
    return ShrinkDecision(d, g, nodes, f"{what} at data-parallel size {d} instead of {dp_from} on {nodes} node(s): "
                                       f"gradient accumulation {g0} -> {g} keeps the global batch of "
                                       f"{shape.global_batch} samples")


def batch_from_ds_config(cfg: Mapping[str, Any], dp: int) -> Optional[tuple[int, int]]:
    """(global batch, micro-batch per rank) in samples from a DeepSpeed config at data-parallel size ``dp``, by
    DeepSpeed's own relation train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp
    (any two of the three give the third); None when the config does not say (a value such as HF's "auto")."""
    def whole(key: str) -> Optional[int]:
        v = cfg.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None
    tb, mb, gas = whole("train_batch_size"), whole("train_micro_batch_size_per_gpu"), whole("gradient_accumulation_steps")
    if mb is None and tb is not None:
        mb = tb // ((gas or 1) * dp) if tb % ((gas or 1) * dp) == 0 else None
    if mb is None:
        return None
    return (tb if tb is not None else mb * (gas or 1) * dp), mb


DS_CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config", "--ds_config", "--ds-config")
"""How training scripts name their DeepSpeed config (DeepSpeed's own ``add_config_arguments`` and common
variants); the launchers read the batch from it when they are not told."""


def ds_config_in(argv: Sequence[str]) -> Optional[str]:
    """The DeepSpeed config file a training command names (``--deepspeed_config PATH`` or ``=PATH``), if any."""
    for i, a in enumerate(argv):
        flag, eq, value = a.partition("=")
        if flag in DS_CONFIG_FLAGS:
            if eq:
                return value
            return argv[i + 1] if i + 1 < len(argv) else None
    return None


def read_ds_batch(path: str, dp: int) -> Optional[tuple[int, int]]:
    """:func:`batch_from_ds_config` of a JSON file; None when it cannot be read as one (the launcher then says the
    batch is not known, and shrinking waits for a spare)."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return batch_from_ds_config(cfg, dp) if isinstance(cfg, dict) else None


MEGATRON_FLAGS = {"--tensor-model-parallel-size": "tp", "--pipeline-model-parallel-size": "pp",
                  "--context-parallel-size": "cp", "--global-batch-size": "global", "--micro-batch-size": "micro"}
"""Megatron-LM's flags that fix a job's model-parallel replica (TP x PP x CP) and its batch."""


def megatron_layout_in(argv: Sequence[str]) -> dict[str, int]:
    """What a Megatron-LM command says of its layout: {"tp", "pp", "cp", "global", "micro"} for the flags it
    gives (``--flag N`` or ``--flag=N``), with a first argument ``@FILE`` read as more arguments, one or more per
    line (as examples/megatron_lm_pretrain_gpt.py expands it); {} when it names none of them or a file cannot be
    read (the launcher then goes by its own options)."""
    argv = list(argv)
    at = next((i for i, a in enumerate(argv) if a.startswith("@")), None)
    if at is not None:
        try:
            with open(argv[at][1:]) as f:
                argv[at:at + 1] = f.read().split()
        except OSError:
            return {}
    out: dict[str, int] = {}
    for i, a in enumerate(argv):
        flag, eq, value = a.partition("=")
        if flag in MEGATRON_FLAGS:
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                out[MEGATRON_FLAGS[flag]] = int(value)
            except ValueError:
                return {}   # not a number: Megatron refuses it itself, with its own message
    return out


def job_shape(*, nodes: int, ranks_per_node: int, model_parallel: int = 1, global_batch: int = 0,
              micro_batch: int = 0, command: Sequence[str] = ()) -> Shape:
    """The full-size job's :class:`Shape`. The model-parallel size is the argument, else TP x PP x CP from a
    Megatron-LM command's flags (:func:`megatron_layout_in`). The batch comes from the arguments, else from the
    DeepSpeed config the training ``command`` names (:func:`ds_config_in`), else from its Megatron-LM flags
    (``--micro-batch-size``, and ``--global-batch-size`` or Megatron's default of one micro-batch per replica),
    else it stays unknown (0: shrinking then waits for a spare).

    Raises:
        ConfigError: the ranks do not split into whole model-parallel replicas, or only one of the batch sizes is
            given, or they do not divide, or ``model_parallel`` contradicts the command's Megatron-LM flags.
    """
    world = nodes * ranks_per_node
    mcore = megatron_layout_in(command)
    replica = mcore.get("tp", 1) * mcore.get("pp", 1) * mcore.get("cp", 1)
    if model_parallel == 1:
        model_parallel = replica
    elif replica != 1 and replica != model_parallel:
        raise ConfigError(f"model_parallel is {model_parallel} but the command's Megatron-LM flags make a replica of "
                          f"{replica} ranks (TP {mcore.get('tp', 1)} x PP {mcore.get('pp', 1)} x CP "
                          f"{mcore.get('cp', 1)}): leave the launcher's model-parallel option out, or make it {replica}")
    if model_parallel < 1 or world % model_parallel:
        raise ConfigError(f"model_parallel {model_parallel} does not divide the job's {world} ranks ({nodes} node(s) x "
                          f"{ranks_per_node}): pass the ranks of one model replica (TP x PP), a divisor of {world}")
    dp = world // model_parallel
    if bool(global_batch) != bool(micro_batch):
        raise ConfigError(f"the global batch ({global_batch}) and the micro-batch ({micro_batch}) go together: give "
                          "both, in samples, or neither (then they come from the program's DeepSpeed config, if it "
                          "names one)")
    if not global_batch:
        path = ds_config_in(command)
        found = read_ds_batch(path, dp) if path else None
        if found is None and mcore.get("micro"):
            found = (mcore.get("global") or mcore["micro"] * dp, mcore["micro"])
        if found is None:
            return Shape(dp=dp, model_parallel=model_parallel, ranks_per_node=ranks_per_node)
        global_batch, micro_batch = found
    if global_batch % (micro_batch * dp):
        raise ConfigError(f"global batch {global_batch} is not a multiple of micro-batch {micro_batch} x data-parallel "
                          f"size {dp}: expected the job's own sizes, in samples")
    return Shape(dp=dp, model_parallel=model_parallel, ranks_per_node=ranks_per_node, global_batch=global_batch,
                 micro_batch=micro_batch)


def shrink_after_s(configured: Optional[float], rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> float:
    """How long the launcher waits for a spare before it shrinks: ``configured`` (0 disables shrinking), else a few
    rendezvous timeouts."""
    if configured is None:
        return DEFAULT_SHRINK_AFTER_RENDEZVOUS * rendezvous_timeout_s
    if configured < 0:
        raise ConfigError(f"shrink_after_s must be >= 0 seconds (0 = never shrink, wait for a spare); got {configured}")
    return float(configured)
