"""TOR at cluster scale, the inputs: failure classes, their rates, the cluster, and shardsafe's costs.

A failure's cost depends on its *class*, because each class takes a different recovery path (docs/tor.md,
"TOR at cluster scale"):

- ``process``: a trainer process crashed or hung; the node and its holder survive. Restored from holder
  memory (tier 1). Lost work: half a snapshot interval.
- ``node``: a node left the job (hardware fault, host maintenance); its holder memory is gone. Its ranks are
  rebuilt from parity on the replacement (tier 2), unless its parity group loses more than ``m`` members before
  it is healed: then the persistent tier (half a flush interval lost).
- ``rack``: a correlated fault that takes a whole rack of ``rack_nodes`` nodes (a leaf switch, its cables, a
  PDU). With the placement rule (every parity group spread over racks: at most one member per rack) each group
  loses one member and parity restores it; without it a group loses all its members in that rack, more than
  ``m``, and the job falls back to the persistent tier.
- ``slow``: a node keeps running at a fraction of its speed (thermal throttling, a degraded link); the whole
  job runs at that pace until the node is detected and evicted at the next snapshot, then rebuilt like a node.

Rates are per node-hour, so the job's failure rate grows with its node count. These dataclasses only hold and
check values; :mod:`.project` turns them into TOR.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from ._checks import _is_num
from .errors import TorError

__all__ = ["CLASSES", "CLASS_TIER", "Rates", "Cluster", "Costs"]

CLASSES = ("process", "node", "rack", "slow")
# The tier a class restores from when nothing worse happens (shardsafe with m >= 1 and the placement rule).
CLASS_TIER = {"process": "memory", "node": "parity", "rack": "parity", "slow": "parity"}


def _nonneg(owner: str, name: str, v: Any, *, positive: bool = False, unit: str = "") -> None:
    if not _is_num(v) or v < 0 or (positive and v == 0):
        raise TorError(f"{owner}({name}={v!r}): expected a finite number {'> 0' if positive else '>= 0'}"
                         f"{' ' + unit if unit else ''}")


def _count(owner: str, name: str, v: Any, *, low: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise TorError(f"{owner}({name}={v!r}): expected an int >= {low}")


@dataclass(kw_only=True)
class Rates:
    """Failure rates per node-hour, by class (:data:`CLASSES`). A job of N nodes sees N x rate events per hour."""

    process: float = 0.0
    """Process crashes and hangs (software bugs, NCCL watchdog timeouts) per node-hour."""
    node: float = 0.0
    """Node losses (a GPU, its memory, host hardware, host maintenance) per node-hour."""
    rack: float = 0.0
    """Correlated rack events (switch, cable, power) per node-hour; each takes ``Cluster.rack_nodes`` nodes."""
    slow: float = 0.0
    """Fail-slow onsets (thermal throttling, degraded links) per node-hour."""
    source: str = "flags"
    """Where the numbers come from (a profile name and its publication, a file, flags)."""

    def __post_init__(self) -> None:
        for c in CLASSES:
            _nonneg("Rates", c, getattr(self, c), unit="failures per node-hour")
        if self.total() <= 0:
            raise TorError("Rates: every class rate is 0; expected at least one failure rate per node-hour > 0 "
                             "(pass --profile NAME, --rates FILE or --rate-node etc.)")

    def total(self) -> float:
        return math.fsum(getattr(self, c) for c in CLASSES)

    def as_dict(self) -> dict[str, float]:
        return {c: getattr(self, c) for c in CLASSES}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str) -> "Rates":
        """From ``{"process": r, "node": r, ...}`` per node-hour, or with ``"per": "gpu-hour"`` and
        ``"gpus_per_node": G`` to convert per-GPU rates. Unknown keys are an error (a typo would read as 0)."""
        per = data.get("per", "node-hour")
        known = set(CLASSES) | {"per", "gpus_per_node", "source"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TorError(f"rates {source}: unknown key(s) {unknown}; expected {', '.join(CLASSES)} (failures "
                             "per node-hour), optionally 'per': 'node-hour'|'gpu-hour' and 'gpus_per_node'")
        if per not in ("node-hour", "gpu-hour"):
            raise TorError(f"rates {source}: per={per!r}; expected 'node-hour' or 'gpu-hour'")
        scale = 1.0
        if per == "gpu-hour":
            gpn = data.get("gpus_per_node")
            _count("rates", "gpus_per_node", gpn, low=1)
            scale = float(gpn)
        vals = {c: float(data.get(c, 0.0)) * scale for c in CLASSES}
        return cls(**vals, source=str(data.get("source", source)))


@dataclass(kw_only=True)
class Cluster:
    """The job's cluster: its size, racks, parity groups and spare nodes."""

    nodes: int
    """Nodes the job trains on (spares not included)."""
    gpus_per_node: int = 8
    rack_nodes: int = 16
    """Nodes per rack (failure domain of a ``rack`` event)."""
    group_nodes: int = 8
    """Parity group size n: ranks with the same (TP, PP) coordinates on n different nodes (docs/parity.md)."""
    parity_m: int = 1
    """Members a group may lose and still rebuild from parity (RS(n-m, m)); 0 = memory-only snapshots."""
    spares: int = 0
    """Idle nodes that replace a lost node at once; without one the job waits ``Costs.replace_wait_s``."""
    spread: bool = True
    """The placement rule: every parity group has at most one member per rack, so a rack event costs each
    group one member. False: groups are consecutive nodes, so a rack holds min(n, rack_nodes) members."""
    model_parallel_gpus: int | None = None
    """GPUs one model replica spans (tensor x pipeline x context parallel); None = one node. The data-parallel
    size is D = nodes x gpus_per_node // model_parallel_gpus; only the shrink policy reads it."""
    global_batch: int | None = None
    """The global batch in micro-batches (global batch size / micro-batch size), a multiple of D: a reduced
    size D' must divide it to keep the batch. None = any D' (the most the shrink policy can keep)."""

    def __post_init__(self) -> None:
        _count("Cluster", "nodes", self.nodes, low=1)
        _count("Cluster", "gpus_per_node", self.gpus_per_node, low=1)
        _count("Cluster", "rack_nodes", self.rack_nodes, low=1)
        _count("Cluster", "group_nodes", self.group_nodes, low=1)
        _count("Cluster", "parity_m", self.parity_m, low=0)
        _count("Cluster", "spares", self.spares, low=0)
        if self.group_nodes > self.nodes:
            raise TorError(f"Cluster(group_nodes={self.group_nodes}): a parity group cannot have more members "
                             f"than the job has nodes ({self.nodes}); pass a smaller --group-nodes")
        if self.parity_m >= self.group_nodes and self.parity_m > 0:
            raise TorError(f"Cluster(parity_m={self.parity_m}): expected m < group size {self.group_nodes} "
                             "(RS(n-m, m) needs at least one data member); pass a smaller --parity-m")
        if self.model_parallel_gpus is not None:
            _count("Cluster", "model_parallel_gpus", self.model_parallel_gpus, low=1)
        if self.dp < 1:
            raise TorError(f"Cluster(model_parallel_gpus={self.model_parallel_gpus}): one model replica needs more "
                             f"GPUs than the job's {self.gpus}; pass a smaller --model-parallel-gpus")
        if self.global_batch is not None:
            _count("Cluster", "global_batch", self.global_batch, low=1)
            if self.global_batch % self.dp:
                raise TorError(f"Cluster(global_batch={self.global_batch}): expected a multiple of the data-parallel "
                                 f"size D = {self.dp} (each rank runs global_batch / D micro-batches per step); "
                                 "pass --global-batch in micro-batches, or leave it out (any D' allowed)")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        """The data-parallel size D: whole model replicas on the job's GPUs."""
        return self.gpus // (self.model_parallel_gpus or self.gpus_per_node)

    @property
    def members_per_rack(self) -> int:
        """Members of one parity group that one rack holds (what a rack event takes from each group it hits)."""
        return 1 if self.spread else min(self.group_nodes, self.rack_nodes)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gpus": self.gpus, "members_per_rack": self.members_per_rack, "dp": self.dp}


@dataclass(kw_only=True)
class Costs:
    """What each step of a recovery and each snapshot costs, in seconds (wall time of the whole job).

    The defaults are illustrative round numbers for a large job (docs/tor.md says where each comes from);
    measure yours (``--from RUN_DIR``, a bench JSON) or pass them.
    """

    detect_s: float = 60.0
    """Fault to detection (watchdog, NCCL timeout, health check)."""
    restart_s: float = 120.0
    """Detection to trainers started again (scheduler, rendezvous, swapping in a spare)."""
    startup_s: float = 180.0
    """Trainer start to ready, restore excluded (imports, process groups, model build, warm-up)."""
    restore_memory_s: float = 5.0
    """Restore from the local holder (tier 1)."""
    restore_parity_s: float = 20.0
    """Restore with the lost members rebuilt from parity (tier 2)."""
    restore_persistent_s: float = 300.0
    """Restore from shardsafe's persistent tier (the holders' flushes)."""
    snapshot_stall_s: float = 0.5
    """Training-loop stall per in-memory snapshot (C)."""
    persist_interval_s: float = 3600.0
    """Productive seconds between versions the holders flush to the persistent tier."""
    disk_save_s: float = 60.0
    """Blocking save of one disk checkpoint (the disk-checkpoint strategy's C)."""
    disk_load_s: float = 300.0
    """Load of one disk checkpoint."""
    replace_wait_s: float = 1800.0
    """Wait for a replacement node when no spare is idle."""
    repair_h: float = 48.0
    """Hours a lost node is away (repair or replacement) before it is a spare again."""
    slow_detect_s: float = 1800.0
    """Fail-slow onset to detection (straggler detection)."""
    slowdown: float = 0.3
    """Fraction of throughput the whole job loses while one node is slow (it paces every collective)."""
    shrink_after_s: float = 180.0
    """Shrink policy: how long the launcher waits for a spare to join before it re-forms the job smaller (the
    launcher's option of that name; 0 = it never shrinks)."""
    reshard_restore_s: float = 40.0
    """Shrink policy: a restore at another data-parallel size, the re-partition included (a shrink, which also
    rebuilds the lost ranks from parity, and a grow back)."""
    source: str = "defaults"

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("source", "slowdown"):
                continue
            positive = f.name in ("persist_interval_s", "repair_h")
            _nonneg("Costs", f.name, getattr(self, f.name), positive=positive,
                    unit="hours" if f.name == "repair_h" else "seconds")
        if not _is_num(self.slowdown) or not 0.0 <= self.slowdown < 1.0:
            raise TorError(f"Costs(slowdown={self.slowdown!r}): expected a fraction in [0, 1) of throughput "
                             "lost while a node is slow")

    def recovery_s(self, restore_s: float) -> float:
        """Detection + restart + startup + the given restore: a fail-stop's wall time before training again."""
        return self.detect_s + self.restart_s + self.startup_s + restore_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "source")
