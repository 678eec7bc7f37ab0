"""What the holders of a job's nodes hold, at any data-parallel size, and which version of which earlier layout a
restore at another size can use (the restore itself is :mod:`.reshard_restore`).

A holder keys its slots by the rank that sealed them. Once the job re-forms at another data-parallel size those
keys are the *old* ranks (the **sources**), on the nodes they ran on, and a current rank can map only its own
node's holder. So a restore at another size starts with a survey: each node's lowest rank lists its holder and
reads the manifests of what it holds (world size, timeline, parallel coordinates; for parity slots the group they
protect), and one JSON gather over the job's hierarchy tells every rank what every node holds. From the survey
every rank computes the same :class:`Choice`: the newest version of one layout (world size and timeline) whose
every source is either held by a node the job runs on or rebuildable from the parity the survivors hold (at most
m lost per parity group), and the current rank that **serves** each held source (it verifies the source and
sends what targets on other nodes need) and each parity share a rebuild reads.

A holder whose node no longer runs a rank cannot be read: its sources count as lost, like those of a node that
died. Whether a survey is needed at all is known from the first gather of every restore (each node's lowest rank
reads the world size of every sealed payload in its holder's listing: shardsafe.snapshot.inventory), so a restart at
the same size pays nothing more.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .. import collectives
from ..holder.protocol import HolderFailure

log = logging.getLogger(__name__)

DISK = "<persistent>"
"""The "node" of sources read from the persistent tier: a shared directory every rank reads by itself."""


@dataclass(frozen=True)
class Held:
    """One sealed data payload: source rank ``key``'s ``version``, taken at world size ``world`` on ``timeline``,
    held by ``node``'s holder (``sealing``: the holder's count of seals when it was sealed), at data-parallel index
    ``dp`` of the model-parallel slice (``tp``, ``pp``)."""
    key: int
    version: int
    world: int
    timeline: int
    node: str
    sealing: int
    dp: int
    tp: int
    pp: int


@dataclass(frozen=True)
class HeldParity:
    """One sealed parity slot: source rank ``key``'s shares of ``version`` (its data taken at ``world`` on
    ``timeline``) on ``node``, protecting parity group ``group`` (``{"index", "members", "nodes", "k", "m"}``) with
    chunks of ``chunk_size`` bytes of ``code``; ``coords``: every member's (dp, tp, pp) as its manifest says."""
    key: int
    version: int
    world: int
    timeline: int
    node: str
    group: dict
    chunk_size: int
    code: dict
    coords: dict


@dataclass
class Survey:
    """Everything the reachable holders hold (the same on every rank), and the holders that could not be read."""
    data: list[Held] = field(default_factory=list)
    parity: list[HeldParity] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)

    def candidates(self, world_size: int) -> list[tuple[int, int, int]]:
        """(version, world size, timeline) of every layout's versions, newest first (at one version the current
        size first: it needs no re-partition)."""
        seen = {(h.version, h.world, h.timeline) for h in self.data}
        return sorted(seen, key=lambda c: (c[0], c[1] == world_size, c[1], c[2]), reverse=True)


@dataclass(frozen=True)
class Source:
    """Where a restore reads source rank ``key`` from: ``where`` is "holder" (``node``'s holder; ``server`` is the
    current rank on that node that verifies it and sends it to targets on other nodes), "rebuilt" (lost: decoded
    from parity by a current rank the restore assigns) or "disk" (the persistent tier; ``server`` verifies it)."""
    key: int
    dp: int
    tp: int
    pp: int
    where: str
    node: Optional[str] = None
    server: Optional[int] = None
    sealing: int = 0

    @property
    def slice(self) -> tuple[int, int]:
        return (self.tp, self.pp)


@dataclass
class LostGroup:
    """A parity group of the source layout with lost members: its record, chunk size and code, the lost members,
    and for every survivor the current rank that reads its data chunks (its source's server) and its parity shares
    (``parity_server``). ``manifests_from`` sends the lost members' manifests (kept in every parity manifest)."""
    group: dict
    chunk_size: int
    code: dict
    lost: list[int]
    parity_server: dict[int, int]
    manifests_from: int


@dataclass
class Choice:
    """One version of one source layout and how each of its sources is reached."""
    version: int
    world: int
    timeline: int
    sources: dict[int, Source]
    groups: list[LostGroup] = field(default_factory=list)

    @property
    def lost(self) -> list[int]:
        return sorted(k for k, s in self.sources.items() if s.where == "rebuilt")

    @property
    def tier(self) -> str:
        if any(s.where == "disk" for s in self.sources.values()):
            return "persistent"
        return "parity" if self.lost else "memory"


# ---- the collective part ----------------------------------------------------------------------------------------

def leads_node(nodes: Sequence[str], rank: int) -> bool:
    """Whether ``rank`` is the lowest rank of its node (the one that speaks for the node's holder)."""
    return list(nodes).index(nodes[rank]) == rank


def world_sizes(client: Any, listing: Optional[dict] = None) -> set[int]:
    """The world sizes of the sealed data payloads in ``listing`` (the holder's ``list`` answer; None: listed
    here), from each slot's listing or, where a holder does not list it, its manifest."""
    sizes = set()
    for key, kinds in (client.list() if listing is None else listing).items():
        for s in kinds.get("data", []):
            if s.get("state") != "sealed":
                continue
            w = s.get("world_size")
            if w is None:   # a holder that does not list it: its manifest says
                man, mm = client.open(rank=int(key), version=int(s["version"]), populate=False)
                mm.close()
                w = man.get("world_size")
            if w is not None:
                sizes.add(int(w))
    return sizes


def survey(client: Any, *, rank: int, nodes: Sequence[str], coll: Any) -> Survey:
    """Collective: what every node's holder holds, from each node's lowest rank (one JSON gather)."""
    mine = None
    if leads_node(nodes, rank):
        mine = {"node": nodes[rank], "data": [], "parity": [], "why": ""}
        if client is None:
            mine["why"] = "no holder"
        else:
            try:
                _read_holder(client, mine)
            except (HolderFailure, OSError, ValueError, KeyError) as e:
                mine["why"] = str(e) or type(e).__name__
    out = Survey()
    for rec in collectives.gather_json(mine, coll.hier, coll.world_size):
        if rec is None:
            continue
        if rec["why"]:
            out.unread.append(f"{rec['node']}: {rec['why']}")
        out.data += [Held(**d) for d in rec["data"]]
        out.parity += [HeldParity(**p) for p in rec["parity"]]
    out.data.sort(key=lambda h: (h.key, h.node))
    out.parity.sort(key=lambda p: (p.key, p.node))
    return out


def coords_of(manifest: dict, key: int) -> tuple[int, int, int]:
    """(dp, tp, pp) a manifest records (snapshots without coordinates: one model-parallel slice, dp = rank)."""
    c = manifest.get("coords") or {}
    return int(c.get("dp", key)), int(c.get("tp", 0)), int(c.get("pp", 0))


def _read_holder(client: Any, rec: dict) -> None:
    node = rec["node"]
    for key, kinds in client.list().items():
        key = int(key)
        for s in kinds.get("data", []):
            if s.get("state") != "sealed":
                continue
            held = client.open_slot(rank=key, version=int(s["version"]), populate=False)
            held.mm.close()
            man = held.manifest
            dp, tp, pp = coords_of(man, key)
            rec["data"].append({"key": key, "version": int(man["version"]), "world": int(man.get("world_size", -1)),
                                "timeline": int(man.get("timeline", 0)), "node": node, "sealing": int(held.sealing),
                                "dp": dp, "tp": tp, "pp": pp})
        for s in kinds.get("parity", []):
            if s.get("state") != "sealed":
                continue
            man, mm = client.open(rank=key, version=int(s["version"]), kind="parity", populate=False)
            mm.close()
            gm = man.get("group_manifests") or {}
            mine = gm.get(str(key)) or {}
            rec["parity"].append({"key": key, "version": int(man["version"]), "world": int(mine.get("world_size", -1)),
                                  "timeline": int(mine.get("timeline", 0)), "node": node, "group": man["group"],
                                  "chunk_size": int(man["chunk_size"]), "code": man.get("code") or {},
                                  "coords": {r: list(coords_of(m, int(r))) for r, m in gm.items()}})


# ---- the choice (pure: every rank computes the same from the same survey) --------------------------------------

def choose(sv: Survey, cand: tuple[int, int, int], rank_nodes: Sequence[str],
           exclude: frozenset[int] = frozenset()) -> tuple[Optional[Choice], str]:
    """How version ``cand`` = (version, world size, timeline) can be restored on ranks placed on ``rank_nodes``, or
    (None, why not). ``exclude``: sources whose held copy failed its checksums (rebuilt from parity like lost ones)."""
    version, world, timeline = cand
    ranks_on: dict[str, list[int]] = {}
    for r, n in enumerate(rank_nodes):
        ranks_on.setdefault(n, []).append(r)
    held: dict[int, Held] = {}
    for h in sv.data:
        if (h.version, h.world, h.timeline) == cand and h.node in ranks_on and h.key not in exclude \
                and 0 <= h.key < world:
            held.setdefault(h.key, h)
    par: dict[int, HeldParity] = {}
    for p in sv.parity:
        if (p.version, p.world, p.timeline) == cand and p.node in ranks_on:
            par.setdefault(p.key, p)
    sources = {k: Source(k, h.dp, h.tp, h.pp, "holder", h.node, _spread(ranks_on[h.node], held, h), h.sealing)
               for k, h in held.items()}
    missing = [k for k in range(world) if k not in held]
    groups: list[LostGroup] = []
    for key in missing:
        if key in sources:
            continue   # rebuilt with an earlier member of its group
        rec = next((p for p in par.values() if key in p.group["members"]), None)
        if rec is None:
            return None, (f"version {version} (world size {world}): source rank {key}'s snapshot is on no node the job "
                          "runs on, and no parity share held there covers it")
        members = [int(r) for r in rec.group["members"]]
        lost = [r for r in members if r not in held]
        m = int(rec.group["m"])
        if len(lost) > m:
            return None, (f"version {version} (world size {world}): parity group {rec.group.get('index')} (ranks "
                          f"{members}) lost {len(lost)} members {lost} on nodes the job does not run on, and parity_shards"
                          f"={m} rebuilds at most {m}")
        short = [r for r in members if r not in lost and r not in par]
        if short:
            return None, (f"version {version} (world size {world}): rebuilding ranks {lost} needs the parity shares of "
                          f"ranks {short}, which no node the job runs on holds")
        pserver = {r: (sources[r].server if par[r].node == sources[r].node else _spread(ranks_on[par[r].node], par,
                                                                                         par[r]))
                   for r in members if r not in lost}
        first = min(pserver)
        groups.append(LostGroup(rec.group, rec.chunk_size, rec.code, lost, pserver, pserver[first]))
        for r in lost:
            dp, tp, pp = (rec.coords.get(str(r)) or [r, 0, 0])
            sources[r] = Source(r, int(dp), int(tp), int(pp), "rebuilt")
    return Choice(version, world, timeline, dict(sorted(sources.items())), groups), ""


def _spread(ranks: list[int], held: dict, item: Any) -> int:
    """The current rank of a node that serves ``item``: the node's ranks take its sources in turn."""
    here = sorted(k for k, h in held.items() if h.node == item.node)
    return ranks[here.index(item.key) % len(ranks)]


def disk_choice(records: list[dict], world_size: int) -> tuple[Optional[Choice], str]:
    """The newest version the persistent tier holds complete at another world size (``records``: one per rank file,
    ``{"key", "version", "world", "timeline", "dp", "tp", "pp"}``), read by every rank from the shared directory; each
    source is verified by one current rank (``server``) before any rank uses it. (None, "") when the newest
    version there is at ``world_size`` (the same-size restore reads it), else (None, why not)."""
    by: dict[tuple[int, int, int], dict[int, dict]] = {}
    for r in records:
        by.setdefault((r["version"], r["world"], r["timeline"]), {})[r["key"]] = r
    why = "the persistent tier holds no version of this job at another world size"
    for (version, world, timeline), keys in sorted(by.items(), reverse=True):
        if world == world_size:
            return None, ""
        if sorted(keys) != list(range(world)):
            why = f"persistent version {version} has {len(keys)} of its {world} ranks' files"
            continue
        sources = {k: Source(k, r["dp"], r["tp"], r["pp"], "disk", DISK, k % world_size) for k, r in keys.items()}
        return Choice(version, world, timeline, sources), ""
    return None, why
