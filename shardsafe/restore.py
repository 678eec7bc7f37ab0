"""Restore: agree on the newest version every rank can restore, verify it, copy it into the live state.

Agreement uses tensors only (no pickle): every rank all-gathers the versions its holder has
sealed, the candidates are the versions present on all ranks, newest first. For a candidate,
each rank opens and verifies its payload (checksums, layout against the live tensors); only if
*every* rank verified does any rank apply it, so ranks never end up at different versions.
A torn write is never sealed, so it is never a candidate.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import manifest as mf
from .holder.client import HolderClient, HolderUnavailable
from .holder.protocol import HolderError
from .state import StateAdapter

log = logging.getLogger("shardsafe.restore")
MAX_VERSIONS = 4


@dataclass
class RestoreResult:
    version: int = -1          # -1: fresh start
    tier: str = "none"         # memory | parity | persistent | none
    seconds: float = 0.0
    nbytes: int = 0
    message: str = ""


class Collectives:
    """The two collectives restore needs, over a process group (or trivially for one rank)."""

    def __init__(self, group=None, world_size: int = 1):
        self.group, self.world_size = group, world_size

    def all_gather_versions(self, mine: list[int]) -> list[list[int]]:
        v = (sorted(mine, reverse=True) + [-1] * MAX_VERSIONS)[:MAX_VERSIONS]
        if self.world_size == 1:
            return [[x for x in v if x >= 0]]
        import torch.distributed as dist
        t = torch.tensor(v, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.group)
        return [[x for x in o.tolist() if x >= 0] for o in out]

    def all_true(self, flag: bool) -> bool:
        if self.world_size == 1:
            return flag
        import torch.distributed as dist
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item() == 1)


def restore_from_holder(adapter: StateAdapter, client: Optional[HolderClient], *, rank: int, coll: Collectives,
                        on_event: Callable[..., None] | None = None) -> RestoreResult:
    """Run on every rank at start. Returns what was restored (version -1: nothing, fresh start)."""
    emit = on_event or (lambda kind, **f: None)
    t0 = time.perf_counter()
    emit("restore_start")
    mine: list[int] = []
    if client is not None:
        try:
            mine = client.sealed_versions(rank)
        except (HolderError, HolderUnavailable) as e:
            log.warning("[rank %d] cannot list snapshots from the holder: %s", rank, e)
    everyone = coll.all_gather_versions(mine)
    common = sorted(set.intersection(*map(set, everyone)), reverse=True) if everyone else []
    res = RestoreResult()
    if not common:
        if any(everyone):
            res.message = (f"no snapshot version is held for every rank (per-rank versions: {everyone}); starting fresh")
        else:
            res.message = "no snapshot in memory for this job: starting fresh"
    live = adapter.capture().tensors
    for version in common:
        manifest, mm, bad = None, None, ["not opened"]
        try:
            manifest, mm = client.open(rank=rank, version=version)
            mf.check_matches(manifest, live, getattr(adapter, "optional_prefixes", ()))
            buf = memoryview(mm)
            try:
                bad = mf.verify(manifest, buf)
            finally:
                buf.release()
        except (HolderError, HolderUnavailable, mf.ManifestError, OSError, KeyError) as e:
            bad = [str(e)]
        if bad:
            log.error("[rank %d] snapshot version %d failed verification, not loaded: %s", rank, version, "; ".join(bad[:5]))
        if not coll.all_true(not bad):
            if mm is not None:
                mm.close()
            log.warning("[rank %d] version %d is not restorable on every rank; trying an older one", rank, version)
            continue
        views = mf.views(manifest, mm)
        adapter.apply(views, mf.from_jsonable(manifest["meta"]))
        del views
        mm.close()
        res = RestoreResult(version=version, tier="memory", seconds=time.perf_counter() - t0,
                            nbytes=manifest["payload_nbytes"], message=f"restored version {version} from holder memory")
        break
    else:
        if common:
            res.message = f"none of the in-memory versions {common} verified on every rank; starting fresh"
    res.seconds = time.perf_counter() - t0
    emit("restore_end", tier=res.tier, version=res.version, seconds=res.seconds, bytes=res.nbytes)
    return res
