"""Re-partitioning a DeepSpeed snapshot from D to D' data-parallel ranks equals DeepSpeed's own reshard (issue 44).

The oracle is DeepSpeed's universal checkpoint: a real job at D (forked gloo ranks, the tiny GPT of
examples/ds_pretrain_gpt.py with odd sizes so that every partition boundary and padding case occurs, DeepSpeed's
default FusedAdam from the config, WarmupLR, gradient clipping) trains V steps, then takes shardsafe's snapshot
(``DeepSpeedStateAdapter.capture``) AND DeepSpeed's ``save_checkpoint`` of the same step. The checkpoint goes
through ``ds_to_universal`` (with the arguments DeepSpeed documents, ``--inject_missing_state`` for a non-Megatron client)
and is loaded by a job at D' with ``"checkpoint": {"load_universal": true}``; the snapshot goes through
``shardsafe.snapshot.reshard.reshard`` and ``DeepSpeedStateAdapter.apply_resharded`` into another job at D'.

Compared, tensor for tensor (torch.equal) and value for value:
1. right after the load, what each engine holds (its adapter's capture: fp32 masters, exp_avg, exp_avg_sq and
   steps per flat tensor, module buffers, loss scaler, RNG, counters, LR scheduler, param_groups, the engine's
   own ZeRO layout) -- and the re-partition's tensors themselves against the oracle engine's;
2. both jobs continue K steps with the same global batch (gradient accumulation x D / D'): every loss (float.hex)
   and the final state (examples/ds_pretrain_gpt.py ``final_state``: capture, low-precision params, the
   module's and optimizer's ``state_dict()``, counters, scheduler) are identical.

What DeepSpeed's universal resume does not restore, or restores wrongly, is put into the oracle engine by hand,
and said here: ZeRO-3's load gives every parameter group group 0's hyperparameters (a no-decay group would
decay; each group's own are in DeepSpeed's converted optimizer_state.pt and are taken from there); FusedAdam's
CPU kernel keeps beta1^t / beta2^t in C++, in no checkpoint (adapters/deepspeed/cpu_adam_powers.py; restored from the
snapshot's metadata on both sides); ``load_universal`` skips the module state, so the module buffers are copied
from DeepSpeed's own saved module state (data-parallel rank 0's, as a same-size load_checkpoint loads them); and
``micro_steps`` is in no checkpoint (a loaded engine counts from 0; the re-partition carries micro_steps x D / D',
checked separately). Everything else the oracle engine holds comes from DeepSpeed's files.
"""
import json
import os

import pytest

from ._fork_ranks import load_tensors, run_ranks, save_tensors
from ._universal import ds_to_universal

pytestmark = pytest.mark.slow

SEED, MB, V, K = 1234, 2, 3, 3
MODEL = dict(vocab=257, d=33, layers=2, heads=3, seq=16)   # odd sizes: no parameter divides the partitions evenly

# name: (zero stage, dtype, D, G at D, D', extra) -- G x D / D' is the accumulation at D'
CASES = {
    "z1_bf16_two_groups_4to2": (1, "bf16", 4, 1, 2, {"groups": True}),
    "z2_fp32_4to2": (2, "fp32", 4, 1, 2, {}),
    "z2_bf16_3to2": (2, "bf16", 3, 2, 2, {}),
    "z2_bf16_grow_2to4": (2, "bf16", 2, 2, 4, {}),
    "z3_bf16_two_groups_subgroups_4to2": (3, "bf16", 4, 1, 2, {"sub_group_size": 5000, "groups": True}),
    "z3_fp32_grow_2to4": (3, "fp32", 2, 2, 4, {"persistence": 0}),
    "bf16_optimizer_4to2": (1, "bf16", 4, 1, 2, {"grad_accum_dtype": "fp32"}),
}


def _config(case, world, gas, universal=False):
    stage, dtype, _, _, _, extra = CASES[case]
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": gas,
           "train_batch_size": MB * gas * world,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},   # DeepSpeed's FusedAdam
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                        "warmup_num_steps": 10}},
           "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if extra.get("grad_accum_dtype"):
        cfg["data_types"] = {"grad_accum_dtype": extra["grad_accum_dtype"]}
    if "sub_group_size" in extra:
        cfg["zero_optimization"]["sub_group_size"] = extra["sub_group_size"]
    if "persistence" in extra:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = extra["persistence"]
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _engine(case, rank, world, gas, universal=False):
    import random

    import deepspeed
    import deepspeed.ops
    import numpy as np
    import torch
    from ds_pretrain_gpt import TinyGPT
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(SEED)
    model = TinyGPT(MODEL["vocab"], MODEL["d"], MODEL["layers"], MODEL["heads"], MODEL["seq"])
    params = list(model.parameters())
    if CASES[case][5].get("groups"):   # decay / no-decay, as most pretraining scripts group them
        params = [{"params": [p for p in params if p.dim() >= 2]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # per-rank dropout streams, seeded the way the example seeds them: the RNG a resumed rank runs with
    torch.manual_seed(SEED + 1 + rank)
    random.seed(SEED + rank)
    np.random.seed(SEED + rank)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params,
                                      config=_config(case, world, gas, universal))
    return engine


def _train(engine, steps, rank, world, gas):
    """``steps`` optimizer steps; micro-batch j of step s on rank r is global micro-batch (s G + j) D + r, so a
    global batch is the same samples at every size."""
    from ds_pretrain_gpt import batch
    losses = []
    for _ in range(steps):
        s, total = engine.global_steps, 0.0
        for j in range(gas):
            x, y = batch(SEED, (s * gas + j) * world + rank, 0, MB, MODEL["seq"], MODEL["vocab"])
            loss = engine(x, y)
            engine.backward(loss)
            total += loss.item()
            engine.step()
        losses.append(float(total).hex())
    return losses


def _save_capture(path, adapter):
    from shardsafe.payload import manifest as mf
    st = adapter.capture()
    save_tensors(path, {n: t.detach().cpu().clone() for n, t in st.tensors.items()}, mf.to_jsonable(st.meta))


def _run_at_d(rank, world, case, out):
    from shardsafe.adapters.deepspeed import DeepSpeedStateAdapter
    engine = _engine(case, rank, world, CASES[case][3])
    losses = _train(engine, V, rank, world, CASES[case][3])
    _save_capture(os.path.join(out, f"snap{rank}"), DeepSpeedStateAdapter(engine))
    engine.save_checkpoint(os.path.join(out, "ckpt"), tag=f"global_step{V}")
    return {"losses": losses}


def _continue_at_d2(rank, world, case, out, oracle):
    import torch.distributed as dist
    from ds_pretrain_gpt import final_state
    from shardsafe.adapters.deepspeed import DeepSpeedStateAdapter
    from shardsafe.payload import manifest as mf
    _, _, d, g, _, _ = CASES[case]
    gas = g * d // world
    # both with load_universal in the config (ours loads nothing): their configs, captured too, are the same
    engine = _engine(case, rank, world, gas, universal=True)
    adapter = DeepSpeedStateAdapter(engine)
    who = "oracle" if oracle else "ours"
    if oracle:
        path, _ = engine.load_checkpoint(os.path.join(out, "ckpt"))
        assert path is not None, "load_universal found no checkpoint"
        # FusedAdam's CPU kernel keeps beta powers outside any checkpoint: the snapshot's, as shardsafe restores them
        _, meta = load_tensors(os.path.join(out, "snap0"))
        powers = mf.from_jsonable(meta).get("adam_powers")
        if adapter.adam_powers is not None and powers:
            adapter.adam_powers.restore(powers)
        _buffers_from_checkpoint(engine, os.path.join(out, "ckpt", f"global_step{V}_universal"))
        if CASES[case][0] == 3:
            _zero3_group_hyperparameters(engine, os.path.join(out, "ckpt", f"global_step{V}_universal"))
    else:
        tensors, meta = load_tensors(os.path.join(out, f"target{rank}"))
        meta = mf.from_jsonable(meta)
        refused = _refusals(adapter, tensors, meta, out, rank, world) if _ranks_differ(case) else None
        adapter.apply_resharded(tensors, meta)
    _save_capture(os.path.join(out, f"{who}_loaded{rank}"), adapter)
    micro = int(engine.micro_steps)
    losses = _train(engine, K, rank, world, gas)
    state = final_state(engine)
    save_tensors(os.path.join(out, f"{who}_final{rank}"), state)
    dist.barrier()
    return {"losses": losses, "micro_steps_loaded": micro, "micro_steps_end": int(engine.micro_steps),
            "refused": None if oracle else refused}


def _ds_to_universal(rank, world, src, dst):
    ds_to_universal(src, dst)


def _ranks_differ(case):
    """ZeRO-1/2 record each rank's partition boundaries; ZeRO-3's and BF16_Optimizer's records are alike on every
    rank (equal partitions), so another rank's state cannot be told from one's own there."""
    return CASES[case][0] < 3 and not CASES[case][5].get("grad_accum_dtype")


def _refusals(adapter, tensors, meta, out, rank, world):
    """apply_resharded refuses, before writing anything, a state that was not re-partitioned and another target
    rank's state (_ranks_differ)."""
    from shardsafe.config import ConfigError
    from shardsafe.payload import manifest as mf
    other_t, other_m = load_tensors(os.path.join(out, f"target{(rank + 1) % world}"))
    got = []
    for t, m in ((tensors, {k: v for k, v in meta.items() if k != "resharded"}), (other_t, mf.from_jsonable(other_m))):
        try:
            adapter.apply_resharded(t, m)
            got.append(None)
        except ConfigError as e:
            got.append(str(e))
    return got


def _buffers_from_checkpoint(engine, folder):
    """The module buffers of DeepSpeed's own checkpoint (data-parallel rank 0's module state, which ds_to_universal
    copies beside the zero/ folder): ``load_universal`` restores parameters from zero/ only and skips the module
    state, leaving buffers (here the model's ``loss_ema``; a BatchNorm's running statistics) as the program
    initialised them. A same-size ``load_checkpoint`` loads them from this file."""
    import glob

    import torch
    files = sorted(glob.glob(os.path.join(folder, "*model_states.pt")))
    assert files, f"no model states file in {folder}"
    module = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
    bufs = dict(engine.module.named_buffers())
    with torch.no_grad():
        for name in engine._get_buffer_names() if hasattr(engine, "_get_buffer_names") else bufs:
            if name in module and name in bufs:
                bufs[name].copy_(module[name])


def _zero3_group_hyperparameters(engine, folder):
    """ZeRO-3's ``load_universal`` gives every parameter group the hyperparameters of group 0
    (``load_hp_checkpoint_state_from_checkpoint_dir_stage3`` reads ``param_groups[0]`` for all): a no-decay group
    would decay. DeepSpeed's own converted file has every group's; they are put where a correct load puts them."""
    import torch
    sd = torch.load(os.path.join(folder, "zero", "optimizer_state.pt"), map_location="cpu", weights_only=False)
    saved = sd["optimizer_state_dict"]["param_groups"]
    assert len(saved) == len(engine.optimizer.optimizer.param_groups)
    for g, s in zip(engine.optimizer.optimizer.param_groups, saved):
        g.update({k: v for k, v in s.items() if k != "params"})


class _Snap:
    def __init__(self, tensors, meta, rank):
        self.tensors, self.meta, self.rank = tensors, meta, rank


def _diff(a, b, skip=()):
    """Names whose tensors are not bit-identical (or missing on one side)."""
    import torch
    out = []
    for n in sorted(set(a) | set(b)):
        if any(n.startswith(s) for s in skip):
            continue
        if n not in a or n not in b:
            out.append(f"{n}: only in {'ours' if n in a else 'oracle'}")
        elif a[n].dtype != b[n].dtype or a[n].shape != b[n].shape or not torch.equal(a[n], b[n]):
            out.append(n)
    return out


def _meta_diff(a, b, skip=("counters",)):
    return [k for k in sorted(set(a) | set(b)) if k not in skip and a.get(k) != b.get(k)]


@pytest.mark.parametrize("case", list(CASES))
def test_reshard_equals_deepspeed_universal_checkpoint(case, tmp_path):
    import time

    from shardsafe.adapters.deepspeed import DeepSpeedStateAdapter
    from shardsafe.adapters.deepspeed.reshard import SIZED_FIELDS
    from shardsafe.payload import manifest as mf
    from shardsafe.snapshot.reshard import reshard
    _, _, d, g, d2, _ = CASES[case]
    out = str(tmp_path)
    t0 = time.monotonic()
    run_ranks(d, _run_at_d, case, out, timeout_s=240, pg_timeout_s=30)
    t_run = time.monotonic() - t0
    # DeepSpeed's reshard: the documented conversion, then load_universal at D'
    run_ranks(1, _ds_to_universal, os.path.join(out, "ckpt", f"global_step{V}"),
              os.path.join(out, "ckpt", f"global_step{V}_universal"), timeout_s=240, pg_timeout_s=30)
    t_conv = time.monotonic() - t0 - t_run
    # shardsafe's: the pure function over the D snapshots
    snaps = []
    for r in range(d):
        tensors, meta = load_tensors(os.path.join(out, f"snap{r}"))
        snaps.append(_Snap(tensors, mf.from_jsonable(meta), r))
    t1 = time.monotonic()
    res = reshard(snaps, d2, DeepSpeedStateAdapter.resharder())
    t_reshard = time.monotonic() - t1
    for tr in res.ranks:
        save_tensors(os.path.join(out, f"target{tr.rank}"), tr.tensors, mf.to_jsonable(tr.meta))
    oracle = run_ranks(d2, _continue_at_d2, case, out, True, timeout_s=240, pg_timeout_s=30)
    ours = run_ranks(d2, _continue_at_d2, case, out, False, timeout_s=240, pg_timeout_s=30)

    for r in range(d2):
        o_t, o_m = load_tensors(os.path.join(out, f"oracle_loaded{r}"))
        s_t, s_m = load_tensors(os.path.join(out, f"ours_loaded{r}"))
        o_m, s_m = mf.from_jsonable(o_m), mf.from_jsonable(s_m)
        # 1a. the re-partition's own tensors are what DeepSpeed's load put into the engine at D'
        mine = res.ranks[r].tensors
        opt = [n for n in o_t if n.startswith("opt/")]
        assert sorted(opt) == sorted(n for n in mine if n.startswith("opt/")), (case, r)
        assert _diff({n: mine[n] for n in opt}, {n: o_t[n] for n in opt}) == [], (case, r)
        assert _diff({n: mine[n] for n in mine if n.startswith("module/")},
                     {n: o_t[n] for n in o_t if n.startswith("module/")}) == [], (case, r)
        # 1b. the engines after load / apply: every captured tensor (RNG included) and the metadata
        assert _diff(s_t, o_t) == [], (case, r)
        assert _meta_diff(s_m, o_m) == [], (case, r, {k: (s_m.get(k), o_m.get(k)) for k in _meta_diff(s_m, o_m)})
        assert {k: v for k, v in s_m["counters"].items() if k != "micro_steps"} == \
            {k: v for k, v in o_m["counters"].items() if k != "micro_steps"}
        assert {k: res.ranks[r].meta["ds_checkpoint"].get(k) for k in SIZED_FIELDS} == \
            {k: o_m["ds_checkpoint"].get(k) for k in SIZED_FIELDS}, (case, r)
    # 2. K more steps at D' with the same global batch: losses and final states bit-identical
    assert [o["losses"] for o in ours] == [o["losses"] for o in oracle], case
    for r in range(d2):
        a = load_tensors(os.path.join(out, f"ours_final{r}"))[0]
        b = load_tensors(os.path.join(out, f"oracle_final{r}"))[0]
        assert _diff(a, b, skip=("fw/counters/micro_steps",)) == [], (case, r)
    if _ranks_differ(case):
        for o in ours:
            assert "was not re-partitioned" in o["refused"][0] and "this engine partitions" in o["refused"][1], o
    # micro_steps: the oracle counts from 0 (DeepSpeed does not save it); ours carries V G D / D'
    gas2 = g * d // d2
    assert [o["micro_steps_loaded"] for o in ours] == [V * g * d // d2] * d2
    assert [o["micro_steps_end"] - o["micro_steps_loaded"] for o in ours] == [K * gas2] * d2
    report = {"case": case, "from": d, "to": d2, "seconds": {"run_at_d": round(t_run, 1), "ds_to_universal":
              round(t_conv, 1), "reshard": round(t_reshard, 3)},
              "traffic": {r: {"local": t.local_bytes, "remote": t.remote_bytes, "from": t.from_ranks}
                          for r, t in res.traffic.items()},
              "segments": len(res.plan.segments),
              "flat_tensors": [len(res.plan.src.numels[0]), len(res.plan.dst.numels[0])]}
    if "subgroups" in case:   # the case is there to regroup ZeRO-3's sub-groups
        assert report["flat_tensors"][0] != report["flat_tensors"][1], report
    print("RESHARD", json.dumps(report))
