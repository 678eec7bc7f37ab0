"""A snapshot restored into a DeepSpeed engine of another setup: refused before anything is applied, with a
message naming the setting (issue 15 items 8 and 14), or restored with a warning where the state still fits.

Real engines on one forked rank (gloo) and a real holder: a ZeRO-2 bf16 snapshot is offered to a ZeRO-3
engine (refused, naming zero_optimization.stage), to an engine whose optimizer path changed (FusedAdam
instead of torch AdamW: refused, naming the optimizer), and to a ZeRO-2 fp32 engine (the fp32 masters and
moments fit: restored, with a warning that the precision changed).
"""
import pytest

from shardsafe.holder.client import HolderClient
from shardsafe.holder.paths import HolderPaths

from ._fork_ranks import run_ranks


def _config(stage, dtype, torch_adam=True):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **({"torch_adam": True} if torch_adam else {})}},
           "steps_per_print": 10 ** 9}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(stage, dtype, torch_adam=True):
    import deepspeed
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=_config(stage, dtype, torch_adam))
    x = torch.randn(2, 16, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    return engine


def _changes(rank, world, root):
    import logging

    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    from shardsafe.adapters.deepspeed import DeepSpeedStateAdapter
    from shardsafe.snapshot.restore import Collectives, RestoreError, restore_from_holder
    from shardsafe.snapshot.pipeline import LocalAgreement, SnapshotPipeline
    client = HolderClient(HolderPaths(root, "ljob", "n0"), timeout_s=10).connect()
    src = DeepSpeedStateAdapter(_engine(2, "bf16"))
    pipe = SnapshotPipeline(client, rank=0, world_size=1, node="n0", agreement=LocalAgreement())
    pipe.submit(1, src.capture())
    assert pipe.flush(timeout=30), pipe.history[-1].error
    pipe.close()
    out = {}
    for what, (stage, dtype, torch_adam) in {"zero3": (3, "bf16", True), "fused": (2, "bf16", False),
                                             "fp32": (2, "fp32", True)}.items():
        adapter = DeepSpeedStateAdapter(_engine(stage, dtype, torch_adam))
        records = []
        handler = logging.Handler()
        handler.emit = lambda r: records.append(r.getMessage())
        logging.getLogger("shardsafe.adapters.deepspeed").addHandler(handler)
        try:
            res = restore_from_holder(adapter, client, rank=0, coll=Collectives())
            out[what] = {"version": res.version, "notes": res.notes, "log": records}
        except RestoreError as e:
            out[what] = {"error": str(e)}
        finally:
            logging.getLogger("shardsafe.adapters.deepspeed").removeHandler(handler)
    out["held"] = client.sealed_versions(0)
    return out


@pytest.fixture
def holder(holder_factory):
    """The root of one holder, job ljob, node n0."""
    return holder_factory(1, job="ljob", budget_gb=0.2).root


def test_setup_changes_are_refused_or_warned_naming_the_setting(holder):
    (got,) = run_ranks(1, _changes, holder, timeout_s=180, pg_timeout_s=10)
    assert "zero_optimization.stage=2" in got["zero3"]["error"] and "stage 3" in got["zero3"]["error"], got["zero3"]
    assert "AdamW" in got["fused"]["error"] and "FusedAdam" in got["fused"]["error"], got["fused"]
    assert got["fp32"]["version"] == 1 and got["fp32"]["notes"]["precision_changed"] == "bfloat16 -> float32"
    assert any("bfloat16 model parameters" in m and "float32" in m for m in got["fp32"]["log"]), got["fp32"]
    assert got["held"] == [1]            # nothing refused was deleted
