"""What shardsafe's own collectives cost on gloo as ranks are added: the vote, the all-gathers, placement's check.

    .venv/bin/python bench/collective_bench.py [--ranks 4,8,16,32] [--iters 40] [--setup]
    .venv/bin/python bench/collective_bench.py --parity-groups 1024,16384,131072

Runs itself under ``torch.distributed.run --standalone`` once per rank count (all ranks on this host, so above
2 ranks they share the 2 cores and every hop waits for a process to be scheduled: the figures show how each
collective grows with the ranks, not what a cluster's network gives). Per rank count, medians over --iters
rounds, the variants alternating, each round after a barrier, rank 0's time:
  * ``min_reduce`` (all_reduce MIN) of 1 and of 4 int64: the votes (shardsafe.collectives.all_true);
  * ``gather_ints`` of 1 and of 10 int64: the restore's agreement and its vote;
  * placement's exchange before a restore when no rank changed node: ``gather_json`` of one node's holder listing
    (8 ranks x 2 data + 2 parity versions, the old path) against ``all_true`` (the vote that replaced it).

``--setup``: what creating shardsafe's world-wide gloo group costs (shardsafe.runtime: ``new_group(backend="gloo")``,
paid by every rank at every start and restart), until its first vote has run: gloo's default connects every pair of
ranks when the group is created (a full mesh: N - 1 connections and store lookups per rank), against
``TORCH_GLOO_LAZY_INIT=1`` (torch connects a pair on its first use; a ring collective uses two neighbours). Medians
of --iters groups per rank count, rank 0, each mode in its own launch (the variable is read when a group is made).

``--parity-groups WORLDS``: what one rank pays at every start for ``ParityExchange`` (shardsafe/parity/exchange.py),
which creates every parity group of the job on every rank (torch's ``new_group`` is called by all ranks in one
order; a rank gets a handle for the groups it is not in). One process plays one rank of a world of each size
(8 ranks per node, pure data parallel, the default plan) on torch's ``fake`` backend with an in-process store, with
``TORCH_GLOO_LAZY_INIT=1`` as shardsafe's launchers set it, so no peer is needed: the time is torch's bookkeeping
for the groups, plan building apart.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def setup_worker(iters: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from shardsafe.collectives import all_true
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    created, ready = [], []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        g = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
        t1 = time.perf_counter()
        all_true(True, g, n)
        t2 = time.perf_counter()
        created.append(t1 - t0)
        ready.append(t2 - t0)
    if dist.get_rank() == 0:
        print(json.dumps({"ranks": n, "created": statistics.median(created), "ready": statistics.median(ready)}),
              flush=True)
    dist.destroy_process_group()


def parity_groups(world: int) -> dict:
    """One rank of a ``world``-rank job: seconds to plan the parity groups and to construct ParityExchange."""
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from shardsafe.parity.exchange import ParityExchange, plan_parity
    from shardsafe.parity.topology import RankPlace
    rank = world // 2 + 3   # a rank in the middle: its group is created half way through the loop
    dist.init_process_group("fake", rank=rank, world_size=world, store=dist.HashStore())
    t0 = time.perf_counter()
    plan = plan_parity([RankPlace(rank=r, node=f"node{r // 8:05d}", dp=r) for r in range(world)], group_size=0,
                       parity_shards=1)
    t1 = time.perf_counter()
    ex = ParityExchange(plan, rank, timeout_s=60)
    t2 = time.perf_counter()
    out = {"world": world, "groups": len(plan), "group_size": len(ex.group.members), "plan_s": t1 - t0,
           "exchange_s": t2 - t1}
    dist.destroy_process_group()
    return out


def worker(iters: int) -> None:
    import torch.distributed as dist
    from shardsafe.collectives import all_true, gather_ints, gather_json, min_reduce
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    listing = {"node": "node00000", "slots": [[r, k, v, 1 << 30, 1 << 30, True] for r in range(8)
                                              for k in ("data", "parity") for v in (100, 101)]}
    cases = {
        "min_reduce[1]": lambda: min_reduce([1], None, n),
        "min_reduce[4]": lambda: min_reduce([1, 2, 3, 4], None, n),
        "gather_ints[1]": lambda: gather_ints([1], None, n),
        "gather_ints[10]": lambda: gather_ints(list(range(10)), None, n),
        "placement: gather_json(listing)": lambda: gather_json(listing, None, n),
        "placement: all_true": lambda: all_true(True, None, n),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for it in range(iters):
        for name in (names if it % 2 == 0 else names[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        print(json.dumps({"ranks": n, **{k: statistics.median(v) for k, v in times.items()}}), flush=True)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="4,8,16,32")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--setup", action="store_true", help="time the creation of a gloo group, full mesh vs lazy")
    p.add_argument("--parity-groups", default="", metavar="WORLDS",
                   help="time ParityExchange's group creation for one rank of worlds of these sizes (comma-separated)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.parity_groups:
        print("ParityExchange at start, one rank (torch's fake backend, lazy gloo groups); plan built apart")
        print(f"{'ranks':>7} {'groups':>7} {'size':>5} {'plan s':>8} {'groups s':>9} {'us/group':>9}")
        for w in (int(x) for x in a.parity_groups.split(",")):
            out = subprocess.run([sys.executable, "-c", "import json, sys; sys.path.insert(0, sys.argv[1]); "
                                  "import collective_bench as c; print(json.dumps(c.parity_groups(int(sys.argv[2]))))",
                                  os.path.dirname(os.path.abspath(__file__)), str(w)],
                                 capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if out.returncode != 0:
                print(f"{w} ranks failed (exit {out.returncode}):\n{out.stderr[-2000:]}", file=sys.stderr)
                return 1
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{r['world']:>7} {r['groups']:>7} {r['group_size']:>5} {r['plan_s']:>8.3f} {r['exchange_s']:>9.3f} "
                  f"{r['exchange_s'] / r['groups'] * 1e6:>9.1f}")
        return 0
    if a.worker:
        (setup_worker if a.setup else worker)(a.iters)
        return 0
    if a.setup:
        return setup_main(a)
    rows = []
    for n in (int(x) for x in a.ranks.split(",")):
        row = _launch(n, a)
        if row is None:
            return 1
        rows.append(row)
    keys = [k for k in rows[0] if k != "ranks"]
    print(f"gloo on this host, medians of {a.iters} rounds (rank 0), ms")
    print(f"{'ranks':>5} " + " ".join(f"{k:>{max(10, len(k))}}" for k in keys) + "  gather/vote")
    for r in rows:
        ratio = r["placement: gather_json(listing)"] / r["placement: all_true"]
        print(f"{r['ranks']:>5} " + " ".join(f"{r[k] * 1e3:>{max(10, len(k))}.2f}" for k in keys) + f"  {ratio:10.1f}x")
    return 0


def _launch(n: int, a, env: dict | None = None) -> dict | None:
    """One torchrun of n ranks on this host running the worker; rank 0's JSON line (None: it failed, said why)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                          os.path.abspath(__file__), "--worker", "--iters", str(a.iters)] + (["--setup"] if a.setup else []),
                         env=env, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("{")), None)
    if out.returncode != 0 or line is None:
        print(f"{n} ranks failed (exit {out.returncode}):\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(line)


def setup_main(a) -> int:
    print(f"a world-wide gloo group until its first vote, medians of {a.iters} (rank 0), ms")
    print(f"{'ranks':>5} {'full mesh: created':>19} {'ready':>8} {'lazy: created':>14} {'ready':>8}  full/lazy (ready)")
    for n in (int(x) for x in a.ranks.split(",")):
        full, lazy = _launch(n, a, {"TORCH_GLOO_LAZY_INIT": "0"}), _launch(n, a, {"TORCH_GLOO_LAZY_INIT": "1"})
        if full is None or lazy is None:
            return 1
        print(f"{n:>5} {full['created'] * 1e3:>19.2f} {full['ready'] * 1e3:>8.2f} {lazy['created'] * 1e3:>14.2f} "
              f"{lazy['ready'] * 1e3:>8.2f}  {full['ready'] / lazy['ready']:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
