"""A DeepSpeed engine abandoned on a rank that restarts in place must not outlive the attempt
(adapters/deepspeed/inplace.py).

ZeRO-1/2 (and BF16_Optimizer where it updates as gradients arrive) register gradient hooks that close over the optimizer on autograd nodes, which the
garbage collector cannot follow, and link every parameter to its data-parallel group and fp32 fragment through the
parameter's own attributes: dropped by the program and collected, the engine stayed alive with its optimizer and
groups, whose sockets stayed open, and a peer waiting in one of their collectives waited for the watchdog. A real
ZeRO-2 engine on two forked ranks (gloo): after one step the program drops every reference; the optimizer is still
alive after a collection, and gone once the adapter has taken the engine apart. (DeepSpeed's pipeline engine with
BF16_Optimizer, whose parameters keep the data-parallel group, restarts in place in tests/fault/test_demo.py.)
"""
from ._fork_ranks import run_ranks


def _abandon(rank, world):
    import gc
    import weakref

    import deepspeed
    import deepspeed.ops
    import torch

    from shardsafe.adapters.deepspeed.inplace import _take_engines_apart, remember_engine
    # DeepSpeed's CPU accelerator would otherwise JIT-compile its shared-memory all-reduce in each rank (minutes
    # on a cold cache), as the other test_ds_* modules say
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    remember_engine(engine)
    x = torch.randn(2, 16)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    kind = type(engine.optimizer).__name__
    optimizer = weakref.ref(engine.optimizer)
    del engine, model, x, _
    gc.collect()
    kept = optimizer() is not None
    taken = _take_engines_apart()
    gc.collect()
    return {"kind": kind, "kept": kept, "taken": taken, "alive_after": optimizer() is not None}


def test_an_abandoned_zero2_engine_is_taken_apart_and_collected():
    for got in run_ranks(2, _abandon, timeout_s=180, pg_timeout_s=20):
        assert got["kind"] == "DeepSpeedZeroOptimizer", got
        assert got["kept"] and got["taken"] == 1, got   # the leak the take-apart exists for
        assert not got["alive_after"], got
