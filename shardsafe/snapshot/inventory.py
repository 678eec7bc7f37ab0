"""What every rank's holder holds, agreed in one all-gather at the start of a restore.

A restart pays each collective of its restore once per failure, on every rank; where ranks outnumber cores, each
one is a round of process switches on top of its messages. The start of a restore asks three things: does any
holder keep copies taken at another world size (they are then re-partitioned, :mod:`.reshard_restore`), does
every holder keep only slots of ranks that run on its node now (else placement moves them first,
shardsafe.parity.placement), and which versions does every rank hold. The first two read the same listing of each
node's holder, and in the common restart (same size, no rank moved) nothing changes the holders between the
questions. So each node's lowest rank lists its holder once (:func:`node_checks`), and its two answers travel in
the gather of what every rank holds (:func:`gather_held`): one collective for the three. Only where a check fails
does the restore take the longer way, and then it gathers again after the slots moved.

A runtime that builds its hierarchy from the launcher's node blocks gathers every rank's place before any restore
(shardsafe.runtime): what each rank holds and its node's listing then travel in that gather as :func:`held_part`,
and :func:`held_from_parts` reads them back, so a restart's first collective answers all of it. The checks that
need every rank's node (placement's) are made from it by every rank alike.
"""
from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..holder.protocol import HolderFailure
from .reshard_survey import leads_node, world_sizes

log = logging.getLogger(__name__)
MAX_VERSIONS = 4   # the newest versions of each rank a restore's gather carries

__all__ = ["NodeChecks", "node_checks", "node_listing", "HeldEverywhere", "gather_held", "held_by", "held_part",
           "held_from_parts", "timeline_draw"]


@dataclass(frozen=True)
class NodeChecks:
    """One node's answers, from its lowest rank (every other rank answers True to both)."""
    same_size: bool = True   # its holder holds no sealed payload taken at another world size
    settled: bool = True     # it holds slots only of ranks that run on this node now (placement has nothing to do)


def node_checks(client: Any, *, rank: int, world_size: int, nodes: Sequence[str],
                settled: Callable[[dict], bool]) -> NodeChecks:
    """Local (no message): the node's lowest rank lists its holder once and answers both checks; ``settled``
    tells from that listing whether the holder keeps only slots of ranks that run on this node (placement's rule,
    shardsafe.parity.placement.settled, handed in by the runtime). A holder that cannot be listed answers as one
    that holds nothing, as each check did on its own: the restore that follows finds out what is restorable."""
    if client is None or not leads_node(nodes, rank):
        return NodeChecks()
    got = node_listing(client, rank=rank, world_size=world_size)
    return NodeChecks() if got is None else NodeChecks(same_size=got[0], settled=settled(got[1]))


def node_listing(client: Any, *, rank: int, world_size: int) -> Optional[tuple[bool, dict]]:
    """One listing of the node's holder (on the node's lowest rank): whether it holds sealed payloads of this world
    size only, and the listing (the holder's ``list`` answer); None where it cannot be listed."""
    if client is None:
        return None
    try:
        listing = client.list()
        return all(w == world_size for w in world_sizes(client, listing)), listing
    except (HolderFailure, OSError) as e:
        log.warning("[rank %d] cannot list the holder's slots (world sizes, placement): %s", rank, e)
        return None


def timeline_draw() -> int:
    """A random timeline id; rank 0's draw is every rank's (``shardsafe.snapshot.restore.new_timeline``)."""
    return secrets.randbits(62) + 1


def held_by(client: Any, rank: int, exchange: Any) -> tuple[list[int], list[int], int, bool]:
    """From one listing of this rank's slots: the sealed data and parity versions (parity only where ``exchange``
    is not None), the world size the newest data copy was taken at (-1: none, or not recorded), and whether the
    holder holds a committed copy."""
    if client is None:
        return [], [], -1, False
    try:
        info = client.list(rank).get(str(rank), {})
    except HolderFailure as e:
        log.warning("[rank %d] cannot list snapshots from the holder: %s", rank, e)
        return [], [], -1, False
    sealed = {kind: sorted((s for s in info.get(kind, []) if s["state"] == "sealed"), key=lambda s: s["version"])
              for kind in ("data", "parity")}
    data = [s["version"] for s in sealed["data"]]
    parity = [s["version"] for s in sealed["parity"]] if exchange is not None else []
    world = int(sealed["data"][-1].get("world_size", -1)) if sealed["data"] else -1
    return data, parity, world, any(s["committed"] for s in sealed["data"])


@dataclass
class HeldEverywhere:
    """The gather's result, the same on every rank (``mine_*``: this rank's own lists)."""
    mine_data: list[int]
    mine_parity: list[int]
    data: list[list[int]]        # per rank: the sealed data versions its holder holds (newest MAX_VERSIONS)
    parity: list[list[int]]      # per rank: the same for parity shares
    world_seen: list[int]        # per rank: the world size its newest data copy was taken at (-1: none)
    committed: list[bool]        # per rank: whether its holder holds a committed copy
    timeline: int                # the new timeline's id (rank 0's draw)
    same_size: bool              # every node's holder holds copies of this world size only
    settled: bool                # every node's holder holds slots only of ranks that run on it now


def gather_held(client: Any, rank: int, exchange: Any, coll: Any,
                checks: Optional[NodeChecks] = None) -> HeldEverywhere:
    """Collective (one all-gather over ``coll``, a shardsafe.snapshot.restore.Collectives): what every rank holds,
    with every node's :class:`NodeChecks` (None: not asked, both True)."""
    checks = checks or NodeChecks()
    mine_d, mine_p, world_seen, committed = held_by(client, rank, exchange)
    everyone, extra = coll.gather_versions_and(
        [mine_d, mine_p], [world_seen, timeline_draw(), int(committed), int(checks.same_size), int(checks.settled)])
    return HeldEverywhere(mine_data=mine_d, mine_parity=mine_p, data=[e[0] for e in everyone],
                          parity=[e[1] for e in everyone], world_seen=[x[0] for x in extra],
                          committed=[bool(x[2]) for x in extra], timeline=int(extra[0][1]),
                          same_size=all(x[3] for x in extra), settled=all(x[4] for x in extra))


def _newest(versions: list[int]) -> list[int]:
    """The newest MAX_VERSIONS of ``versions``, newest first (what the int gather carries)."""
    return sorted(versions, reverse=True)[:MAX_VERSIONS]


def held_part(client: Any, rank: int, listed: Optional[tuple[bool, list[int]]] = None) -> dict:
    """This rank's part of a gather that runs anyway (JSON): what it holds, its timeline draw and, on a node's
    lowest rank, ``listed``: whether its holder holds this world size only and the ranks it keeps sealed slots of
    (from :func:`node_listing`; None where it could not list, which counts as nothing held)."""
    data, parity, world, committed = held_by(client, rank, True)
    part = {"d": data, "p": parity, "w": world, "c": int(committed), "t": timeline_draw()}
    if listed is not None:
        part.update(s=int(listed[0]), o=list(listed[1]))
    return part


def held_from_parts(parts: Sequence[dict], rank: int, nodes: Sequence[str], *, parity: bool,
                    settled: Callable[[str, list[int]], bool]) -> HeldEverywhere:
    """Every rank's :func:`held_part`, in rank order, as :func:`gather_held` would have gathered it.

    Args:
        parts: the parts, one per rank.
        rank: this rank.
        nodes: every rank's node.
        parity: whether the job keeps parity (without, the parity versions are not counted, as in gather_held).
        settled: placement's rule, ``settled(node, ranks)``: whether a holder on ``node`` that keeps slots of
            ``ranks`` holds slots only of ranks that run on it now.
    """
    leaders = [(r, p) for r, p in enumerate(parts) if "s" in p]
    return HeldEverywhere(
        mine_data=list(parts[rank]["d"]), mine_parity=list(parts[rank]["p"]) if parity else [],
        data=[_newest(p["d"]) for p in parts], parity=[_newest(p["p"]) if parity else [] for p in parts],
        world_seen=[int(p["w"]) for p in parts], committed=[bool(p["c"]) for p in parts], timeline=int(parts[0]["t"]),
        same_size=all(p["s"] for _, p in leaders),
        settled=all(settled(nodes[r], [int(x) for x in p["o"]]) for r, p in leaders))
