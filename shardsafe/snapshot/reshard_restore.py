"""Restore at another data-parallel size: every rank reads only its own node's holder, sources lost with a node are
rebuilt from parity, and each target rank receives just the pieces of the old ranks' state it needs.

The job ran at D data-parallel ranks and now runs at D' (TP and PP unchanged). The holders keep the snapshots of
the D old ranks (the **sources**) where they ran; :mod:`.reshard_survey` finds the newest version every source of
one layout has, held on a node the job runs on or rebuildable from the survivors' parity, and which current rank
**serves** each held source. Then every rank, from the same facts:

1. **manifests**: each server maps the sources it serves (and each parity share a rebuild reads), and one JSON
   gather hands every rank all the sources' manifests (a lost source's survives in its group's parity manifests);
2. **plan**: per model-parallel slice, the framework's resharder (``adapter.resharder()``) says from the manifests
   alone what each target reads from each source (:meth:`~.reshard.Resharder.reads`): the plan's pieces of the
   fp32 masters and moments, and the few small tensors it takes whole. A batch the new size cannot split, or a run
   whose fingerprint differs (another data-parallel size with the same global batch is the same run), is refused;
3. **move**, posted: each target reads what its own node holds from its holder and receives the rest, one message
   per piece of each (source, target) pair on different nodes (no byte crosses the network twice); the messages
   travel during the next two steps, into buffers nothing reads before both votes passed;
4. **verify**: each server checks every xxh3 segment of what it serves, and one gather hands every rank the
   verdicts. A held copy that fails its checksums is rebuilt from parity like a lost one (once); anything else
   wrong refuses the version, and the next older one is tried;
5. **rebuild**: each target decodes the part of a lost source it reads, all targets at once (:mod:`.reshard_move`);
6. **assemble**: the resharder builds the target's state from these pieces (:class:`~.reshard.Pieces`), its flat
   tensors deferred (:class:`~.reshard.Deferred`: shapes, and where each piece goes). Every rank checks that state
   against the live one (``adapter.resharded_problems``: shapes, dtypes, layouts, metadata), and only when every
   rank's fits does any write it: each flat tensor straight into the live tensor it replaces, each byte once, from
   the holder's mapping or the received message (never a partial state: a refusal leaves the live state untouched);
7. **apply**: ``adapter.apply_resharded`` writes the rest (its copy of a flat tensor onto itself copies nothing).

Every refusal is reached by every rank alike (after a gather), so all go on to the same next candidate. When memory
cannot serve, the persistent tier is tried the same way, read by every rank from the shared directory, if it holds
the old layout complete; else :class:`Unrestorable` says what was held, why none of it fits and what to do. Per
rank the bytes read from its own node and received from other nodes are logged and go into the ``restore_end``
event (``reshard``); the tier is "memory", "parity" (a source was rebuilt) or "persistent".
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .. import collectives
from .. import fingerprint as fpr
from ..errors import ConfigError
from ..faults import PHASE_RESTORE_APPLY, PHASE_RESTORE_REBUILD, PHASE_RESTORE_VERIFY
from ..holder.protocol import HolderFailure
from ..payload import manifest as mf
from .reshard import Deferred, ReshardError, reshard
from .reshard_move import REPAIRS, Move, Opened, Refused, decode_plan, rebuild
from .reshard_survey import Choice, choose, disk_choice, leads_node, survey
from .state import StateAdapter

log = logging.getLogger(__name__)

SAME_SIZE = "same-size"
""":func:`restore_resized`'s answer when the newest restorable version is at the job's own size."""


@dataclass
class Resize:
    """What a restore at another data-parallel size needs besides what a same-size restore gets (the runtime builds
    it when :mod:`.inventory`'s checks say a holder holds another size).

    Args:
        places: every current rank's (node, dp, tp, pp), in rank order.
        recovery: rebuilds a lost source from parity (``shardsafe.parity.recovery.MemberRecovery``: tier 2 is handed
            in, never imported here); None: lost sources cannot be rebuilt.
        migrate: run before falling back to the same-size restore (the runtime's placement migration, which a restore
            at another size must not run: it would move the old ranks' payloads by their old rank numbers).
        repair: how a target decodes its part of a lost source (:func:`.reshard_move.rebuild`): "chain", the partial
            sums formed along the ranks that read the survivors (it receives each byte it decodes once), or
            "gather", the k fragments sent to it (the baseline bench/shrink_restore.py measures beside it).
    """
    places: list[tuple[str, int, int, int]]
    recovery: Optional[Callable[..., Any]] = None
    migrate: Optional[Callable[[], Any]] = None
    repair: str = "chain"

    def __post_init__(self) -> None:   # said where it is set, not at the first node loss
        if self.repair not in REPAIRS:
            raise ConfigError(f"Resize.repair must be one of {REPAIRS}; got {self.repair!r}")


@dataclass
class Resized:
    """What :func:`restore_resized` restored on this rank: the version, its tier, a one-line message, the bytes of
    this rank's state and of the payloads it rebuilt, the phases' seconds, the adapter's notes, the lost sources,
    and ``reshard``: the sizes and this rank's traffic (read from its node, received from others, sent, and
    ``fragment_bytes``: received for the parity rebuild, partial sums or fragments as ``Resize.repair`` says)."""
    version: int
    tier: str
    message: str
    nbytes: int
    rebuilt_bytes: int
    phases: dict
    notes: dict
    reshard: dict
    lost: list


@dataclass
class Unrestorable:
    """Nothing held at another data-parallel size can be restored: :attr:`message` says what and what to do."""
    message: str


@dataclass
class _Run:
    adapter: StateAdapter
    client: Any
    rank: int
    coll: Any
    resize: Resize
    persist: Any
    fingerprint: Optional[dict]
    force: bool
    on_phase: Callable[[str, int], None]   # fault injection at the restore's phases (shardsafe.faults)
    refusals: list = field(default_factory=list)
    phases: dict = field(default_factory=lambda: dict.fromkeys(
        ("survey", "verify", "rebuild", "move", "assemble", "apply"), 0.0))

    @property
    def nodes(self) -> list[str]:
        return [p[0] for p in self.resize.places]

    @property
    def my_slice(self) -> tuple[int, int]:
        return tuple(self.resize.places[self.rank][2:4])   # type: ignore[return-value]

    def gather(self, obj: Any) -> list[Any]:
        return collectives.gather_json(obj, self.coll.hier, self.coll.world_size)

    def vote(self, choice: Choice, problems: list[str], what: str) -> None:
        """Every rank's problems, gathered: any one refuses the candidate on every rank alike."""
        said = [p for r in self.gather(problems[:3]) for p in r]
        if said:
            raise Refused(f"version {choice.version} (world size {choice.world}), {what}: " + "; ".join(said[:3]))


def restore_resized(adapter: StateAdapter, client: Any, *, rank: int, coll: Any, resize: Resize, persist: Any = None,
                    fingerprint: Optional[dict] = None, force: bool = False,
                    on_phase: Optional[Callable[[str, int], None]] = None) -> "Resized | Unrestorable | str":
    """Collective, on every rank: restore the newest version of the newest layout that the holders (or, failing
    that, the persistent tier) hold complete at another data-parallel size. Returns what was restored
    (:class:`Resized`), :data:`SAME_SIZE` when the newest restorable version is at this size (the same-size restore
    takes it), or :class:`Unrestorable` (the same on every rank; nothing was applied, nothing deleted)."""
    if adapter.resharder() is None:
        return Unrestorable(
            f"the holders hold snapshots of this job taken at another world size than this one ({coll.world_size}), "
            f"and {type(adapter).__name__} cannot re-partition its state to another data-parallel size. Nothing was "
            "loaded or deleted. Run with the original world size, or export the snapshot (`shardsafe export`) and "
            "load it with your framework's resharding loader under a new shardsafe job_id.")
    run = _Run(adapter, client, rank, coll, resize, persist, fingerprint, force, on_phase or (lambda name, v: None))
    t0 = time.perf_counter()
    sv = survey(client, rank=rank, nodes=run.nodes, coll=coll)
    run.phases["survey"] = time.perf_counter() - t0
    if sv.unread and rank == 0:
        log.warning("[rank 0] holders that could not be read (their snapshots count as lost): %s", sv.unread)
    for cand in sv.candidates(coll.world_size):
        exclude: frozenset[int] = frozenset()
        for _ in range(2):
            choice, why = choose(sv, cand, run.nodes, exclude)
            if choice is None:
                run.refusals.append(why)
                break
            if choice.world == coll.world_size:
                return SAME_SIZE
            out, bad = _attempt(run, choice)
            if out is not None:
                return out
            if not bad:
                break
            exclude |= bad   # corrupt copies: rebuilt from parity like lost ones, once
    if persist is not None:
        choice, why = disk_choice(_disk_records(run), coll.world_size)
        if choice is None and not why:
            return SAME_SIZE   # the persistent tier's newest version is at this size: the same-size restore reads it
        if choice is not None:
            out, _ = _attempt(run, choice)
            if out is not None:
                return out
        else:
            run.refusals.append(why)
    return Unrestorable(_refusal_message(run))


def _refusal_message(run: _Run) -> str:
    why = " | ".join(r.rstrip(". ") for r in run.refusals[:6]) or "nothing held is complete"
    tier = (f" The persistent tier {run.persist.dir} cannot serve either." if run.persist is not None
            else " No persistent tier is configured (shardsafe.persist_dir).")
    return (f"the holders hold snapshots of this job taken at another data-parallel size, and none can be "
            f"re-partitioned to this one ({run.coll.world_size} ranks): {why}.{tier} Nothing was loaded and nothing "
            "was deleted. Restart on enough nodes for parity to rebuild what is lost (every node that still holds "
            "snapshots must run a rank), or at the original size; or resume from your last disk checkpoint "
            "(engine.load_checkpoint / Megatron --load) with a new shardsafe job_id.")


# ---- one candidate ------------------------------------------------------------------------------------------------

def _attempt(run: _Run, choice: Choice) -> tuple[Optional[Resized], frozenset[int]]:
    """Restore ``choice`` on every rank; else (None, the sources whose copies failed their checksums), the refusal
    noted in ``run.refusals``."""
    opened = Opened(run.client, run.persist)
    group = run.coll.group
    pending: Optional[Move] = None
    try:
        t0 = time.perf_counter()
        manifests, served, bad = _manifests(run, choice, opened)
        if bad:
            return None, bad
        slices = _plans(run, choice, manifests)
        plan = decode_plan(choice, manifests, slices)
        # the pieces travel while the servers hash what they serve and the targets rebuild (nothing is read from
        # them before both votes)
        pending = Move(choice, manifests, slices, {k: s.server for k, s in choice.sources.items()}, opened,
                       rank=run.rank, nodes=run.nodes, group=group)
        bad = _verify(run, choice, opened, served)
        run.phases["verify"] += time.perf_counter() - t0
        if bad:
            return None, bad
        run.on_phase(PHASE_RESTORE_VERIFY, choice.version)
        t0 = time.perf_counter()
        rebuilt, problems, fragment_bytes, decoded = {}, _fingerprint_problems(run, choice, manifests), 0, 0
        if choice.groups:
            if run.resize.recovery is None:
                problems.append(f"source ranks {choice.lost} are lost and this restore has no parity decoder")
            else:
                rebuilt, why, fragment_bytes, decoded = rebuild(choice, manifests, plan, run.resize.recovery, opened,
                                                                rank=run.rank, group=group, repair=run.resize.repair)
                problems += why
                if rebuilt:
                    run.on_phase(PHASE_RESTORE_REBUILD, choice.version)
        run.vote(choice, problems, "rebuild")
        run.phases["rebuild"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        light, traffic = pending.finish(rebuilt, run.my_slice)
        run.phases["move"] += time.perf_counter() - t0
        mine = slices[run.my_slice]
        target, problems, deferred = None, [], Deferred()
        t0 = time.perf_counter()
        try:
            with deferred:   # the flat tensors' shapes only: nothing is written before the vote
                target = reshard(light, len(mine["targets"]), run.adapter.resharder(),
                                 ranks=[mine["targets"].index(run.rank)]).ranks[0]
            problems = [str(p) for p in run.adapter.resharded_problems(target.tensors, target.meta)]
        except (ReshardError, KeyError, ValueError, RuntimeError, NotImplementedError) as e:
            # RuntimeError/NotImplementedError: a check that reads values, which the deferred shapes do not have
            problems = [f"rank {run.rank}: {type(e).__name__}: {e}"]
        run.phases["assemble"] += time.perf_counter() - t0
        run.vote(choice, problems, "check")
        t0 = time.perf_counter()
        tensors = deferred.fill(target.tensors, _live(run.adapter),
                                halfway=lambda: run.on_phase(PHASE_RESTORE_APPLY, choice.version))
        run.phases["assemble"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        run.adapter.apply_resharded(tensors, target.meta)
        run.phases["apply"] += time.perf_counter() - t0
    except Refused as e:
        run.refusals.append(str(e))
        return None, frozenset()
    finally:
        if pending is not None:   # gloo reads the mappings and writes the buffers until its messages ended
            try:
                pending.wait()
            except Exception as e:   # noqa: BLE001 -- what went wrong first is already on its way out
                log.debug("[rank %d] the pieces' messages of an abandoned attempt failed: %s", run.rank, e)
        opened.close()
    _fence(run, choice)
    d_old, d_new = len(mine["keys"]), len(mine["targets"])
    traffic.update(from_dp=d_old, to_dp=d_new, from_world=choice.world, fragment_bytes=fragment_bytes,
                   rebuilt_sources=choice.lost, rebuilt_by={str(k): sorted(v) for k, v in plan.items()})
    log.info("[rank %d] re-partitioned version %d from %d to %d data-parallel ranks (%s): %d bytes read on this node, "
             "%d received from other nodes, %d sent, %d bytes of the parity rebuild received", run.rank, choice.version,
             d_old, d_new, choice.tier, traffic["local_bytes"], traffic["remote_bytes"], traffic["sent_bytes"],
             fragment_bytes)
    where = "the persistent tier" if choice.tier == "persistent" else "holder memory"
    message = (f"restored version {choice.version} from {where}, re-partitioned from {d_old} to {d_new} data-parallel "
               "ranks" + (f" after rebuilding source ranks {choice.lost} from parity" if choice.lost else ""))
    return Resized(choice.version, choice.tier, message, sum(t.numel() * t.element_size()
                                                             for t in tensors.values()),
                   decoded, {k: round(v, 6) for k, v in run.phases.items()},
                   dict(getattr(run.adapter, "restore_notes", {}) or {}), traffic, choice.lost), frozenset()


def _live(adapter: StateAdapter) -> dict:
    """The live tensors the re-partitioned flat tensors are written into (``capture`` hands out references to the
    live state: the tensors a snapshot copies from are the ones an apply writes), or none when it cannot say."""
    try:
        return dict(adapter.capture().tensors)
    except Exception as e:   # noqa: BLE001 -- any failure only costs the direct write: new tensors, then the apply
        log.debug("capture() for the live tensors failed (%s): assembling into new tensors", e)
        return {}


def _manifests(run: _Run, choice: Choice, opened: Opened) -> tuple[dict[int, dict], dict, frozenset[int]]:
    """Each server maps the sources it serves (and each parity share a rebuild reads), every rank maps the sources
    its node holds for its slice (a target reads those itself), and one gather gives every rank every source's
    manifest (a lost source's from its group's parity manifests). Returns (manifests, what this rank verifies next:
    {"data": [source keys], "parity": [members]}, the held sources whose copies cannot be read or whose manifest
    does not describe their payload: rebuilt from parity like lost ones)."""
    mine: dict[str, Any] = {"bad": {}, "why": [], "manifests": {}}
    served: dict[str, list[int]] = {"data": [], "parity": []}
    for s in choice.sources.values():
        serve = s.server == run.rank
        reads_here = s.slice == run.my_slice and (s.where == "disk" or s.node == run.nodes[run.rank])
        if not serve and not reads_here:
            continue
        try:
            man, mm = opened.source(s, choice.version)
            if serve:
                if man.get("format") != mf.FORMAT or int(man.get("payload_nbytes", -1)) > len(mm):
                    mine["bad"][str(s.key)] = (f"its manifest (format {man.get('format')!r}, "
                                               f"{man.get('payload_nbytes')} bytes) does not describe its "
                                               f"{len(mm)}-byte payload")
                else:
                    mine["manifests"][str(s.key)] = man
                    served["data"].append(s.key)
        except (Refused, HolderFailure, OSError, ValueError, KeyError, TypeError) as e:   # said in the gather all reach
            if serve and not isinstance(e, Refused):   # unreadable where it is held: rebuilt like a lost one
                mine["bad"][str(s.key)] = f"cannot read it: {type(e).__name__}: {e}"
            else:
                mine["why"].append(f"source rank {s.key}: {e}")
    for g in choice.groups:
        for member, server in g.parity_server.items():
            if server != run.rank:
                continue
            try:
                pman, _ = opened.parity_of(member, choice.version)
                served["parity"].append(member)
                if g.manifests_from == run.rank and member == min(g.parity_server):
                    for lost in g.lost:
                        mine["manifests"][str(lost)] = pman["group_manifests"][str(lost)]
            except (HolderFailure, OSError, ValueError, KeyError) as e:
                mine["why"].append(f"rank {member}'s parity shares of version {choice.version}: {e}")
    everyone = run.gather(mine)
    bad = _bad_copies(run, choice, {int(k): v for r in everyone for k, v in r["bad"].items()}, "cannot be read")
    if bad:
        return {}, served, bad
    why = [w for r in everyone for w in r["why"]]
    if why:
        raise Refused(f"version {choice.version} (world size {choice.world}): " + "; ".join(why[:3]))
    manifests = {int(k): v for r in everyone for k, v in r["manifests"].items()}
    missing = sorted(set(choice.sources) - set(manifests))
    if missing:
        raise Refused(f"version {choice.version}: no manifest of source ranks {missing} reached every rank")
    return manifests, served, frozenset()


def _verify(run: _Run, choice: Choice, opened: Opened, served: dict) -> frozenset[int]:
    """Each server checks every xxh3 segment of the sources it serves and of the parity shares a rebuild reads, and
    one gather hands every rank every verdict. Returns the held sources whose copies fail their checksums."""
    mine: dict[str, Any] = {"bad": {}, "why": []}
    for key in served["data"]:
        man, mm = opened.source(choice.sources[key], choice.version)
        bad = mf.verify_mapping(man, mm, populate=True)
        if bad:
            mine["bad"][str(key)] = "; ".join(bad[:2])
    for member in served["parity"]:
        pman, pmm = opened.parity_of(member, choice.version)
        bad = mf.verify_mapping(pman, pmm)
        if bad:
            mine["why"].append(f"rank {member}'s parity shares of version {choice.version} fail their "
                               f"checksums ({'; '.join(bad[:2])})")
    everyone = run.gather(mine)
    bad = _bad_copies(run, choice, {int(k): v for r in everyone for k, v in r["bad"].items()}, "fail their checksums")
    why = [w for r in everyone for w in r["why"]]
    if why and not bad:
        raise Refused(f"version {choice.version} (world size {choice.world}): " + "; ".join(why[:3]))
    return bad


def _bad_copies(run: _Run, choice: Choice, bad: dict[int, str], what: str) -> frozenset[int]:
    """The held copies that cannot serve, said once; refused when one of them has no parity to be rebuilt from."""
    if not bad:
        return frozenset()
    said = "; ".join(f"rank {k}: {v}" for k, v in sorted(bad.items())[:2])
    if any(choice.sources[k].where != "holder" for k in bad):   # no parity to repair them with
        raise Refused(f"version {choice.version}: source ranks {sorted(bad)} {what} ({said})")
    if run.rank == 0:
        log.warning("[rank 0] version %d: the copies of source ranks %s %s (%s); rebuilding them from parity",
                    choice.version, sorted(bad), what, said)
    return frozenset(bad)


def _plans(run: _Run, choice: Choice, manifests: dict[int, dict]) -> dict:
    """Per model-parallel slice: its sources and targets in data-parallel order, their metadata and what each target
    reads from each source (the resharder's, from the manifests alone)."""
    src: dict[tuple[int, int], dict[int, int]] = {}
    for s in choice.sources.values():
        src.setdefault(s.slice, {})[s.dp] = s.key
    dst: dict[tuple[int, int], dict[int, int]] = {}
    for r, (_, dp, tp, pp) in enumerate(run.resize.places):
        dst.setdefault((tp, pp), {})[dp] = r
    if set(src) != set(dst):
        raise Refused(f"version {choice.version}: its model-parallel slices (tp, pp) {sorted(src)} are not this job's "
                      f"{sorted(dst)}: only the data-parallel size may change")
    resharder = run.adapter.resharder()
    slices = {}
    for sl in sorted(src):
        keys = [src[sl][d] for d in sorted(src[sl])]
        targets = [dst[sl][d] for d in sorted(dst[sl])]
        if sorted(src[sl]) != list(range(len(keys))) or sorted(dst[sl]) != list(range(len(targets))):
            raise Refused(f"version {choice.version}: slice {sl} has data-parallel indices {sorted(src[sl])} -> "
                          f"{sorted(dst[sl])}, expected 0..D-1 on both sides")
        metas = [mf.from_jsonable(manifests[k]["meta"]) for k in keys]
        try:
            reads = resharder.reads(metas, [manifests[k]["entries"] for k in keys], len(targets))
        except (ReshardError, KeyError, ValueError) as e:
            raise Refused(f"version {choice.version} cannot be re-partitioned from {len(keys)} to {len(targets)} "
                          f"data-parallel ranks: {e}") from None
        slices[sl] = {"keys": keys, "targets": targets, "metas": metas, "reads": reads}
    return slices


def _fingerprint_problems(run: _Run, choice: Choice, manifests: dict[int, dict]) -> list[str]:
    """Why the sources of this rank's slice are another run's (shardsafe/fingerprint.py: another data-parallel size
    with the same global batch is the same run)."""
    if run.fingerprint is None:
        return []
    for s in choice.sources.values():
        if s.slice != run.my_slice:
            continue
        diff = fpr.differences(manifests[s.key].get("fingerprint"), run.fingerprint)
        if not diff:
            continue
        if run.force:
            log.warning("[rank %d] resume \"force\": re-partitioning another run's version %d: %s", run.rank,
                        choice.version, "; ".join(diff[:3]))
            return []
        return [f"source rank {s.key} is another run's snapshot (its fingerprint differs: {diff[0]}). Nothing of it "
                "is applied: keep the global batch (gradient_accumulation_steps x data-parallel size) and every "
                "other setting, or start with resume \"never\" or a new job_id"]
    return []


# ---- around the attempt -------------------------------------------------------------------------------------------

def _fence(run: _Run, choice: Choice) -> None:
    """After the apply: every newer copy the node holds goes (the abandoned branch), and the restored version's held
    copies are committed again, so the holder keeps them until a version at the new size commits (the runtime then
    drops them). The node's lowest rank does it."""
    if run.client is None or choice.tier == "persistent" or not leads_node(run.nodes, run.rank):
        return
    try:
        for key, kinds in run.client.list().items():
            key = int(key)
            for kind in ("data", "parity"):
                for s in kinds.get(kind, []):
                    if s["version"] > choice.version:
                        run.client.drop(rank=key, version=s["version"], kind=kind)
                    elif s["version"] == choice.version and s["state"] == "sealed" and key in choice.sources:
                        run.client.commit(ranks=[key], version=s["version"], kind=kind)
    except (HolderFailure, OSError) as e:
        log.warning("[rank %d] could not fence newer versions / keep version %d in the holder: %s", run.rank,
                    choice.version, e)


def drop_old_layout(client: Any, *, rank: int, node: str, nodes: list[str], version: int) -> None:
    """After a restore at another size, once ``version`` committed at the new size on every rank (the runtime calls
    it from its commit hook): the copies the restore re-partitioned from are no longer the newest protection. Each
    rank drops its own older versions (its rank number's copies from the old layout), and each node's lowest rank
    the copies of ranks that do not run on its node now (the old layout's other ranks): the holders keep the new
    layout alone, within the budget it was sized for."""
    if client is None:
        return
    try:
        for kind in ("data", "parity"):
            for v in client.sealed_versions(rank, kind):
                if v < version:
                    client.drop(rank=rank, version=v, kind=kind)
        if leads_node(nodes, rank):
            here = {r for r, n in enumerate(nodes) if n == node}
            stale = sorted(int(r) for r in client.list() if int(r) not in here)
            for kind in ("data", "parity"):
                if stale:
                    client.drop(ranks=stale, kind=kind)
    except (HolderFailure, OSError) as e:   # their memory stays taken until a restart's placement drops them
        log.warning("[rank %d] the old layout's copies were not dropped from the holder: %s", rank, e)


def _disk_records(run: _Run) -> list[dict]:
    """The persistent tier's newest versions, one record per rank file, as rank 0 reads them (every rank takes rank
    0's answer: one view of a directory a flush may be writing)."""
    recs = []
    if run.rank == 0:
        try:
            for v in sorted(run.persist.versions(), reverse=True)[:4]:
                d = run.persist.version_dir(v)
                for name in sorted(n for n in os.listdir(d) if n.startswith("rank") and n.endswith(".json")):
                    with open(os.path.join(d, name)) as f:
                        man = json.load(f)
                    c, key = man.get("coords") or {}, int(man["rank"])
                    recs.append({"key": key, "version": int(man["version"]), "world": int(man.get("world_size", -1)),
                                 "timeline": int(man.get("timeline", 0)), "dp": int(c.get("dp", key)),
                                 "tp": int(c.get("tp", 0)), "pp": int(c.get("pp", 0))})
        except (OSError, ValueError, KeyError) as e:
            log.warning("[rank 0] the persistent tier %s cannot be listed: %s", run.persist.dir, e)
    return run.gather(recs)[0]
