"""Restore at a smaller (and larger) data-parallel size from memory against a same-size restore, 0.25 to 2 GiB per rank.

    .venv/bin/python bench/shrink_restore.py [--sizes 0.25,0.5,1,2] [--repeats 3] [--repairs chain,gather] [--json]

The real path of issue 44: real holders (one per simulated node, subprocesses, shared memory), real gloo ranks
(one process per rank), the snapshot pipeline with parity (parity_shards 1: RS(3, 1) over the 4 nodes), and
``restore_from_holder`` with ``resize=Resize(places, MemberRecovery)`` as the runtime calls it: survey, verify,
parity rebuild, the plan of DeepSpeed's resharder (``DeepSpeedResharder.reads``), the point-to-point move and the
apply. The rank state is a DeepSpeed ZeRO-1/2 state (``DeepSpeedZeroOptimizer``: one parameter group, 16
parameters of uneven sizes, DeepSpeed's alignment to 2 x D, fp32 master and Adam moments of random bytes, a step),
its metadata the layout DeepSpeed records, built by ``DeepSpeedPartitioning``; no engine is built (a bf16 ZeRO-2
engine also holds the whole model's bf16 parameters and gradients, 4 bytes per parameter = D/3 times the state per
rank: 2.7 GiB more per rank at 2 GiB of state, and the bench alone needs about 16 GiB per GiB per rank: see
bench/RESULTS.md). The target's live tensors are allocated at their size and pre-faulted, and written in place, as
the DeepSpeed adapter writes an engine's.

Per size, one job on 4 simulated nodes n0..n3, each phase a fresh set of rank processes (as a restart is):

  A. D = 4 on n0..n3: snapshot version 1 (parity included); **same-size restore** 4 -> 4, timed;
  B. D' = 3 on n0, n0, n1 after A on the 2-node layout n0, n0, n1, n1 (a GPU lost, its node kept: every source is
     held on a node that runs a rank, nothing is rebuilt): **shrink, no node lost**, and the same-size restore of
     that layout beside it;
  S. after A with n1's holder SIGKILLed, its like-for-like baseline: D = 4 on n0, n4, n2, n3, n4 a spare with an
     empty holder, **same size with one node lost**: rank 1 rebuilt from parity by its own restore (each
     repetition on a fresh spare);
  C. D' = 3 on n0, n2, n3 after S: **shrink with one node lost**, source rank 1 rebuilt from the survivors'
     parity by the targets that read it, per --repairs: "gather" (k fragments to each target), then "chain";
  D. (after C, unless --no-grow) C's ranks snapshot version 2 at D' = 3; n1 returns with an empty holder; D = 4
     on n0..n3: **grow** 3 -> 4.

Every restore is repeated (--repeats, medians; the holders keep the restored copies, so each repetition restores
the same version again) and each is followed, on every rank, by its floors: a memcpy of the same bytes into the
live tensors (from 256 MiB of pre-faulted private memory, beyond any cache, copied over and over), and for a
restore at another size the network's: the same pieces sent again between the same ranks as one gloo message per
pair into pre-faulted buffers (``_net_floor``). A time is the slowest rank's (the job waits for it). The restore's
phases come from ``RestoreResult.phases``; "assem." is its "assemble" phase (the resharder building the target
state from the pieces, the checks' shapes first, then the flat tensors written into the live ones after the vote;
a restore that reports no such phase: the time around ``DeepSpeedResharder.reshard``). Traffic: per rank the bytes read
from its own node's holder, received from other nodes (pieces + the parity rebuild's fragments or partial sums) and
sent, as the restore reports them (``RestoreResult.reshard``); the model's bound comes from the plan and the placement
alone: every byte a target needs that its node does not hold (a lost source: that its rebuilder's node does not hold)
crosses the network once. --profile DIR writes every rank's cProfile of every restore.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
GIB = 1 << 30
JOB = "shrinkbench"
G = 3                # gradient accumulation at D = 4: a global batch of 12 micro-batches, kept at D' = 3 (G' = 4)
N_PARAMS = 16
STATE_BYTES_PER_ELEM = 12   # fp32 master + exp_avg + exp_avg_sq
FLOOR_SRC_BYTES = 256 << 20


# ---- the synthetic DeepSpeed ZeRO-1/2 state -----------------------------------------------------------------------

def model_params(nbytes_per_rank: float, world: int) -> list[tuple[str, list[int]]]:
    """Parameters of uneven sizes whose ZeRO partition at ``world`` ranks is ``nbytes_per_rank`` of state."""
    total = int(nbytes_per_rank * world) // STATE_BYTES_PER_ELEM
    weights = [3 + (i * 7) % 5 for i in range(N_PARAMS)]
    out, left = [], total
    for i, w in enumerate(weights):
        k = left if i == N_PARAMS - 1 else total * w // sum(weights) + (2 * i + 1)   # odd sizes: no boundary lines up
        left -= k
        out.append((f"module.p{i}", [k]))
    return out


def ds_meta(params: list[tuple[str, list[int]]], world: int, rank: int, gas: int) -> dict:
    """What the DeepSpeed adapter records of a ZeRO-2 engine at ``world`` ranks (adapters/deepspeed/state.py)."""
    from adapters.deepspeed.reshard import ZERO12, DeepSpeedPartitioning
    flat, at = [], 0
    for n, s in params:
        flat.append([n, at, s[0]])
        at += s[0]
    lay = {"param_shapes": [[[n, s] for n, s in params]], "flat_params": [flat], "param_alignment_paddings": None,
           "ds_config": {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
                         "zero_optimization": {"stage": 2}}}
    meta = {"engine": "deepspeed", "optimizer": ZERO12, "zero_stage": 2, "dp_world_size": world, "parallel": {},
            "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}],
            "counters": {"global_steps": 1, "global_samples": 12, "skipped_steps": 0, "micro_steps": gas},
            "opt_scalars": {}, "ds_checkpoint": lay}
    lay.update(DeepSpeedPartitioning(meta).sized_fields(world, rank))
    return meta


class ZeroShard:
    """A StateAdapter over one rank's ZeRO-1/2 partition, re-partitioned by DeepSpeed's resharder."""

    def __init__(self, params, world: int, rank: int, gas: int, fill: bool):
        import torch

        from adapters.deepspeed.reshard import DeepSpeedPartitioning
        self.meta = ds_meta(params, world, rank, gas)
        part = DeepSpeedPartitioning(self.meta).layout(world).numels[rank][0]
        g = torch.Generator().manual_seed(1000 + rank)
        self.tensors = {}
        for k in ("opt/master/0", "opt/state/0/exp_avg", "opt/state/0/exp_avg_sq"):
            t = torch.empty(part, dtype=torch.float32)
            if fill:   # random bytes (no compressible pattern); else pre-faulted, as an engine's live state is
                t.view(torch.int32).random_(-2 ** 31, 2 ** 31 - 1, generator=g)
            else:
                t.fill_(0.5)
            self.tensors[k] = t
        self.tensors["opt/state/0/step"] = torch.tensor(1.0)

    # StateAdapter
    uses_peer_payloads = False

    def capture(self):
        from shardsafe.snapshot.state import RankState
        return RankState(tensors=dict(self.tensors), meta=json.loads(json.dumps(self.meta)))

    def apply(self, tensors, meta, peers=None) -> None:
        for k, t in tensors.items():
            self.tensors[k].copy_(t)

    assemble_s = 0.0   # the resharder's assembly of the target state (between the restore's move and apply phases)

    def resharder(self):
        from adapters.deepspeed.reshard import DeepSpeedResharder
        shard = self

        class Timed(DeepSpeedResharder):
            def reshard(self, *args, **kw):
                t0 = time.perf_counter()
                try:
                    return super().reshard(*args, **kw)
                finally:
                    shard.assemble_s += time.perf_counter() - t0
        return Timed()

    def resharded_problems(self, tensors, meta) -> list[str]:
        from adapters.deepspeed.reshard import layout_problems
        out = [f"{n}: {list(t.shape)} {t.dtype} vs live {list(self.tensors[n].shape)} {self.tensors[n].dtype}"
               for n, t in tensors.items() if n in self.tensors and (t.shape != self.tensors[n].shape
                                                                     or t.dtype != self.tensors[n].dtype)]
        out += [f"missing {n}" for n in self.tensors if n not in tensors]
        return out + layout_problems(meta, self.meta["ds_checkpoint"])

    def apply_resharded(self, tensors, meta) -> None:
        for k, t in tensors.items():
            self.tensors[k].copy_(t)

    def fingerprint(self):
        return {}

    def pending_state_nbytes(self) -> int:
        return 0


def _adapter_class():
    from shardsafe.snapshot.state import StateAdapter

    class Adapter(ZeroShard, StateAdapter):
        pass
    return Adapter


# ---- one rank of one phase ----------------------------------------------------------------------------------------

def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from shardsafe.config import ShardsafeConfig
    from shardsafe.parity.recovery import MemberRecovery
    from shardsafe.runtime import Runtime
    from shardsafe.snapshot.reshard_restore import Resize
    from shardsafe.snapshot.restore import restore_from_holder

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = a.nodes.split(",")
    params = json.loads(a.params)
    gas = G * 4 // world
    shard = _adapter_class()(params, world, rank, gas, fill=a.snapshot_first)
    cfg = ShardsafeConfig(interval=1, holder_dir=a.root, node=nodes[rank], job_id=JOB, start_holder=False,
                          restore=False, parity_shards=1, timeout_s=120, memory_budget_gb=a.budget_gb)
    rt = Runtime(cfg, rank=rank, world_size=world)

    def mx(v: float) -> float:   # the job waits for its slowest rank
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    res: dict[str, Any] = {"rank": rank, "node": nodes[rank], "restore_s": [], "memcpy_s": [], "phases": [],
                           "nbytes": sum(t.numel() * t.element_size() for t in shard.tensors.values())}
    if a.snapshot_first:
        rt.pipeline.submit(a.version, shard.capture())
        assert rt.pipeline.flush(), rt.pipeline.history[-1].error
        res["snapshot_committed"] = rt.pipeline.last_committed
    if a.repeats:
        resize = None if a.same_size else Resize(places=rt.places, recovery=MemberRecovery, repair=a.repair)
        # the floor's source: 256 MiB of pre-faulted private memory (beyond any cache), copied over and over into the
        # live tensors until every byte of them is written: the bytes a restore writes, without a second state
        src = torch.empty(FLOOR_SRC_BYTES // 4, dtype=torch.float32).fill_(0.25)
        for i in range(a.repeats):
            dist.barrier()
            shard.assemble_s = 0.0
            prof = None
            if a.profile:
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            t0 = time.perf_counter()
            r = restore_from_holder(shard, rt.client, rank=rank, coll=rt.coll, exchange=rt.exchange, nodes=rt.nodes,
                                    resize=resize)
            el = mx(time.perf_counter() - t0)
            if prof is not None:
                prof.disable()
                prof.dump_stats(os.path.join(a.profile, f"{a.tag}-{'same' if a.same_size else 'resized'}-w{world}-"
                                                        f"rank{rank}-rep{i}.prof"))
            assert r.version == a.expect_version, r.message
            dist.barrier()
            t0 = time.perf_counter()
            for t in shard.tensors.values():
                flat = t.view(-1)
                for at in range(0, flat.numel(), src.numel()):
                    n = min(src.numel(), flat.numel() - at)
                    flat[at:at + n].copy_(src[:n])
            mc = mx(time.perf_counter() - t0)
            if r.reshard:   # the network's floor: the same pieces between the same ranks, one gloo message each
                res.setdefault("net_s", []).append(mx(_net_floor(r.reshard, rank, world)))
            res["restore_s"].append(el)
            res["memcpy_s"].append(mc)
            # the restore's own "assemble" phase where it reports one; else the time around the resharder
            res["phases"].append(dict({"assemble": shard.assemble_s} if r.reshard else {}, **r.phases))
            rt.pipeline.timeline = r.timeline   # as Runtime.try_restore: snapshots from here on are this branch's
            res.update(tier=r.tier, version=r.version, reshard=r.reshard, lost=r.lost_ranks,
                       rebuilt_bytes=r.rebuilt_bytes, restored_nbytes=r.nbytes)
        res["rss_peak_gib"] = _peak_rss_gib()
    if a.snapshot_after:   # a version at this size, for the grow phase
        rt.pipeline.submit(a.snapshot_after, shard.capture())
        assert rt.pipeline.flush(), rt.pipeline.history[-1].error
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    rt.close()
    dist.barrier()
    dist.destroy_process_group()


def _net_floor(traffic: dict, rank: int, world: int) -> float:
    """Seconds to send every piece this restore received from another node again, from the rank that sent it, as one
    gloo message per (sender, receiver) pair into pre-faulted buffers, all posted before any wait (as the move
    does): the restore's move at this machine's speed of gloo over loopback, without planning, mapping or
    assembling. The rebuild's parity fragments are not in it."""
    import torch
    import torch.distributed as dist
    mine = [(int(v["from_rank"]), int(v["bytes"])) for v in traffic["by_source"].values() if not v["same_node"]]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    pairs: dict = {}
    for dst, got in enumerate(everyone):
        for src, n in got:
            pairs[(src, dst)] = pairs.get((src, dst), 0) + n
    bufs = {k: torch.empty(n, dtype=torch.uint8).fill_(1) for k, n in pairs.items() if rank in k}
    dist.barrier()
    t0 = time.perf_counter()
    works = [dist.isend(b, dst) if src == rank else dist.irecv(b, src) for (src, dst), b in sorted(bufs.items())]
    for w in works:
        w.wait()
    return time.perf_counter() - t0


def _peak_rss_gib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


# ---- the driver ---------------------------------------------------------------------------------------------------

class Holders:
    def __init__(self, root: str, budget_gb: float):
        self.root, self.budget, self.procs = root, budget_gb, {}

    def start(self, node: str) -> None:
        from shardsafe.holder.client import holder_command
        from shardsafe.holder.paths import HolderPaths
        p = subprocess.Popen(holder_command(HolderPaths(self.root, JOB, node), budget_gb=self.budget, idle_exit_s=0),
                             stdout=subprocess.PIPE)
        line = p.stdout.readline()
        if not line.startswith(b"holder ready"):
            raise SystemExit(f"holder {node} did not start: {line!r}")
        self.procs[node] = p

    def kill(self, node: str) -> None:   # the node is lost, its shared memory with it
        p = self.procs.pop(node)
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()

    def stop(self) -> None:
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        self.procs = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_phase(a, root: str, nodes: list[str], params, *, repeats: int, expect: int, same_size: bool = False,
              snapshot_first: int = 0, snapshot_after: int = 0, repair: str = "chain") -> list[dict]:
    out = tempfile.mkdtemp(prefix="shrink-phase-")
    port = _free_port()
    procs = []
    for r in range(len(nodes)):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(len(nodes)), OMP_NUM_THREADS="1")
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out, "--root", root,
                "--nodes", ",".join(nodes), "--params", json.dumps(params), "--repeats", str(repeats),
                "--expect-version", str(expect), "--version", str(snapshot_first or 1),
                "--snapshot-after", str(snapshot_after), "--budget-gb", str(a.budget_gb), "--repair", repair]
        argv += ["--profile", a.profile, "--tag", "-".join(nodes)] if a.profile else []
        argv += ["--same-size"] if same_size else []
        argv += ["--snapshot-first"] if snapshot_first else []
        procs.append(subprocess.Popen(argv, env=env))
    rcs = [p.wait(timeout=3000) for p in procs]
    if any(rcs):
        raise SystemExit(f"phase on {nodes} failed: exit codes {rcs}")
    got = []
    for r in range(len(nodes)):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            got.append(json.load(f))
    shutil.rmtree(out, ignore_errors=True)
    return got


def bound(params, nodes_from: list[str], nodes_to: list[str], rebuilt_by: dict | None = None) -> dict:
    """The model's traffic from the plan alone: per target, the bytes it needs, those its own node holds, and those
    that must cross the network (once). A lost source counts as held by every target that reads it: each decodes its
    own part (``rebuilt_by``: source rank -> the target ranks that decode it)."""
    from adapters.deepspeed.reshard import deepspeed_plan
    nodes_from = list(nodes_from)
    decoded = {int(k) for k in (rebuilt_by or {})}
    d, d2 = len(nodes_from), len(nodes_to)
    metas = [ds_meta(params, d, r, G * 4 // d) for r in range(d)]
    p = deepspeed_plan(metas, d2)
    out = []
    for t in range(d2):
        need = {s: p.elements_between(s, t) * STATE_BYTES_PER_ELEM for s in range(d)}
        local = sum(b for s, b in need.items() if nodes_from[s] == nodes_to[t] or s in decoded)
        out.append({"need": sum(need.values()), "local": local, "remote": sum(need.values()) - local})
    return {"per_target": out, "remote_total": sum(o["remote"] for o in out), "args": (params, nodes_from, nodes_to)}


def summarize(name: str, ranks: list[dict], base: dict | None, bnd: dict | None, nodes: list[str]) -> dict:
    med = statistics.median
    restore = [max(x) for x in zip(*[r["restore_s"] for r in ranks])]   # already the max over ranks
    memcpy = [max(x) for x in zip(*[r["memcpy_s"] for r in ranks])]
    nb = max(r["nbytes"] for r in ranks)
    row = {"case": name, "ranks": len(ranks), "nodes": nodes, "state_bytes_per_rank": nb,
           "restore_s": med(restore), "restore_all": restore, "memcpy_s": med(memcpy),
           "tier": ranks[0]["tier"], "version": ranks[0]["version"], "lost": ranks[0]["lost"],
           "rss_peak_gib": [round(r["rss_peak_gib"], 2) for r in ranks],
           "phases": {k: med([max(r["phases"][i].get(k, 0.0) for r in ranks) for i in range(len(restore))])
                      for k in ranks[0]["phases"][0]}}
    row["vs_memcpy"] = row["restore_s"] / row["memcpy_s"]
    if ranks[0].get("net_s"):
        row["net_floor_s"] = med([max(x) for x in zip(*[r["net_s"] for r in ranks])])
    if ranks[0].get("reshard"):
        tr = [r["reshard"] for r in ranks]
        row["traffic"] = [{"local": t["local_bytes"], "in": t["remote_bytes"], "out": t["sent_bytes"],
                           "fragments_in": t["fragment_bytes"]} for t in tr]
        row["moved_total"] = sum(t["remote_bytes"] + t["fragment_bytes"] for t in tr)
        row["rebuilt_bytes"] = sum(r["rebuilt_bytes"] for r in ranks)
        if bnd is not None:
            if tr[0].get("rebuilt_by"):   # the lost source is held where it is decoded
                bnd = bound(*bnd["args"], tr[0]["rebuilt_by"])
            row["bound_remote_total"] = bnd["remote_total"]
            row["bound_per_target"] = bnd["per_target"]
    if base is not None:
        row["vs_same_size"] = row["restore_s"] / base["restore_s"]
    return row


class MemWatch:
    """What the run took of the machine at its peak while a size runs (holders' shared memory and every rank's)."""

    def __init__(self):
        import threading
        self.mine = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.mine = max(self.mine, _tree_pss())

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        return self.mine / GIB


def _tree_pss() -> int:
    """Bytes of memory this process and its descendants (holders, ranks) use, shared memory counted once (PSS)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    tree, grew = {os.getpid()}, True
    while grew:
        add = {p for p, pp in parent.items() if pp in tree and p not in tree}
        tree |= add
        grew = bool(add)
    total = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


SPARE = ["n0", "n4", "n2", "n3"]


def spare_phases(a, holders: "Holders", params) -> list[dict]:
    """The like-for-like baseline of the node-lost shrink: the job at its own size with n1's place taken by a spare
    (n4, its holder empty), rank 1 rebuilt from parity by its own restore (the same-size path). A rebuilt copy stays
    in the spare's holder, so each repeat runs on a fresh spare. Returns the phases' per-rank results, merged."""
    merged: list[dict] = []
    for _ in range(a.repeats):
        holders.start("n4")
        try:
            got = run_phase(a, holders.root, SPARE, params, repeats=1, expect=1, same_size=True)
        finally:
            holders.kill("n4")
        assert got[1]["tier"] == "parity" and got[1]["rebuilt_bytes"] > 0, got[1]
        if not merged:
            merged = got
            continue
        for m, g in zip(merged, got):
            for k in ("restore_s", "memcpy_s", "phases"):
                m[k] += g[k]
            m["rss_peak_gib"] = max(m["rss_peak_gib"], g["rss_peak_gib"])
    return merged


def run_size(a, size: float) -> list[dict]:
    params = model_params(size * GIB, 4)
    watch = MemWatch()
    root = tempfile.mkdtemp(prefix="shrink-holders-")
    os.chmod(root, 0o700)
    rows = []
    full = [f"n{i}" for i in range(4)]
    # Case B's layout first (2 nodes x 2 ranks), then the 4-node layout of A, C, D; each with its own holders.
    holders = Holders(os.path.join(root, "two"), a.budget_gb)
    os.makedirs(holders.root, mode=0o700)
    try:
        two = ["n0", "n0", "n1", "n1"]
        for n in ("n0", "n1"):
            holders.start(n)
        same2 = run_phase(a, holders.root, two, params, repeats=a.repeats, expect=1, same_size=True, snapshot_first=1)
        base2 = summarize("same-size 4->4 (2 nodes x 2)", same2, None, None, two)
        rows.append(base2)
        shr = ["n0", "n0", "n1"]
        b = run_phase(a, holders.root, shr, params, repeats=a.repeats, expect=1)
        rows.append(summarize("shrink 4->3, no node lost", b, base2, bound(params, two, shr), shr))
    finally:
        holders.stop()
    holders = Holders(os.path.join(root, "four"), a.budget_gb)
    os.makedirs(holders.root, mode=0o700)
    try:
        for n in full:
            holders.start(n)
        same = run_phase(a, holders.root, full, params, repeats=a.repeats, expect=1, same_size=True, snapshot_first=1)
        base = summarize("same-size 4->4", same, None, None, full)
        rows.append(base)
        holders.kill("n1")
        spare = summarize("same-size 4->4, n1 lost, spare", spare_phases(a, holders, params), base, None, SPARE)
        rows.append(spare)
        shr = ["n0", "n2", "n3"]   # the survivors in node order
        repairs = sorted(a.repairs.split(","), key=lambda r: r == "chain")   # the last one snapshots for the grow
        for rp in repairs:
            c = run_phase(a, holders.root, shr, params, repeats=a.repeats, expect=1, repair=rp,
                          snapshot_after=2 if rp == repairs[-1] and not a.no_grow else 0)
            name = "shrink 4->3, node n1 lost" if rp == "chain" else f"shrink 4->3, n1 lost, {rp}"
            rows.append(summarize(name, c, base, bound(params, full, shr), shr))
            rows[-1].update(repair=rp, vs_spare=rows[-1]["restore_s"] / spare["restore_s"])
        if not a.no_grow:
            holders.start("n1")   # back, with an empty holder
            d = run_phase(a, holders.root, full, params, repeats=a.repeats, expect=2)
            rows.append(summarize("grow 3->4", d, base, bound(params, shr, full), full))
    finally:
        holders.stop()
        shutil.rmtree(root, ignore_errors=True)
    peak = watch.stop()
    for r in rows:
        r["GiB_per_rank_at_4"] = size
        r["run_peak_gib"] = round(peak, 2)
    print(f"{size} GiB per rank: the run's processes (holders and ranks) used up to {peak:.2f} GiB (PSS)",
          file=sys.stderr)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--out", "--root", "--nodes", "--params"):
        p.add_argument(hidden, default="", help=argparse.SUPPRESS)
    p.add_argument("--expect-version", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--version", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--snapshot-after", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--repair", default="chain", help=argparse.SUPPRESS)
    p.add_argument("--same-size", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--snapshot-first", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sizes", default="0.25,0.5,1,2", help="GiB of state per rank at D = 4, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--repairs", default="chain,gather", help="the node-lost shrink's rebuilds: chain and/or gather")
    p.add_argument("--no-grow", action="store_true", help="skip the grow 3 -> 4 phase")
    p.add_argument("--budget-gb", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", default="", help="a directory: cProfile every rank's restores into it")
    p.add_argument("--tag", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
    rows = []
    for s in a.sizes.split(","):
        size = float(s)
        a.budget_gb = round(8.5 * size + 0.25, 2)   # two versions of two ranks per node, their parity, headroom
        rows += run_size(a, size)
    if a.json:
        print(json.dumps(rows))
        return 0
    print_table(rows, a.repeats)
    return 0


def print_table(rows: list[dict], repeats: int) -> None:
    mib = 1 << 20
    print(f"medians of {repeats}; seconds of the slowest rank; floors in the same phase: memcpy of the restored bytes "
          "per rank, net = the same pieces over gloo; phases from RestoreResult.phases")
    print(f"{'GiB':>4} | {'case':<29} | {'restore':>7} {'memcpy':>6} {'x floor':>7} {'x same':>6} | {'agree':>5} "
          f"{'verify':>6} {'rebuild':>7} {'move':>5} {'(net)':>5} {'assem.':>6} {'apply':>5} {'rest':>5}")
    for r in rows:
        ph = r["phases"]
        same = f"{r['vs_same_size']:.2f}x" if "vs_same_size" in r else "-"
        rest = r["restore_s"] - sum(ph.values())
        print(f"{r['GiB_per_rank_at_4']:>4} | {r['case']:<29} | {r['restore_s']:>7.3f} {r['memcpy_s']:>6.3f} "
              f"{r['vs_memcpy']:>6.2f}x {same:>6} | {ph.get('survey', ph.get('agree', 0)):>5.3f} "
              f"{ph.get('verify', 0):>6.3f} {ph.get('rebuild', 0):>7.3f} {ph.get('move', 0):>5.3f} "
              f"{r.get('net_floor_s', 0):>5.3f} {ph.get('assemble', 0):>6.3f} {ph.get('apply', 0):>5.3f} {rest:>5.3f}")
    for r in rows:
        if "vs_spare" in r:
            print(f"{r['GiB_per_rank_at_4']:>4} | {r['case']:<29} | {r['vs_spare']:.2f}x the same-size restore with n1 "
                  "lost on a spare (rank 1 rebuilt from parity by its own restore)")
    print("traffic, MiB per target rank: in (pieces received from other nodes) + parity rebuild received / out")
    for r in rows:
        if "traffic" not in r:
            continue
        per = ", ".join(f"{t['in'] / mib:.0f}+{t['fragments_in'] / mib:.0f}/{t['out'] / mib:.0f}" for t in r["traffic"])
        pieces = sum(t["in"] for t in r["traffic"])
        frags = sum(t["fragments_in"] for t in r["traffic"])
        state = r["state_bytes_per_rank"] * r["ranks"]
        print(f"{r['GiB_per_rank_at_4']:>4} | {r['case']:<29} | {per}; pieces {pieces / mib:.0f} MiB (bound "
              f"{r['bound_remote_total'] / mib:.0f}) + rebuild {frags / mib:.0f} MiB (source rebuilt: "
              f"{r['rebuilt_bytes'] / mib:.0f} MiB); total {(pieces + frags) / state:.2f}x the state")


if __name__ == "__main__":
    sys.exit(main())
