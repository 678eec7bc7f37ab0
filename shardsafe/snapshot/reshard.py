"""Re-partitioning one committed version from D data-parallel ranks to D' (shrink: D' < D; grow back: D' > D).

ZeRO and distributed optimizers keep each data-parallel rank's share of one logical state -- the fp32 master
weights and optimizer moments of every parameter -- in flat per-rank tensors, cut by rules that depend on D.
Every parameter's elements therefore lie in *runs*: (parameter, first element, length) at (rank, flat tensor,
offset). A framework adapter describes where the runs lie at D and at D' by its framework's own partitioning
rules (:class:`FlatLayout`; DeepSpeed: ``shardsafe.adapters.deepspeed.reshard``, Megatron's DistributedOptimizer:
``shardsafe.adapters.megatron.reshard``); this module intersects the two into a
:class:`TransferPlan` of (source rank, tensor, offset, length) -> (target rank, tensor, offset) segments and
assembles a target rank's flat tensors from the source ranks' with it.

What the plan guarantees (checked when it is built, pinned by tests/unit/test_reshard.py):

* every element of every parameter is copied exactly once, from the one source rank that holds it to the one
  target rank that holds it: a byte crosses the network at most once, and only when the two ranks are not on
  the same node (:meth:`TransferPlan.elements_between` and the adapter's byte counts);
* elements of a target tensor that belong to no parameter (alignment and partition padding) are zero, which is
  what a freshly built engine at D' holds there and what DeepSpeed's universal-checkpoint load leaves there;
* copies are byte copies (no arithmetic, no dtype change): the values are bit-identical to the source.

:func:`reshard` is the entry point: the verified snapshots of the D ranks of one model-parallel slice (ordered by
data-parallel rank) and the framework's :class:`Resharder` in, each requested target rank's tensors and metadata
out, as the engine at D' holds them. It is a pure function of tensors (no process group); the launcher's
shrink/grow policy and the restore decide which ranks call it with which snapshots.
"""
from __future__ import annotations

import bisect
import contextvars
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional, Sequence

import torch

from ..errors import ShardsafeError


class ReshardError(ValueError, ShardsafeError):
    """The snapshots cannot be re-partitioned to the requested size; the message says what was expected, what
    was found and what to do."""


@dataclass(frozen=True)
class Run:
    """``length`` elements of parameter ``param`` from its element ``start`` on, at element ``offset`` of flat
    tensor ``tensor`` of data-parallel rank ``rank``."""
    param: int
    start: int
    length: int
    rank: int
    tensor: int
    offset: int


@dataclass
class FlatLayout:
    """Where every parameter's elements lie in the flat tensors of ``world`` data-parallel ranks.

    Args:
        world: the data-parallel size.
        params: (name, number of elements) of every parameter, in an order that does not depend on the size.
        numels: ``numels[rank][tensor]``: the length of each flat tensor of each rank, padding included.
        runs: ``runs[param]``: the runs of that parameter, sorted by ``start``; together exactly its elements.
    """
    world: int
    params: list[tuple[str, int]]
    numels: list[list[int]]
    runs: list[list[Run]]

    def check(self) -> None:
        """Every parameter is covered exactly once, and no two runs overlap inside a tensor (a layout bug would
        otherwise copy one element over another silently)."""
        if len(self.numels) != self.world or len(self.runs) != len(self.params):
            raise ReshardError(f"layout of {self.world} ranks describes {len(self.numels)} ranks and "
                               f"{len(self.runs)} of {len(self.params)} parameters")
        spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for i, ((name, numel), runs) in enumerate(zip(self.params, self.runs)):
            at = 0
            for r in runs:
                if r.param != i or r.start != at or r.length <= 0:
                    raise ReshardError(f"parameter {name!r}: a run at element {r.start} (length {r.length}) where "
                                       f"element {at} was expected")
                if not (0 <= r.rank < self.world and 0 <= r.tensor < len(self.numels[r.rank])
                        and r.offset >= 0 and r.offset + r.length <= self.numels[r.rank][r.tensor]):
                    raise ReshardError(f"parameter {name!r}: run {r} lies outside rank {r.rank}'s flat tensors "
                                       f"{self.numels[r.rank] if 0 <= r.rank < self.world else '?'}")
                spans.setdefault((r.rank, r.tensor), []).append((r.offset, r.offset + r.length))
                at += r.length
            if at != numel:
                raise ReshardError(f"parameter {name!r}: runs cover {at} of its {numel} elements")
        for (rank, tensor), s in spans.items():
            s.sort()
            for (a0, a1), (b0, _) in zip(s, s[1:]):
                if b0 < a1:
                    raise ReshardError(f"rank {rank} tensor {tensor}: two parameters' runs overlap at element {b0}")


@dataclass(frozen=True)
class Segment:
    """``length`` elements copied from (``src_rank``, ``src_tensor``, ``src_offset``) to (``dst_rank``,
    ``dst_tensor``, ``dst_offset``)."""
    src_rank: int
    src_tensor: int
    src_offset: int
    dst_rank: int
    dst_tensor: int
    dst_offset: int
    length: int


@dataclass
class TransferPlan:
    """The segments that turn the source layout's tensors into the target layout's, coalesced (adjacent on both
    sides: one segment), sorted by target."""
    src: FlatLayout
    dst: FlatLayout
    segments: list[Segment]
    _by_dst: dict[tuple[int, int], list[Segment]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for s in self.segments:
            self._by_dst.setdefault((s.dst_rank, s.dst_tensor), []).append(s)

    def into(self, rank: int, tensor: Optional[int] = None) -> list[Segment]:
        """The segments written into target ``rank`` (into its flat tensor ``tensor`` only, when given)."""
        if tensor is not None:
            return list(self._by_dst.get((rank, tensor), ()))
        return [s for s in self.segments if s.dst_rank == rank]

    def elements_between(self, src_rank: int, dst_rank: int) -> int:
        """Elements (of each flat state kind) that target ``dst_rank`` takes from source ``src_rank``."""
        return sum(s.length for s in self.segments if s.src_rank == src_rank and s.dst_rank == dst_rank)

    def elements_into(self, rank: int, colocated: Iterable[int] = ()) -> tuple[int, int]:
        """(elements from sources on the target's own node, elements from other nodes) of target ``rank``, per
        flat state kind; ``colocated``: the source ranks whose snapshots the target's node holds."""
        near = set(colocated)
        local = remote = 0
        for s in self.into(rank):
            if s.src_rank in near:
                local += s.length
            else:
                remote += s.length
        return local, remote


def plan(src: FlatLayout, dst: FlatLayout) -> TransferPlan:
    """The transfer plan from ``src`` to ``dst`` (same parameters, any sizes). Both layouts are checked first."""
    if src.params != dst.params:
        diff = [(a, b) for a, b in zip(src.params, dst.params) if a != b][:3]
        raise ReshardError(f"the layouts at {src.world} and {dst.world} ranks describe different parameters (first "
                           f"differences {diff}, {len(src.params)} vs {len(dst.params)} parameters)")
    src.check()
    dst.check()
    raw: list[Segment] = []
    for a_runs, b_runs in zip(src.runs, dst.runs):
        starts = [r.start for r in a_runs]
        for b in b_runs:
            # the source runs overlapping [b.start, b.start + b.length)
            i = bisect.bisect_right(starts, b.start) - 1
            end = b.start + b.length
            while i < len(a_runs) and a_runs[i].start < end:
                a = a_runs[i]
                lo, hi = max(a.start, b.start), min(a.start + a.length, end)
                if lo < hi:
                    raw.append(Segment(a.rank, a.tensor, a.offset + lo - a.start,
                                       b.rank, b.tensor, b.offset + lo - b.start, hi - lo))
                i += 1
    raw.sort(key=lambda s: (s.dst_rank, s.dst_tensor, s.dst_offset))
    out: list[Segment] = []
    for s in raw:
        p = out[-1] if out else None
        if (p is not None and (p.dst_rank, p.dst_tensor, p.src_rank, p.src_tensor) ==
                (s.dst_rank, s.dst_tensor, s.src_rank, s.src_tensor)
                and p.dst_offset + p.length == s.dst_offset and p.src_offset + p.length == s.src_offset):
            out[-1] = Segment(p.src_rank, p.src_tensor, p.src_offset, p.dst_rank, p.dst_tensor, p.dst_offset,
                              p.length + s.length)
        else:
            out.append(s)
    return TransferPlan(src, dst, out)


def assemble(plan_: TransferPlan, rank: int, tensor: int, source: Callable[[int, int], torch.Tensor],
             *, dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
    """Target ``rank``'s flat tensor ``tensor``: every segment copied in from ``source(src_rank, src_tensor)`` (a
    flat tensor of the source layout, e.g. a view of that rank's verified payload), every element no segment writes
    (padding) zero. Inside :class:`Deferred`, only the shape is returned (a tensor on the meta device) and the copy
    is recorded, to be written later by :meth:`Deferred.fill` (straight into the live tensors); the sources are
    looked up either way, so a piece that was not received raises here, before any vote."""
    n = plan_.dst.numels[rank][tensor]
    copies: list[tuple[int, torch.Tensor]] = []
    at = 0
    for s in sorted(plan_.into(rank, tensor), key=lambda s: s.dst_offset):
        src = source(s.src_rank, s.src_tensor).reshape(-1)
        if src.dtype != dtype:
            raise ReshardError(f"source rank {s.src_rank} tensor {s.src_tensor} is {src.dtype}, the target {dtype}: "
                               "a re-partition copies bytes and never converts")
        if s.dst_offset < at or s.dst_offset + s.length > n:   # plan() rules it out; a gap's zeros would overwrite
            raise ReshardError(f"target rank {rank} tensor {tensor}: a segment at {s.dst_offset} (length {s.length}) "
                               f"overlaps another or ends past its {n} elements: an internal error, nothing applied")
        copies.append((s.dst_offset, src[s.src_offset: s.src_offset + s.length]))
        at = s.dst_offset + s.length
    recipes = _DEFERRED.get()
    if recipes is not None:
        out = torch.empty(n, dtype=dtype, device="meta")
        recipes[id(out)] = (out, copies, device)
        return out
    # no zero-fill of the whole tensor: fresh pages are faulted in by the copies, each byte written once
    return _fill(torch.empty(n, dtype=dtype, device=device), copies)


@torch.no_grad()   # a live tensor may be a parameter (DeepSpeed's fp32 partitions): written as the apply writes it
def _fill(out: torch.Tensor, copies: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """``out`` with each (offset, piece) copied in and every element between the pieces zeroed (``copies`` sorted,
    not overlapping: :func:`assemble` checked it)."""
    at = 0
    for off, src in copies:
        if off > at:
            out[at: off].zero_()
        out[off: off + src.numel()].copy_(src)
        at = off + src.numel()
    if at < out.numel():
        out[at:].zero_()
    return out


_DEFERRED: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("shardsafe_reshard_deferred", default=None)


class Deferred:
    """Within ``with Deferred() as d:``, :func:`assemble` records its copies instead of making them and returns only
    the shape. A restore then checks the target state (every check that decides whether it may be applied reads
    shapes, dtypes and metadata only) and votes on it with nothing written, and only then :meth:`fill` writes each
    flat tensor once, straight into the live tensor it replaces: the same bytes as an assembly into new tensors
    followed by an apply, without writing every byte twice into freshly faulted memory."""

    def __init__(self) -> None:
        self._recipes: dict[int, tuple[torch.Tensor, list, Any]] = {}
        self._token: Any = None

    def __enter__(self) -> "Deferred":
        self._token = _DEFERRED.set(self._recipes)
        return self

    def __exit__(self, *exc: Any) -> None:
        _DEFERRED.reset(self._token)

    def deferred(self, t: Any) -> bool:
        """Whether ``t`` is a shape :func:`assemble` returned inside this context."""
        got = self._recipes.get(id(t))
        return got is not None and got[0] is t

    def fill(self, tensors: Mapping[str, Any], into: Mapping[str, torch.Tensor],
             halfway: Optional[Callable[[], None]] = None) -> dict[str, Any]:
        """``tensors`` with every deferred tensor written: into ``into[name]`` when that is a host tensor of its
        exact shape and dtype, contiguous (a live tensor: the apply's copy from it into itself is then no copy),
        else into a new one. Call it only once the target state may be applied: it writes the live state.
        ``halfway`` is called once half of the deferred tensors are written (fault injection: a torn apply)."""
        out = dict(tensors)
        todo = [name for name, t in tensors.items() if self.deferred(t)]
        half = len(todo) // 2
        if halfway is not None and not todo:
            halfway()
        for i, name in enumerate(todo):
            t = tensors[name]
            if halfway is not None and i == half:
                halfway()
            _, copies, device = self._recipes[id(t)]
            live = into.get(name)
            fits = (torch.is_tensor(live) and live.device.type == "cpu" and torch.device(device).type == "cpu"
                    and live.dtype == t.dtype and live.shape == t.shape and live.is_contiguous())
            out[name] = _fill(live if fits else torch.empty(t.shape, dtype=t.dtype, device=device), copies)
        return out


@dataclass
class Traffic:
    """What one target rank must receive: bytes from source ranks on its own node (``local_bytes``) and from
    other nodes (``remote_bytes``, by source rank in ``from_ranks``)."""
    rank: int
    local_bytes: int = 0
    remote_bytes: int = 0
    from_ranks: dict[int, int] = field(default_factory=dict)

    def add(self, src_rank: int, nbytes: int, local: bool) -> None:
        if nbytes <= 0:
            return
        if local:
            self.local_bytes += nbytes
        else:
            self.remote_bytes += nbytes
            self.from_ranks[src_rank] = self.from_ranks.get(src_rank, 0) + nbytes


@dataclass
class ReshardedRank:
    """One target rank's state: tensors and metadata named as its adapter's ``capture`` names them at D'."""
    rank: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


@dataclass
class Reshard:
    """The result of :func:`reshard`: the requested target ranks' states, the plan and each target's traffic."""
    from_world: int
    to_world: int
    ranks: list[ReshardedRank]
    plan: TransferPlan
    traffic: dict[int, Traffic]


def default_colocation(src_world: int, dst_world: int) -> dict[int, list[int]]:
    """Target rank r runs where source rank r ran (the survivors keep their data-parallel ranks; a rank that is
    new when growing holds no source)."""
    return {r: [r] if r < src_world else [] for r in range(dst_world)}


Read = tuple[str, int, int]
"""What a target reads from one source: (tensor name, first element, elements), elements -1 for the whole tensor."""


class Pieces:
    """A source's flat tensor of which a target holds only the pieces it reads (:meth:`Resharder.reads`), received
    from the node that holds the source: the tensor's shape and dtype, and its pieces. :meth:`Resharder.reshard` reads
    a flat source tensor only through :func:`assemble` (``reshape(-1)[a:b]`` for each segment of the plan) and its
    shape, dtype and sizes, so it runs on these as on complete tensors; a slice that was not received raises (the
    resharder's ``reads`` missed it: a bug, never a silent zero)."""

    def __init__(self, name: str, shape: Sequence[int], dtype: torch.dtype):
        self.name, self.shape, self.dtype = name, torch.Size(shape), dtype
        self._pieces: list[tuple[int, torch.Tensor]] = []   # (first element, 1-D tensor), sorted

    def add(self, start: int, piece: torch.Tensor) -> None:
        bisect.insort(self._pieces, (start, piece.reshape(-1)), key=lambda p: p[0])

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        n = 1
        for x in self.shape:
            n *= int(x)
        return n

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def reshape(self, *shape: Any) -> "Pieces":
        want = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        if want not in ((-1,), (self.numel(),)):
            raise ReshardError(f"{self.name}: only the flat view of a partly received tensor exists, not {want}")
        flat = Pieces(self.name, [self.numel()], self.dtype)
        flat._pieces = self._pieces
        return flat

    def __getitem__(self, sl: Any) -> torch.Tensor:
        if self.dim() != 1 or not isinstance(sl, slice) or sl.step not in (None, 1):
            raise ReshardError(f"{self.name}: a partly received tensor is read only by element ranges of its flat view")
        a, b = sl.start or 0, self.numel() if sl.stop is None else sl.stop
        i = bisect.bisect_right([p[0] for p in self._pieces], a) - 1
        if i >= 0:
            start, piece = self._pieces[i]
            if b <= start + piece.numel():
                return piece[a - start: b - start]
        raise ReshardError(f"{self.name}: elements {a}..{b} were not received (the resharder's reads do not name "
                           "them): an internal error, nothing was applied")


def reads_by_plan(p: TransferPlan, flat_names: Callable[[int, int], Sequence[str]],
                  whole: Callable[[int], Sequence[str]]) -> dict[int, dict[int, list[Read]]]:
    """Target rank -> source rank -> what it reads: the plan's segments of every flat tensor ``flat_names(source,
    source tensor)`` names (the master and each per-element state cut alike), then the tensors ``whole(source)``."""
    out: dict[int, dict[int, list[Read]]] = {t: {} for t in range(p.dst.world)}
    for s in p.segments:
        lst = out[s.dst_rank].setdefault(s.src_rank, [])
        lst += [(n, s.src_offset, s.length) for n in flat_names(s.src_rank, s.src_tensor)]
    for d in range(p.src.world):
        names = list(whole(d))
        for t in out:
            if names:
                out[t].setdefault(d, []).extend((n, 0, -1) for n in names)
    return out


class Resharder(ABC):
    """One framework's re-partitioning: its partitioning rules and what else a target rank gets (counters, steps,
    buffers). Adapters implement it (DeepSpeed: ``shardsafe.adapters.deepspeed.reshard.DeepSpeedResharder``, also
    ``DeepSpeedStateAdapter.resharder()``; Megatron: ``shardsafe.adapters.megatron.reshard.MegatronResharder``, also
    ``MegatronStateAdapter.resharder()``); this package never imports a framework, so callers hand it in."""

    engine: ClassVar[str]
    """The ``meta["engine"]`` of the snapshots it re-partitions."""

    @abstractmethod
    def transfer_plan(self, metas: Sequence[Mapping[str, Any]], new_world: int) -> TransferPlan:
        """The plan from the D snapshots' metadata alone."""

    @abstractmethod
    def reshard(self, snapshots: Sequence[Any], new_world: int, *, ranks: Optional[Sequence[int]],
                colocated: Optional[Mapping[int, Sequence[int]]]) -> Reshard:
        """The target ranks' states (see :func:`reshard`)."""

    def reads(self, metas: Sequence[Mapping[str, Any]], entries: Sequence[Sequence[Mapping[str, Any]]],
              new_world: int) -> dict[int, dict[int, list[Read]]]:
        """What each target rank reads from each source (target -> source -> :data:`Read` list), from the D
        snapshots' metadata and manifest entries (name, dtype, shape) alone: the pieces of the flat tensors the plan
        names, and the small tensors it takes whole. :meth:`reshard` given snapshots that hold only these (the
        pieces as :class:`Pieces`, every other tensor as an empty :class:`Pieces` of its shape) returns for that
        target exactly what it returns from complete snapshots: a restore where no rank holds every source moves
        just these bytes (shardsafe/snapshot/reshard_restore.py). Default: not supported."""
        raise ReshardError(f"{type(self).__name__} does not say what each target reads from each source: a restore "
                           "at another data-parallel size cannot move its state; restart at the original size")


def _check_engine(engine: Any, resharder: Resharder) -> None:
    if engine != resharder.engine:
        raise ReshardError(f"the snapshot was taken by the {engine!r} adapter and {type(resharder).__name__} "
                           f"re-partitions {resharder.engine!r} snapshots: pass the resharder of the adapter that took "
                           "them (its resharder()), or restart at the original data-parallel size")


def transfer_plan(metas: Sequence[Mapping[str, Any]], new_world: int, resharder: Resharder) -> TransferPlan:
    """The plan of a re-partition to ``new_world`` ranks from the D snapshots' metadata alone (data-parallel rank
    order), before any payload is read: which (source rank, tensor, offset, length) each target rank needs, so it
    fetches only those from other nodes."""
    if not metas:
        raise ReshardError("no snapshot metadata given: pass every data-parallel rank's")
    _check_engine(metas[0].get("engine"), resharder)
    return resharder.transfer_plan(metas, new_world)


def reshard(snapshots: Sequence[Any], new_world: int, resharder: Resharder, *,
            ranks: Optional[Sequence[int]] = None,
            colocated: Optional[Mapping[int, Sequence[int]]] = None) -> Reshard:
    """Re-partition one version of one model-parallel slice from D to ``new_world`` data-parallel ranks.

    Args:
        snapshots: the verified snapshots of all D data-parallel ranks of the slice, in data-parallel rank order
            (checked where the ranks' records differ, e.g. DeepSpeed ZeRO-1/2's partition boundaries; equal
            partitions cannot be told apart): objects with ``tensors`` and ``meta``
            (``shardsafe.export.sources.RankSnapshot``, or a ``RankState``); with a ``manifest`` too, all must be of
            one version. ``tensors`` may view a holder payload: only the plan's segments are copied out of them.
        new_world: D'.
        resharder: the framework's rules (:class:`Resharder`; the live adapter's ``resharder()``).
        ranks: the target ranks to build (default all): a rank builds only its own.
        colocated: target rank -> the source ranks whose snapshots its node's holder has (for the traffic
            counts; default :func:`default_colocation`).

    Returns: a :class:`Reshard`. Raises :class:`ReshardError` naming the problem when the snapshots cannot be
    re-partitioned (another framework, inconsistent snapshots, a batch that does not divide, a layout the
    framework's rules do not support).
    """
    if not snapshots:
        raise ReshardError("no snapshots given: pass the verified snapshots of every data-parallel rank")
    if new_world < 1:
        raise ReshardError(f"the new data-parallel size must be at least 1, got {new_world}")
    versions = {s.manifest.get("version") for s in snapshots if getattr(s, "manifest", None)}
    if len(versions) > 1:
        raise ReshardError(f"the snapshots are of different versions {sorted(versions)}: re-partition one version "
                           "that every rank holds (the restore's vote names it)")
    _check_engine(snapshots[0].meta.get("engine"), resharder)
    return resharder.reshard(snapshots, new_world, ranks=ranks, colocated=colocated)
