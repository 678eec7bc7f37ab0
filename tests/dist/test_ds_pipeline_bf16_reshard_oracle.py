"""Re-partitioning a pipeline's BF16_Optimizer state from D to D' data-parallel ranks equals DeepSpeed's own
per-parameter placement (issue 44).

A PipelineModule (PP = 2, the tied-embedding GPT of examples/ds_pretrain_gpt.py) in bf16 with ZeRO stage 0 runs
DeepSpeed's BF16_Optimizer, whose checkpoint ``ds_to_universal`` refuses ("param_shapes must contain
dictionaries"): no universal checkpoint can be the oracle here. This one goes through no checkpoint and none of
shardsafe's layout rules: at D = 3, DeepSpeed's own accessors gather every parameter's full fp32 master and Adam
moments (``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``: each rank's fragment
through the engine's hp mapping, summed over the stage's data-parallel group); at D' = 2 a fresh engine takes them
back through ``safe_set_full_*`` (its own mapping writes each fragment into its own partition) and
``update_lp_params`` (the bf16 parameters from the fp32 masters, all-gathered), with the per-group optimizer
hyperparameters and step, the LR scheduler and the step counters of the run at D (the same on every rank).
shardsafe's side is the pure re-partition of each stage's D snapshots (``shardsafe.snapshot.reshard.reshard``)
applied to another fresh engine at D' (``DeepSpeedStateAdapter.apply_resharded``).

Compared, tensor for tensor (torch.equal): what both engines hold right after (the adapter's capture: fp32
partitions, moments, param_groups and steps; the bf16 flat buffers), then K more steps of both with the same
global batch (accumulation x D / D'): every loss (float.hex) and the final state (module and optimizer
``state_dict``, counters, scheduler, the bf16 buffers). Dropout is 0: the oracle restores no RNG, and the
re-partition's RNG placement is tested elsewhere (tests/dist/test_ds_reshard_oracle.py).
"""
import os

import pytest

from ._fork_ranks import load_tensors, run_ranks, save_tensors

pytestmark = pytest.mark.slow

SEED, MB, V, K, PP, D, D2, GAS = 1234, 2, 3, 3, 2, 3, 2, 2
MODEL = dict(vocab=61, d=24, layers=2, heads=2, seq=8)


def _engine(world, gas):
    import deepspeed
    import deepspeed.ops
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from ds_pretrain_gpt import Block, PosEmbed, TokEmbed, _lm_loss, _tied_head
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(SEED)
    m = MODEL
    layers = [TiedLayerSpec("embed", TokEmbed, m["vocab"], m["d"]), LayerSpec(PosEmbed, m["seq"], m["d"], 0.0),
              *[LayerSpec(Block, m["d"], m["heads"], 0.0) for _ in range(m["layers"])],
              LayerSpec(torch.nn.LayerNorm, m["d"]),
              TiedLayerSpec("embed", TokEmbed, m["vocab"], m["d"], forward_fn=_tied_head)]
    model = PipelineModule(layers=layers, loss_fn=_lm_loss, num_stages=PP, partition_method="parameters")
    dp = world // PP
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": gas, "train_batch_size": MB * gas * dp,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},   # DeepSpeed's FusedAdam
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                        "warmup_num_steps": 10}},
           "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}, "bf16": {"enabled": True},
           "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()], config=cfg)
    assert type(engine.optimizer).__name__ == "BF16_Optimizer", type(engine.optimizer)
    return engine


def _train(engine, steps):
    """``steps`` optimizer steps of train_batch(); micro-batch j of step s on data-parallel rank r reads the samples
    at global position (s G D + j D + r) MB, so a step trains on the same samples at any size."""
    from ds_pretrain_gpt import samples
    gas, dp, r = engine.gradient_accumulation_steps(), engine.dp_world_size, engine.grid.get_data_parallel_rank()
    losses = []
    for _ in range(steps):
        s = engine.global_steps
        data = iter([samples(SEED, (s * gas * dp + j * dp + r) * MB, MB, MODEL["seq"], MODEL["vocab"])
                     for j in range(gas)])
        losses.append(float(engine.train_batch(data).item()).hex())
    return losses


def _stage(engine):
    return engine.stage_id


def _run_at_d(rank, world, out):
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from shardsafe.adapters.deepspeed import DeepSpeedStateAdapter
    from shardsafe.payload import manifest as mf
    engine = _engine(world, GAS)
    losses = _train(engine, V)
    st = DeepSpeedStateAdapter(engine).capture()
    save_tensors(os.path.join(out, f"snap{rank}"), {n: t.detach().cpu().clone() for n, t in st.tensors.items()},
                 mf.to_jsonable(st.meta))
    full = {}
    for name, p in engine.module.named_parameters():   # collectives over the stage's data-parallel group
        full[f"fp32/{name}"] = safe_get_full_fp32_param(p).detach().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    opt = engine.optimizer.optimizer
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    scalars = [{k: (v.item() if torch.is_tensor(v) else v) for k, v in opt.state[g["params"][0]].items()
                if not (torch.is_tensor(v) and v.numel() > 1)} for g in opt.param_groups]
    if engine.grid.get_data_parallel_rank() == 0:
        save_tensors(os.path.join(out, f"full_stage{_stage(engine)}"), full,
                     {"groups": groups, "scalars": scalars, "scheduler": engine.lr_scheduler.state_dict(),
                      "counters": {k: int(getattr(engine, k)) for k in ("global_steps", "global_samples",
                                                                          "skipped_steps")}})
    return {"losses": losses}


def _oracle_load(engine, out):
    """DeepSpeed's per-parameter API puts the full values gathered at D into this engine's own partitions."""
    import torch
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    full, meta = load_tensors(os.path.join(out, f"full_stage{_stage(engine)}"))
    opt = engine.optimizer.optimizer
    with torch.no_grad():
        for g, saved, scalars in zip(opt.param_groups, meta["groups"], meta["scalars"]):
            g.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})   # betas: JSON made a list
            for p in g["params"]:   # the state an optimizer step would create, then linked to the hp fragments
                opt.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                opt.state[p].update({k: torch.tensor(v) if isinstance(v, float) else v for k, v in scalars.items()})
        engine.optimizer._lazy_init_hp_params_optimizer_state()
        for name, p in engine.module.named_parameters():
            safe_set_full_fp32_param(p, full[f"fp32/{name}"])
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, full[f"{key}/{name}"], key)
        engine.optimizer.update_lp_params()
    engine.lr_scheduler.load_state_dict(meta["scheduler"])
    for k, v in meta["counters"].items():
        setattr(engine, k, v)


def _continue_at_d2(rank, world, out, oracle):
    import torch.distributed as dist
    from ds_pretrain_gpt import final_state
    from shardsafe.adapters.deepspeed import DeepSpeedStateAdapter
    from shardsafe.payload import manifest as mf
    engine = _engine(world, GAS * D // D2)
    adapter = DeepSpeedStateAdapter(engine)
    who = "oracle" if oracle else "ours"
    if oracle:
        _oracle_load(engine, out)
    else:
        tensors, meta = load_tensors(os.path.join(out, f"target{rank}"))
        adapter.apply_resharded(tensors, mf.from_jsonable(meta))
    st = adapter.capture()
    save_tensors(os.path.join(out, f"{who}_loaded{rank}"), {n: t.detach().cpu().clone() for n, t in st.tensors.items()},
                 mf.to_jsonable(st.meta))
    losses = _train(engine, K)
    save_tensors(os.path.join(out, f"{who}_final{rank}"), final_state(engine))
    dist.barrier()
    return {"losses": losses}


class _Snap:
    def __init__(self, tensors, meta, rank):
        self.tensors, self.meta, self.rank = tensors, meta, rank


def _diff(a, b, prefixes):
    import torch
    names = sorted(n for n in set(a) | set(b) if n.startswith(prefixes))
    return [n for n in names if n not in a or n not in b or a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
            or not torch.equal(a[n], b[n])], names


def test_pipeline_bf16_optimizer_reshard_equals_deepspeeds_per_parameter_placement(tmp_path):
    from shardsafe.adapters.deepspeed import DeepSpeedStateAdapter
    from shardsafe.payload import manifest as mf
    from shardsafe.snapshot.reshard import reshard
    out = str(tmp_path)
    run_ranks(PP * D, _run_at_d, out, timeout_s=240, pg_timeout_s=30)
    for s in range(PP):   # each stage's data-parallel group: ranks s D .. s D + D - 1 (DeepSpeed's pipe x data grid)
        snaps = []
        for d in range(D):
            tensors, meta = load_tensors(os.path.join(out, f"snap{s * D + d}"))
            snaps.append(_Snap(tensors, mf.from_jsonable(meta), d))
        res = reshard(snaps, D2, DeepSpeedStateAdapter.resharder())
        for tr in res.ranks:
            save_tensors(os.path.join(out, f"target{s * D2 + tr.rank}"), tr.tensors, mf.to_jsonable(tr.meta))
    oracle = run_ranks(PP * D2, _continue_at_d2, out, True, timeout_s=240, pg_timeout_s=30)
    ours = run_ranks(PP * D2, _continue_at_d2, out, False, timeout_s=240, pg_timeout_s=30)
    for r in range(PP * D2):
        o_t, o_m = load_tensors(os.path.join(out, f"oracle_loaded{r}"))
        s_t, s_m = load_tensors(os.path.join(out, f"ours_loaded{r}"))
        bad, names = _diff(s_t, o_t, ("opt/", "module/"))
        assert any(n.startswith("opt/master/") for n in names) and any(n.startswith("opt/state/") for n in names), \
            names
        assert bad == [], (r, bad)
        o_m, s_m = mf.from_jsonable(o_m), mf.from_jsonable(s_m)
        assert s_m["param_groups"] == o_m["param_groups"], (r, s_m["param_groups"], o_m["param_groups"])
        assert {k: v for k, v in s_m["counters"].items() if k != "micro_steps"} == \
            {k: v for k, v in o_m["counters"].items() if k != "micro_steps"}, r
    assert [o["losses"] for o in ours] == [o["losses"] for o in oracle]
    for r in range(PP * D2):
        a, _ = load_tensors(os.path.join(out, f"ours_final{r}"))
        b, _ = load_tensors(os.path.join(out, f"oracle_final{r}"))
        bad, names = _diff(a, b, ("fw/", "lp/"))
        assert any(n.startswith("lp/") for n in names) and any(n.startswith("fw/optimizer/") for n in names), names
        assert bad == [], (r, bad)
