"""Votes and gathers over every rank in O(log nodes) rounds: the node's ranks first, then one leader per node.

A ring all-reduce or all-gather over N ranks (gloo's, torch's default for a CPU group) takes 2(N-1) sequential,
latency-bound steps: about a second per vote at 16k ranks, every snapshot. Here every collective goes

1. **up** inside the node: each rank sends its part to the node's leader (its lowest rank), one round;
2. **across** the leaders by recursive doubling: ``ceil(log2(nodes))`` rounds of pairwise exchanges (plus one round
   in and one out for the leaders beyond the largest power of two);
3. **down** inside the node: the leader sends the result to its ranks, one round.

The algorithms are generators that yield the messages they send and receive (:class:`Send`, :class:`Recv`), so the
same code runs over real gloo groups (:class:`GlooLinks`, groups shardsafe builds itself over the job's store, only
by their members, rebuilt under a new prefix after a failure) and in the simulator (:func:`simulate`), which drives
thousands of ranks in one process and counts rounds, messages and the pairs of ranks that ever talk (in a group of
more than SHARED_DEVICE_MAX members each is one gloo connection, set up through the job's store on first use;
smaller groups connect all their pairs when made).

Payloads are int64 vectors (votes) or bytes (gathers of JSON): no pickle.
"""
from __future__ import annotations

import _thread
import atexit
import dataclasses
import functools
import os
import struct
import time
from datetime import timedelta
from typing import Any, Callable, Generator, Mapping, NamedTuple, Optional, Sequence

import torch

from .errors import ShardsafeError

__all__ = ["Topology", "Send", "Recv", "min_reduce_algo", "allgather_algo", "allgather_ints_algo", "MemberGroup",
           "GlooLinks", "Hierarchy", "simulate", "SimStats", "HierarchyError", "rounds_bound", "let_go_of"]


class HierarchyError(RuntimeError, ShardsafeError):
    """A collective over the hierarchy failed (a peer gone, a timeout): the caller rebuilds it or gives up."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """Which node every rank is on. ``node_of[r]``: the node index of rank r (nodes numbered by first appearance)."""

    node_of: tuple[int, ...]

    @staticmethod
    def from_names(names: Sequence[str]) -> "Topology":
        index: dict[str, int] = {}
        return Topology(tuple(index.setdefault(n, len(index)) for n in names))

    @staticmethod
    def blocks(world: int, per_node: int) -> "Topology":
        """Ranks in contiguous blocks of ``per_node`` (torchrun and shardsafe's launchers with the same number of
        processes on every node)."""
        return Topology(tuple(r // per_node for r in range(world)))

    @staticmethod
    def from_launcher(env: Mapping[str, str], world: int, rank: int) -> "Optional[Topology]":
        """The node blocks torchrun (and shardsafe's launchers) place ranks in, from what they export: GROUP_WORLD_SIZE
        nodes of LOCAL_WORLD_SIZE ranks each, contiguous. None when the environment does not say so (another
        launcher, nodes with different process counts): the caller then gathers every rank's node."""
        try:
            per, nodes, local = int(env["LOCAL_WORLD_SIZE"]), int(env["GROUP_WORLD_SIZE"]), int(env["LOCAL_RANK"])
        except (KeyError, ValueError):
            return None
        if per < 1 or per * nodes != world or not 0 <= local < per or (rank - local) % per:
            return None
        return Topology.blocks(world, per)

    @property
    def world(self) -> int:
        return len(self.node_of)

    @functools.cached_property
    def _members(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = []
        for r, n in enumerate(self.node_of):
            while len(out) <= n:
                out.append([])
            out[n].append(r)
        return tuple(tuple(m) for m in out)

    def members(self, rank: int) -> tuple[int, ...]:
        """The ranks on ``rank``'s node, lowest first (the first is the node's leader)."""
        return self._members[self.node_of[rank]]

    @functools.cached_property
    def leaders(self) -> tuple[int, ...]:
        return tuple(m[0] for m in self._members if m)

    @property
    def nodes(self) -> int:
        return len(self.leaders)


class Send(NamedTuple):
    peer: int
    data: torch.Tensor      # int64 or uint8, 1-D, contiguous


class Recv(NamedTuple):
    peer: int
    like: Optional[torch.Tensor] = None   # a fixed-size message of this shape and dtype; None: bytes of any length


# A yielded batch of messages is posted at once and waited for together; the generator gets each Recv's tensor
# (None for a Send) back in the batch's order.
Algo = Generator[list, list, Any]


def _like(like: Any, ranks: int) -> Optional[torch.Tensor]:
    """The receive buffer of a message that carries ``ranks`` ranks' parts: ``like`` itself (a fixed shape), or
    ``like(ranks)`` (a size that follows from the ranks carried), or None (bytes of any length)."""
    return like(ranks) if callable(like) else like


def _leader_rounds(leaders: Sequence[int], me: int, mine: Any, pack: Callable[[Any], torch.Tensor],
                   unpack: Callable[[torch.Tensor], Any], merge: Callable[[Any, Any], Any],
                   like: Any, weight: Callable[[int], int], world: int) -> Algo:
    """Recursive doubling among ``leaders``: every leader ends with the merge of all leaders' values.
    ``weight(i)``: the ranks leader ``leaders[i]`` speaks for (its node's), for receives sized by the ranks carried."""
    p = len(leaders)
    i = leaders.index(me)
    p2 = 1 << (p.bit_length() - 1)
    if i >= p2:   # beyond the largest power of two: fold into a partner, get the result back
        partner = leaders[i - p2]
        got = yield [Send(partner, pack(mine)), Recv(partner, _like(like, world))]
        return unpack(got[1])
    extra = leaders[i + p2] if i + p2 < p else None
    if extra is not None:
        got = yield [Recv(extra, _like(like, weight(i + p2)))]
        mine = merge(mine, unpack(got[0]))

    def block(j: int, k: int) -> int:   # the ranks partner j holds before round k: its block of k, extras folded in
        start = j & ~(k - 1)
        return sum(weight(b) + (weight(b + p2) if b + p2 < p else 0) for b in range(start, start + k))
    k = 1
    while k < p2:
        partner = leaders[i ^ k]
        got = yield [Send(partner, pack(mine)), Recv(partner, _like(like, block(i ^ k, k)))]
        mine = merge(mine, unpack(got[1]))
        k <<= 1
    if extra is not None:
        yield [Send(extra, pack(mine))]
    return mine


def _hierarchical(topo: Topology, rank: int, mine: Any, pack, unpack, merge, like) -> Algo:
    members = topo.members(rank)
    leader = members[0]
    if rank != leader:
        got = yield [Send(leader, pack(mine)), Recv(leader, _like(like, topo.world))]
        return unpack(got[1])
    if len(members) > 1:
        got = yield [Recv(m, _like(like, 1)) for m in members[1:]]
        for t in got:
            mine = merge(mine, unpack(t))
    if topo.nodes > 1:
        mine = yield from _leader_rounds(topo.leaders, rank, mine, pack, unpack, merge, like,
                                         lambda i: len(topo.members(topo.leaders[i])), topo.world)
    if len(members) > 1:
        out = pack(mine)
        yield [Send(m, out) for m in members[1:]]
    return mine


def min_reduce_algo(topo: Topology, rank: int, values: Sequence[int]) -> Algo:
    """Element-wise minimum of every rank's ``values`` (one length everywhere)."""
    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    out = yield from _hierarchical(topo, rank, t, lambda x: x, lambda x: x, torch.minimum, torch.empty_like(t))
    return [int(x) for x in out.tolist()]


def _pack_blocks(blocks: dict[int, bytes]) -> torch.Tensor:
    head = struct.pack(f"<q{2 * len(blocks)}q", len(blocks), *[v for r in sorted(blocks)
                                                               for v in (r, len(blocks[r]))])
    raw = head + b"".join(blocks[r] for r in sorted(blocks))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def _unpack_blocks(t: torch.Tensor) -> dict[int, bytes]:
    raw = bytes(t.numpy())
    (n,) = struct.unpack_from("<q", raw, 0)
    pairs = struct.unpack_from(f"<{2 * n}q", raw, 8)
    pos, out = 8 + 16 * n, {}
    for j in range(n):
        r, ln = pairs[2 * j], pairs[2 * j + 1]
        out[r] = raw[pos:pos + ln]
        pos += ln
    return out


def allgather_ints_algo(topo: Topology, rank: int, values: Sequence[int]) -> Algo:
    """Every rank's ``values`` (one length L on every rank), in rank order. A message is the ranks it carries,
    then their values: its size follows from the topology, so each hop is one message of a size the receiver
    knows, where bytes of any length take two (their length, then the bytes), one after the other."""
    n = len(values)

    def pack(d: dict[int, torch.Tensor]) -> torch.Tensor:
        ranks = sorted(d)
        return torch.cat([torch.tensor(ranks, dtype=torch.int64), *[d[r] for r in ranks]])

    def unpack(t: torch.Tensor) -> dict[int, torch.Tensor]:
        k = t.numel() // (1 + n)
        vals = t[k:].view(k, n)
        return {int(r): vals[j] for j, r in enumerate(t[:k].tolist())}

    got = yield from _hierarchical(topo, rank, {rank: torch.tensor([int(v) for v in values], dtype=torch.int64)},
                                   pack, unpack, lambda a, b: {**a, **b},
                                   lambda ranks: torch.empty(ranks * (1 + n), dtype=torch.int64))
    return [[int(x) for x in got[r].tolist()] for r in range(topo.world)]


def allgather_algo(topo: Topology, rank: int, blob: bytes) -> Algo:
    """Every rank's ``blob`` (any length), in rank order."""
    got = yield from _hierarchical(topo, rank, {rank: blob}, _pack_blocks, _unpack_blocks,
                                   lambda a, b: {**a, **b}, None)
    return [got[r] for r in range(topo.world)]


# ---- running the algorithms over gloo ---------------------------------------------------------------------

def let_go_of(pgs: Sequence[Any], *, abort: bool) -> None:
    """Let go of gloo process groups in a thread of their own, never the caller's.

    A ProcessGroupGloo's destructor joins its device's event-loop thread, and that thread can be inside a wait
    for a peer of an attempt being abandoned for up to the group's timeout. A survivor of a restart in place
    whose main thread dropped such a group stayed there for that long, and every other rank timed out waiting for
    it in the next attempt's first gather. ``abort``: abort each group first (a broken group, whose peers must not
    wait on it), else only drop it (its sockets close as it goes). The thread starts without waiting for it to be
    scheduled; the interpreter waits for it at exit (:func:`_wait_for_drops`)."""
    pgs = [pg for pg in pgs if pg is not None]
    if pgs:
        done = _thread.allocate_lock()
        done.acquire()
        _DROPPING.append(done)
        _thread.start_new_thread(_drop_groups, (pgs, abort, done))


# The drops still running. torch drops a group's GIL while destroying it, and a thread that takes the GIL back
# after the interpreter finalized is ended by forced unwinding, which std::terminate()s in gloo's noexcept
# destructors: a trainer that raised on a lost peer right after letting go of a group exited with SIGABRT, not
# its own error, and the launcher blamed it for the failure.
_DROPPING: list = []
DROP_WAIT_AT_EXIT_S = 30.0


def _drop_groups(pgs: list, abort: bool, done: Any) -> None:
    try:
        if abort:
            _abort_each(pgs)
        pgs.clear()   # the destructors run here: nothing else refers to the groups
    finally:
        done.release()


def _abort_each(pgs: list) -> None:
    for pg in pgs:
        for stop in ("abort", "shutdown"):
            try:
                getattr(pg, stop)()
                break
            except Exception:  # noqa: BLE001 - tearing down a broken group: nothing to save
                continue


@atexit.register
def _wait_for_drops() -> None:
    """At exit, while the interpreter still runs: the drops still running end first (bounded: a drop that waits
    longer is a peer that hangs, and the process ends as it would have)."""
    deadline = time.monotonic() + DROP_WAIT_AT_EXIT_S
    while _DROPPING:
        done = _DROPPING.pop()
        if done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            done.release()


def _forget_drops() -> None:   # a forked child runs none of its parent's threads
    _DROPPING.clear()


os.register_at_fork(after_in_child=_forget_drops)


# gloo's loop thread wakes every 10 ms (tcp/loop.cc: epoll_wait, 10 ms timeout), one per device, and torch gives each
# group its own device (a bench trainer ran 9-15 in a restart). Groups of up to SHARED_DEVICE_MAX members share a device
# per process. A lazy device cannot serve two groups (the second one's pairs time out connecting, torch 2.13), so this
# one connects a group's pairs when it is made; larger groups keep their own device, lazy with TORCH_GLOO_LAZY_INIT=1.
SHARED_DEVICE_MAX = 16
_SHARED: dict[int, list] = {}   # pid -> the devices (a forked child makes its own: the loop threads stay behind)
_SHARED_LOCK = _thread.allocate_lock()   # the snapshot thread's vote and the main thread's restore may both build


def _keep_parents_devices() -> None:   # a device's destructor joins its loop thread, which a forked child lacks
    import ctypes
    for devices in _SHARED.values():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(devices))
    _SHARED.clear()


os.register_at_fork(after_in_child=_keep_parents_devices)


def _shared_options(size: int, timeout: timedelta) -> Optional[Any]:
    """Options for a group of ``size`` members on this process's shared device, or None: the group gets a device of
    its own (too large, or a torch without these options)."""
    from torch.distributed import ProcessGroupGloo
    make = getattr(ProcessGroupGloo, "_Options", None)
    if size > SHARED_DEVICE_MAX or make is None:
        return None
    with _SHARED_LOCK:
        devices = _SHARED.get(os.getpid())
        if devices is None:
            from .env import gloo_interfaces
            devices = ([ProcessGroupGloo.create_device(interface=n, lazy_init=False) for n in gloo_interfaces()]
                       or [ProcessGroupGloo.create_default_device(lazy_init=False)])   # torch's, but not lazy
            _SHARED[os.getpid()] = devices
    opts = make()
    opts._devices, opts._threads, opts._timeout = devices, 1, timeout   # 1 worker: a group's collectives run in turn
    return opts


class MemberGroup:
    """A gloo process group of ``members`` (global ranks) that shardsafe builds itself over the job's store under
    ``prefix``, only in its members. torch's ``new_group`` is collective over the whole world (every rank creates
    every group) and names groups by a process-wide counter, so a group broken by a failed collective could not be
    built again; this one is built again under a new prefix. Methods take global ranks, like torch.distributed's.
    Groups of up to SHARED_DEVICE_MAX members connect their pairs when made, larger ones on first use."""

    def __init__(self, store: Any, prefix: str, members: Sequence[int], rank: int, timeout_s: float):
        from torch.distributed import PrefixStore, ProcessGroupGloo
        self.members = list(members)
        self._index = {r: i for i, r in enumerate(self.members)}
        self.rank, self.size = rank, len(self.members)
        store, timeout = PrefixStore(prefix, store), timedelta(seconds=timeout_s)
        opts = _shared_options(self.size, timeout)
        self.pg = (ProcessGroupGloo(store, self._index[rank], self.size, opts) if opts is not None else
                   ProcessGroupGloo(store, self._index[rank], self.size, timeout))

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Any:
        return self.pg.send([t], self._index[dst], tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Any:
        return self.pg.recv([t], self._index[src], tag)

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(t, dst, tag).wait()

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(t, src, tag).wait()

    def all_gather(self, outs: list[torch.Tensor], t: torch.Tensor) -> None:
        self.pg.allgather([outs], [t]).wait()

    def min_reduce(self, values: Sequence[int]) -> list[int]:
        import torch.distributed as dist
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return [int(x) for x in t.tolist()]

    def close(self) -> None:
        """Abort the group (it broke), off this thread (:func:`let_go_of`); the object is unusable after."""
        pg, self.pg = self.pg, None
        let_go_of([pg], abort=True)

    def retire(self) -> None:
        """Drop the group without aborting it, off this thread (:func:`let_go_of`); the object is unusable after."""
        pg, self.pg = self.pg, None
        let_go_of([pg], abort=False)


class GlooLinks:
    """The gloo groups one rank's messages travel on: its node's group (every rank) and the leaders' group (the
    node's leader only), each a :class:`MemberGroup` under ``prefix``: a rank ever talks to its leader, a leader to
    its node and ``log2(nodes)`` other leaders."""

    def __init__(self, store: Any, prefix: str, topo: Topology, rank: int, timeout_s: float):
        self.topo, self.rank = topo, rank
        members = topo.members(rank)
        self._via: dict[int, MemberGroup] = {}   # peer -> the group its messages travel on
        self._owned: list[MemberGroup] = []
        if len(members) > 1:
            node = MemberGroup(store, f"{prefix}/node{topo.node_of[rank]}", members, rank, timeout_s)
            self._owned.append(node)
            self._via.update({r: node for r in members})
        if rank == members[0] and topo.nodes > 1:
            lead = MemberGroup(store, f"{prefix}/leaders", topo.leaders, rank, timeout_s)
            self._owned.append(lead)
            for r in topo.leaders:
                self._via.setdefault(r, lead)

    def run(self, algo: Algo) -> Any:
        """Drive ``algo`` to its result over the groups."""
        try:
            batch = next(algo)
            while True:
                batch = algo.send(self._exchange(batch))
        except StopIteration as done:
            return done.value

    def _exchange(self, batch: list) -> list:
        """Post the batch's messages, then the data receives of the variable-length ones once their lengths are in,
        then wait for everything (waiting for a send before its peer posts the matching receive would deadlock
        two leaders exchanging with each other)."""
        works, results, lengths = [], [None] * len(batch), []
        for j, op in enumerate(batch):
            g = self._via[op.peer]
            if isinstance(op, Send):
                data = op.data.contiguous()
                if data.dtype == torch.uint8:   # bytes of any length: their length goes first
                    works.append(g.isend(torch.tensor([data.numel()], dtype=torch.int64), op.peer, 0))
                    if data.numel():
                        works.append(g.isend(data, op.peer, 1))
                else:
                    works.append(g.isend(data, op.peer, 0))
            elif op.like is not None:
                results[j] = torch.empty_like(op.like)
                works.append(g.irecv(results[j], op.peer, 0))
            else:
                n = torch.empty(1, dtype=torch.int64)
                lengths.append((j, n, g, op.peer, g.irecv(n, op.peer, 0)))
        for j, n, g, src, w in lengths:
            w.wait()
            results[j] = torch.empty(int(n.item()), dtype=torch.uint8)
            if results[j].numel():
                works.append(g.irecv(results[j], src, 1))
        for w in works:
            w.wait()
        return results

    def close(self) -> None:
        for g in self._owned:
            g.close()
        self._owned.clear()
        self._via.clear()

    def retire(self) -> None:
        for g in self._owned:
            g.retire()
        self._owned.clear()
        self._via.clear()


class Hierarchy:
    """The job-wide collectives of one rank (:func:`min_reduce`, :func:`gather_bytes`) over :class:`GlooLinks`,
    rebuilt under a new generation after a failure (:meth:`rebuild`). Every rank of the job must make the same
    calls in the same order; one rank returns its own answer without any message.

    Args:
        store: the job's store (``torch.distributed``'s default store).
        prefix: scopes this hierarchy's groups in the store (two hierarchies of one job differ in it).
        topo: which node every rank is on.
        rank: this rank.
        timeout_s: how long a message may take before the collective fails.
    """

    def __init__(self, store: Any, prefix: str, topo: Topology, rank: int, timeout_s: float):
        self.store, self.prefix, self.topo, self.rank, self.timeout_s = store, prefix, topo, rank, timeout_s
        self.generation = 0
        self._links: Optional[GlooLinks] = None
        self._retired = False

    @property
    def world(self) -> int:
        return self.topo.world

    def _run(self, algo: Algo) -> Any:
        if self._retired:   # a thread of an abandoned attempt must not build groups under its keys again
            raise HierarchyError(f"the groups of {self.prefix} were let go of (the attempt was abandoned)")
        try:
            if self._links is None:
                self._links = GlooLinks(self.store, f"{self.prefix}/g{self.generation}", self.topo, self.rank,
                                        self.timeout_s)
            return self._links.run(algo)
        except Exception as e:  # gloo raises RuntimeError subclasses for timeouts and closed peers
            raise HierarchyError(f"{type(e).__name__}: {e}") from e

    def min_reduce(self, values: Sequence[int]) -> list[int]:
        if self.world == 1:
            return [int(v) for v in values]
        return self._run(min_reduce_algo(self.topo, self.rank, values))

    def gather_bytes(self, blob: bytes) -> list[bytes]:
        if self.world == 1:
            return [bytes(blob)]
        return self._run(allgather_algo(self.topo, self.rank, bytes(blob)))

    def gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (one length on every rank), in rank order: :func:`allgather_ints_algo`."""
        if self.world == 1:
            return [[int(v) for v in values]]
        return self._run(allgather_ints_algo(self.topo, self.rank, values))

    def rebuild(self, generation: int) -> None:
        """Drop the groups (a failed collective leaves them unusable) and build the next ones, lazily, under
        ``generation``: every rank that rebuilds after the same failure passes the same number."""
        if self._links is not None:
            self._links.close()
            self._links = None
        self.generation = generation

    def close(self) -> None:
        """Let go of the groups (healthy ones are not aborted: a peer may still be finishing its last message)."""
        self._links = None

    def retire(self) -> None:
        """For good, for a restart in place: the groups are dropped off this thread (:func:`let_go_of`), and a later
        collective raises HierarchyError instead of building them again."""
        self._retired = True
        links, self._links = self._links, None
        if links is not None:
            links.retire()


# ---- the simulator ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class SimStats:
    ranks: int
    nodes: int
    rounds: int            # the longest chain of messages one after another (latency-bound steps)
    messages: int          # messages sent (a gather's bytes count as one message each way)
    pairs: int             # distinct pairs of ranks that exchanged a message (gloo connections)
    max_pairs_per_rank: int
    max_messages_per_rank: int


def simulate(topo: Topology, make: Callable[[int], Algo]) -> tuple[list[Any], SimStats]:
    """Run ``make(rank)`` for every rank of ``topo`` in this process, delivering messages in memory. Returns every
    rank's result and the pattern's cost: rounds (each message takes one round after its sender's latest
    receipt), messages, and the pairs of ranks that talked."""
    n = topo.world
    gens = [make(r) for r in range(n)]
    clock = [0] * n
    pending: list[Optional[list]] = [None] * n
    results: list[Any] = [None] * n
    mail: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}
    sent = [0] * n
    pairs: set[tuple[int, int]] = set()
    talk: list[set[int]] = [set() for _ in range(n)]
    done = [False] * n

    def post(r: int, batch: list) -> None:
        for op in batch:
            if isinstance(op, Send):
                mail.setdefault((r, op.peer), []).append((clock[r] + 1, op.data.clone()))
                sent[r] += 1
                pairs.add((min(r, op.peer), max(r, op.peer)))
                talk[r].add(op.peer)
                talk[op.peer].add(r)
        pending[r] = batch

    for r in range(n):
        try:
            post(r, next(gens[r]))
        except StopIteration as s:
            results[r], done[r] = s.value, True
    progress = True
    while progress and not all(done):
        progress = False
        for r in range(n):
            if done[r] or pending[r] is None:
                continue
            batch = pending[r]
            recvs = [op for op in batch if isinstance(op, Recv)]
            if any(not mail.get((op.peer, r)) for op in recvs):
                continue
            out, t = [], clock[r]
            for op in batch:
                if isinstance(op, Recv):
                    when, data = mail[(op.peer, r)].pop(0)
                    if op.like is not None and (data.dtype, data.shape) != (op.like.dtype, op.like.shape):
                        # gloo fails a receive whose size is not the message's
                        raise HierarchyError(f"simulated rank {r} expected {op.like.dtype}{list(op.like.shape)} "
                                             f"from rank {op.peer}, got {data.dtype}{list(data.shape)}")
                    t = max(t, when)
                    out.append(data)
                else:
                    out.append(None)
            clock[r] = max(t, clock[r] + (1 if not recvs else 0))
            progress = True
            try:
                post(r, gens[r].send(out))
            except StopIteration as s:
                results[r], done[r], pending[r] = s.value, True, None
    if not all(done):
        raise HierarchyError(f"simulation deadlocked: ranks {[r for r in range(n) if not done[r]][:8]} still wait")
    return results, SimStats(ranks=n, nodes=topo.nodes, rounds=max(clock), messages=sum(sent), pairs=len(pairs),
                             max_pairs_per_rank=max(len(t) for t in talk), max_messages_per_rank=max(sent))


def rounds_bound(nodes: int) -> int:
    """The most rounds a vote may take: 2 * ceil(log2(nodes)) + 2."""
    return 2 * max(0, (nodes - 1).bit_length()) + 2
