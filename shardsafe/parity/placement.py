"""Rank placement across restarts: bring every rank's snapshots to the node the rank runs on now.

A rank's snapshot lives in the holder of the node it ran on. Torch elastic does not keep ranks on
nodes: its c10d rendezvous numbers the nodes of every round afresh (sorted by address, then agent
pid), so after a node is replaced or a spare joins, rank r may run on a node whose holder holds
rank r' (or nothing). shardsafe does not fight the rendezvous; before restoring, ranks *migrate*:

1. every rank all-gathers what its holder holds (sealed data and parity slots of any rank, as JSON
   over a uint8 tensor: no pickle);
2. every rank computes the same plan (:func:`plan_migration`): for each rank r, the node that holds
   r's newest version is the source; if r's own node lacks it, all of the source's sealed versions
   of r move (point-to-point over the restore gloo group, from the lowest rank on the source node);
3. after every rank stored what it received (sealed, and committed so a later snapshot cannot
   overwrite it), each node drops the slots of ranks that no longer run on it.

The normal restore then finds each rank's payload in its own holder; what was lost with a node is
still rebuilt from parity. When placement did not change (the common case) the listings never travel: each
node's lowest rank checks that its holder holds only its node's ranks, and one vote of one integer says so
(:func:`settled`). A failed migration leaves every holder as it was and says why.
"""
from __future__ import annotations

import json
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from ..collectives import all_true, gather_json

log = logging.getLogger(__name__)

KINDS = ("data", "parity")
_TAG = 1 << 22


@dataclass(frozen=True, order=True)
class Move:
    """Versions of one (rank, kind) that travel from ``src`` (sent by rank ``sender``) to ``dst``."""

    rank: int
    kind: str
    version: int
    src: str
    dst: str
    sender: int
    nbytes: int


@dataclass
class MigrationPlan:
    moves: list[Move] = field(default_factory=list)
    clear_first: list[tuple[int, str]] = field(default_factory=list)
    """(rank, kind) whose slots at the rank's own node are dropped before receiving: older versions
    there would otherwise be reused as write slots for the incoming ones."""
    drop_after: dict[str, list[int]] = field(default_factory=dict)
    """node -> ranks whose slots are stale there (they run elsewhere now), dropped after success."""

    @property
    def moved_ranks(self) -> list[int]:
        return sorted({m.rank for m in self.moves})


@dataclass
class MigrationResult:
    ok: bool = True
    moves: list[Move] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    dropped: int = 0
    deferred: int = 0
    """Slots this rank received into process memory (no room in its holder until stale copies were dropped)."""
    message: str = ""


Inventory = Mapping[tuple[int, str], Mapping[int, Mapping[str, Any]]]
"""(rank, kind) -> version -> {"nbytes", "capacity", "committed"} of one holder's sealed slots."""


def inventory_of(listing: Mapping[str, Any]) -> dict[tuple[int, str], dict[int, dict[str, Any]]]:
    """A holder's ``list`` answer -> :data:`Inventory` (sealed data and parity slots only)."""
    inv: dict[tuple[int, str], dict[int, dict[str, Any]]] = {}
    for rank, kinds in listing.items():
        for kind in KINDS:
            for s in kinds.get(kind, []):
                if s.get("state") == "sealed":
                    inv.setdefault((int(rank), kind), {})[int(s["version"])] = {
                        "nbytes": int(s["nbytes"]), "capacity": int(s.get("capacity", s["nbytes"])),
                        "committed": bool(s.get("committed"))}
    return inv


def plan_migration(rank_nodes: list[str], inventories: Mapping[str, Inventory]) -> MigrationPlan:
    """The moves that bring every rank's newest snapshots to its current node (pure, deterministic).

    Linear in the slots held (one pass over every inventory, then one over the ranks): it runs on every rank at
    every restart that found a slot off its rank's node, where a rank x node loop would grow as the square of the
    job (bench/placement_bench.py compares the two).

    Args:
        rank_nodes: the node every rank of the job runs on now, by rank.
        inventories: node -> what that node's holder holds (nodes without a rank now are absent:
            nobody can read their holders).
    """
    leader: dict[str, int] = {}
    for r, n in enumerate(rank_nodes):
        leader.setdefault(n, r)
    # (rank, kind) -> the node off the rank's own node with its newest version (ties: the first node in name
    # order), and the ranks each node holds that run elsewhere now
    best: dict[tuple[int, str], tuple[int, str]] = {}
    plan = MigrationPlan()
    for node in sorted(inventories):
        if node not in leader:
            continue
        stale: set[int] = set()
        for (r, kind), vs in inventories[node].items():
            if not _off_node(rank_nodes, node, r, vs):
                continue
            stale.add(r)
            top = max(vs)
            if (r, kind) not in best or top > best[(r, kind)][0]:
                best[(r, kind)] = (top, node)
        if stale:
            plan.drop_after[node] = sorted(stale)
    for (r, kind), (top, src_node) in sorted(best.items()):
        dst = rank_nodes[r]
        here = inventories.get(dst, {}).get((r, kind), {})
        if here and max(here) >= top:
            continue
        if here:
            plan.clear_first.append((r, kind))
        src = inventories[src_node][(r, kind)]
        for v in sorted(src):
            plan.moves.append(Move(r, kind, v, src_node, dst, leader[src_node], int(src[v]["nbytes"])))
    return plan


def plan_migration_reference(rank_nodes: list[str], inventories: Mapping[str, Inventory]) -> MigrationPlan:
    """The spec of :func:`plan_migration`, in its plainest form: a loop over ranks x nodes, quadratic in the job's
    size, too slow for a restart at scale. tests/unit/test_launch_pieces.py holds the two equal over random
    placements; bench/placement_bench.py times both."""
    world = len(rank_nodes)
    leader: dict[str, int] = {}
    for r, n in enumerate(rank_nodes):
        leader.setdefault(n, r)
    plan = MigrationPlan()
    for r in range(world):
        dst = rank_nodes[r]
        for kind in KINDS:
            here = inventories.get(dst, {}).get((r, kind), {})
            best = None
            for node in sorted(inventories):
                if node == dst or node not in leader:
                    continue
                vs = inventories[node].get((r, kind))
                if vs and (best is None or max(vs) > max(inventories[best][(r, kind)])):
                    best = node
            if best is None:
                continue
            src = inventories[best][(r, kind)]
            if here and max(here) >= max(src):
                continue
            if here:
                plan.clear_first.append((r, kind))
            for v in sorted(src):
                plan.moves.append(Move(r, kind, v, best, dst, leader[best], int(src[v]["nbytes"])))
    for node in sorted(inventories):
        if node not in leader:
            continue
        stale = sorted({r for (r, _k) in inventories[node] if r < world and rank_nodes[r] != node})
        if stale:
            plan.drop_after[node] = stale
    return plan


def settled(rank_nodes: list[str], node: str, inventory: Inventory) -> bool:
    """Does ``node``'s holder hold slots only of ranks that run on ``node`` now? True for every node that has a
    rank exactly when :func:`plan_migration` has nothing to move or drop (a move's source and a drop are a slot
    held off its rank's node), so the nodes can find that out with one vote instead of exchanging listings."""
    return settled_ranks(rank_nodes, node, slot_ranks(inventory))


def slot_ranks(inventory: Inventory) -> list[int]:
    """The ranks ``inventory`` holds sealed slots of: all that :func:`settled` needs of it, a few ints a node's
    lowest rank can send before anyone knows where the ranks run."""
    return sorted({r for (r, _kind), vs in inventory.items() if vs})


def settled_ranks(rank_nodes: list[str], node: str, ranks: list[int]) -> bool:
    """:func:`settled` of a holder on ``node`` that keeps slots of ``ranks`` (:func:`slot_ranks`)."""
    return not any(_off_node(rank_nodes, node, r, (True,)) for r in ranks)


def _off_node(rank_nodes: list[str], node: str, rank: int, versions: Mapping[int, Any]) -> bool:
    """Does ``node``'s holder hold versions of ``rank`` while the rank runs on another node now? Every move's
    source and every drop is such a slot (ranks beyond the world are ignored: no rank runs them)."""
    return bool(versions) and rank < len(rank_nodes) and rank_nodes[rank] != node


# ---- the collective ------------------------------------------------------------------------------------

def migrate(client, *, rank: int, world_size: int, node: str, rank_nodes: Optional[list[str]] = None,
            group=None, coll=None, settled: Optional[bool] = None) -> MigrationResult:
    """Run on every rank before restore (a collective over ``group``, every rank must call it).

    Args:
        client: this node's HolderClient, or None (this rank then has nothing to offer or receive).
        rank, world_size, node: this rank and where it runs now.
        rank_nodes: every rank's node (all-gathered here when not given).
        group: the gloo process group the slots move on, point to point (None: the default group).
        coll: what the votes and the inventories' gather run on (shardsafe.collectives: a Hierarchy in a job;
            None: ``group``).
        settled: whether every node's holder holds only slots of ranks that run on it, when every rank knows it
            already (the restore's first gather carries it: shardsafe.snapshot.inventory); None: one vote asks.
    Returns:
        What moved. Never raises for a holder problem: a rank that cannot serve or store votes no,
        and then nothing is dropped anywhere (the restore that follows decides what is restorable).
    """
    t0 = time.perf_counter()
    res = MigrationResult()
    coll = group if coll is None else coll
    if rank_nodes is not None and (settled if settled is not None else
                                   _settled_everywhere(client, rank_nodes, rank=rank, node=node, group=coll)):
        res.message = "placement: no slot to move"
        res.seconds = time.perf_counter() - t0
        return res
    gathered, inventories = _gather_inventories(client, rank=rank, world_size=world_size, node=node, group=coll)
    if rank_nodes is None:
        rank_nodes = gathered
    plan = plan_migration(rank_nodes, inventories)
    if not plan.moves and not plan.drop_after:
        res.seconds = time.perf_counter() - t0
        return res
    xfer = _Transfer(client, plan, rank=rank, node=node, group=group, res=res)
    try:
        xfer.post_sends()   # 1. every sender posts all its sends first (non-blocking): no receiver waits on a
        xfer.receive()      #    rank itself blocked receiving; 2. receivers take theirs in version order
        for q in xfer.reqs:
            q.wait()
    finally:
        xfer.close()
    if xfer.why:
        log.error("[rank %d] placement: %s", rank, xfer.why)
    res.ok = all_true(xfer.ok, coll)
    res.moves = plan.moves
    if res.ok and client is not None and rank_nodes.index(node) == rank:   # the node's lowest rank drops
        _drop_stale(client, plan.drop_after.get(node, []), rank=rank, res=res)
    res.deferred = len(xfer.deferred)
    if res.ok and all_true(not xfer.deferred, coll) is False:   # someone waits for room: the drops are done now
        xfer.store_deferred()
    res.seconds = time.perf_counter() - t0
    where = sorted({(m.rank, m.src, m.dst) for m in plan.moves})
    res.message = (f"placement: {len(plan.moves)} slot(s) of ranks {plan.moved_ranks} moved to the nodes they run on "
                   f"now ({', '.join(f'rank {r}: {s} -> {d}' for r, s, d in where)})"
                   if plan.moves else "placement: no slot to move")
    if not res.ok:
        res.message += "; FAILED on some rank, nothing dropped (see the errors above)"
    if rank == 0:
        log.info("[rank 0] %s in %.3f s", res.message, res.seconds)
    return res


def _listing(client, rank: int) -> dict:
    from ..holder.protocol import HolderFailure
    if client is None:
        return {}
    try:
        return client.list()
    except HolderFailure as e:   # as a holder without slots: the restore that follows decides
        log.warning("[rank %d] cannot list the holder's slots for placement: %s", rank, e)
        return {}


def _settled_everywhere(client, rank_nodes: list[str], *, rank: int, node: str, group) -> bool:
    """The common restart, where no rank changed node, in one vote: each node's lowest rank checks its holder
    (:func:`settled`). The listings travel only when some node says no (at 8k ranks they are ~11 MB to every
    rank, and planning over them is a pass over every node's slots)."""
    ok = True
    if node in rank_nodes and rank_nodes.index(node) == rank:
        ok = settled(rank_nodes, node, inventory_of(_listing(client, rank)))
    return all_true(ok, group)


def _gather_inventories(client, *, rank: int, world_size: int, node: str, group) -> tuple[list[str], dict[str, dict]]:
    """(every rank's node, node -> what its holder has) from one JSON all-gather; the ranks of one node share
    its holder, and its lowest rank speaks for it."""
    mine = {"node": node, "slots": [[r, k, v, i["nbytes"], i["capacity"], i["committed"]]
                                    for (r, k), vs in inventory_of(_listing(client, rank)).items()
                                    for v, i in vs.items()]}
    everyone = gather_json(mine, group, world_size)
    inventories: dict[str, dict] = {}
    for e in everyone:
        if e["node"] in inventories:
            continue
        inv: dict[tuple[int, str], dict[int, dict]] = {}
        for sr, k, v, nb, cap, com in e["slots"]:
            inv.setdefault((int(sr), k), {})[int(v)] = {"nbytes": nb, "capacity": cap, "committed": com}
        inventories[e["node"]] = inv
    return [e["node"] for e in everyone], inventories


def _drop_stale(client, stale: list[int], *, rank: int, res: MigrationResult) -> None:
    from ..holder.protocol import HolderFailure
    for kind in KINDS:
        if stale:
            try:
                res.dropped += client.drop(ranks=stale, kind=kind)
            except HolderFailure as e:
                log.warning("[rank %d] placement: cannot drop stale slots of ranks %s: %s", rank, stale, e)


class _Transfer:
    """One rank's part of a migration plan: the slots it sends and receives over ``group``. ``ok``/``why`` is
    this rank's vote and its last reason; a problem never raises (the frames the peer expects are still sent
    or drained), it votes no."""

    def __init__(self, client, plan: "MigrationPlan", *, rank: int, node: str, group, res: MigrationResult):
        self.client, self.plan, self.rank, self.node, self.group, self.res = client, plan, rank, node, group, res
        self.ok, self.why = True, ""
        self.handles: list = []
        self.reqs: list = []
        self.deferred: list[tuple[Move, dict, Any]] = []

    def _fail(self, why: str) -> None:
        self.ok, self.why = False, why

    def post_sends(self) -> None:
        import torch
        import torch.distributed as dist
        rank, group = self.rank, self.group
        for i, m in enumerate(self.plan.moves):
            if m.sender != rank:
                continue
            try:
                man, mm = self.client.open(rank=m.rank, version=m.version, kind=m.kind)
                self.handles.append(mm)
                blob = json.dumps(man).encode()
            except Exception as e:   # noqa: BLE001 - the receiver still expects the frames
                self._fail(f"rank {rank}: cannot read rank {m.rank}'s {m.kind} v{m.version} on {self.node}: {e}")
                man, mm, blob = None, None, b""
            head = torch.tensor([len(blob), len(mm) if mm is not None else 0], dtype=torch.int64)
            self.reqs.append(dist.isend(head, dst=m.rank, group=group, tag=_TAG + 3 * i))
            if blob:
                self.reqs.append(dist.isend(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst=m.rank,
                                            group=group, tag=_TAG + 3 * i + 1))
            if mm is not None and len(mm):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")   # a read-only mapping: only ever sent
                    payload = torch.frombuffer(mm, dtype=torch.uint8)
                self.reqs.append(dist.isend(payload, dst=m.rank, group=group, tag=_TAG + 3 * i + 2))

    def receive(self) -> None:
        """Clear stale versions, then receive in version order; seal + commit each, so the next acquire gets
        a fresh slot instead of reusing the one just written."""
        import torch
        import torch.distributed as dist
        from ..holder.protocol import HolderFailure
        rank, group, client = self.rank, self.group, self.client
        if any(m.rank == rank for m in self.plan.moves) and client is not None:
            for r, kind in self.plan.clear_first:
                if r == rank:
                    try:
                        client.drop(rank=rank, kind=kind)
                    except HolderFailure as e:
                        self._fail(f"rank {rank}: cannot clear stale {kind} slots: {e}")
        for i, m in enumerate(self.plan.moves):
            if m.rank != rank:
                continue
            head = torch.zeros(2, dtype=torch.int64)
            dist.recv(head, src=m.sender, group=group, tag=_TAG + 3 * i)
            n_man, n_pay = int(head[0]), int(head[1])
            man = None
            if n_man:
                b = torch.empty(n_man, dtype=torch.uint8)
                dist.recv(b, src=m.sender, group=group, tag=_TAG + 3 * i + 1)
                man = json.loads(bytes(b.numpy()))
            if not n_pay:
                self._fail(self.why or f"rank {rank}: rank {m.sender} could not send {m.kind} v{m.version}")
                continue
            dst, defer = self._slot_for(m, man, n_pay)
            if dst is None:   # receive into process memory (deferred write), or just drain the frame
                buf = torch.empty(n_pay, dtype=torch.uint8)
                dist.recv(buf, src=m.sender, group=group, tag=_TAG + 3 * i + 2)
                if defer:
                    self.deferred.append((m, man, buf))
                continue
            dist.recv(dst, src=m.sender, group=group, tag=_TAG + 3 * i + 2)
            del dst
            try:
                client.seal(rank=rank, version=m.version, manifest=man, kind=m.kind)
                client.commit(ranks=[rank], version=m.version, kind=m.kind)
                self.res.nbytes += n_pay
            except HolderFailure as e:
                self._fail(f"rank {rank}: cannot seal {m.kind} v{m.version}: {e}")

    def _slot_for(self, m: Move, man: Optional[dict], n_pay: int) -> tuple[Any, bool]:
        """(a tensor over the holder slot to receive into, or None; whether to keep the bytes in RAM until the
        stale copies are dropped, when the budget has no room yet)."""
        import torch
        from ..holder.protocol import HolderError, HolderFailure
        if self.client is None or man is None:
            return None, False
        try:
            _, wmm = self.client.acquire(rank=self.rank, version=m.version, nbytes=m.nbytes, kind=m.kind)
            if len(wmm) >= n_pay:
                return torch.frombuffer(wmm, dtype=torch.uint8, count=n_pay), False
            self._fail(f"rank {self.rank}: slot of {len(wmm)} bytes < {n_pay} bytes to receive")
        except HolderError as e:
            if e.code == "budget":   # room comes when the stale copies are dropped: keep it in RAM till then
                return None, True
            self._fail(f"rank {self.rank}: cannot store {m.kind} v{m.version} on {self.node}: {e}")
        except (HolderFailure, OSError) as e:
            self._fail(f"rank {self.rank}: cannot store {m.kind} v{m.version} on {self.node}: {e}")
        return None, False

    def store_deferred(self) -> None:
        import torch
        from ..holder.protocol import HolderFailure
        for m, man, buf in self.deferred:
            try:
                _, wmm = self.client.acquire(rank=self.rank, version=m.version, nbytes=m.nbytes, kind=m.kind)
                torch.frombuffer(wmm, dtype=torch.uint8, count=buf.numel()).copy_(buf)
                self.client.seal(rank=self.rank, version=m.version, manifest=man, kind=m.kind)
                self.client.commit(ranks=[self.rank], version=m.version, kind=m.kind)
                self.res.nbytes += buf.numel()
            except (HolderFailure, OSError, ValueError) as e:
                log.error("[rank %d] placement: %s v%d of rank %d could not be stored even after dropping stale "
                          "copies (%s): raise memory_budget_gb; restore falls back to parity", self.rank, m.kind,
                          m.version, self.rank, e)

    def close(self) -> None:
        for mm in self.handles:
            try:
                mm.close()
            except BufferError:
                pass


def summarize(moves: Iterable[Move]) -> dict[str, Any]:
    """JSON-able summary for events and logs."""
    moves = list(moves)
    return {"moved_ranks": sorted({m.rank for m in moves}), "moved_slots": len(moves)}
