"""Restore: agree on the newest version every rank can restore, verify it, copy it into the live state.

Agreement uses tensors only (no pickle): every rank all-gathers the versions its holder has
sealed, the candidates are the versions present on all ranks, newest first. For a candidate,
each rank opens and verifies its payload (checksums, layout against the live tensors); only if
*every* rank verified does any rank apply it, so ranks never end up at different versions.
A torn write is never sealed, so it is never a candidate.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import xxhash

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
    rebuilt_bytes: int = 0     # bytes this rank rebuilt from parity
    rebuild_seconds: float = 0.0
    lost_ranks: list = None    # type: ignore[assignment]
    phases: dict = None        # type: ignore[assignment]  # seconds: agree, rebuild, verify, apply
    notes: dict = None         # type: ignore[assignment]  # the adapter's account of how it applied (restore_notes)


class RestoreError(RuntimeError):
    """Snapshots exist but no version can be restored from memory; the message says what is lost and what to do."""


class Collectives:
    """The collectives restore needs, over a process group (or trivially for one rank)."""

    def __init__(self, group=None, world_size: int = 1):
        self.group, self.world_size = group, world_size

    def all_gather_versions(self, *lists: list[int]) -> list[list[list[int]]]:
        """For each rank, each of ``lists`` (newest MAX_VERSIONS versions each), as plain ints."""
        rows = [(sorted(v, reverse=True) + [-1] * MAX_VERSIONS)[:MAX_VERSIONS] for v in lists]
        flat = [x for r in rows for x in r]
        if self.world_size == 1:
            outs = [flat]
        else:
            import torch.distributed as dist
            t = torch.tensor(flat, dtype=torch.int64)
            got = [torch.empty_like(t) for _ in range(self.world_size)]
            dist.all_gather(got, t, group=self.group)
            outs = [g.tolist() for g in got]
        return [[[x for x in o[i * MAX_VERSIONS:(i + 1) * MAX_VERSIONS] if x >= 0] for i in range(len(lists))]
                for o in outs]

    def all_true(self, flag: bool) -> bool:
        if self.world_size == 1:
            return flag
        import torch.distributed as dist
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item() == 1)


def manifest_digest(manifest: dict) -> int:
    """63-bit digest of a payload's identity (version, rank, every segment checksum): two copies of a
    rank's snapshot with equal digests hold the same bytes."""
    key = json.dumps([manifest.get("version"), manifest.get("rank"), [e.get("xxh3") for e in manifest["entries"]]])
    return xxhash.xxh3_64_intdigest(key.encode()) & ((1 << 63) - 1)


class PeerPayloads:
    """Other ranks' payloads of the version being restored, read from this node's holder.

    An adapter whose re-derivation step is a collective over data-parallel peers (DeepSpeed's
    ``update_lp_params``: fp32 shard -> low-precision partition -> all-gather) can instead read the
    peers' shards straight from the node's shared memory when the node holds all of them. A peer's
    copy is used only if its digest equals the one its owner verified and voted on (``digests``,
    all-gathered before apply): a copy left on this node by an earlier placement of that rank, from
    an earlier timeline of the same version, is never mixed in. Nothing writes to a holder during a
    restore. ``available`` is collective: every rank takes the same path.
    """

    def __init__(self, client: Optional[HolderClient], version: int, coll: "Collectives", digests: list[int]):
        self.client, self.version, self.coll, self.digests = client, version, coll, digests
        self._open: dict[int, tuple] = {}

    def available(self, ranks: list[int], *, usable: bool = True) -> bool:
        """True on every rank iff every rank's holder has the verified copy of all of its ``ranks``
        and every rank found the path ``usable``. Every rank calls it at most once per apply, and
        either all ranks or none (it is a collective)."""
        ok = False
        if usable and self.client is not None:
            try:
                held = self.client.list()
                ok = all(any(s["version"] == self.version and s["state"] == "sealed"
                             for s in held.get(str(r), {}).get("data", [])) for r in ranks)
                ok = ok and all(manifest_digest(self._get(r)[0]) == self.digests[r] for r in ranks)
            except (HolderError, HolderUnavailable, OSError, KeyError) as e:
                log.info("peer payloads not available from the holder: %s", e)
                ok = False
        return self.coll.all_true(ok)

    def tensors(self, rank: int) -> dict[str, torch.Tensor]:
        """Views of ``rank``'s payload (valid until ``close``)."""
        return self._get(rank)[2]

    def meta(self, rank: int) -> dict:
        """``rank``'s snapshot metadata (decoded)."""
        return self._get(rank)[3]

    def _get(self, rank: int) -> tuple:
        if rank not in self._open:
            man, mm = self.client.open(rank=rank, version=self.version, populate=False)
            self._open[rank] = (man, mm, mf.views(man, mm), mf.from_jsonable(man["meta"]))
        return self._open[rank]

    def close(self) -> None:
        for man, mm, views, _ in self._open.values():
            views.clear()
            mm.close()
        self._open.clear()


def _plan_version(v: int, data: list[list[int]], parity: list[list[int]], exchange) -> tuple[str, list[int]] | None:
    """How version v can be restored: ("memory", []) if every rank holds it, ("parity", lost ranks) if
    every parity group misses at most m members and all survivors hold its parity, else None."""
    missing = [r for r, vs in enumerate(data) if v not in vs]
    if not missing:
        return "memory", []
    if exchange is None:
        return None
    for g in exchange.plan:
        lost = [r for r in g.members if r in missing]
        if not lost:
            continue
        if len(lost) > g.m or any(v not in parity[r] or v not in data[r] for r in g.members if r not in lost):
            return None
    return "parity", missing


def _unrecoverable_message(data: list[list[int]], nodes: list[str] | None, exchange) -> str:
    newest = max(v for vs in data for v in vs)
    missing = [r for r, vs in enumerate(data) if newest not in vs]
    where = sorted({nodes[r] for r in missing}) if nodes else []
    msg = (f"cannot restore from memory: the newest snapshot (version {newest}) is gone on ranks {missing}"
           + (f" (nodes {where})" if where else "") + " and no older version is complete or rebuildable.")
    if exchange is None:
        msg += " Parity is off (parity_group_size=1 or all ranks on one node), so a lost node's snapshots cannot be rebuilt."
    else:
        worst = [(g.index, g.m, [r for r in g.members if r in missing]) for g in exchange.plan]
        worst = [w for w in worst if len(w[2]) > w[1]]
        if worst:
            gi, m, lost = worst[0]
            msg += (f" Parity group {gi} lost {len(lost)} members {lost} but parity_shards={m} covers {m}; "
                    f"rebuilding needs parity_shards >= {len(lost)}.")
    return (msg + " Resume from your last disk checkpoint (engine.load_checkpoint / Megatron --load) with a new "
                  "shardsafe job_id, or set shardsafe.restore=false to start from scratch.")


def restore_from_holder(adapter: StateAdapter, client: Optional[HolderClient], *, rank: int, coll: Collectives,
                        on_event: Callable[..., None] | None = None, exchange=None,
                        nodes: list[str] | None = None, persist=None) -> RestoreResult:
    """Run on every rank at start. Returns what was restored (version -1: nothing, fresh start).

    Raises RestoreError when snapshots exist but none is restorable (e.g. more lost nodes than
    parity covers): silently starting from scratch would throw the whole run away.
    """
    emit = on_event or (lambda kind, **f: None)
    t0 = time.perf_counter()
    emit("restore_start")
    mine_d: list[int] = []
    mine_p: list[int] = []
    if client is not None:
        try:
            mine_d = client.sealed_versions(rank)
            mine_p = client.sealed_versions(rank, kind="parity") if exchange is not None else []
        except (HolderError, HolderUnavailable) as e:
            log.warning("[rank %d] cannot list snapshots from the holder: %s", rank, e)
    everyone = coll.all_gather_versions(mine_d, mine_p)
    data, parity = [e[0] for e in everyone], [e[1] for e in everyone]
    candidates = sorted({v for vs in data for v in vs}, reverse=True)
    res = RestoreResult(message="no snapshot in memory for this job: starting fresh")
    live = adapter.capture().tensors
    rebuilt_bytes, rebuild_s, tried = 0, 0.0, []
    why = ""   # this rank's reason for refusing the last candidate
    phases = {"agree": time.perf_counter() - t0, "rebuild": 0.0, "verify": 0.0, "apply": 0.0}
    for version in candidates:
        how = _plan_version(version, data, parity, exchange)
        if how is None:
            continue
        tier, lost = how
        tried.append(version)
        if tier == "parity":
            t1 = time.perf_counter()
            ok, nb, why = exchange.rebuild(version=version, client=client, lost=lost)
            if not coll.all_true(ok):
                if why:
                    log.error("[rank %d] rebuild of version %d from parity failed: %s", rank, version, why)
                exchange.finish_rebuild(client, version, restored=False)
                continue
            rebuilt_bytes, rebuild_s = nb, time.perf_counter() - t1
            phases["rebuild"] += rebuild_s
        t1 = time.perf_counter()
        manifest, mm, bad = _open_verified(lambda: client.open(rank=rank, version=version), adapter, live)
        if bad:
            log.error("[rank %d] snapshot version %d failed verification, not loaded: %s", rank, version, "; ".join(bad[:5]))
            why = f"rank {rank}: " + "; ".join(bad[:3])
        everywhere = coll.all_true(not bad)
        if tier == "parity":   # rebuilt slots: committed once the version verified everywhere, else dropped
            exchange.finish_rebuild(client, version, restored=everywhere)
        if not everywhere:
            if mm is not None:
                mm.close()
            log.warning("[rank %d] version %d is not restorable on every rank; trying an older one", rank, version)
            continue
        t2 = time.perf_counter()
        phases["verify"] += t2 - t1
        views = mf.views(manifest, mm)
        if getattr(adapter, "uses_peer_payloads", False):
            digests = [e[0][0] for e in coll.all_gather_versions([manifest_digest(manifest)])]
            peers = PeerPayloads(client, version, coll, digests)
            try:
                adapter.apply(views, mf.from_jsonable(manifest["meta"]), peers=peers)
            finally:
                peers.close()
        else:
            adapter.apply(views, mf.from_jsonable(manifest["meta"]))
        del views
        mm.close()
        phases["apply"] = time.perf_counter() - t2
        res = RestoreResult(version=version, tier=tier, nbytes=manifest["payload_nbytes"],
                            message=f"restored version {version} from holder memory"
                                    + (f" after rebuilding ranks {lost} from parity" if lost else ""))
        res.rebuilt_bytes, res.rebuild_seconds, res.lost_ranks = rebuilt_bytes, rebuild_s, lost
        res.phases = {k: round(v, 6) for k, v in phases.items()}
        res.notes = dict(getattr(adapter, "restore_notes", {}) or {})
        break
    else:
        # Memory could not serve (nothing held, or more losses than parity covers): the persistent tier.
        pres = _restore_persistent(adapter, persist, rank=rank, coll=coll, live=live) if persist is not None else None
        if pres is not None:
            res = pres
        elif candidates:
            res.seconds = time.perf_counter() - t0
            emit("restore_end", tier="none", version=-1, seconds=res.seconds, bytes=0)
            tried_disk = (f" The persistent tier {persist.dir} had no version complete and verified on every rank."
                          if persist is not None else " No persistent tier is configured (shardsafe.persist_dir).")
            msg = (_unrecoverable_message(data, nodes, exchange) if not tried else
                   f"none of the in-memory versions {tried} verified on every rank (corrupt snapshot, or "
                   f"one that does not fit this job{': ' + why if why else ''}); "
                   "nothing was loaded. Resume from your last disk checkpoint with a new shardsafe job_id, "
                   "or set shardsafe.restore=false to start from scratch.")
            raise RestoreError(msg + tried_disk)
    res.seconds = time.perf_counter() - t0
    emit("restore_end", tier=res.tier, version=res.version, seconds=res.seconds, bytes=res.nbytes,
         rebuilt_bytes=res.rebuilt_bytes, rebuild_seconds=res.rebuild_seconds, phases=res.phases,
         **({"notes": res.notes} if res.notes else {}))
    return res


def _open_verified(opener: Callable[[], tuple], adapter: StateAdapter, live) -> tuple:
    """Open a payload (holder slot or file) and check it: layout against the live tensors, every xxh3
    segment, then the adapter's own checks. Returns (manifest, mapping or None, problems)."""
    manifest, mm = None, None
    try:
        manifest, mm = opener()
        mf.check_matches(manifest, live, getattr(adapter, "optional_prefixes", ()))
        buf = memoryview(mm)
        try:
            bad = mf.verify(manifest, buf)
        finally:
            buf.release()
        if not bad and hasattr(adapter, "validate"):
            bad = _adapter_problems(adapter, manifest, mm)
    except (HolderError, HolderUnavailable, OSError, ValueError, KeyError, AttributeError) as e:
        bad = [str(e) or type(e).__name__]
    return manifest, mm, bad


def _adapter_problems(adapter: StateAdapter, manifest: dict, mm) -> list[str]:
    """The adapter's own checks of a verified payload (layout, optimizer config, LR schedule...), without
    touching live state. They join the vote because ``apply`` may be collective (Megatron's param
    all-gather): a snapshot that one rank would refuse must be refused by every rank before any applies."""
    views = mf.views(manifest, mm)
    try:
        return [str(p) for p in adapter.validate(views, mf.from_jsonable(manifest["meta"]))]
    except Exception as e:  # a validator bug must not leave the other ranks waiting in the vote
        return [f"{type(adapter).__name__}.validate failed: {type(e).__name__}: {e}"]
    finally:
        del views


def _restore_persistent(adapter: StateAdapter, persist, *, rank: int, coll: Collectives, live) -> Optional[RestoreResult]:
    """Newest version every rank has complete on disk and that verifies everywhere, applied in place."""
    t0 = time.perf_counter()
    mine = persist.rank_versions(rank)
    common = sorted(set.intersection(*[set(e[0]) for e in coll.all_gather_versions(mine)]), reverse=True)
    for version in common:
        manifest, mm, bad = _open_verified(lambda: persist.open(version, rank), adapter, live)
        if bad:
            log.error("[rank %d] persistent version %d in %s failed verification, not loaded: %s", rank, version,
                      persist.dir, "; ".join(bad[:3]))
        if not coll.all_true(not bad):
            if mm is not None:
                mm.close()
            continue
        views = mf.views(manifest, mm)
        adapter.apply(views, mf.from_jsonable(manifest["meta"]))
        del views
        mm.close()
        return RestoreResult(version=version, tier="persistent", seconds=time.perf_counter() - t0,
                             nbytes=manifest["payload_nbytes"],
                             message=f"restored version {version} from the persistent tier {persist.dir}")
    if common or mine:
        log.warning("[rank %d] no persistent version in %s is complete and verified on every rank (this rank has %s)",
                    rank, persist.dir, mine)
    return None
