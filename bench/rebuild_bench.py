#!/usr/bin/env python3
"""Rebuild of a lost node's snapshot from parity: partial-parallel repair against gathering the sources, one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rebuild_bench.py [--nodes 4] [--m 1] [--mib 64,256,512] [--repeats 3]

N simulated nodes x 1 rank, one holder each, real gloo: every rank snapshots S bytes of state with parity
(SnapshotPipeline + ParityExchange, RS(N-m, m)) and commits it. Then rank 1's node is lost (its holder's copies
dropped: a fresh spare) and the group rebuilds it (``ParityExchange.rebuild``, what a restore after a node loss
runs), with both repairs, alternating, ``--repeats`` times each:

* **gather**: the k surviving fragments of every codeword go to the rebuilder, which decodes them (it receives
  k bytes per byte it rebuilds);
* **chain**: partial products reduced along the survivors (shardsafe.parity.repair): the rebuilder receives each
  of its fragments once, finished.

Reported per size: the median rebuild time (slowest rank, which is the rebuilder), chain / gather, and two floors
measured in the same run: a memcpy of the rebuilt bytes, and one gloo send of them from a survivor to the
rebuilder (the least any rebuild that moves them over this transport can take). On one host the hops are
loopback copies sharing the cores: the ratio says how the two move the same bytes, not what a network does.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from parity_snapshot_bench import forked_ranks   # bench/ is this script's folder, first on sys.path

LOST = 1


def _rank(rank: int, world: int, root: str, nbytes: int, m: int, repeats: int) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist
    from shardsafe.holder.client import HolderClient
    from shardsafe.holder.paths import HolderPaths
    from shardsafe.parity.exchange import ParityExchange, gather_places, plan_parity
    from shardsafe.snapshot.pipeline import GlooAgreement, SnapshotPipeline
    from shardsafe.snapshot.state import RankState

    client = HolderClient(HolderPaths(root, "rb", f"n{rank}"), timeout_s=60).connect()
    places = gather_places(rank, world, f"n{rank}", rank)
    plan = plan_parity(places, group_size=0, parity_shards=m)
    ex = {r: ParityExchange(plan, rank, timeout_s=300, repair=r) for r in ("gather", "chain")}
    pipe = SnapshotPipeline(client, rank=rank, world_size=world, node=f"n{rank}", agreement=GlooAgreement(),
                            parity=ex["chain"])
    g = torch.Generator().manual_seed(rank)
    state = {"w": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)}
    pipe.submit(1, RankState(state, {}))
    if not pipe.flush(timeout=600):
        raise RuntimeError(f"snapshot not committed: {pipe.history[-1].error}")
    pipe.close()
    out: dict = {"gather": [], "chain": []}
    for rep in range(repeats):
        for repair in (("gather", "chain") if rep % 2 == 0 else ("chain", "gather")):
            if rank == LOST:   # a fresh spare: nothing of version 1 in its holder
                client.drop(rank=rank, kind="data")
                client.drop(rank=rank, kind="parity")
            dist.barrier()
            t0 = time.perf_counter()
            ok, nb, why = ex[repair].rebuild(version=1, client=client, lost=[LOST])
            t = time.perf_counter() - t0
            if not ok:
                raise RuntimeError(f"{repair} rebuild failed: {why}")
            if rank == LOST:   # the bytes are the snapshot's: verified against its checksums before the seal
                _, mm = client.open(rank=rank, version=1)
                if not np.array_equal(np.frombuffer(mm, dtype=np.uint8, count=nbytes), state["w"].numpy()):
                    raise RuntimeError(f"{repair} rebuilt other bytes")
                mm.close()
            ex[repair].finish_rebuild(client, 1, restored=rank != LOST)
            out[repair].append(t)
    # Floors: one gloo send of the rebuilt bytes to the rebuilder, and a memcpy of them.
    cs = ex["chain"].group.chunk_size(ex["chain"].pmax_hint)
    rebuilt = (ex["chain"].group.k + m) * cs   # its data chunks and its parity shares
    buf = torch.empty(rebuilt, dtype=torch.uint8)
    out["send"], out["memcpy"] = [], []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, LOST)
        elif rank == LOST:
            dist.recv(buf, 0)
        out["send"].append(time.perf_counter() - t0)
        dst = np.empty(rebuilt, dtype=np.uint8)
        dst.fill(0)
        t0 = time.perf_counter()
        np.copyto(dst, buf.numpy())
        out["memcpy"].append(time.perf_counter() - t0)
    out["rebuilt_bytes"], out["k"] = rebuilt, ex["chain"].group.k
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=4, help="simulated nodes, one rank each (default: 4)")
    p.add_argument("--m", type=int, default=1, help="parity shards per group (default: 1)")
    p.add_argument("--mib", default="64,256,512", help="MiB of state per rank, comma-separated (default: 64,256,512)")
    p.add_argument("--repeats", type=int, default=3, help="rebuilds per repair and size (default: 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    a = p.parse_args()
    med = statistics.median
    rows = []
    for mib in [int(x) for x in a.mib.split(",") if x]:
        per = forked_ranks(a.nodes, "rb", (mib << 20) * 6 / 2**30 + 0.5, _rank, mib << 20, a.m, a.repeats,
                           timeout_s=1800)
        slowest = {r: [max(x[r][i] for x in per) for i in range(a.repeats)] for r in ("gather", "chain")}
        row = {"mib_per_rank": mib, "k": per[0]["k"], "m": a.m, "rebuilt_mib": round(per[LOST]["rebuilt_bytes"] / 2**20, 1),
               "gather_s": med(slowest["gather"]), "chain_s": med(slowest["chain"]),
               "send_floor_s": med(per[LOST]["send"]), "memcpy_floor_s": med(per[LOST]["memcpy"])}
        row["chain_vs_gather"] = row["chain_s"] / row["gather_s"]
        rows.append(row)
        print(f"{mib:5d} MiB/rank, RS({row['k']},{a.m}): gather {row['gather_s']:.3f} s "
              f"({row['gather_s'] / row['send_floor_s']:.2f}x one send), chain {row['chain_s']:.3f} s "
              f"({row['chain_s'] / row['send_floor_s']:.2f}x one send) = {row['chain_vs_gather']:.2f}x gather; "
              f"floors: one gloo send {row['send_floor_s']:.3f} s, memcpy {row['memcpy_floor_s']:.3f} s "
              f"of {row['rebuilt_mib']} MiB", flush=True)
    if a.json:
        print(json.dumps({"nodes": a.nodes, "m": a.m, "repeats": a.repeats, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
