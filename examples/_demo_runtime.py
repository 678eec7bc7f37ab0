"""DEMO STAND-IN for shardsafe's holder runtime: snapshots as files in a directory.

It implements the adapters' ``Runtime`` protocol (``after_step``, ``on_exit``, ``try_restore``)
synchronously, without holders, shared memory, parity or checksums, so that the Megatron examples
and tests can show a fork-free snapshot and a restore in fresh processes before the real runtime
is wired in. Layout: ``DIR/it<N>/rank<R>.json`` (manifest: entries + meta) and ``.bin`` (raw bytes).
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

import torch


def save_tensors(path: str, tensors: Mapping[str, torch.Tensor], meta: Optional[Mapping[str, Any]] = None) -> None:
    """JSON index (name, dtype, shape, offset, nbytes) + raw bytes; no pickle."""
    index, off = [], 0
    with open(path + ".bin", "wb") as f:
        for name, t in tensors.items():
            t = t.detach().cpu().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            f.write(raw)
            index.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                          "offset": off, "nbytes": len(raw)})
            off += len(raw)
    tmp = path + ".json.tmp"
    with open(tmp, "w") as f:
        json.dump({"entries": index, "meta": dict(meta or {})}, f)
    os.replace(tmp, path + ".json")  # the manifest lands last and atomically: a torn write is invisible


def load_tensors(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    with open(path + ".json") as f:
        idx = json.load(f)
    with open(path + ".bin", "rb") as f:
        blob = f.read()
    out = {}
    for e in idx["entries"]:
        buf = bytearray(blob[e["offset"]:e["offset"] + e["nbytes"]])
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        out[e["name"]] = t.view(getattr(torch, e["dtype"])).reshape(e["shape"]).clone()
    return out, idx["meta"]


class DirRuntime:
    """Every ``interval`` iterations each rank writes its state; restore takes the newest complete one."""

    def __init__(self, directory: str, interval: int = 1):
        self.dir, self.interval = directory, interval
        self.events: list[tuple[str, int]] = []
        os.makedirs(directory, exist_ok=True)

    def _rank(self) -> tuple[int, int]:
        return torch.distributed.get_rank(), torch.distributed.get_world_size()

    def after_step(self, iteration: int, adapter: Any) -> None:
        if iteration % self.interval:
            return
        rank, _ = self._rank()
        st = adapter.capture()
        d = os.path.join(self.dir, f"it{iteration}")
        os.makedirs(d, exist_ok=True)
        save_tensors(os.path.join(d, f"rank{rank}"), st.tensors, json.loads(json.dumps(st.meta)))
        self.events.append(("snapshot", iteration))

    def on_exit(self, iteration: int, adapter: Any) -> None:
        self.events.append(("exit", iteration))

    def try_restore(self, adapter: Any) -> Optional[int]:
        rank, world = self._rank()
        complete = []
        for name in os.listdir(self.dir):
            d = os.path.join(self.dir, name)
            if name.startswith("it") and all(os.path.exists(os.path.join(d, f"rank{r}.json")) for r in range(world)):
                complete.append(int(name[2:]))
        if not complete:
            return None
        it = max(complete)
        tensors, meta = load_tensors(os.path.join(self.dir, f"it{it}", f"rank{rank}"))
        adapter.apply(tensors, meta)
        self.events.append(("restore", it))
        return it
