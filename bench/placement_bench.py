"""Rank placement at a restart, at job sizes this machine cannot run: what every rank computes and receives.

    .venv/bin/python bench/placement_bench.py [--worlds 1024,4096,16384,131072] [--per-node 8] [--repeats 5]

Before restoring, every rank of a restarted job makes sure its snapshots are on the node it runs on now
(shardsafe/parity/placement.py). The holders are synthetic but shaped as a job's: --per-node ranks per node,
each with two sealed data and two parity versions. Two restarts are planned per world size:
  * unchanged: every rank on its old node (a rank killed and restarted in place; the common case);
  * shifted: one node lost and the nodes after it renumbered by one, as torch elastic's rendezvous does when a
    spare sorts last: almost every rank finds its snapshots on the previous node.
Per world size, medians of --repeats:
  * what each rank receives: the unchanged case settles with one vote of one integer (each node's lowest rank
    checks its own holder: ``settled``, timed for one node); otherwise every rank's listing is all-gathered
    (padded to the longest, so world x listing bytes to every rank) and planned;
  * the plan: ``plan_migration`` (one pass over the slots) against ``plan_migration_reference`` (the rank x
    node loop it replaced), measured in the same run up to --reference-max ranks (it grows with the square).
The collectives' own latency is not modelled (a vote and an all-gather each cost at least a ring of the group
over gloo); bench/RESULTS.md says what this leaves.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from shardsafe.parity.placement import KINDS, plan_migration, plan_migration_reference, settled


def job(world: int, per_node: int) -> tuple[list[str], dict]:
    """(rank -> node, node -> inventory) of a job before its restart."""
    nodes = [f"node{i:06d}" for i in range(-(-world // per_node))]
    inventories: dict = {n: {} for n in nodes}
    for r in range(world):
        inv = inventories[nodes[r // per_node]]
        for kind in KINDS:
            inv[(r, kind)] = {v: {"nbytes": 1 << 30, "capacity": 1 << 30, "committed": True} for v in (100, 101)}
    return [nodes[r // per_node] for r in range(world)], inventories


def timed(fn, repeats: int) -> tuple[float, object]:
    out, ts = None, []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="1024,4096,16384,131072")
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--reference-max", type=int, default=16384, help="largest world the quadratic planner runs at")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    rows = []
    for world in (int(w) for w in a.worlds.split(",")):
        before, inventories = job(world, a.per_node)
        nodes = sorted(inventories)
        # node 1 lost, a spare sorts last, every later node renumbered down by one
        shifted_nodes = [n for n in nodes if n != nodes[1]] + ["spare"]
        shifted = [shifted_nodes[r // a.per_node] for r in range(world)]
        live = {n: inventories.get(n, {}) for n in set(shifted)}
        listing = {"node": nodes[0], "slots": [[r, k, v, i["nbytes"], i["capacity"], i["committed"]]
                                               for (r, k), vs in inventories[nodes[0]].items() for v, i in vs.items()]}
        listing_b = len(json.dumps(listing, separators=(",", ":")))
        t_settled, ok = timed(lambda: settled(before, nodes[0], inventories[nodes[0]]), a.repeats)
        assert ok
        t_same, plan = timed(lambda: plan_migration(before, inventories), a.repeats)
        assert not plan.moves and not plan.drop_after
        t_shift, plan = timed(lambda: plan_migration(shifted, live), a.repeats)
        row = {"world": world, "nodes": len(nodes), "listing_bytes": listing_b,
               "gathered_bytes_per_rank": listing_b * world, "vote_bytes_per_rank": 8,
               "settled_s": t_settled, "plan_unchanged_s": t_same, "plan_shifted_s": t_shift,
               "moves_shifted": len(plan.moves)}
        if world <= a.reference_max:   # the quadratic planner, fewer rounds from 16k ranks (seconds per call)
            reps = min(a.repeats, 3) if world > 4096 else a.repeats
            row["reference_unchanged_s"], _ = timed(lambda: plan_migration_reference(before, inventories), reps)
            row["reference_shifted_s"], ref = timed(lambda: plan_migration_reference(shifted, live), reps)
            assert (ref.moves, ref.clear_first, ref.drop_after) == (plan.moves, plan.clear_first, plan.drop_after)
        rows.append(row)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{a.per_node} ranks per node, 2 data + 2 parity versions each; medians of {a.repeats}")
    print(f"{'ranks':>7} {'nodes':>6} | {'unchanged: vote':>15} {'settled()':>10} | {'otherwise: gather':>17} "
          f"{'plan':>8} {'reference':>10} {'ratio':>6} | {'shifted: moves':>14} {'plan':>8} {'reference':>10} {'ratio':>6}")
    for r in rows:
        def ref(key: str, new: str) -> str:
            return (f"{r[key]:9.3f}s {r[key] / r[new]:5.0f}x" if key in r else f"{'-':>10} {'-':>6}")
        print(f"{r['world']:>7} {r['nodes']:>6} | {r['vote_bytes_per_rank']:>13} B {r['settled_s'] * 1e6:8.1f}us | "
              f"{r['gathered_bytes_per_rank'] / 1e6:14.1f} MB {r['plan_unchanged_s'] * 1e3:6.1f}ms "
              f"{ref('reference_unchanged_s', 'plan_unchanged_s')} | {r['moves_shifted']:>14} "
              f"{r['plan_shifted_s'] * 1e3:6.1f}ms {ref('reference_shifted_s', 'plan_shifted_s')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
