"""The hierarchical collectives over real gloo (shardsafe/hierarchy.py): node-local groups and a leaders' group
shardsafe builds itself over the job's store, only by their members; rebuilt under a new generation after a
failure. And the same algorithms in the simulator, at sizes no machine here can run."""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from shardsafe.hierarchy import (Hierarchy, HierarchyError, MemberGroup, Recv, Send, Topology, allgather_algo,
                                 allgather_ints_algo, min_reduce_algo, rounds_bound, simulate)

from ._fork_ranks import run_ranks


def _collectives(rank, world, per_node):
    import torch.distributed as dist
    topo = Topology.blocks(world, per_node)
    h = Hierarchy(dist.distributed_c10d._get_default_store(), "test/h", topo, rank, timeout_s=3)
    out = {"min": h.min_reduce([10 + rank, -rank, 7]),
           "gather": [b.decode() for b in h.gather_bytes(("r%d" % rank * (rank + 1)).encode())],
           "ints": h.gather_ints([rank, -rank, 1000 + rank])}
    h.close()
    return out


@pytest.mark.parametrize("world,per_node", [(4, 2), (5, 2), (3, 1)])
def test_votes_and_gathers_over_nodes_and_leaders(world, per_node):
    for got in run_ranks(world, _collectives, per_node):
        assert got["min"] == [10, -(world - 1), 7]
        assert got["gather"] == ["r%d" % r * (r + 1) for r in range(world)]
        assert got["ints"] == [[r, -r, 1000 + r] for r in range(world)]


def _loop_threads() -> int:
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names.count("gloo_tcp_loop")


def _many_groups(rank, world):
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    before = _loop_threads()
    topo = Topology.blocks(world, 2)
    hs = [Hierarchy(store, f"test/share{i}", topo, rank, timeout_s=3) for i in range(3)]
    mins = [h.min_reduce([rank + i]) for i, h in enumerate(hs)]
    pair = MemberGroup(store, f"test/share/pair{rank // 2}", [rank - rank % 2, rank - rank % 2 + 1], rank, 3)
    pair_min = pair.min_reduce([rank])
    return {"mins": mins, "pair": pair_min, "new_loops": _loop_threads() - before}


def test_shardsafe_groups_share_one_gloo_loop_thread_per_process():
    # gloo's loop thread wakes every 10 ms: three hierarchies (a node group each, a leaders' group each on the
    # leaders) and a pair group add one loop thread per process, not one per group.
    for rank, got in enumerate(run_ranks(4, _many_groups)):
        assert got["mins"] == [[0], [1], [2]] and got["pair"] == [rank - rank % 2]
        assert got["new_loops"] == 1, got


def _failure_then_rebuild(rank, world):
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    h = Hierarchy(store, "test/rb", Topology.blocks(world, 2), rank, timeout_s=1.5)
    assert h.min_reduce([rank]) == [0]
    failed = ""
    if rank == 3:
        time.sleep(2.5)   # slower than the timeout: every rank's vote fails
    try:
        h.min_reduce([rank])
    except HierarchyError as e:
        failed = str(e)[:200]
    h.rebuild(1)          # every rank after the same failure: the same generation
    return {"failed": failed, "after": h.min_reduce([100 + rank])}


def test_a_failed_vote_leaves_the_group_rebuildable_by_every_rank():
    got = run_ranks(4, _failure_then_rebuild, timeout_s=60)
    assert all(g["after"] == [100] for g in got), got
    assert all(g["failed"] for g in got[:3]), got   # the ones that waited timed out


@pytest.mark.parametrize("ranks,per_node", [(64, 4), (1024, 8), (1000, 8)])
def test_simulated_rounds_stay_within_two_log_nodes_plus_two(ranks, per_node):
    topo = Topology.blocks(ranks, per_node)
    res, st = simulate(topo, lambda r: min_reduce_algo(topo, r, [r % 7, -r]))
    assert all(x == [0, -(ranks - 1)] for x in res)
    assert st.rounds <= rounds_bound(topo.nodes), st
    assert st.messages <= 2 * ranks + 2 * topo.nodes * topo.nodes.bit_length()   # O(N) messages in all
    assert st.max_pairs_per_rank <= per_node + topo.nodes.bit_length() + 1         # O(log) connections per rank
    res, st = simulate(topo, lambda r: allgather_algo(topo, r, b"%d" % r))
    assert res[ranks // 2] == [b"%d" % r for r in range(ranks)] and st.rounds <= rounds_bound(topo.nodes)


def test_int_gathers_size_every_message_from_the_topology():
    """Fixed-length int gathers send each hop as one message whose size the receiver computes from the ranks it
    carries (the simulator fails a receive of another size, as gloo does), on uneven and interleaved nodes and with
    leaders beyond the largest power of two (on gloo, a bytes gather's hop is two messages: its length, then the
    bytes)."""
    for names in (["a", "a", "b", "c", "c", "c", "d", "e", "e"], ["x", "y", "x", "z", "y", "x", "w"],
                  ["a"] * 3 + ["b"]):
        topo = Topology.from_names(names)
        vals = [[r, 7 * r, -r] for r in range(topo.world)]
        res, st = simulate(topo, lambda r: allgather_ints_algo(topo, r, vals[r]))
        assert all(x == vals for x in res)
        _, sb = simulate(topo, lambda r: allgather_algo(topo, r, bytes(3 * 8)))
        assert (st.rounds, st.messages) == (sb.rounds, sb.messages)   # the pattern is the same; each message whole
    topo = Topology.blocks(4, 2)

    def wrong(r):   # a receive sized for one rank's part where the partner sends two
        if r == 0:
            got = yield [Recv(2, torch.empty(1, dtype=torch.int64))]
            return got
        if r == 2:
            yield [Send(0, torch.zeros(2, dtype=torch.int64))]
        return None
    with pytest.raises(HierarchyError, match="expected"):
        simulate(topo, wrong)


def test_letting_go_of_a_group_never_runs_its_destructor_on_the_caller():
    """A ProcessGroupGloo's destructor joins its event loop, which can wait for a peer of an abandoned attempt up to
    the group's timeout: a survivor of a restart in place that dropped one on its main thread stayed there, and the
    next attempt's first gather timed out on every other rank. Retired groups are dropped on a thread of their own,
    and a retired hierarchy never builds groups under its old keys again."""
    import threading
    release, dropped, where = threading.Event(), threading.Event(), []

    class Stuck:   # stands for a gloo group whose destructor waits
        def __del__(self):
            where.append(threading.get_ident())
            release.wait(30)
            dropped.set()

    g = MemberGroup.__new__(MemberGroup)
    g.pg = Stuck()
    g.retire()   # with the destructor on this thread, this would wait for `release`, and `where` name this thread
    assert g.pg is None
    release.set()
    assert dropped.wait(30) and where and where[0] != threading.get_ident(), where
    h = Hierarchy(None, "t/retired", Topology.from_names(["a", "b"]), 0, 1.0)
    h.retire()
    with pytest.raises(HierarchyError, match="let go of"):
        h.min_reduce([1])


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child_env(**extra):
    """This checkout first on the children's path, whatever the working directory; the caller's PYTHONPATH kept."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


_EXIT_AFTER_LETTING_GO = textwrap.dedent("""
    import os, sys, time
    from shardsafe.hierarchy import MemberGroup
    mark = sys.argv[1]

    class Slow:   # stands for a gloo group whose abort and destructor take a while
        def abort(self):
            time.sleep(0.3)
        def __del__(self):
            time.sleep(0.3)
            open(mark, "w").close()

    g = MemberGroup.__new__(MemberGroup)
    g.pg = Slow()
    g.close()
    sys.exit(3)   # at once, as a trainer that raised on the lost peer
""")


def test_a_process_exits_only_after_the_groups_it_let_go_of_are_gone(tmp_path):
    """A thread still dropping a group when the interpreter finalizes is ended by forced unwinding, which aborts
    in gloo's noexcept destructors: a trainer that raised on a lost peer right after its broken vote group was let
    go of died with SIGABRT instead of its own error. The interpreter waits for the drop at exit (bounded)."""
    mark = tmp_path / "dropped"
    res = subprocess.run([sys.executable, "-c", _EXIT_AFTER_LETTING_GO, str(mark)], capture_output=True, text=True,
                         timeout=120, env=_child_env())
    assert res.returncode == 3 and mark.exists(), (res.returncode, res.stderr[-2000:])


_LOST_PEER = textwrap.dedent("""
    import os, signal, sys, time
    from datetime import timedelta
    from torch.distributed import TCPStore
    from shardsafe.hierarchy import MemberGroup
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    g = MemberGroup(store, "lost", [0, 1], rank, 5.0)
    g.min_reduce([1])
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        g.min_reduce([2])
        sys.exit(4)
    except Exception:
        g.close()   # the vote broke: abort the group, off this thread
        sys.exit(3)
""")


def test_a_rank_that_let_go_of_a_broken_group_exits_with_its_own_error_over_real_gloo():
    """The same over real gloo: the peer is SIGKILLed, the survivor's vote fails, it lets go of the group and exits
    with its own code (three pairs at once; without the wait at exit most of them ended in SIGABRT)."""
    import socket
    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    env = _child_env(OMP_NUM_THREADS="1")
    pairs = [[subprocess.Popen([sys.executable, "-c", _LOST_PEER, str(r), str(p)], env=env,
                               stderr=subprocess.PIPE, text=True) for r in (0, 1)] for p in ports]
    got = []
    for a, b in pairs:
        err = a.communicate(timeout=120)[1]
        b.communicate(timeout=120)
        got.append((a.returncode, b.returncode, err[-600:]))
    assert all(g[:2] == (3, -9) for g in got), got
