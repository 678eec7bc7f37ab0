"""The "device" parity transport on GPUs: NCCL between ranks, the CUDA kernels, parity back into the holders.

Each rank runs on its own GPU (NCCL refuses two ranks on one device), so this needs >= 2 GPUs in one
machine; skipped with that reason otherwise (the single-GPU machines lent so far could not run it). The
scenario is tests/dist/test_parity_exchange.py's ``_device_double``: version 1 encoded by the host
transport, version 2 (the same data) by the device transport in 64 KiB blocks; the shares must be byte for
byte equal, and a lost member is rebuilt from the device-made parity bit-exact. Ranks are separate
processes started with subprocess (CUDA does not survive fork; results come back as JSON files).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason=f"the device parity transport needs >= 2 GPUs (NCCL refuses two ranks on one "
                                        f"device); {GPUS} visible"),
]

_RANK = r"""
import json, os, sys
from datetime import timedelta
import torch
rank, world, root, m, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
torch.cuda.set_device(rank)
torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(store, world), rank=rank,
                                     world_size=world, timeout=timedelta(seconds=60))
from tests.dist.test_parity_exchange import _device_double
res = _device_double(rank, world, root, m, device=f"cuda:{rank}")
with open(out, "w") as f:
    json.dump(res, f)
"""


@pytest.mark.parametrize("world, m", [(2, 1), (3, 1), (4, 2)])
def test_device_transport_on_gpus_makes_the_host_transports_parity(holder_factory, tmp_path, world, m):
    if world > GPUS:
        pytest.skip(f"needs {world} GPUs, {GPUS} visible")
    store = tempfile.mktemp(prefix="shardsafe-store-", dir=str(tmp_path))
    root = holder_factory(world, job="pjob", budget_gb=0.1).root   # test_parity_exchange's holders, `world` of them
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(world), root, str(m), store,
                               str(tmp_path / f"rank{r}.json")], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(f"rank {r}:\n{t[-3000:]}" for r, t in enumerate(logs))
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(o["same_parity"] for o in out), out
    assert [o["version"] for o in out] == [2] * world and all(o["equal"] for o in out), out
    assert [o["tier"] for o in out] == ["parity"] * world and out[1]["rebuilt"] > 0
