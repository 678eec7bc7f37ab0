"""The snapshot pipeline's GPU path: D2H on a side CUDA stream into cudaHostRegister'ed holder memory.

Checks (on a GPU; skipped with a printed reason elsewhere):
* ordering: kernels queued before the snapshot are in it, the "optimizer step" queued after
  ``wait_copied`` is not (the compute stream waits for the copy on the device);
* bit-exact round trip through the holder into CUDA tensors (restore), with the holder's mapping
  page-locked for the copies (restore_h2d="pinned") and from pageable memory;
* copy bandwidth vs a plain pinned D2H copy, and the CPU-side stall while compute is queued.
Results go to $OUT/snapshot_gpu.json when OUT is set.
"""
import json
import os
import statistics
import time

import pytest
import torch

from shardsafe.holder.client import HolderClient
from shardsafe.snapshot.restore import Collectives, restore_from_holder
from shardsafe.snapshot.pipeline import LocalAgreement, SnapshotPipeline
from shardsafe.snapshot.state import RankState, StateAdapter

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU snapshot path runs in scripts/gpu_check.sh on a GPU machine",
                allow_module_level=True)

N = int(os.environ.get("SNAPSHOT_GPU_MIB", "512")) * (1 << 20) // 4


class GpuState(StateAdapter):
    def __init__(self, seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.t = {"master": torch.randn(N, device="cuda", generator=g),
                  "exp_avg": torch.randn(N // 3 + 7, device="cuda", generator=g).to(torch.bfloat16),
                  "step": torch.tensor(3.0, device="cuda")}

    def capture(self):
        return RankState(dict(self.t), {"k": 1})

    def apply(self, tensors, meta):
        for k, v in self.t.items():
            v.copy_(tensors[k], non_blocking=False)


@pytest.fixture
def client(holder_factory):
    """A client of one holder, job gpujob, node n0, 16 GB."""
    (h,) = holder_factory(1, job="gpujob", budget_gb=16)
    return HolderClient(h.paths, timeout_s=60).connect()


def _busy(ms: float) -> None:
    """Queue roughly ``ms`` of GPU work on the current stream."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    n = 0
    while (time.perf_counter() - t0) * 1e3 < ms / 20 and n < 2000:
        a = a @ a.T / 64
        n += 1


def test_gpu_snapshot_ordering_roundtrip_and_speed(client):
    results = {}
    st = GpuState(1)
    pipe = SnapshotPipeline(client, rank=0, world_size=1, node="n0", agreement=LocalAgreement())
    # kernels queued *before* the snapshot must be in it
    x = torch.randn(N, device="cuda")
    _busy(50)
    st.t["master"].copy_(x)
    expected = {k: v.clone() for k, v in st.t.items()}   # same stream: after the copy above
    pipe.submit(1, st.capture())
    pipe.wait_copied()
    st.t["master"].add_(1.0)          # the next optimizer step, queued after wait_copied
    st.t["exp_avg"].mul_(2)
    assert pipe.flush(timeout=120), pipe.history[-1].error
    torch.cuda.synchronize()
    man, mm = client.open(rank=0, version=1)
    from shardsafe.payload import manifest as mf
    views = mf.views(man, mm)
    for k in expected:
        assert torch.equal(views[k], expected[k].cpu()), k
    del views
    mm.close()
    # restore into fresh CUDA tensors
    dst = GpuState(2)
    res = restore_from_holder(dst, client, rank=0, coll=Collectives())
    assert res.version == 1
    for k in expected:
        assert torch.equal(dst.t[k], expected[k]), k
    # the copies read the holder's mapping page-locked (restore_h2d="pinned", pinning.py), not through staging
    assert res.notes.get("h2d") == "pinned", res.notes
    slow = GpuState(3)
    res_pageable = restore_from_holder(slow, client, rank=0, coll=Collectives(), h2d="pageable")
    assert res_pageable.notes.get("h2d") == "pageable", res_pageable.notes
    for k in expected:
        assert torch.equal(slow.t[k], expected[k]), k
    # bandwidth: snapshot copy vs a plain pinned D2H copy of the same bytes
    nbytes = sum(t.numel() * t.element_size() for t in st.t.values())
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in st.t.items()}
    copy_s, base_s, stall_s, with_hash_s = [], [], [], []
    for i in range(5):
        pipe.submit(10 + i, st.capture())
        pipe.flush()
        copy_s.append(pipe.history[-1].copy_s)
        with_hash_s.append(pipe.history[-1].copy_s + pipe.history[-1].hash_s)   # D2H + the checksums' tail
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, v in st.t.items():
            pinned[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()
        base_s.append(time.perf_counter() - t0)
    # stall: forward/backward-like work queued after the submit, then the step waits for the copy
    for i in range(5):
        pipe.submit(100 + i, st.capture())
        _busy(100)
        stall_s.append(pipe.wait_copied())
        st.t["master"].add_(1.0)
    pipe.close()
    med = statistics.median
    results = {"bytes": nbytes, "snapshot_copy_GBps": nbytes / med(copy_s) / 1e9,
               "pinned_d2h_GBps": nbytes / med(base_s) / 1e9,
               "ratio_snapshot_vs_pinned_d2h": med(base_s) / med(copy_s),
               "snapshot_with_checksums_GBps": nbytes / med(with_hash_s) / 1e9,
               "ratio_snapshot_with_checksums_vs_pinned_d2h": med(base_s) / med(with_hash_s),
               "stall_ms_median": med(stall_s) * 1e3, "restore_s": res.seconds,
               "restore_phases": res.phases, "restore_notes": res.notes,
               "restore_pageable_s": res_pageable.seconds, "restore_pageable_phases": res_pageable.phases}
    print("snapshot GPU path:", json.dumps(results))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "snapshot_gpu.json"), "w") as f:
            json.dump(results, f)
