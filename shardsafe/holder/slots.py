"""The holder's bookkeeping records: one ``Slot`` per shared-memory segment, the slots of each rank by kind.

Apart from the daemon (server.py) because its background work (background.py: flushes, scrubs) reads and
pins the same records: both import them from here, neither imports the other for them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .segments import Segment

MAX_SLOTS = 2
"""Versions a holder keeps per rank (double buffering: the last committed one is never overwritten)."""

KINDS = ("data", "parity", "manifest")


@dataclass
class Slot:
    slot_id: int
    seg: Segment
    version: int = -1
    state: str = "free"        # free | writing | sealed | corrupt
    committed: bool = False
    manifest: dict | None = None
    nbytes: int = 0            # bytes the writer asked for (payload size)
    sealed_at: float = 0.0
    pins: int = 0              # a flush or scrub is reading it: not handed out for writing
    doomed: bool = False       # dropped while pinned: closed when the last reader lets go
    scrubbed_at: float = 0.0
    sealing: int = 0           # the holder's count of seals when this content was sealed (0: never sealed): two
                               # opens that report the same one read bytes nobody was handed to write in between

    def info(self) -> dict[str, Any]:
        out = {"slot": self.slot_id, "version": self.version, "state": self.state, "committed": self.committed,
               "nbytes": self.nbytes, "capacity": self.seg.size, "scrubbed_at": self.scrubbed_at}
        # The world size a data payload was taken at: a restart can tell from one listing whether the node holds
        # snapshots of another size (a restore that re-partitions), without opening every slot.
        if self.state == "sealed" and isinstance(self.manifest, dict) and "world_size" in self.manifest:
            out["world_size"] = self.manifest["world_size"]
        return out


@dataclass
class RankEntry:
    slots: dict[str, list[Slot]] = field(default_factory=lambda: {k: [] for k in KINDS})
    last_committed: dict[str, int] = field(default_factory=lambda: {k: -1 for k in KINDS})
