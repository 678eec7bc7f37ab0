"""Fork-based multi-rank harness for dist/ tests: gloo over a FileStore, short timeouts, no pickle.

``run_ranks(world, fn, *args)`` forks ``world`` children (fork, so nothing is pickled and the
parent's imports are reused), each joins a gloo group through a FileStore in a fresh temp dir
with a short collective timeout, runs ``fn(rank, world, *args)`` and writes its JSON-able return
value to a file. The parent kills every child when one fails or the deadline passes, and raises
with the failing rank's traceback. Tensors travel through ``save_tensors``/``load_tensors``
(shardsafe.payload.manifest's JSON layout plus raw bytes, and a JSON file for metadata).
"""
from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))

PG_TIMEOUT_S = float(os.environ.get("SHARDSAFE_TEST_PG_TIMEOUT_S", "3"))


def _child(rank: int, world: int, store_path: str, out_dir: str, fn: Callable, args: tuple, pg_timeout_s: float) -> None:
    code = 0
    try:
        os.nice(5)  # the host is shared: let interactive work and other suites go first
        torch.set_num_threads(1)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                           "OMP_NUM_THREADS": "1"})
        store = torch.distributed.FileStore(store_path, world)
        torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                             timeout=timedelta(seconds=pg_timeout_s))
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    except BaseException:  # noqa: BLE001 - report everything to the parent
        code = 1
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        os._exit(code)  # skip pytest's atexit handlers and gloo teardown ordering in the child


def run_ranks(world: int, fn: Callable, *args: Any, timeout_s: float = 90.0,
              pg_timeout_s: float = PG_TIMEOUT_S) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked ranks; return their results by rank."""
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="shardsafe-ranks-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(r, world, store_path, tmp, fn, args, pg_timeout_s), daemon=True)
                 for r in range(world)]
        # The children's garbage collections would write to the GC header of every object this pytest worker
        # imported (torch, DeepSpeed, Megatron...), and each write copies a page the child shares with us: frozen,
        # those objects are skipped (the gc module's recipe for fork without exec), as the fork servers do.
        gc.freeze()
        try:
            for p in procs:
                p.start()
        finally:
            gc.unfreeze()
        deadline = time.monotonic() + timeout_s
        failed = None
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                failed = "a rank failed"
                break
            if time.monotonic() > deadline:
                failed = f"timeout after {timeout_s:.0f}s"
                break
            time.sleep(0.05)
        for p in procs:  # only our own children, by pid
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
        errs = {r: open(os.path.join(tmp, f"rank{r}.err")).read()
                for r in range(world) if os.path.exists(os.path.join(tmp, f"rank{r}.err"))}
        if errs or failed or any(p.exitcode != 0 for p in procs):
            first = min(errs) if errs else None
            detail = "\n".join(f"rank {r}:\n{e}" for r, e in sorted(errs.items())) if errs else "no traceback"
            raise RuntimeError(f"{failed or 'rank(s) failed'} (exit codes {[p.exitcode for p in procs]}); {detail}")
        out = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                out.append(json.load(f))
        return out


# ---- tensors between processes: JSON index + raw bytes (no pickle) --------------------------------

def save_tensors(path: str, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> None:
    """``path.bin`` + ``path.json`` (shardsafe.payload.manifest.save_tensors) and ``path.meta.json``."""
    from shardsafe.payload import manifest as mf
    mf.save_tensors(path, tensors)
    with open(path + ".meta.json", "w") as f:
        json.dump(meta or {}, f)


def load_tensors(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    from shardsafe.payload import manifest as mf
    with open(path + ".meta.json") as f:
        meta = json.load(f)
    return mf.load_tensors(path), meta
