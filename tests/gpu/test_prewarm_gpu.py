"""The fork server on a GPU node: a trainer forked from a server that preloaded torch initializes CUDA
itself and computes what a cold trainer computes, bit for bit (deterministic kernels).

Skipped (with the reason) without a GPU; ``scripts/gpu_check.sh`` runs tests/gpu with ``-rs``.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip(f"no CUDA device visible to torch {torch.__version__}: the forked-trainer GPU check runs in "
                "scripts/gpu_check.sh", allow_module_level=True)

from shardsafe.launch.prewarm import ForkServer  # noqa: E402

TRAINER = textwrap.dedent("""
    import hashlib, json, os, sys, torch
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    m = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512)).to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for i in range(5):
        x = torch.randn(64, 512, device=dev)
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    h = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in m.parameters())).hexdigest()
    json.dump({"hash": h, "loss": float(loss).hex(), "initialized": torch.cuda.is_initialized()},
              open(os.environ["SHARDSAFE_TEST_OUT"], "w"))
""")


def test_forked_trainer_uses_cuda_like_a_cold_one(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    server = ForkServer(["torch", "torch._dynamo"], env=env, log_path=str(tmp_path / "prewarm.log")).start(timeout_s=300)
    try:
        got = {}
        for mode in ("forked", "cold"):
            out = str(tmp_path / f"{mode}.json")
            e = {**env, "SHARDSAFE_TEST_OUT": out}
            with open(tmp_path / f"{mode}.log", "wb") as log:
                if mode == "forked":
                    assert server.accepts([sys.executable, str(script)], e) == ""
                    rc = server.spawn([sys.executable, str(script)], env=e, stdout=log.fileno(),
                                      stderr=log.fileno()).wait(timeout=300)
                else:
                    rc = subprocess.run([sys.executable, str(script)], env=e, stdout=log, stderr=subprocess.STDOUT,
                                        timeout=300).returncode
            assert rc == 0, (tmp_path / f"{mode}.log").read_text()[-3000:]
            got[mode] = json.load(open(out))
        assert got["forked"] == got["cold"] and got["forked"]["initialized"] is True, got
    finally:
        server.close()
