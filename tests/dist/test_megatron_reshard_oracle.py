"""Re-partitioning a Megatron DistributedOptimizer snapshot from D to D' equals Megatron's own reshard (issue 44).

The oracle is megatron-core's ``dist_checkpointing`` (torch_dist) with the DistributedOptimizer's fully reshardable
format (``metadata={"distrib_optim_sharding_type": "fully_reshardable"}``, Megatron-LM's
``--dist-ckpt-optim-fully-reshardable``): a real job at D (forked gloo ranks, the tiny GPT of
examples/megatron_pretrain_gpt.py with its CPU shims, DistributedOptimizer over torch Adam, cosine LR with warmup,
gradient clipping, dropout) trains V steps, then takes shardsafe's snapshot (``MegatronStateAdapter.capture``) AND
Megatron's checkpoint of the same step, saved as Megatron-LM's ``save_checkpoint`` builds it: the unwrapped model's
sharded state dict, the optimizer's, the scheduler, the iteration and consumed samples, and the RNG state as
Megatron-LM's ``get_rng_state`` wraps it (one ShardedObject per (PP, TP) coordinate, written by data-parallel
rank 0). A job at D' loads it the way Megatron-LM's ``load_checkpoint`` does (model, optimizer, scheduler, then
``rng_state[0]``); the snapshots go through ``shardsafe.snapshot.reshard.reshard`` with ``MegatronResharder`` and
``MegatronStateAdapter.apply_resharded`` into another job at D'. Both jobs at D' run the global batch of the job at
D (micro-batches x D / D'; Megatron's num-microbatches calculator is initialised as Megatron-LM does).

Compared, tensor for tensor (torch.equal) and value for value:
1. right after the load, the re-partition's own tensors against what Megatron's load put into the optimizer at D'
   (fp32 main-parameter shards, exp_avg, exp_avg_sq, step of every shard), and the two jobs' full captures (every
   optimizer tensor, the model parameters, RNGs, buffers) and metadata (groups and hyperparameters, scheduler,
   counters, iteration, layout);
2. both continue K steps with the same global batch: every loss (float.hex) and the final state (capture plus model
   parameters) are identical;
3. ``apply_resharded`` refuses, before writing anything, a state that was not re-partitioned and another target
   rank's state.
Before the capture at D, data-parallel rank 1 draws one random number, so the ranks' RNG streams differ and the
RNG rule is tested, not assumed (Megatron-LM gives every rank at D' data-parallel rank 0's).

Megatron's checkpoint is examples/megatron_dist_ckpt.py's, which works around megatron-core's bugs on this CPU path
(its docstring); its load leaves the checkpoint's param_groups ``step`` in the live groups, which torch Adam does not
read: the one metadata difference, checked to be the step and then ignored. The multi-bucket save bug it fixes fails
the bucketed case without the fix (one bucket is unaffected).
Megatron-LM's writer forks worker processes and starts a multiprocessing manager; the harness's forked ranks are
daemonic, which multiprocessing forbids to have children, so the saving ranks lift that flag (and stop the manager).
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (see docs/megatron.md)")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (HERE, os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

import megatron.core.dist_checkpointing  # noqa: E402,F401
import megatron.core.distributed  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401

import megatron_dist_ckpt as dist_ckpt  # noqa: E402
import megatron_pretrain_gpt as ex  # noqa: E402
from _fork_ranks import load_tensors, run_ranks, save_tensors  # noqa: E402

pytestmark = pytest.mark.slow

V, K, MB = 3, 3, 2
# tp/pp: model-parallel sizes (unchanged); d -> d2: the data-parallel size; g: micro-batches per rank at d (the
# global batch is MB x g x d). With a bucket size, gradients are reduced overlapped and bucketed
# (--overlap-grad-reduce --ddp-bucket-size): several buckets, whose end padding lcm(D, 128) moves every later
# bucket. With pp 2 the tied embedding / output weights are marked shared_embedding and get buckets of their own.
CASES = {
    "tp2_bf16_dp2to1": dict(tp=2, pp=1, dtype="bf16", d=2, g=2, d2=1, bucket=None),
    "tp2_fp32_grow_dp1to2": dict(tp=2, pp=1, dtype="fp32", d=1, g=4, d2=2, bucket=None),
    "tp1_bf16_dp4to2": dict(tp=1, pp=1, dtype="bf16", d=4, g=1, d2=2, bucket=None),
    "tp1_fp32_buckets_dp3to2": dict(tp=1, pp=1, dtype="fp32", d=3, g=2, d2=2, bucket=4000),
    "pp2_bf16_dp2to1": dict(tp=1, pp=2, dtype="bf16", d=2, g=2, d2=1, bucket=None),
}


def _start(case: str, world_dp: int, microbatches: int, seed: int) -> "ex.Trainer":
    import _megatron_cpu_shims
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    _megatron_cpu_shims.install()
    c = CASES[case]
    bucket_size = c["bucket"]
    if bucket_size is not None:   # the example's DDP config, bucketed (the Trainer reads the class at build time)
        import megatron.core.distributed as mcd
        config = mcd.DistributedDataParallelConfig
        mcd.DistributedDataParallelConfig = lambda **kw: config(**kw, overlap_grad_reduce=True, bucket_size=bucket_size)
    run = ex.TinyGPT(tp=c["tp"], pp=c["pp"], bf16=c["dtype"] == "bf16", num_microbatches=microbatches,
                     micro_batch_size=MB, seed=seed, timeout_s=30.0)
    ex.initialize_parallel(run)
    # as Megatron-LM's initialize does: the global batch is the run's, the micro-batches follow the size
    init_num_microbatches_calculator(torch.distributed.get_rank(), None, MB * c["g"] * c["d"], MB, world_dp)
    return ex.Trainer(run)


def _loss(step: dict):
    return None if step["loss"] is None else float(step["loss"]).hex()   # None: not the last pipeline stage


def _capture(path: str, tr: "ex.Trainer", adapter) -> None:
    tensors, meta = ex.cpu_copy(adapter.capture())
    tensors.update({f"model/{k}": v.cpu().clone() for k, v in tr.model_params().items()})
    save_tensors(path, tensors, meta)


def _run_at_d(rank: int, world: int, case: str, out: str) -> dict:
    import multiprocessing as mp

    from megatron.core import parallel_state as ps
    mp.current_process()._config["daemon"] = False   # Megatron's writer has child processes (module docstring)
    tr = _start(case, CASES[case]["d"], CASES[case]["g"], seed=1234)
    losses = [_loss(tr.train_step()) for _ in range(V)]
    if ps.get_data_parallel_rank() == 1:
        torch.rand(1)   # the data-parallel ranks' RNG streams now differ
    _capture(os.path.join(out, f"snap{rank}"), tr, tr.adapter())
    t0 = time.monotonic()
    dist_ckpt.save(tr, os.path.join(out, "ckpt"))
    return {"losses": losses, "save_s": time.monotonic() - t0}


def _continue_at_d2(rank: int, world: int, case: str, out: str, oracle: bool) -> dict:
    c = CASES[case]
    tr = _start(case, c["d2"], c["g"] * c["d"] // c["d2"], seed=1234 + 17)   # another init: nothing may come from it
    adapter = tr.adapter()
    who = "oracle" if oracle else "ours"
    t0 = time.monotonic()
    if oracle:
        dist_ckpt.load(tr, os.path.join(out, "ckpt"))
    else:
        tensors, meta = load_tensors(os.path.join(out, f"target{rank}"))
        refused = _refusals(adapter, tensors, meta, out, rank, world)
        t0 = time.monotonic()
        adapter.apply_resharded(tensors, meta)
    load_s = time.monotonic() - t0
    _capture(os.path.join(out, f"{who}_loaded{rank}"), tr, adapter)
    loaded = {"iteration": tr.iteration, "consumed": tr.counters["consumed_train_samples"],
              "num_steps": tr.scheduler.num_steps}
    losses = [_loss(tr.train_step()) for _ in range(K)]
    _capture(os.path.join(out, f"{who}_final{rank}"), tr, adapter)
    torch.distributed.barrier()
    return {"losses": losses, "loaded": loaded, "load_s": load_s, "refused": None if oracle else refused}


def _refusals(adapter, tensors, meta, out, rank, world) -> list:
    """What apply_resharded refuses before it writes anything: a state that was not re-partitioned, and another
    data-parallel rank's re-partitioned state (its shards lie elsewhere)."""
    from megatron.core import parallel_state as ps

    from shardsafe.errors import ConfigError
    got = []
    others = [w for w in range(world) if w != rank and w % ps.get_tensor_model_parallel_world_size()
              == rank % ps.get_tensor_model_parallel_world_size()]
    cases = [(tensors, {k: v for k, v in meta.items() if k != "resharded"})]
    if others:
        cases.append(load_tensors(os.path.join(out, f"target{others[0]}")))
    for t, m in cases:
        try:
            adapter.apply_resharded(t, m)
            got.append(None)
        except ConfigError as e:
            got.append(str(e))
    return got


class _Snap:
    def __init__(self, tensors, meta):
        self.tensors, self.meta = tensors, meta


def _diff(a: dict, b: dict) -> list[str]:
    out = []
    for n in sorted(set(a) | set(b)):
        if n not in a or n not in b:
            out.append(f"{n}: only in {'ours' if n in a else 'oracle'}")
        elif a[n].dtype != b[n].dtype or a[n].shape != b[n].shape or not torch.equal(a[n], b[n]):
            out.append(n)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_reshard_equals_megatron_fully_reshardable_checkpoint(case, tmp_path):
    from shardsafe.adapters.megatron import MegatronStateAdapter
    from shardsafe.snapshot.reshard import reshard
    tp, pp, d, g, d2 = (CASES[case][k] for k in ("tp", "pp", "d", "g", "d2"))
    out = str(tmp_path)
    os.makedirs(os.path.join(out, "ckpt"))
    t0 = time.monotonic()
    at_d = run_ranks(tp * pp * d, _run_at_d, case, out, timeout_s=180, pg_timeout_s=30)
    t_run = time.monotonic() - t0
    # shardsafe's reshard, slice by slice: the D snapshots of one (TP, PP) coordinate, in data-parallel order
    results = {}
    t1 = time.monotonic()
    snaps = [_Snap(*load_tensors(os.path.join(out, f"snap{w}"))) for w in range(tp * pp * d)]
    for t in range(tp):
        for s in range(pp):
            part = sorted((x for x in snaps if (x.meta["coords"]["tp"], x.meta["coords"]["pp"]) == (t, s)),
                          key=lambda x: x.meta["coords"]["dp"])
            res = reshard(part, d2, MegatronStateAdapter.resharder())
            for tr in res.ranks:   # Megatron's default order tp-dp-pp: world rank = tp + tp x (dp + D' x pp)
                w = t + tp * (tr.rank + d2 * s)
                results[w] = (tr, res)
                save_tensors(os.path.join(out, f"target{w}"), tr.tensors, tr.meta)
    t_reshard = time.monotonic() - t1
    oracle = run_ranks(tp * pp * d2, _continue_at_d2, case, out, True, timeout_s=180, pg_timeout_s=30)
    ours = run_ranks(tp * pp * d2, _continue_at_d2, case, out, False, timeout_s=180, pg_timeout_s=30)

    for w in range(tp * pp * d2):
        o_t, o_m = load_tensors(os.path.join(out, f"oracle_loaded{w}"))
        s_t, s_m = load_tensors(os.path.join(out, f"ours_loaded{w}"))
        # 1a. the re-partition's own tensors are what Megatron's load put into the optimizer at D'
        mine = results[w][0].tensors
        opt = sorted(n for n in o_t if n.startswith("opt"))
        assert opt == sorted(n for n in mine if n.startswith("opt")), (case, w)
        assert any(n.endswith("/step") for n in opt) and any(n.endswith("/exp_avg_sq") for n in opt)
        assert _diff({n: mine[n] for n in opt}, {n: o_t[n] for n in opt}) == [], (case, w)
        # 1b. the two jobs after load / apply: every captured tensor (model parameters, RNGs) and the metadata
        assert _diff(s_t, o_t) == [], (case, w)
        # Megatron's load_state_dict leaves the checkpoint's param_groups 'step' in the live groups, which torch Adam
        # never reads (its step is per parameter, compared above): the one difference, and it must be the step
        for om in o_m["optimizers"]:
            for gm in om["groups"]:
                assert gm["hparams"].pop("step") == V, gm["hparams"]
        assert s_m == o_m, (case, w, [k for k in set(s_m) | set(o_m) if s_m.get(k) != o_m.get(k)])
        assert s_m["coords"]["dp_size"] == d2 and s_m["batch"]["num_microbatches"] == g * d // d2
    for w, o in enumerate(ours):
        assert "was not re-partitioned" in o["refused"][0], o["refused"]
        if d2 > 1:   # another target rank's state: its shards are cut for another data-parallel rank
            assert "dp_rank" in o["refused"][1] and "restart at the original" in o["refused"][1], o["refused"]
    # the run continued from the snapshot's step, not from the start
    gbs = MB * g * d
    assert [o["loaded"] for o in ours] == [o["loaded"] for o in oracle] == \
        [{"iteration": V, "consumed": V * gbs, "num_steps": V * gbs}] * (tp * pp * d2)
    # 2. K more steps at D' with the same global batch: losses and final states bit-identical
    assert [o["losses"] for o in ours] == [o["losses"] for o in oracle], case
    assert all(None not in o["losses"] for o in ours[-tp * d2:])   # the last pipeline stage's ranks
    for w in range(tp * pp * d2):
        a = load_tensors(os.path.join(out, f"ours_final{w}"))[0]
        b = load_tensors(os.path.join(out, f"oracle_final{w}"))[0]
        assert _diff(a, b) == [], (case, w)
    res = results[0][1]
    report = {"case": case, "from": d, "to": d2, "seconds": {
        "run_at_d": round(t_run, 1), "megatron_save": round(max(r["save_s"] for r in at_d), 1),
        "reshard": round(t_reshard, 3), "megatron_load": round(max(o["load_s"] for o in oracle), 2),
        "apply_resharded": round(max(o["load_s"] for o in ours), 2)},
        "traffic_slice0": {r: {"local": t.local_bytes, "remote": t.remote_bytes, "from": t.from_ranks}
                        for r, t in res.traffic.items()},
        "segments_slice0": len(res.plan.segments),
        "shards_slice0": [len(res.plan.src.numels[0]), len(res.plan.dst.numels[0])]}
    print("RESHARD", json.dumps(report))
