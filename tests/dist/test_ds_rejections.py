"""DeepSpeed setups shardsafe cannot protect yet are refused with a message naming the setting.

Real engines, one forked rank (gloo): an LR scheduler whose state_dict is not plain data is refused; a
PipelineModule (PipelineEngine, ZeRO-1) and MoE layers are accepted (tests/fault/test_deepspeed_3d.py runs them). ZeRO stage 0 is refused end to end in
tests/fault/test_degraded.py; NVMe offload needs DeepSpeed's aio op, which this CPU build does not have.
"""

from ._fork_ranks import run_ranks

CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10 ** 9}


def _refusals(rank, world, cases):
    """One rank builds each engine in turn (one DeepSpeed import for all cases)."""
    return {what: _refusal(what) for what in cases}


def _refusal(what):
    import deepspeed
    import deepspeed.ops
    import torch
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")   # the harness's process group, DeepSpeed's comm layer
    from shardsafe.adapters.deepspeed.checks import check_supported
    from shardsafe.config import ConfigError
    torch.manual_seed(0)
    kw = {}
    if what == "pipeline":
        from deepspeed.pipe import PipelineModule
        model = PipelineModule(layers=[torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)], num_stages=1,
                               loss_fn=torch.nn.MSELoss())
    elif what == "moe":
        from deepspeed.moe.layer import MoE

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.moe = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2, ep_size=1, k=1)

            def forward(self, x):
                return self.moe(x)[0]
        model = Net()
    else:   # scheduler
        model = torch.nn.Linear(8, 8)

        class Warmup(torch.optim.lr_scheduler.LRScheduler):
            def __init__(self, optimizer):
                self.factor = lambda step: min(1.0, (step + 1) / 10)   # a callable in the state
                super().__init__(optimizer)

            def get_lr(self):
                return [g * self.factor(self.last_epoch) for g in self.base_lrs]
        kw["lr_scheduler"] = Warmup
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()], config=CONFIG,
                                      **kw)
    try:
        check_supported(engine)
    except ConfigError as e:
        return str(e)
    return "accepted"


WORDS = {
    "pipeline": ["accepted"],
    "moe": ["accepted"],
    "scheduler": ["LR scheduler Warmup", "not plain data", "shardsafe.enabled=false"],
}


def test_unsupported_setups_are_refused_naming_the_setting():
    (got,) = run_ranks(1, _refusals, list(WORDS), timeout_s=120, pg_timeout_s=10)
    for what, words in WORDS.items():
        assert all(w in got[what] for w in words), (what, got[what])
