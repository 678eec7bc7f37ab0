"""bench/control_plane_bench.py --simulate: the control plane's message pattern at 1k-16k ranks, in one process.

The vote and the gathers of the snapshot and restart paths run here with shardsafe's own algorithms
(``shardsafe.hierarchy.min_reduce_algo`` / ``allgather_algo``, the generators the runtime drives over gloo) in
``shardsafe.hierarchy.simulate``, which delivers their messages in memory and counts:

* rounds: the longest chain of messages one after another (the latency-bound steps);
* messages, and the most one rank sends;
* pairs of ranks that ever exchange a message. Each gloo group of up to ``SHARED_DEVICE_MAX`` members (a node's
  ranks; the leaders of a few nodes) connects all its pairs through the job's store when it is made (it is on the
  process's shared gloo device, shardsafe.hierarchy); a larger one connects the pairs its messages use, on first use
  (shardsafe's launchers set TORCH_GLOO_LAZY_INIT=1): :func:`connections`.

The store's load per connection is measured, not assumed (:func:`store_costs`): gloo groups of a few ranks are
built in threads over a counting store, as shardsafe's hierarchies (small groups only, a large leaders' group, both)
and as a torch world group (the ring's, lazily and as a full mesh), and the operations per group member and per
connected pair are read off; at 1k-16k ranks they are multiplied by the members and pairs of :func:`connections`.
The old design (gloo's ring all-reduce over a world group) is not simulated: its figures are gloo's algorithm,
2(N - 1) steps per rank.

An all-gather at 16k ranks would hold N x N blobs in this one process (tens of GB): gathers are simulated up to
GATHER_SIM_MAX ranks, where the harness checks that their rounds, messages and pairs equal the vote's (both run
the same up-across-down pattern, ``hierarchy._hierarchical``), and beyond it take the vote's pattern, with the
bytes counted (every rank receives N blobs: an all-gather's result is O(N) per rank by definition).
"""
from __future__ import annotations

import collections
import contextlib
import os
import threading
from datetime import timedelta
from typing import Any, Sequence

GATHER_SIM_MAX = 1024

# What a restarted rank runs on shardsafe's hierarchy between its start and its first step (kind, ints or bytes
# per rank, which hierarchy), as the harness records it at 4 ranks: the places gather (runtime._places), which
# carries what every rank holds and each node's placement and world-size checks, then the restore's vote on the
# verified copy (with the copies' digests), which carries the budget check. Every real run records its own
# (rows[].start_collectives) and the harness simulates that.
DEFAULT_RESTART = (("gather_bytes", 126, "restore"), ("gather_ints", 7, "restore"))


def vote_len() -> int:
    """Ints in one commit vote: the flag, the version both ways, one "not set" flag per cause bit for the
    version's causes and for the standing ones (shardsafe.snapshot.pipeline.GlooAgreement.vote)."""
    from shardsafe.protection import Cause
    return 3 + 2 * len(Cause)


def _stats(st) -> dict[str, int]:
    return {"rounds": st.rounds, "messages": st.messages, "pairs": st.pairs,
            "max_pairs_per_rank": st.max_pairs_per_rank, "max_messages_per_rank": st.max_messages_per_rank}


def vote_pattern(ranks: int, per_node: int, length: int | None = None) -> dict[str, int]:
    from shardsafe.hierarchy import Topology, min_reduce_algo, simulate
    topo = Topology.blocks(ranks, per_node)
    n = vote_len() if length is None else length
    res, st = simulate(topo, lambda r: min_reduce_algo(topo, r, [r % 3] * (n - 1) + [-r]))
    if any(x != [0] * (n - 1) + [-(ranks - 1)] for x in res):
        raise AssertionError(f"simulated vote at {ranks} ranks: a rank got the wrong minimum")
    return {**_stats(st), "nodes": topo.nodes}


def gather_pattern(ranks: int, per_node: int, nbytes: int, ints: bool = False) -> dict[str, Any]:
    """An all-gather of ``nbytes`` per rank (``ints``: of ``nbytes`` int64s, in fixed-size messages):
    simulated up to GATHER_SIM_MAX, else the vote's pattern."""
    from shardsafe.hierarchy import Topology, allgather_algo, allgather_ints_algo, simulate
    size = 8 * nbytes if ints else nbytes
    if ranks > GATHER_SIM_MAX:
        return {**vote_pattern(ranks, per_node, 1), "bytes_per_rank_received": ranks * size, "simulated": False}
    topo = Topology.blocks(ranks, per_node)
    if ints:
        want = [[r] * nbytes for r in range(ranks)]
        res, st = simulate(topo, lambda r: allgather_ints_algo(topo, r, want[r]))
    else:
        want = [bytes([r % 251]) * nbytes for r in range(ranks)]
        res, st = simulate(topo, lambda r: allgather_algo(topo, r, want[r]))
    if res[ranks // 2] != want:
        raise AssertionError(f"simulated gather at {ranks} ranks: a rank got the wrong blobs")
    return {**_stats(st), "nodes": topo.nodes, "bytes_per_rank_received": ranks * size, "simulated": True}


def ring_model(ranks: int) -> dict[str, int]:
    """gloo's ring all-reduce over a world group (the old vote): reduce-scatter then all-gather around the ring,
    N - 1 steps each, every rank sending one message per step to its right neighbour."""
    return {"rounds": 2 * (ranks - 1), "messages": 2 * ranks * (ranks - 1), "pairs_lazy": ranks,
            "pairs_full_mesh": ranks * (ranks - 1) // 2}


class _CountingStore:
    """Built lazily: a torch.distributed.Store subclass counting every operation on an in-process HashStore."""

    @staticmethod
    def make():
        import torch.distributed as dist

        class Counting(dist.Store):
            def __init__(self) -> None:
                super().__init__()
                self.inner, self.ops, self.lock = dist.HashStore(), collections.Counter(), threading.Lock()

            def _n(self, kind: str) -> None:
                with self.lock:
                    self.ops[kind] += 1

            def set(self, key, value):
                self._n("set")
                return self.inner.set(key, value)

            def get(self, key):
                self._n("get")
                return self.inner.get(key)

            def add(self, key, value):
                self._n("add")
                return self.inner.add(key, value)

            def compare_set(self, key, expected, desired):
                self._n("compare_set")
                return self.inner.compare_set(key, expected, desired)

            def wait(self, keys, timeout=None):
                self._n("wait")
                return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

            def check(self, keys):
                self._n("check")
                return self.inner.check(keys)

            def delete_key(self, key):
                self._n("delete_key")
                return self.inner.delete_key(key)

            def num_keys(self):
                return self.inner.num_keys()

            def set_timeout(self, timeout):
                return self.inner.set_timeout(timeout)

        return Counting()


def _in_threads(ranks: int, fn) -> None:
    errors: list = []

    def run(r: int) -> None:
        try:
            fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below with the rank
            errors.append((r, e))

    ts = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    if errors or any(t.is_alive() for t in ts):
        raise RuntimeError(f"store count at {ranks} ranks failed: {errors[:2] or 'a rank hung'}")


@contextlib.contextmanager
def _gloo_lazy(lazy: bool):
    """TORCH_GLOO_LAZY_INIT as given while groups are created (torch reads it then; shardsafe's launchers set 1)."""
    old = os.environ.get("TORCH_GLOO_LAZY_INIT")
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1" if lazy else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
        else:
            os.environ["TORCH_GLOO_LAZY_INIT"] = old


def connections(ranks: int, per_node: int) -> dict[str, int]:
    """The gloo connections one :class:`shardsafe.hierarchy.Hierarchy` over ``ranks`` makes, by how its groups
    connect: a group of up to ``SHARED_DEVICE_MAX`` members is on the process's shared device and connects every
    pair of its members when it is made (``mesh_*``); a larger one (the leaders of many nodes) connects the pairs its
    messages use, on first use (``lazy_*``, the pairs the simulation counts)."""
    from shardsafe.hierarchy import SHARED_DEVICE_MAX, Topology
    topo = Topology.blocks(ranks, per_node)
    groups = [len(topo.members(r)) for r in topo.leaders if len(topo.members(r)) > 1]
    out = {"mesh_members": 0, "mesh_pairs": 0, "lazy_members": 0, "lazy_pairs": 0}
    used_in_nodes = 0   # node groups' pairs the messages use: each member with its leader
    for m in groups:
        used_in_nodes += m - 1
        kind = "mesh" if m <= SHARED_DEVICE_MAX else "lazy"
        out[f"{kind}_members"] += m
        out[f"{kind}_pairs"] += m * (m - 1) // 2 if kind == "mesh" else m - 1
    if topo.nodes > 1:
        lead = topo.nodes
        if lead <= SHARED_DEVICE_MAX:
            out["mesh_members"] += lead
            out["mesh_pairs"] += lead * (lead - 1) // 2
        else:
            out["lazy_members"] += lead
            out["lazy_pairs"] += vote_pattern(ranks, per_node, 1)["pairs"] - used_in_nodes
    return out


def _count_hierarchy(ranks: int, per_node: int) -> dict[str, Any]:
    from shardsafe.hierarchy import Hierarchy, Topology
    store, topo = _CountingStore.make(), Topology.blocks(ranks, per_node)
    with _gloo_lazy(True):
        _in_threads(ranks, lambda r: Hierarchy(store, "count", topo, r, 60).min_reduce([r]))
    return {"ranks": ranks, "per_node": per_node, "ops": sum(store.ops.values()), "by_op": dict(store.ops),
            **connections(ranks, per_node)}


def _count_world_group(ranks: int, lazy: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    store = _CountingStore.make()

    def vote(r: int) -> None:
        pg = dist.ProcessGroupGloo(store, r, ranks, timedelta(seconds=60))
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        pg.allreduce([torch.tensor([r])], opts).wait()

    with _gloo_lazy(lazy):
        _in_threads(ranks, vote)
    return {"ranks": ranks, "ops": sum(store.ops.values()), "by_op": dict(store.ops)}


def store_ops(costs: dict[str, Any], conn: dict[str, int]) -> float:
    """The store operations of the connections ``conn`` (:func:`connections`) at the measured ``costs``."""
    return (costs["per_mesh_member"] * conn["mesh_members"] + costs["per_lazy_member"] * conn["lazy_members"]
            + costs["per_pair"] * (conn["mesh_pairs"] + conn["lazy_pairs"]))


def store_costs(per_node: int = 4) -> dict[str, Any]:
    """Store operations per group member (for groups that connect every pair when made, and for those that connect
    on first use) and per connected pair, measured on hierarchies built in threads over a counting store; raises
    when the same coefficients do not explain every hierarchy counted (the model would not hold)."""
    from shardsafe.hierarchy import SHARED_DEVICE_MAX
    mesh = [_count_hierarchy(n, per_node) for n in (2 * per_node, 4 * per_node)]   # every group on the shared device
    many = SHARED_DEVICE_MAX + 4                                                    # leaders beyond it: lazy pairs
    lazy = [_count_hierarchy(n, 1) for n in (many, 2 * many)]
    per_lazy_member = lazy[0]["by_op"].get("set", 0) / lazy[0]["lazy_members"]
    per_pair = (lazy[0]["ops"] - lazy[0]["by_op"].get("set", 0)) / lazy[0]["lazy_pairs"]
    per_mesh_member = (mesh[0]["ops"] - per_pair * mesh[0]["mesh_pairs"]) / mesh[0]["mesh_members"]
    costs = {"per_mesh_member": per_mesh_member, "per_lazy_member": per_lazy_member, "per_pair": per_pair}
    mixed = _count_hierarchy(2 * many, 2)   # node groups on the shared device, the leaders' group lazy
    hier = mesh + lazy + [mixed]
    for h in hier:
        if abs(store_ops(costs, h) - h["ops"]) > 0.5:
            raise AssertionError(f"store ops {h}: not {costs}")
    sizes = (8, 16)
    lazy_world = [_count_world_group(n, True) for n in sizes]
    full = [_count_world_group(n, False) for n in sizes]
    # A full mesh: every rank reads every member's address, a * N^2 + b * N (solved from the two largest sizes).
    (n1, o1), (n2, o2) = [(m["ranks"], m["ops"]) for m in full[-2:]]
    a = (o2 / n2 - o1 / n1) / (n2 - n1)
    return {**costs, "hierarchy": hier, "world_lazy": lazy_world,
            "world_full_mesh": full, "world_lazy_per_rank": lazy_world[-1]["ops"] / sizes[-1],
            "world_full_mesh_n2": a, "world_full_mesh_n1": o2 / n2 - a * n2}


def simulate_sizes(sizes: Sequence[int], per_node: int, restart: Sequence[Sequence] = DEFAULT_RESTART,
                   store: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per simulated rank count: the commit vote, one restart's collectives on the hierarchy, the old ring's
    figures, and (with ``store``, :func:`store_costs`) the store operations of one restart's gloo connections."""
    from shardsafe.hierarchy import SHARED_DEVICE_MAX, Topology, rounds_bound
    rows = []
    for n in sizes:
        topo = Topology.blocks(n, per_node)
        vote = vote_pattern(n, per_node)
        steps = []
        for kind, size, _ in restart:
            steps.append(gather_pattern(n, per_node, int(size), ints=kind == "gather_ints")
                         if kind.startswith("gather") else vote_pattern(n, per_node, int(size)))
        if n <= GATHER_SIM_MAX:   # the gathers' pattern is the vote's: what lets the larger sizes use it
            for s in steps:
                if (s["rounds"], s["messages"], s["pairs"]) != (vote["rounds"], vote["messages"], vote["pairs"]):
                    raise AssertionError(f"{n} ranks: a gather's pattern {s} differs from the vote's {vote}")
        # Two hierarchies per start (the restore's and the vote's), each with its own groups: their pairs connect
        # once each (the vote's at the first commit vote, the restore's during the restart). Groups on the shared
        # device connect all their pairs, larger ones the pairs the messages use (connections()).
        conn = connections(n, per_node)
        leaders_pairs = topo.nodes - 1 if topo.nodes <= SHARED_DEVICE_MAX else 0
        row = {"ranks": n, "nodes": topo.nodes, "per_node": per_node, "rounds_bound": rounds_bound(topo.nodes),
               "vote": vote, "ring": ring_model(n),
               "restart": {"collectives": len(steps), "rounds": sum(s["rounds"] for s in steps),
                           "messages": sum(s["messages"] for s in steps),
                           "gathers": sum(1 for k, _, _ in restart if k.startswith("gather")),
                           "votes": sum(1 for k, _, _ in restart if k == "min_reduce"),
                           "bytes_per_rank_received": sum(s.get("bytes_per_rank_received", 0) for s in steps),
                           "pairs": 2 * (conn["mesh_pairs"] + conn["lazy_pairs"]),
                           "max_pairs_per_rank": 2 * max(vote["max_pairs_per_rank"],
                                                         len(topo.members(0)) - 1 + leaders_pairs),
                           "group_members": 2 * (conn["mesh_members"] + conn["lazy_members"]),
                           "connections": {k: 2 * v for k, v in conn.items()}}}
        row["within_bound"] = vote["rounds"] <= row["rounds_bound"] and all(
            s["rounds"] <= row["rounds_bound"] for s in steps)
        if store is not None:
            r = row["restart"]
            r["store_ops"] = 2 * store_ops(store, conn)
            r["store_ops_per_rank"] = r["store_ops"] / n
            row["ring"]["store_ops_lazy"] = store["world_lazy_per_rank"] * n
            row["ring"]["store_ops_full_mesh"] = store["world_full_mesh_n2"] * n * n + store["world_full_mesh_n1"] * n
        rows.append(row)
    return {"per_node": per_node, "rows": rows, "restart_sequence": [list(x) for x in restart],
            "store": store, "gather_sim_max": GATHER_SIM_MAX, "shared_device_max": SHARED_DEVICE_MAX}
