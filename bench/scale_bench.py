"""Snapshot and restore at real shard sizes: time per GiB from 0.25 to 2 GiB of state per rank.

    .venv/bin/python bench/scale_bench.py [--sizes 0.25,0.5,1,2] [--repeats 5] [--ranks 2] [--hash-threads 0]
                                          [--early-open [verify|map]] [--json]

Two ranks (--ranks) on one simulated node, the real holder, snapshot pipeline and collective restore
(restore_from_holder: vote, every xxh3 segment verified, copied in place). The rank state is synthetic:
three fp32 tensors of equal size (an fp32 master and two Adam moments, as a ZeRO/DistOpt shard is) and a
small one, filled with random bytes; what is measured is shardsafe's own path, independent of the engine
(bench/snapshot_bench.py has the DeepSpeed engine and its load_checkpoint beside it). Per size, medians of
--repeats, every figure next to its floor measured in the same run:
  * snapshot: copy into the holder slot plus the checksum tail (the segments still hashing when the
    last byte landed) vs a memcpy (torch copy_) of the same tensors into pre-faulted private memory;
  * restore: the whole collective restore (agree, verify, apply) vs a memcpy of the same bytes into
    pre-faulted memory; its verify and apply phases apart;
  * checksums alone: xxh3 of the payload on 1 thread and on the configured threads.
With --early-open each restore finds its slot opened, its page tables filled and its checksums verified
beforehand (--early-open map: only opened), as a restarted trainer's restore does
(shardsafe/holder/early_open.py: the trainer does it while it sets up); that early open's own time is printed
apart. A cost that grows faster than the bytes shows as a rising s/GiB column. This machine has 2 cores for 2 ranks:
one hash thread per rank is what auto-sizing picks here, so --hash-threads 2 oversubscribes. --ranks 1 gives
the one rank both cores (auto-sizing: 2 hash threads), the nearest this machine comes to a GPU node's
8-16 cores per rank. --device cuda puts the state on the rank's GPU (one per rank): the snapshot's floor is then
a pinned D2H copy of the same bytes and the restore's a pinned H2D copy (scripts/gpu_check.sh runs it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from shardsafe.holder.segments import huge_pages_possible, shmem_huge_setting
from shardsafe.snapshot.state import StateAdapter

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 1 << 30


class SyntheticShard(StateAdapter):
    """A StateAdapter over fixed tensors: capture hands them over, apply copies a snapshot into them."""

    def __init__(self, nbytes: int, seed: int, device: str = "cpu"):
        import torch
        g = torch.Generator().manual_seed(seed)
        n = nbytes // 3 // 4
        self.tensors = {k: torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), generator=g, dtype=torch.int32).view(torch.float32)
                        .to(device) for k in ("fp32_master", "exp_avg", "exp_avg_sq")}
        self.tensors["step"] = torch.tensor([7], dtype=torch.int64, device=device)

    def capture(self):
        from shardsafe.snapshot.state import RankState
        return RankState(tensors=dict(self.tensors), meta={"step": 7})

    def apply(self, tensors, meta) -> None:
        for k, t in tensors.items():
            self.tensors[k].copy_(t)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from shardsafe.payload import checksum
    from shardsafe.payload import manifest as mf
    from shardsafe.config import ShardsafeConfig
    from shardsafe.holder.early_open import EarlyOpen
    from shardsafe.snapshot.restore import restore_from_holder
    from shardsafe.runtime import Runtime

    torch.set_num_threads(1)
    dist.init_process_group("gloo")   # the bench's own few collectives are on CPU tensors
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def mx(v: float) -> float:   # the job waits for its slowest rank
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    shard = SyntheticShard(int(a.size * GIB), seed=rank, device=a.device)
    cfg = ShardsafeConfig(interval=1, memory_budget_gb=a.budget_gb, hash_threads=a.hash_threads, parity_group_size=1,
                          restore=False, job_id=os.environ["SHARDSAFE_JOB_ID"])
    rt = Runtime(cfg, rank=rank, world_size=world)
    pipe = rt.pipeline
    st = shard.capture()
    # Floors, pre-faulted: a copy of the same bytes into host memory (pinned on a GPU: the D2H copy a snapshot
    # makes), and on a GPU the pinned H2D copy of the same bytes a restore makes.
    floor = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda).fill_(1) for k, t in st.tensors.items()}
    h2d = {k: torch.empty_like(t).fill_(1) for k, t in st.tensors.items()} if cuda else {}
    res: dict = {"snapshot_s": [], "copy_s": [], "hash_tail_s": [], "memcpy_s": [], "restore_s": [], "phases": [],
                 "hash1_s": [], "hashN_s": [], "h2d_s": [],
           "h2d_mode": [], "pin_s": [], "pin_wait_s": [], "early_open_s": []}
    for i in range(a.warmup + a.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        pipe.submit(100 + i, shard.capture())
        pipe.flush()
        snap = mx(time.perf_counter() - t0)
        h = pipe.history[-1]
        assert h.committed, h.error
        sync()
        t0 = time.perf_counter()
        for k, t in st.tensors.items():
            floor[k].copy_(t, non_blocking=cuda)
        sync()
        mc = mx(time.perf_counter() - t0)
        hd = 0.0
        if cuda:
            t0 = time.perf_counter()
            for k, t in floor.items():
                h2d[k].copy_(t, non_blocking=True)
            sync()
            hd = mx(time.perf_counter() - t0)
        early, eo = None, 0.0
        if a.early_open:   # as a restarted trainer does while it sets up (holder/early_open.py), timed apart
            t0 = time.perf_counter()
            early = EarlyOpen(rt.paths, rank, verify=a.early_open == "verify").start()
            early.wait()
            eo = mx(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        r = restore_from_holder(shard, rt.client, rank=rank, coll=rt.coll, h2d=a.h2d, early=early)
        sync()
        rest = mx(time.perf_counter() - t0)
        assert r.version == 100 + i, r.message
        assert not a.early_open or (r.notes or {}).get("early_open") == "used", r.notes
        assert a.early_open != "verify" or r.notes.get("early_verify") == "used", r.notes
        man, mm = rt.client.open(rank=rank, version=100 + i)
        ranges = [rg for e in man["entries"] for rg in mf.chunk_ranges(e)]
        buf = memoryview(mm)
        one = checksum.Hasher(1)
        t0 = time.perf_counter()
        one.hash_ranges(buf, ranges)
        h1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        pipe.hasher.hash_ranges(buf, ranges)
        hn = time.perf_counter() - t0
        buf.release()
        mm.close()
        if i >= a.warmup:
            res["snapshot_s"].append(snap)
            res["copy_s"].append(h.copy_s)
            res["hash_tail_s"].append(h.hash_s)
            res["memcpy_s"].append(mc)
            res["restore_s"].append(rest)
            res["phases"].append(r.phases)
            res["hash1_s"].append(h1)
            res["hashN_s"].append(hn)
            res["h2d_s"].append(hd)
            res["h2d_mode"].append((r.notes or {}).get("h2d", "cpu"))
            res["pin_s"].append((r.notes or {}).get("pin_s", 0.0))
            res["pin_wait_s"].append((r.notes or {}).get("pin_wait_s", 0.0))
            res["early_open_s"].append(eo)
    res["nbytes"] = h.nbytes
    res["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    res["hash_threads"] = pipe.hasher.threads
    res["native"] = checksum.native_available()
    res["xxh3"] = checksum.implementation()   # which library, and whether the CPU copy hashes as it copies
    if rank == 0:
        with open(os.path.join(a.out, "scale_result.json"), "w") as f:
            json.dump(res, f)
    rt.close()
    dist.barrier()
    dist.destroy_process_group()


def run_size(a: argparse.Namespace, size: float) -> dict:
    from shardsafe.launch import LaunchConfig, LocalLauncher
    tmp = tempfile.mkdtemp(prefix="shardsafe-scale-")
    budget = a.budget_gb or max(1.0, 2 * a.ranks * size * 1.1 + 0.5)   # two versions of every rank
    job = f"scale{os.getpid()}x{int(size * 100)}"
    run = LocalLauncher(LaunchConfig(nodes=1, nproc_per_node=a.ranks, job_id=job, run_dir=tmp, max_restarts=0,
                                     memory_budget_gb=budget, attempt_timeout_s=3000))
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--out", tmp, "--size", str(size),
            "--repeats", str(a.repeats), "--warmup", str(a.warmup), "--budget-gb", str(budget),
            "--hash-threads", str(a.hash_threads), "--device", a.device, "--h2d", a.h2d] \
        + (["--early-open", a.early_open] if a.early_open else [])
    if not run.run(argv).ok:
        raise SystemExit(f"benchmark at {size} GiB failed; logs kept in {tmp}")
    with open(os.path.join(tmp, "scale_result.json")) as f:
        res = json.load(f)
    shutil.rmtree(tmp, ignore_errors=True)
    med = statistics.median
    gib = res["nbytes"] / GIB
    row = {"GiB_per_rank": round(gib, 3), "hash_threads": res["hash_threads"], "native_hash": res["native"], "xxh3": res["xxh3"],
           "snapshot_s": med(res["snapshot_s"]), "copy_s": med(res["copy_s"]), "hash_tail_s": med(res["hash_tail_s"]),
           "memcpy_s": med(res["memcpy_s"]), "restore_s": med(res["restore_s"]),
           "verify_s": med([p["verify"] for p in res["phases"]]), "apply_s": med([p["apply"] for p in res["phases"]]),
           "hash1_s": med(res["hash1_s"]), "hashN_s": med(res["hashN_s"]), "repeats": a.repeats,
           "early_open_s": med(res["early_open_s"]),
           "ranks": a.ranks, "device": res["device"]}
    row["ratio_snapshot_vs_memcpy"] = row["snapshot_s"] / row["memcpy_s"]
    row["ratio_restore_vs_memcpy"] = row["restore_s"] / row["memcpy_s"]
    if a.device == "cuda":   # on a GPU the floors are the pinned D2H (memcpy_s) and H2D copies of the same bytes
        row["h2d_s"] = med(res["h2d_s"])
        row["ratio_restore_vs_h2d"] = row["restore_s"] / row["h2d_s"]
        # how the restore's copies read the holder's memory, and what page-locking it cost (beside the verify)
        row["h2d_mode"] = sorted(set(res["h2d_mode"]))
        row["pin_s"], row["pin_wait_s"] = med(res["pin_s"]), med(res["pin_wait_s"])
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="")
    p.add_argument("--size", type=float, default=0.25, help=argparse.SUPPRESS)
    p.add_argument("--sizes", default="0.25,0.5,1,2", help="GiB of state per rank, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds: the holder rotates two slots, and a slot's first use faults in fresh memory")
    p.add_argument("--ranks", type=int, default=2, help="ranks on the node (2 = one core each here)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the rank state lives (cuda: one GPU per rank; floors: pinned D2H and H2D copies)")
    p.add_argument("--h2d", choices=["pinned", "pageable"], default="pinned",
                   help="restore_h2d: how a restore into GPU tensors reads the holder's memory (GPU only)")
    p.add_argument("--early-open", nargs="?", const="verify", choices=["verify", "map"], default=None,
                   help="open the slot before each restore, as a restarted trainer does while it sets up "
                        "(shardsafe.holder.early_open): 'verify' (the default, as SHARDSAFE_EARLY_OPEN unset) maps and "
                        "verifies it, 'map' only maps it (the restore verifies); its time is printed apart")
    p.add_argument("--hash-threads", type=int, default=0, help="shardsafe hash_threads (0 = auto)")
    p.add_argument("--budget-gb", type=float, default=0.0, help="holder budget (0 = sized to the run)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    if a.device == "cuda":
        import torch
        if not torch.cuda.is_available() or torch.cuda.device_count() < a.ranks:
            raise SystemExit(f"--device cuda needs {a.ranks} GPU(s); this machine has "
                             f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    rows = [run_size(a, float(s)) for s in a.sizes.split(",")]
    policy = shmem_huge_setting() or "unknown"
    for r in rows:
        r["shmem_enabled"] = policy   # the holder's slots are on 2 MiB pages only where this allows it
    if a.json:
        print(json.dumps(rows))
        return 0
    print(f"{a.ranks} rank(s), one node, synthetic fp32 shard; medians of {a.repeats}; s/GiB per rank; floor = memcpy of the "
          f"same bytes into pre-faulted memory, same run; hash threads per rank: {rows[0]['hash_threads']} "
          f"({'off the GIL' if rows[0]['native_hash'] else 'python-xxhash, under the GIL'}); holder slots "
          f"{'on 2 MiB pages' if huge_pages_possible() else 'on 4 KiB pages'} (shmem_enabled={policy}); xxh3: "
          f"{rows[0]['xxh3']}")
    print(f"{'GiB':>5} | {'snapshot':>8} {'(copy':>7} {'+hash tail)':>11} {'memcpy':>7} {'ratio':>6} | "
          f"{'restore':>8} {'(verify':>8} {'apply)':>7} {'ratio':>6} | {'xxh3 1 thr':>10} {'N thr':>6}")
    if a.device == "cuda":
        print(f"  on {rows[0]['device']}: memcpy = pinned D2H of the same bytes (the snapshot's floor); restore vs "
              "pinned H2D: " + ", ".join(f"{r['GiB_per_rank']:.2f} GiB {r['ratio_restore_vs_h2d']:.2f}x "
                                         f"({r['h2d_s'] / r['GiB_per_rank']:.3f} s/GiB)" for r in rows))
        print(f"  restore_h2d={a.h2d}: copies read " + ", ".join(
            f"{r['GiB_per_rank']:.2f} GiB {'/'.join(r['h2d_mode'])} (pin {r['pin_s']:.3f} s beside the verify, "
            f"apply waited {r['pin_wait_s']:.3f} s)" for r in rows))
    if a.early_open:
        print(f"  early open, {a.early_open} (before the restore, beside the trainer's set-up; not in the restore column): " + ", ".join(
            f"{r['GiB_per_rank']:.2f} GiB {r['early_open_s'] / r['GiB_per_rank']:.3f} s/GiB" for r in rows))
    for r in rows:
        g = r["GiB_per_rank"]
        print(f"{g:5.2f} | {r['snapshot_s'] / g:8.3f} {r['copy_s'] / g:7.3f} {r['hash_tail_s'] / g:11.3f} "
              f"{r['memcpy_s'] / g:7.3f} {r['ratio_snapshot_vs_memcpy']:5.2f}x | {r['restore_s'] / g:8.3f} "
              f"{r['verify_s'] / g:8.3f} {r['apply_s'] / g:7.3f} {r['ratio_restore_vs_memcpy']:5.2f}x | "
              f"{r['hash1_s'] / g:10.3f} {r['hashN_s'] / g:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
