"""Several protected DeepSpeed engines in one process keep their snapshots apart (issue 16: HF's Trainer builds
a new engine for every ``train()`` call and hyperparameter trial; RLHF programs run several engines at once).

Real engines on two forked ranks (gloo), a real holder, the explicit ``shardsafe.adapters.deepspeed.initialize``.
Engines A and B have the same layout, so a snapshot of one fits the other: before engine scopes, B restored A's
newest version without a word. Run 1 trains A 3 steps and B 2 steps, both alive at once. Run 2 (new processes,
the same holder, as after a crash) builds A and B again: A restores version 3 with A's state, B version 2 with
B's, bit for bit. Retiring A keeps only its newest version; B's are untouched.
"""
import pytest

from shardsafe.holder.client import HolderClient
from shardsafe.holder.paths import HolderPaths

from ._fork_ranks import run_ranks

JOB = "scopes"


def _config(root):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "gradient_clipping": 1.0,
            "steps_per_print": 10 ** 9,
            "shardsafe": {"enabled": True, "job_id": JOB, "holder_dir": root, "node": "n0", "start_holder": False,
                          "timeout_s": 20}}


def _engine(root, seed):
    import torch
    from shardsafe.adapters.deepspeed import initialize
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    engine, *_ = initialize(model=model, model_parameters=list(model.parameters()), config=_config(root))
    return engine


def _train(engine, steps, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(2, 16, generator=g)
        engine.backward(engine(x).pow(2).mean())
        engine.step()


def _hex(t):
    """A tensor as float.hex of every element (fp32 and its step counter convert exactly): JSON, bit for bit."""
    import torch
    t = t if torch.is_tensor(t) else torch.tensor(float(t))
    return [float(x).hex() for x in t.detach().double().flatten().tolist()]


def _state(engine):
    """This rank's fp32 master partition and Adam state of the engine."""
    o = engine.optimizer
    out = {f"master/{i}": _hex(m) for i, m in enumerate(o.single_partition_of_fp32_groups)}
    for i, m in enumerate(o.single_partition_of_fp32_groups):
        for k, v in o.optimizer.state.get(m, {}).items():
            out[f"state/{i}/{k}"] = _hex(v)
    return out


def _run(rank, world, root, again):
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    a = _engine(root, seed=0)
    b = _engine(root, seed=0)   # the same layout and weights: only its scope tells its snapshots from A's
    got = {"ordinals": [a.shardsafe.ordinal, b.shardsafe.ordinal],
           "restored": [a.shardsafe.restored.version, b.shardsafe.restored.version]}
    if not again:
        _train(a, 3, seed=1)
        _train(b, 2, seed=2)   # other data: B's state differs from A's at every step
        assert a.shardsafe.flush() and b.shardsafe.flush()
    got["a"], got["b"] = _state(a), _state(b)
    if again:
        c = HolderClient(HolderPaths(root, JOB, "n0"), timeout_s=10).connect()
        c1 = HolderClient(HolderPaths(root, JOB, "n0"), timeout_s=10, scope="engine1").connect()
        got["held_before"] = [c.sealed_versions(rank), c1.sealed_versions(rank)]
        a.shardsafe.retire()
        got["held_after"] = [c.sealed_versions(rank), c1.sealed_versions(rank)]
        c.close()
        c1.close()
    b.shardsafe.close()
    a.shardsafe.close()
    return got


@pytest.fixture
def holder(holder_factory):
    return holder_factory(1, job=JOB, budget_gb=0.2).root


def test_each_engine_of_a_process_restores_its_own_snapshot(holder):
    first = run_ranks(2, _run, holder, False, timeout_s=180, pg_timeout_s=20)
    again = run_ranks(2, _run, holder, True, timeout_s=180, pg_timeout_s=20)
    for r in range(2):
        f, g = first[r], again[r]
        assert f["ordinals"] == [0, 1] and g["ordinals"] == [0, 1], (f["ordinals"], g["ordinals"])
        assert f["restored"] == [-1, -1] and g["restored"] == [3, 2], (f["restored"], g["restored"])
        assert set(g["a"]) == set(f["a"]) and len(f["a"]) >= 4, sorted(f["a"])
        for which in ("a", "b"):
            for k, t in f[which].items():
                assert g[which][k] == t, (r, which, k)
        # the two engines' states differ: restoring one into the other would have been caught above
        assert f["a"]["master/0"] != f["b"]["master/0"]
        assert g["held_before"] == [[2, 3], [1, 2]], g["held_before"]
        assert g["held_after"] == [[3], [1, 2]], g["held_after"]
