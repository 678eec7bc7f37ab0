"""Restore: agree on the newest version every rank can restore, verify it, copy it into the live state.

Agreement uses tensors only (no pickle): every rank all-gathers the versions its holder has
sealed, the candidates are the versions present on all ranks, newest first. For a candidate,
each rank opens and verifies its payload (checksums, layout against the live tensors; the checksums may have
been verified while the trainer started, by the early open of that same sealed slot); only if
*every* rank verified does any rank apply it, so ranks never end up at different versions.
A torn write is never sealed, so it is never a candidate.

Snapshots taken at another world size (the job re-formed at another data-parallel size) are not this path's:
:mod:`.reshard_restore` re-partitions them, and hands back here only when the newest restorable version is at
this size.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional


from .. import collectives
from ..errors import ShardsafeError
from ..faults import PHASE_RESTORE_APPLY, PHASE_RESTORE_VERIFY
from ..holder.client import HolderClient
from ..holder.early_open import EarlyOpen
from ..holder.protocol import HolderFailure
from ..payload import manifest as mf
from .inventory import MAX_VERSIONS, HeldEverywhere, gather_held, timeline_draw
from .peers import PeerPayloads, manifest_digest
from .pinning import PinnedMapping
from .reshard_restore import SAME_SIZE, Resize, Resized, restore_resized
from .state import StateAdapter
from .verify import open_verified

if TYPE_CHECKING:   # the exchange imports the holder client and the codec; the restore needs it only typed
    from ..parity.exchange import ParityExchange

log = logging.getLogger(__name__)


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
    timeline: int = 0          # the id every snapshot of this attempt carries (a new branch starts at `version`)
    repaired_ranks: list = None  # type: ignore[assignment]  # ranks whose copy failed its checksums, rebuilt from parity
    reshard: dict = None       # type: ignore[assignment]  # restored at another data-parallel size: sizes, traffic
    vote_rows: list = None     # type: ignore[assignment]  # every rank's ``vote_extra`` ints, from the vote that passed


class RestoreError(RuntimeError, ShardsafeError):
    """Snapshots exist but no version can be restored from memory; the message says what is lost and what to do."""


class Collectives:
    """The collectives restore needs, over a process group (or trivially for one rank).

    ``group``: the gloo group slots move on point to point (placement); ``hier``: the
    :class:`shardsafe.hierarchy.Hierarchy` every vote and gather runs on (None: ``group``, a ring)."""

    def __init__(self, group=None, world_size: int = 1, hier=None):
        self.group, self.world_size = group, world_size
        self.hier = hier if hier is not None else group

    def all_gather_versions(self, *lists: list[int]) -> list[list[list[int]]]:
        """For each rank, each of ``lists`` (newest MAX_VERSIONS versions each), as plain ints."""
        return self.gather_versions_and(list(lists), [])[0]

    def gather_versions_and(self, lists: list[list[int]], extra: list[int]) -> tuple[list[list[list[int]]], list[list[int]]]:
        """:meth:`all_gather_versions` of ``lists`` and every rank's ``extra`` ints (one length on every rank), in
        one all-gather: (for each rank its lists, for each rank its extra)."""
        rows = [(sorted(v, reverse=True) + [-1] * MAX_VERSIONS)[:MAX_VERSIONS] for v in lists]
        outs = self.gather_ints([x for r in rows for x in r] + [int(x) for x in extra])
        n = len(lists) * MAX_VERSIONS
        return ([[[x for x in o[i * MAX_VERSIONS:(i + 1) * MAX_VERSIONS] if x >= 0] for i in range(len(lists))]
                 for o in outs], [o[n:] for o in outs])

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same length on every rank), in rank order."""
        return collectives.gather_ints(values, self.hier, self.world_size)

    def all_true(self, flag: bool) -> bool:
        return collectives.all_true(flag, self.hier, self.world_size)


def _plan_version(v: int, data: list[list[int]], parity: list[list[int]],
                  exchange: Optional[ParityExchange]) -> tuple[str, list[int]] | None:
    """How version v can be restored: ("memory", []) if every rank holds it, ("parity", lost ranks) if
    every parity group misses at most m members and all survivors hold its parity, else None."""
    missing = [r for r, vs in enumerate(data) if v not in vs]
    if not missing:
        return "memory", []
    if exchange is None or not exchange.can_rebuild(v, missing, data, parity):
        return None
    return "parity", missing


def _unrecoverable_message(data: list[list[int]], nodes: list[str] | None, exchange: Optional[ParityExchange],
                           advice: bool = True) -> str:
    newest = max(v for vs in data for v in vs)
    missing = [r for r, vs in enumerate(data) if newest not in vs]
    where = sorted({nodes[r] for r in missing}) if nodes else []
    msg = (f"cannot restore from memory: the newest snapshot (version {newest}) is gone on ranks {missing}"
           + (f" (nodes {where})" if where else "") + " and no older version is complete or rebuildable.")
    if exchange is None:
        msg += " Parity is off (parity_group_size=1 or all ranks on one node), so a lost node's snapshots cannot be rebuilt."
    else:
        worst = exchange.beyond_parity(missing)
        if worst:
            gi, m, lost = worst[0]
            msg += (f" Parity group {gi} lost {len(lost)} members {lost} but parity_shards={m} covers {m}; "
                    f"rebuilding needs parity_shards >= {len(lost)}.")
    if not advice:
        return msg
    return (msg + " Resume from your last disk checkpoint (engine.load_checkpoint / Megatron --load) with a new "
                  "shardsafe job_id, or set shardsafe.resume=\"never\" to start from scratch.")


# Per-rank outcome of opening and verifying one copy, voted on with the copy's timeline.
_OK, _CORRUPT, _REFUSED = 0, 1, 2


def new_timeline(coll: Collectives) -> int:
    """A fresh timeline id, the same on every rank (rank 0's random draw): every snapshot sealed from now on
    carries it, so copies made by an abandoned branch can never be combined with this branch's."""
    return int(coll.gather_ints([timeline_draw()])[0][0])


@dataclass
class _Attempt:
    """What one restore call has found so far (for the result, the events and the error message)."""
    rank: int
    phases: dict
    tried: list
    refusals: list          # "version v: why" for every refused version (this rank's reasons)
    rebuilt_bytes: int = 0
    rebuild_s: float = 0.0
    on_phase: Callable[[str, int], None] = None   # type: ignore[assignment]  # fault injection hook
    h2d: str = "pinned"     # restore_h2d: how copies into GPU tensors read the mapping (pinning.py)
    early: Optional[EarlyOpen] = None   # this rank's slot, mapped while the trainer started (holder/early_open.py)
    fingerprint: Optional[dict] = None   # the starting run's (shardsafe/fingerprint.py); None: not compared
    force: bool = False                  # resume "force": another run's fingerprint is applied anyway, said loudly
    vote_extra: Optional[Callable[[Optional[dict]], list[int]]] = None   # restore_from_holder's ``vote_extra``


def restore_from_holder(adapter: StateAdapter, client: Optional[HolderClient], *, rank: int, coll: Collectives,
                        on_event: Callable[..., None] | None = None, exchange: Optional[ParityExchange] = None,
                        nodes: list[str] | None = None, persist=None,
                        on_phase: Callable[[str, int], None] | None = None, h2d: str = "pinned",
                        early: Optional[EarlyOpen] = None, fingerprint: Optional[dict] = None,
                        force: bool = False, resize: Optional[Resize] = None,
                        held: Optional[HeldEverywhere] = None, started: Optional[float] = None,
                        vote_extra: Optional[Callable[[Optional[dict]], list[int]]] = None) -> RestoreResult:
    """Run on every rank at start. Returns what was restored (version -1: nothing, fresh start).

    ``h2d`` (config ``restore_h2d``): how a restore into GPU tensors reads the holder's memory, "pinned"
    (the verified mapping page-locked while it verifies, the copies are DMA; pageable if the driver refuses)
    or "pageable" (shardsafe/snapshot/pinning.py).

    ``early``: this rank's newest slot, opened with its page tables filled (and its checksums verified) while
    the trainer started (shardsafe/holder/early_open.py); its mapping is used if the version chosen is that one
    in the same shared memory, its verification only if the holder has not handed the slot to a writer since
    and the manifest is the same (else this verifies it like any other); closed here in any case.

    ``resize``: the holders hold snapshots taken at another world size (the runtime's vote said so): they are
    re-partitioned to this job's data-parallel size (shardsafe/snapshot/reshard_restore.py) unless the newest
    restorable version is at this size.

    ``held``: what every rank holds, gathered by the caller (shardsafe/snapshot/inventory.py) with nothing moved
    since; None: gathered here. Not used with ``resize`` (placement may move slots after it). ``started``: when
    the caller began the restore (``time.perf_counter()``), having emitted ``restore_start`` itself; the restore's
    seconds and its "agree" phase count from there.

    ``vote_extra``: ints of the caller's that ride in the vote on a verified copy, so that a check the caller would
    otherwise run as a collective of its own costs no message: called with the manifest this rank verified (None
    where it has none or refused it), it returns the same number of ints on every rank. Every rank's ints from the
    vote that passed come back in ``vote_rows`` of the result (None where no holder copy was applied).

    Raises RestoreError whenever any tier holds something for this job and nothing is restorable (more lost
    nodes than parity covers, every copy corrupt, snapshots of another layout): silently starting from
    scratch would throw the whole run away. Nothing refused is deleted. The one exception: ranks lost before the
    job's first commit (no holder holds a committed copy, no copy was refused): the job was not protected yet
    and starts fresh, saying so at WARNING level.
    """
    emit = on_event or (lambda kind, **f: None)
    t0 = time.perf_counter() if started is None else started
    if started is None:
        emit("restore_start")
    res = None
    if resize is not None:
        res = _resized(adapter, client, rank=rank, coll=coll, resize=resize, persist=persist, emit=emit, t0=t0,
                       early=early, fingerprint=fingerprint, force=force, on_phase=on_phase)
    if res is None:
        res = _same_size(adapter, client, rank=rank, coll=coll, emit=emit, t0=t0, exchange=exchange, nodes=nodes,
                         persist=persist, on_phase=on_phase, h2d=h2d, early=early, fingerprint=fingerprint,
                         force=force, size_checked=resize is not None, held=held if resize is None else None,
                         vote_extra=vote_extra)
    res.seconds = time.perf_counter() - t0
    emit("restore_end", tier=res.tier, version=res.version, seconds=res.seconds, bytes=res.nbytes,
         rebuilt_bytes=res.rebuilt_bytes, rebuild_seconds=res.rebuild_seconds, phases=res.phases,
         timeline=res.timeline, **({"repaired_ranks": res.repaired_ranks} if res.repaired_ranks else {}),
         **({"lost_ranks": res.lost_ranks} if res.lost_ranks else {}),
         **({"from_dp": res.reshard["from_dp"], "to_dp": res.reshard["to_dp"], "reshard": res.reshard}
            if res.reshard else {}),
         **({"notes": res.notes} if res.notes else {}))
    return res


def _same_size(adapter: StateAdapter, client, *, rank: int, coll: Collectives, emit, t0: float, exchange, nodes,
               persist, on_phase, h2d: str, early, fingerprint, force: bool, size_checked: bool,
               held: Optional[HeldEverywhere] = None,
               vote_extra: Optional[Callable[[Optional[dict]], list[int]]] = None) -> RestoreResult:
    """The restore of snapshots taken at this job's size (``size_checked``: the copies held at other sizes were
    looked at already, and the newest restorable version is at this size)."""
    # One all-gather says what every rank holds, at which world size its newest copy was taken, whether its
    # holder ever saw a commit, and the new timeline's id (rank 0's draw): each collective of a restore is paid
    # by every restart, in the ring's latency at thousands of ranks.
    if held is None:
        held = gather_held(client, rank, exchange, coll)
    data, parity, timeline = held.data, held.parity, held.timeline
    candidates = sorted({v for vs in data for v in vs}, reverse=True)
    if not size_checked:
        _check_world_size(held.world_seen, coll.world_size)
    st = _Attempt(rank, {"agree": time.perf_counter() - t0, "rebuild": 0.0, "verify": 0.0, "apply": 0.0}, [], [],
                  on_phase=on_phase or (lambda name, version: None), h2d=h2d, early=early, fingerprint=fingerprint,
                  force=force, vote_extra=vote_extra)
    live = adapter.capture().tensors
    res = None
    try:
        for version in candidates:
            res = _try_version(version, adapter, client, coll, st, data, parity, exchange, live)
            if res is not None:
                _fence_and_keep(client, rank, res.version, held.mine_data, held.mine_parity, exchange)
                break
    finally:
        if early is not None:
            early.discard()   # not claimed (no candidate, another version): its mapping goes now
    if res is not None and early is not None:
        res.notes = {**(res.notes or {}), **early.notes(res.version)}
    if res is None:
        # Memory could not serve (nothing held, or more losses than parity covers): the persistent tier.
        res, disk_refusals = (_restore_persistent(adapter, persist, rank=rank, coll=coll, live=live, h2d=h2d, st=st)
                              if persist is not None else (None, []))
        if res is None and candidates and not (st.tried or disk_refusals or any(held.committed)):
            res = _never_committed(rank, candidates, data, nodes, exchange)
        if res is None and (candidates or disk_refusals):
            emit("restore_end", tier="none", version=-1, seconds=time.perf_counter() - t0, bytes=0)
            raise RestoreError(_refusal_message(st, data, nodes, exchange, persist, disk_refusals))
        if res is None:
            res = RestoreResult(message="no snapshot in memory for this job: starting fresh"
                                + (" (nor in the persistent tier)" if persist is not None else ""))
    res.timeline = timeline
    res.phases = res.phases or {k: round(v, 6) for k, v in st.phases.items()}
    return res


def _resized(adapter: StateAdapter, client, *, rank: int, coll: Collectives, resize: Resize, persist, emit,
             t0: float, early: Optional[EarlyOpen], fingerprint, force: bool, on_phase=None) -> Optional[RestoreResult]:
    """The restore at another data-parallel size (shardsafe/snapshot/reshard_restore.py); None when the newest
    restorable version is at this size (then placement runs, and the same-size restore goes on)."""
    out = restore_resized(adapter, client, rank=rank, coll=coll, resize=resize, persist=persist,
                          fingerprint=fingerprint, force=force, on_phase=on_phase)
    if out == SAME_SIZE:
        if resize.migrate is not None:
            resize.migrate()
        return None
    if early is not None:
        early.discard()   # its slot is this rank's old one: a re-partition reads the sources another way
    if not isinstance(out, Resized):
        emit("restore_end", tier="none", version=-1, seconds=time.perf_counter() - t0, bytes=0)
        raise RestoreError(out.message)
    return RestoreResult(version=out.version, tier=out.tier, nbytes=out.nbytes, message=out.message,
                         rebuilt_bytes=out.rebuilt_bytes, rebuild_seconds=out.phases.get("rebuild", 0.0),
                         lost_ranks=out.lost, phases=out.phases, notes=out.notes, timeline=new_timeline(coll),
                         reshard=out.reshard)


def _never_committed(rank: int, candidates: list[int], data, nodes, exchange) -> RestoreResult:
    """No version is complete or rebuildable (lost ranks, not corrupt or foreign copies: those are refused), and no
    holder of this job's ranks holds a committed copy: the versions held were sealed before the job's first commit,
    when it was not protected yet (a node lost then takes copies that parity did not cover yet). Refusing would
    stop a job that lost nothing protection ever promised: it starts fresh, as it would have without shardsafe,
    and says so."""
    why = _unrecoverable_message(data, nodes, exchange, advice=False)
    msg = (f"starting fresh: no version of this job was ever committed, so it was not protected yet; the copies "
           f"held (versions {sorted(candidates)}) were sealed before the first commit and are not restorable: {why}")
    log.warning("[rank %d] %s", rank, msg)
    return RestoreResult(message=msg, notes={"never_committed": sorted(candidates)})


def _check_world_size(seen: list[int], world_size: int) -> None:
    """Snapshots of a job that ran at another world size are not 'lost ranks': say what changed. ``seen``: every
    rank's world size from shardsafe.snapshot.inventory.held_by (the same list on every rank, so every rank raises or none)."""
    sizes = {w for w in seen if w >= 0}
    if sizes and sizes != {world_size}:
        raise RestoreError(
            f"the holders hold snapshots of this job taken at world size {sorted(sizes)}, and this job runs at world "
            f"size {world_size}: shardsafe restores onto the layout it snapshotted (same ranks, same "
            "parallelism). Nothing was loaded or deleted. Run with the original world size, or export the snapshot "
            "(`shardsafe export`) and load it with your framework's resharding loader under a new shardsafe job_id.")


def _try_version(version: int, adapter: StateAdapter, client, coll: Collectives, st: _Attempt, data, parity,
                 exchange, live) -> Optional[RestoreResult]:
    """Restore ``version`` if every rank can: rebuild lost members from parity, verify every copy, repair a
    member whose copy fails its checksums from parity (once), refuse copies of two timelines, then apply."""
    rank, corrupt = st.rank, set()
    for _round in range(2):
        held = [vs if r not in corrupt else [x for x in vs if x != version] for r, vs in enumerate(data)]
        how = _plan_version(version, held, parity, exchange)
        if how is None:
            if corrupt:
                st.refusals.append(f"version {version}: ranks {sorted(corrupt)} fail their checksums and parity "
                                   "cannot rebuild them")
            return None
        tier, lost = how
        if version not in st.tried:
            st.tried.append(version)
        if tier == "parity" and not _rebuild(version, client, coll, st, exchange, lost):
            return None
        t1 = time.perf_counter()
        manifest, pin, bad, is_corrupt = open_verified(lambda: _open_held(client, st, version), adapter, live,
                                                        populate=True, h2d=st.h2d, st=st)
        status = _OK if not bad else (_CORRUPT if is_corrupt else _REFUSED)
        st.on_phase(PHASE_RESTORE_VERIFY, version)
        if bad:
            log.error("[rank %d] snapshot version %d failed verification, not loaded: %s", rank, version,
                      "; ".join(bad[:5]))
            st.refusals.append(f"version {version}: rank {rank}: " + "; ".join(bad[:3]))
        # The vote carries each copy's digest too, for an adapter that reads its peers' copies from the holder
        # (PeerPayloads checks them against it); 0 for the others (the same on every rank: a class attribute).
        digest = manifest_digest(manifest) if manifest and not bad and adapter.uses_peer_payloads else 0
        extra = st.vote_extra(manifest if manifest and not bad else None) if st.vote_extra is not None else []
        votes = coll.gather_ints([status, int(manifest.get("timeline", 0)) if manifest else -1, digest, *extra])
        st.phases["verify"] += time.perf_counter() - t1
        statuses = [v[0] for v in votes]
        newly = {r for r, x in enumerate(statuses) if x == _CORRUPT}
        timelines = {v[1] for v in votes if v[0] == _OK}
        if newly and _REFUSED not in statuses and exchange is not None and _round == 0:
            # Corrupt bytes on some members: rebuild them from parity like lost ones, then verify again.
            pin.close()
            if tier == "parity":
                exchange.finish_rebuild(client, version, restored=False)
            log.warning("[rank %d] version %d: ranks %s fail their checksums; rebuilding them from parity", rank,
                        version, sorted(newly))
            corrupt |= newly
            continue
        ok = all(x == _OK for x in statuses) and len(timelines) == 1
        if all(x == _OK for x in statuses) and len(timelines) > 1:
            st.refusals.append(f"version {version}: the ranks' copies come from {len(timelines)} different timelines "
                               "(an abandoned branch's copy next to the current one); never combined")
            log.warning("[rank %d] version %d: copies from different timelines %s; trying an older version", rank,
                        version, sorted(timelines))
        if tier == "parity":   # rebuilt slots: committed once the version verified everywhere, else dropped
            exchange.finish_rebuild(client, version, restored=ok)
        if not ok:
            pin.close()
            log.warning("[rank %d] version %d is not restorable on every rank; trying an older one", rank, version)
            return None
        res = _apply(adapter, client, coll, st, version, manifest, pin, tier, digests=[v[2] for v in votes])
        res.lost_ranks = lost
        res.repaired_ranks = sorted(corrupt)
        res.vote_rows = [v[3:] for v in votes] if st.vote_extra is not None else None
        if lost:
            res.message += (f" after rebuilding ranks {lost} from parity"
                            + (f" (ranks {sorted(corrupt)} had corrupt copies)" if corrupt else ""))
        return res
    return None


def _open_held(client: HolderClient, st: _Attempt, version: int) -> tuple[dict, object, bool, bool]:
    """(manifest, read-only mapping, whether its page tables are filled, whether its bytes verified) of this rank's
    ``version``: the early open's mapping when it is the same slot (verified already when that open verified the
    same sealing of it against the same manifest), else a fresh one mapped without MAP_POPULATE (the hash
    threads fill its page tables, each for its own segments)."""
    held = client.open_slot(rank=st.rank, version=version, populate=False)
    if st.early is not None:   # claimed once: later candidates get None
        got = st.early.claim(st.rank, version, held)
        if got is not None:
            held.mm.close()
            return held.manifest, got.mm, True, got.verified
    return held.manifest, held.mm, False, False


def _rebuild(version: int, client, coll: Collectives, st: _Attempt, exchange, lost: list[int]) -> bool:
    t1 = time.perf_counter()
    ok, nb, why = exchange.rebuild(version=version, client=client, lost=lost)
    if not coll.all_true(ok):
        if why:
            log.error("[rank %d] rebuild of version %d from parity failed: %s", st.rank, version, why)
            st.refusals.append(f"version {version}: {why}")
        exchange.finish_rebuild(client, version, restored=False)
        return False
    st.rebuilt_bytes, st.rebuild_s = nb, time.perf_counter() - t1
    st.phases["rebuild"] += st.rebuild_s
    return True


def _apply(adapter: StateAdapter, client, coll: Collectives, st: _Attempt, version: int, manifest: dict,
           pin: PinnedMapping, tier: str, *, digests: list[int]) -> RestoreResult:
    """Apply the verified ``manifest`` of ``version``; ``digests``: every rank's :func:`manifest_digest` of the copy
    it verified and voted on."""
    t2 = time.perf_counter()
    views = _HalfwayHook(mf.views(manifest, pin.mm), lambda: st.on_phase(PHASE_RESTORE_APPLY, version))
    try:
        pin.wait()
        if adapter.uses_peer_payloads:
            peers = PeerPayloads(client, version, coll, digests)
            try:
                adapter.apply(views, mf.from_jsonable(manifest["meta"]), peers=peers)
            finally:
                peers.close()
        else:
            adapter.apply(views, mf.from_jsonable(manifest["meta"]))
    finally:
        del views
        pin.close()
    st.phases["apply"] = time.perf_counter() - t2
    res = RestoreResult(version=version, tier=tier, nbytes=manifest["payload_nbytes"],
                        message=f"restored version {version} from holder memory" + _origin(manifest))
    res.rebuilt_bytes, res.rebuild_seconds = st.rebuilt_bytes, st.rebuild_s
    res.phases = {k: round(v, 6) for k, v in st.phases.items()}
    res.notes = {**adapter.restore_notes, **pin.notes()}
    return res


def _origin(manifest: dict) -> str:
    """When and by which command the restored snapshot was taken (rank 0's log line)."""
    when = manifest.get("created")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(when)) if isinstance(when, (int, float)) else "?"
    cmd = manifest.get("command")
    return f", taken {stamp}" + (f" by `{cmd}`" if cmd else "")


class _HalfwayHook(dict):
    """The payload's views, calling ``at_half`` once when the adapter looks up its second tensor by name (it has
    written the first): where a SIGKILL "mid-apply" lands, some live tensors overwritten and others not."""

    def __init__(self, views: dict, at_half: Callable[[], None]):
        super().__init__(views)
        self._left, self._at_half = 2, at_half

    def __getitem__(self, key):
        self._left -= 1
        if self._left == 0:
            self._at_half()
        return super().__getitem__(key)


def _fence_and_keep(client: Optional[HolderClient], rank: int, version: int, mine_d: list[int], mine_p: list[int],
                    exchange) -> None:
    """After restoring ``version``: drop this rank's copies of newer versions (the abandoned branch: the new
    timeline writes those versions again, and an old copy must never meet a new one), and commit the restored
    version again so the holder keeps it until a newer one commits everywhere (a second failure soon after
    must find it, also when a rank died between the vote and its commit)."""
    if client is None:
        return
    try:
        for kind, held in (("data", mine_d), ("parity", mine_p)):
            for w in held:
                if w > version:
                    client.drop(rank=rank, version=w, kind=kind)
        client.commit(ranks=[rank], version=version)
        if exchange is not None and client.sealed_versions(rank, kind="parity").count(version):
            client.commit(ranks=[rank], version=version, kind="parity")
    except (HolderFailure, OSError) as e:
        # The timeline id still keeps an abandoned copy from ever being combined with a new one.
        log.warning("[rank %d] could not fence newer versions / keep version %d in the holder: %s", rank, version, e)


def _refusal_message(st: _Attempt, data, nodes, exchange, persist, disk_refusals: list[str]) -> str:
    if not st.tried and any(data):
        msg = _unrecoverable_message(data, nodes, exchange)
    elif st.tried:
        msg = (f"none of the in-memory versions {st.tried} could be restored on every rank ("
               + " | ".join(r.rstrip(". ") for r in st.refusals[:6]) + "); nothing was loaded and nothing was deleted.")
        msg += (" Resume from your last disk checkpoint with a new shardsafe job_id, or set shardsafe.resume=\"never\" to "
                "start from scratch.")
    else:
        msg = "no in-memory snapshot of this job is held."
    if persist is None:
        return msg + " No persistent tier is configured (shardsafe.persist_dir)."
    if disk_refusals:
        return (msg + f" The persistent tier {persist.dir} holds versions of this job but none is complete and verified "
                f"on every rank: " + " | ".join(disk_refusals[:6]) + ". The files are kept as they are; move them "
                "aside or use a new shardsafe job_id to start fresh.")
    return msg + f" The persistent tier {persist.dir} holds no version of this job complete on every rank."


def _restore_persistent(adapter: StateAdapter, persist, *, rank: int, coll: Collectives, live,
                        h2d: str = "pinned", st: Optional[_Attempt] = None) -> tuple[Optional[RestoreResult], list[str]]:
    """Newest version every rank has complete on disk, verified everywhere and of one timeline, applied in place.
    Returns (result or None, this rank's reasons for refusing what the tier held)."""
    t0 = time.perf_counter()
    mine = persist.rank_versions(rank)
    held = coll.all_gather_versions(mine)
    common = sorted(set.intersection(*[set(e[0]) for e in held]), reverse=True)
    refusals: list[str] = []
    for version in common:
        manifest, pin, bad, _ = open_verified(lambda: (*persist.open(version, rank), False, False), adapter, live,
                                               h2d=h2d, st=st)
        if bad:
            log.error("[rank %d] persistent version %d in %s failed verification, not loaded: %s", rank, version,
                      persist.dir, "; ".join(bad[:3]))
            refusals.append(f"version {version}: rank {rank}: " + "; ".join(bad[:3]))
        votes = coll.gather_ints([0 if not bad else 1, int(manifest.get("timeline", 0)) if manifest else -1])
        if any(v[0] for v in votes) or len({v[1] for v in votes}) != 1:
            if not any(v[0] for v in votes):
                refusals.append(f"version {version}: copies from different timelines")
            pin.close()
            continue
        views = mf.views(manifest, pin.mm)
        try:
            pin.wait()
            adapter.apply(views, mf.from_jsonable(manifest["meta"]))
        finally:
            del views
            pin.close()
        return RestoreResult(version=version, tier="persistent", seconds=time.perf_counter() - t0,
                             nbytes=manifest["payload_nbytes"],
                             message=f"restored version {version} from the persistent tier {persist.dir}"
                                     + _origin(manifest)), []
    anything = any(e[0] for e in held)
    if anything:
        log.warning("[rank %d] no persistent version in %s is complete and verified on every rank (this rank has %s)",
                    rank, persist.dir, mine)
        if not refusals:
            refusals.append(f"rank {rank} has versions {mine}; versions complete on every rank: {common or 'none'}")
    return None, refusals
