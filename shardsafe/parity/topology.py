"""Placement: which ranks protect each other, and which bytes of whom form each codeword.

Pure python (no torch, no process groups), deterministic, so every rank computes the same plan from
the same inputs, and cheap enough that every rank plans the whole job at every start
(bench/collective_bench.py --parity-groups times it at up to 131,072 ranks).

**Parity groups.** Ranks that hold *different* shards of the *same* model partition are the ones
whose states are independent and equally sized: the members of one data-parallel (DP) group, i.e.
ranks with equal (tp, pp, extra) coordinates. Each DP group of D ranks is split into
G = ceil(D / n) groups of near-equal size (n when n divides D), every group on distinct nodes, so a
node loss costs each group at most one member. A group of n members is protected by RS(k=n-m, m):
any m members may be lost.

**Rotated stripes.** With a single codeword per group, m members would store all the parity. Instead
each member's payload is cut into k chunks of ``chunk_size(payload)`` bytes and the group forms n
codewords r = 0..n-1 (members i, positions 0..n-1 in the group)::

    data fragment p (0 <= p < k)   = chunk p of member (r - 1 - p) mod n
    parity fragment k + j (j < m)  = held in parity slot j of member (r + j) mod n

Member i is data in the k codewords i+1..i+k (its chunk c in codeword i+1+c) and holds parity slot
j of codeword i-j, so every member stores exactly m chunks of parity, m/k = m/(n-m) of its padded
payload, and no member holds two fragments of one codeword (any m member losses are decodable).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, NamedTuple, Sequence

from ..errors import ShardsafeError

ALIGN = 64
"""Chunk alignment in bytes: a cache line and ISA-L's widest vector, so chunks of a shared-memory
payload start on aligned addresses."""
STAGGER = 64 << 10
"""Large chunks are odd multiples of this (+ ALIGN), see :func:`chunk_stride`."""
STAGGER_FROM = 4 << 20
"""Chunk size from which the STAGGER padding (< 2 * STAGGER bytes, < 3.2 %) is applied."""
DEFAULT_MAX_GROUP_SIZE = 8
"""Default cap on n: beyond 8 the parity saving is small (m/(n-m)) while rebuild traffic (k chunks
per lost chunk) and the odds of m+1 losses in one group keep growing."""


def chunk_stride(nbytes: int) -> int:
    """The smallest chunk size >= ``nbytes`` that is safe as the stride of packed fragments.

    Encode/rebuild streams k + m fragments at once. When they sit at a stride that is a multiple of
    a large power of two, every stream maps to the same cache sets and DRAM banks, and beyond 8 streams
    (k + m > 8, e.g. RS(12, 4)) they evict each other: ISA-L then runs at about half the speed it reaches
    with the stride below (bench/RESULTS.md "Parity codec"). So the stride is always an odd
    multiple of :data:`ALIGN` (stream i starts in L1 set i, for up to 64 streams) and, from
    :data:`STAGGER_FROM` on, an odd multiple of :data:`STAGGER` plus ALIGN (streams also start
    64 KiB apart within a 2 MiB huge page, i.e. on different L2 sets and DRAM banks).
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise TopologyError(f"nbytes must be an int >= 0; got {nbytes!r}")
    if nbytes == 0:
        return 0
    if nbytes < STAGGER_FROM:
        q = -(-nbytes // ALIGN)
        return ALIGN * (q | 1)
    q = -(-(nbytes - ALIGN) // STAGGER)
    return STAGGER * (q | 1) + ALIGN


class TopologyError(ValueError, ShardsafeError):
    """The requested placement is impossible or the rank coordinates are inconsistent."""


class Unrecoverable(TopologyError):
    """More than m members of one parity group are lost: rebuild from memory is impossible."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlace:
    """Where one global rank sits.

    Args:
        rank: global rank (>= 0, unique).
        node: failure domain, usually the hostname; ranks on one node fail together.
        dp: data-parallel rank inside its DP group.
        tp: tensor-parallel rank.
        pp: pipeline-parallel rank.
        extra: further model-parallel coordinates (context/expert parallel...) that, like tp and
            pp, must be equal inside a parity group.
    """

    rank: int
    node: str
    dp: int
    tp: int = 0
    pp: int = 0
    extra: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("rank", "dp", "tp", "pp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TopologyError(f"RankPlace.{name} must be an int >= 0; got {v!r} (rank {self.rank!r})")
        if not isinstance(self.node, str) or not self.node:
            raise TopologyError(f"RankPlace.node must be a non-empty str (the node's hostname); got {self.node!r} "
                                f"for rank {self.rank}")
        if not isinstance(self.extra, tuple) or any(isinstance(x, bool) or not isinstance(x, int) for x in self.extra):
            raise TopologyError(f"RankPlace.extra must be a tuple of ints; got {self.extra!r} for rank {self.rank}")

    @property
    def key(self) -> tuple:
        """Model-partition coordinates; equal within a DP group (and so within a parity group)."""
        return (self.tp, self.pp, self.extra)


class FragmentRef(NamedTuple):
    """One fragment of one codeword and where its bytes live.

    ``slot`` is a chunk index for data (bytes ``chunk_range(slot)`` of the member's padded payload)
    and a parity slot for parity (bytes ``chunk_range(slot)`` of the member's parity buffer).
    """

    codeword: int
    fragment: int  # codec index: 0..k-1 data, k..n-1 parity
    member: int  # position in the group
    rank: int  # global rank of that member
    is_parity: bool
    slot: int


@dataclass(frozen=True, slots=True)
class Stripe:
    """Codeword ``codeword`` of a group: k data fragments then m parity fragments, in codec order."""

    codeword: int
    data: tuple[FragmentRef, ...]
    parity: tuple[FragmentRef, ...]

    @property
    def fragments(self) -> tuple[FragmentRef, ...]:
        return self.data + self.parity


@dataclass(frozen=True, slots=True)
class CodewordRecovery:
    """How to rebuild the lost fragments of one codeword.

    ``sources`` are the k fragments to read, ascending by fragment index (the rule of
    :func:`shardsafe.parity.codec.select_sources`, so their order matches
    ``Codec.reconstruct({s.fragment: ...}, [t.fragment for t in targets])``); ``targets`` the lost ones.
    """

    codeword: int
    sources: tuple[FragmentRef, ...]
    targets: tuple[FragmentRef, ...]


@dataclass(frozen=True)
class ParityGroup:
    """n ranks with equal (tp, pp, extra) on n distinct nodes, protected by RS(k, m).

    Args:
        index: position of the group in the plan.
        members: global ranks in member order (position 0..n-1; ascending dp).
        nodes: node of each member.
        k: data fragments per codeword (n - m).
        m: parity fragments per codeword; any m members may be lost.
        key: the shared (tp, pp, extra) coordinates.
        dp: dp coordinate of each member.
    """

    index: int
    members: tuple[int, ...]
    nodes: tuple[str, ...]
    k: int
    m: int
    key: tuple
    dp: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.members)
        if self.m < 1 or self.k < 1 or self.k + self.m != n:
            raise TopologyError(f"parity group {self.index}: need k >= 1, m >= 1 and k + m = {n} members; "
                                f"got k={self.k}, m={self.m}")
        if len(set(self.nodes)) != n or len(self.nodes) != n or len(set(self.members)) != n:
            raise TopologyError(f"parity group {self.index}: members {self.members} must be distinct ranks on "
                                f"distinct nodes; got nodes {self.nodes}")

    # --- membership ------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.members)

    @cached_property
    def _positions(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(self.members)}

    def position(self, rank: int) -> int:
        """Member position (0..n-1) of a global rank."""
        try:
            return self._positions[rank]
        except KeyError:
            raise TopologyError(f"rank {rank} is not in parity group {self.index} (members {self.members})") from None

    # --- sizes -------------------------------------------------------------------------------------
    def chunk_size(self, payload_nbytes: int) -> int:
        """Bytes per chunk (= per fragment) for payloads of up to ``payload_nbytes`` bytes.

        Pass the group's largest payload: members pad their payload to ``k * chunk_size``. It is
        :func:`chunk_stride` of ceil(payload / k): 64-byte aligned, and staggered so that fragments
        packed back to back (a member's chunks, its parity slots, a staging buffer holding the k
        chunks of one codeword) never alias in the caches. Pack fragments at this stride rather
        than in separately page-aligned allocations.
        """
        if isinstance(payload_nbytes, bool) or not isinstance(payload_nbytes, int) or payload_nbytes < 0:
            raise TopologyError(f"payload_nbytes must be an int >= 0; got {payload_nbytes!r}")
        return chunk_stride(-(-payload_nbytes // self.k))

    def padded_nbytes(self, payload_nbytes: int) -> int:
        """Size of a member's payload area once padded to k chunks."""
        return self.k * self.chunk_size(payload_nbytes)

    def parity_nbytes(self, payload_nbytes: int) -> int:
        """Size of a member's parity area: m chunks, i.e. m/(n-m) of the padded payload."""
        return self.m * self.chunk_size(payload_nbytes)

    def chunk_range(self, slot: int, payload_nbytes: int) -> tuple[int, int]:
        """[start, stop) of data chunk ``slot`` in the padded payload, or of parity slot ``slot``
        in the parity area (the same arithmetic)."""
        if not 0 <= slot < max(self.k, self.m):
            raise TopologyError(f"slot {slot} out of range (data chunks 0..{self.k - 1}, parity slots 0..{self.m - 1})")
        cs = self.chunk_size(payload_nbytes)
        return slot * cs, (slot + 1) * cs

    # --- stripes -----------------------------------------------------------------------------------
    @cached_property
    def stripes(self) -> tuple[Stripe, ...]:
        """The n codewords, see the module docstring for the rotation."""
        n, k, m = self.n, self.k, self.m
        out = []
        for r in range(n):
            data = tuple(FragmentRef(r, p, (r - 1 - p) % n, self.members[(r - 1 - p) % n], False, p) for p in range(k))
            parity = tuple(FragmentRef(r, k + j, (r + j) % n, self.members[(r + j) % n], True, j) for j in range(m))
            out.append(Stripe(r, data, parity))
        return tuple(out)

    def data_stripes(self, rank: int) -> tuple[Stripe, ...]:
        """The k codewords this rank's chunks belong to; entry c holds chunk c (as ``data[c]``).

        The exchange sends chunk c to every ``stripe.parity`` holder of entry c.
        """
        i = self.position(rank)
        return tuple(self.stripes[(i + 1 + c) % self.n] for c in range(self.k))

    def parity_stripes(self, rank: int) -> tuple[Stripe, ...]:
        """The m codewords this rank holds parity for; entry j is the codeword of parity slot j.

        To fill slot j the rank receives ``stripe.data`` (k chunks, one from each data member) and
        computes fragment k + j: ``codec.reconstruct(dict(enumerate(chunks)), [k + j], out=[slot])``
        (a re-encode of one row, no inversion).
        """
        i = self.position(rank)
        return tuple(self.stripes[(i - j) % self.n] for j in range(self.m))

    # --- recovery ----------------------------------------------------------------------------------
    def _lost_positions(self, lost: Iterable[int]) -> set[int]:
        pos = {self.position(r) for r in lost}
        if len(pos) > self.m:
            gone = sorted(self.members[p] for p in pos)
            raise Unrecoverable(
                f"parity group {self.index} (RS(k={self.k}, m={self.m}), members {self.members}) lost {len(pos)} "
                f"members {gone}; at most {self.m} can be rebuilt from memory. Restore these ranks from the "
                "persistent tier (or use more parity_shards).")
        return pos

    def recoverable(self, lost: Iterable[int]) -> bool:
        """True if the group survives losing these ranks (at most m of its members)."""
        return len({self.position(r) for r in lost}) <= self.m

    def recovery_plan(self, lost: Iterable[int]) -> tuple[CodewordRecovery, ...]:
        """Per affected codeword: the k fragments to read and the lost fragments to rebuild.

        Args:
            lost: global ranks of lost members (their data chunks and parity slots are gone).
        Returns:
            One :class:`CodewordRecovery` per codeword with a lost fragment, by codeword. A lost
            member's payload is its data targets (chunk ``slot``); its parity slots are re-encoded
            once the data is back (they appear as targets too).
        Raises:
            Unrecoverable: more than m members lost.
        """
        gone = self._lost_positions(lost)
        if not gone:
            return ()
        plan = []
        for s in self.stripes:
            frags = s.fragments
            targets = tuple(f for f in frags if f.member in gone)
            if not targets:
                continue
            # Same rule as shardsafe.parity.codec.select_sources: lowest surviving fragment indices.
            sources = tuple(f for f in frags if f.member not in gone)[: self.k]
            plan.append(CodewordRecovery(s.codeword, sources, targets))
        return tuple(plan)

    def rebuild_sources(self, lost: Iterable[int]) -> dict[int, tuple[FragmentRef, ...]]:
        """Surviving rank -> the fragments it must send to rebuild ``lost`` (what moves, by sender)."""
        out: dict[int, list[FragmentRef]] = defaultdict(list)
        for cw in self.recovery_plan(lost):
            for f in cw.sources:
                out[f.rank].append(f)
        return {r: tuple(v) for r, v in sorted(out.items())}


class ParityGroups(list):
    """The plan: a ``list[ParityGroup]`` with a rank index.

    Attributes:
        parity_shards: m of every group.
        group_size: the n requested or chosen (the largest group size; see build_parity_groups).
    """

    def __init__(self, groups: Iterable[ParityGroup], *, parity_shards: int, group_size: int) -> None:
        super().__init__(groups)
        self.parity_shards = parity_shards
        self.group_size = group_size
        self._by_rank = {r: g for g in self for r in g.members}

    def group_of(self, rank: int) -> ParityGroup:
        """The group holding ``rank``."""
        try:
            return self._by_rank[rank]
        except KeyError:
            raise TopologyError(f"rank {rank} is in no parity group of this plan ({len(self._by_rank)} ranks "
                                "planned); build the plan from every rank's RankPlace") from None


def group_of(groups: Sequence[ParityGroup], rank: int) -> ParityGroup:
    """``groups.group_of(rank)`` for any sequence of groups (linear scan unless it is a ParityGroups)."""
    if isinstance(groups, ParityGroups):
        return groups.group_of(rank)
    for g in groups:
        if rank in g.members:
            return g
    raise TopologyError(f"rank {rank} is in no parity group")


# --- planning --------------------------------------------------------------------------------------

def _feasible(d: int, max_per_node: int, n: int, m: int) -> bool:
    if n > d or n < m + 1:
        return False
    g = -(-d // n)
    # round-robin over a node-grouped list puts a node's ranks in distinct groups iff they fit in g;
    # the smallest group (d // g members) must still hold m parity + 1 data member
    return g >= max_per_node and d // g >= m + 1


def _describe_dp(key: tuple, d: int, nodes: int, max_per_node: int) -> str:
    tp, pp, extra = key
    where = f"tp={tp}, pp={pp}" + (f", extra={extra}" if extra else "")
    return (f"DP group ({where}) has {d} rank{'s' * (d != 1)} on {nodes} node{'s' * (nodes != 1)}, "
            f"up to {max_per_node} per node")


def build_parity_groups(places: Iterable[RankPlace], *, group_size: int | None = None,
                        parity_shards: int = 1) -> ParityGroups:
    """Plan parity groups for a whole job.

    Args:
        places: one :class:`RankPlace` per global rank.
        group_size: n, members per parity group (k = n - parity_shards). A DP group of D ranks
            becomes ceil(D / n) groups of near-equal size (exactly n when n divides D). Default:
            the largest feasible n <= min(D, 8).
        parity_shards: m, member losses each group survives (>= 1); costs m/(n-m) of each payload.
    Returns:
        :class:`ParityGroups`, ordered by (tp, pp, extra) then by group; member order ascending dp.
    Raises:
        TopologyError: inconsistent places, or no placement meets the request; the message names
            the largest feasible group_size (or what else to change).
    """
    m = parity_shards
    _check_sizes(group_size, m)
    stats = _dp_group_stats(places)
    n = _choose_group_size(stats, group_size, m)
    groups: list[ParityGroup] = []
    for key, mem, _, _ in stats:
        d = len(mem)
        g = -(-d // n)
        # Node-grouped order (nodes by their lowest dp), then deal round-robin: ranks of one node
        # are consecutive, so they land in distinct groups, and group sizes differ by at most one.
        first: dict[str, int] = {}
        for p in mem:
            first.setdefault(p.node, p.dp)
        order = sorted(mem, key=lambda p: (first[p.node], p.dp))
        for j in range(g):
            part = sorted(order[j::g], key=lambda p: p.dp)
            groups.append(ParityGroup(index=len(groups), members=tuple(p.rank for p in part),
                                      nodes=tuple(p.node for p in part), k=len(part) - m, m=m, key=key,
                                      dp=tuple(p.dp for p in part)))
    return ParityGroups(groups, parity_shards=m, group_size=max(g.n for g in groups))


def _check_sizes(group_size: int | None, m: Any) -> None:
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise TopologyError(f"parity_shards must be an int >= 1 (member losses survived per group); got {m!r}")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TopologyError(f"group_size must be an int or None; got {group_size!r}")
        if group_size <= m:
            raise TopologyError(
                f"group_size={group_size} must exceed parity_shards={m}: RS(k=n-m, m) needs k >= 1 data member. "
                f"Use group_size >= {m + 1} (memory cost m/(n-m)), or fewer parity_shards.")


def _dp_group_stats(places: Iterable[RankPlace]) -> list[tuple[tuple, list[RankPlace], int, int]]:
    """Per DP group (by key): (key, members sorted by dp, distinct nodes, most ranks on one node)."""
    dp_groups: dict[tuple, list[RankPlace]] = defaultdict(list)
    seen: dict[int, RankPlace] = {}
    for p in places:
        if not isinstance(p, RankPlace):
            raise TopologyError(f"places must hold RankPlace objects; got {type(p).__name__}")
        if p.rank in seen:
            raise TopologyError(f"rank {p.rank} is listed twice ({seen[p.rank]} and {p}); give each rank one place")
        seen[p.rank] = p
        dp_groups[p.key].append(p)
    if not dp_groups:
        raise TopologyError("no ranks to place: pass one RankPlace per rank")
    stats = []
    for key in sorted(dp_groups):
        mem = sorted(dp_groups[key], key=lambda p: p.dp)
        for a, b in zip(mem, mem[1:]):
            if a.dp == b.dp:
                raise TopologyError(f"ranks {a.rank} and {b.rank} share dp={a.dp} with tp={a.tp}, pp={a.pp}, "
                                    f"extra={a.extra}; dp coordinates must be unique within a DP group")
        per_node: dict[str, int] = defaultdict(int)
        for p in mem:
            per_node[p.node] += 1
        stats.append((key, mem, len(per_node), max(per_node.values())))
    return stats


def _choose_group_size(stats: list, group_size: int | None, m: int) -> int:
    """The n every DP group is split by: the requested one if every group can take it, else TopologyError naming
    the largest feasible; by default the largest feasible n <= DEFAULT_MAX_GROUP_SIZE."""
    def all_feasible(n: int) -> bool:
        return all(_feasible(len(mem), mx, n, m) for _, mem, _, mx in stats)

    d_min = min(len(mem) for _, mem, _, _ in stats)

    def largest_feasible(upper: int) -> int | None:
        return next((n for n in range(min(upper, d_min), m, -1) if all_feasible(n)), None)

    if group_size is None:
        n = largest_feasible(max(DEFAULT_MAX_GROUP_SIZE, m + 1))
        if n is None:
            raise TopologyError(_no_placement(stats, m, largest_feasible(d_min)))
        return n
    n = group_size
    bad = [s for s in stats if not _feasible(len(s[1]), s[3], n, m)]
    if bad:
        key, mem, nodes, mx = bad[0]
        best = largest_feasible(n - 1) if n - 1 > m else None
        if best is not None:   # name the size the groups really get (n=3 over 4 ranks makes groups of 2)
            best = max(-(-len(s[1]) // -(-len(s[1]) // best)) for s in stats)
        why = (f"only {len(mem)} ranks" if n > len(mem) else
               f"a group can span at most {nodes} distinct nodes" if -(-len(mem) // n) < mx else
               f"splitting into {-(-len(mem) // n)} groups leaves one with fewer than {m + 1} members")
        fix = (f"The largest feasible group_size is {best} (RS(k={best - m}, m={m}), parity = "
               f"{m / (best - m):.0%} of each payload)" if best else _no_placement(stats, m, None))
        raise TopologyError(
            f"group_size={n} with parity_shards={m} is infeasible: {_describe_dp(key, len(mem), nodes, mx)} "
            f"({why}; each group needs {n} members on {n} distinct nodes). {fix}"
            + (f"; {len(bad)} of {len(stats)} DP groups are affected" if len(bad) > 1 else ""))
    return n


def _no_placement(stats: list, m: int, best: int | None) -> str:
    key, mem, nodes, mx = min(stats, key=lambda s: s[2])
    if best is not None:
        best = max(-(-len(s[1]) // -(-len(s[1]) // best)) for s in stats)   # the size the groups really get
        return f"The largest feasible group_size is {best}."
    return (f"no parity group of >= {m + 1} members on distinct nodes fits: {_describe_dp(key, len(mem), nodes, mx)}. "
            f"Surviving {m} node loss{'es' * (m != 1)} needs every DP group spread over >= {m + 1} nodes: lower "
            "parity_shards, place DP ranks on more nodes (e.g. tensor/pipeline parallel within a node), or rely "
            "on the persistent tier alone.")


def grid_places(*, world_size: int, ranks_per_node: int, tp: int = 1, pp: int = 1, order: str = "tp-dp-pp",
                node_prefix: str = "node") -> list[RankPlace]:
    """Places of a regular job: consecutive ranks fill nodes, coordinates from a rank order.

    Args:
        world_size: total ranks (a multiple of tp * pp).
        ranks_per_node: ranks per node (node of rank r = r // ranks_per_node).
        tp, pp: tensor/pipeline parallel sizes; dp = world_size / (tp * pp).
        order: the three axes fastest-varying first, e.g. "tp-dp-pp" (Megatron's default
            tp-cp-ep-dp-pp with cp=ep=1, and DeepSpeed's pipe/data/model topology) or "tp-pp-dp".
    Returns:
        One RankPlace per rank, ascending rank.
    """
    axes = order.split("-")
    if sorted(axes) != ["dp", "pp", "tp"]:
        raise TopologyError(f"order must be a permutation of tp, dp, pp joined by '-', e.g. 'tp-dp-pp'; got {order!r}")
    for name, v in (("world_size", world_size), ("ranks_per_node", ranks_per_node), ("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TopologyError(f"{name} must be an int >= 1; got {v!r}")
    if world_size % (tp * pp):
        raise TopologyError(f"world_size={world_size} is not a multiple of tp*pp={tp * pp}")
    sizes = {"tp": tp, "pp": pp, "dp": world_size // (tp * pp)}
    out = []
    for r in range(world_size):
        rest, coord = r, {}
        for a in axes:
            coord[a] = rest % sizes[a]
            rest //= sizes[a]
        out.append(RankPlace(rank=r, node=f"{node_prefix}{r // ranks_per_node:05d}", **coord))
    return out
