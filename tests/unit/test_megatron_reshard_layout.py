"""Megatron DistributedOptimizer re-partitioning without processes (adapters/megatron/distopt_layout.py, .reshard).

1. The partitioning rules equal megatron-core's own code over a grid of data-parallel sizes and bucket layouts:
   ``_ParamAndGradBuffer`` (padding, bucket boundaries, shared-embedding buckets, high-busbw padding) and
   ``DistributedOptimizer``'s range and group builders (which shard of which parameter each rank owns, in the
   inner optimizer's order), built on CPU with a stand-in process group.
2. Re-partitioning synthetic snapshots from D to D' over a grid: every element of every parameter and its Adam
   moments lands where the rules put it at D', bytes unchanged, padding nowhere; scalars, counters, RNG carried.
3. What is refused, with the message naming what to do.
The multi-process proof against Megatron's own resharded checkpoint load is tests/dist/test_megatron_reshard_oracle.py.
"""
from __future__ import annotations

import copy
import types
from itertools import product

import pytest
import torch

from shardsafe.adapters.megatron import distopt_layout as dl
from shardsafe.adapters.megatron.reshard import MegatronResharder
from shardsafe.adapters.megatron.state_checks import FORMAT
from shardsafe.snapshot.reshard import ReshardError, reshard

# name: per buffer (param dtype, [(numel, own bucket, group)], bucket size, high busbw)
LAYOUTS = {
    "one_bucket": [("torch.float32", [(100, 0, 0), (7, 0, 1), (300, 0, 0), (64, 0, 1), (1, 0, 1)], None, False)],
    "small_buckets": [("torch.bfloat16", [(100, 0, 0), (7, 0, 1), (300, 0, 0), (64, 0, 1), (1, 0, 1), (129, 0, 0)],
                       150, False)],
    "shared_embedding": [("torch.bfloat16", [(513, 1, 0), (33, 0, 1), (250, 0, 0), (5, 0, 1), (77, 0, 0)], None,
                          False)],
    "high_busbw": [("torch.float32", [(70000, 0, 0), (3, 0, 1), (129, 0, 0)], None, True)],
    "two_buffers": [("torch.float32", [(90, 0, 1), (200, 0, 0)], 100, False),
                    ("torch.bfloat16", [(257, 1, 0), (31, 0, 1), (400, 0, 0), (2, 0, 1)], None, False)],
}
SIZES = (1, 2, 3, 4, 8)


def _record(layout: str, world: int, rank: int = 0) -> dict:
    bufs = []
    for bi, (dtype, params, bucket_size, busbw) in enumerate(LAYOUTS[layout]):
        buf = {"param_dtype": dtype, "grad_dtype": "torch.float32", "expert": False, "bucket_size": bucket_size,
               "high_busbw": busbw, "params": [[f"b{bi}.p{i}", n, bool(own)] for i, (n, own, _) in enumerate(params)]}
        lay = dl.layout_of(buf, world)
        buf["starts"] = list(lay.starts)
        buf["buckets"] = [[b.offset, b.numel, b.numel_unpadded] for b in lay.buckets]
        bufs.append(buf)
    return {"dp_size": world, "dp_rank": rank, "instances": 1, "buffers": bufs}


def _groups(layout: str) -> dict[str, int]:
    return {f"b{bi}.p{i}": g for bi, (_, params, _, _) in enumerate(LAYOUTS[layout])
            for i, (_, _, g) in enumerate(params)}


# ---- 1. the rules are megatron-core's --------------------------------------------------------------------------

class _Group:
    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def megatron_on_cpu(monkeypatch):
    """megatron-core's buffer and optimizer classes built on CPU (allocation device, CUDA type names and the
    per-stage bucket log, which needs a process group); undone after the test."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    import megatron.core.distributed.param_and_grad_buffer as pgb
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(pgb, "log_on_each_pipeline_stage", lambda *a, **k: None)
    names = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}
    orig = torch.Tensor.type
    monkeypatch.setattr(torch.Tensor, "type", lambda self, *a, **k: orig(self, *a, **k) if a or k
                        else names.get(orig(self), orig(self)))
    return pgb, DistributedOptimizer


def _megatron(pgb, DistributedOptimizer, layout: str, world: int):
    """megatron-core's buffers for LAYOUTS[layout] at ``world`` ranks, and per rank its inner optimizer's shards
    as (name, first, end) per group."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    names, groups, buffers = {}, [[], []], []
    for bi, (dtype, params, bucket_size, busbw) in enumerate(LAYOUTS[layout]):
        ps = [torch.nn.Parameter(torch.zeros(n, dtype=getattr(torch, dtype.split(".")[1]))) for n, _, _ in params]
        for i, (p, (_, own, g)) in enumerate(zip(ps, params)):
            names[p] = f"b{bi}.p{i}"
            groups[g].append(p)
            if own:
                p.shared_embedding = True
        cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                            pad_buckets_for_high_nccl_busbw=busbw)
        buffers.append(pgb._ParamAndGradBuffer(cfg, ps[0].dtype, torch.float32, ps, _Group(world), bucket_size,
                                               names, 1.0 / world, list(range(len(ps))), False,
                                               types.SimpleNamespace(tp=_Group(1), dp_cp=_Group(world))))
    per_rank = []
    for r in range(world):
        for b in buffers:
            b.data_parallel_group = _Group(world, r)
        gbuf_ranges = [DistributedOptimizer._build_gbuf_range_map(b) for b in buffers]
        param_gbuf_map = DistributedOptimizer._build_model_param_gbuf_map(gbuf_ranges)
        _, opt_ranges = DistributedOptimizer._build_optimizer_group_ranges([{"params": g} for g in groups], gbuf_ranges)
        m16, m32, *_ = DistributedOptimizer._build_model_and_main_param_groups(
            gbuf_ranges, param_gbuf_map, opt_ranges, OptimizerConfig(use_distributed_optimizer=True))
        rank_groups = []
        for g16, g32 in zip(m16, m32):
            rank_groups.append([])
            for p in g32 + g16:   # the inner optimizer's order: fp32 shards, then the 16-bit params' main shards
                gi, dtype, bi = param_gbuf_map[p]
                rng = gbuf_ranges[gi][dtype][bi]["param_map"][p]["param"]
                rank_groups[-1].append((names[p], rng.start, rng.end))
        per_rank.append(rank_groups)
    return buffers, names, per_rank


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rules_equal_megatron_cores_buffers_and_shards(layout, megatron_on_cpu):
    pgb, DO = megatron_on_cpu
    for world in SIZES:
        buffers, names, per_rank = _megatron(pgb, DO, layout, world)
        rec = _record(layout, world)
        for buf, rbuf in zip(buffers, rec["buffers"]):
            assert rbuf["starts"] == [buf.param_index_map[p][0] for p in buf.params], (layout, world)
            assert rbuf["buckets"] == [[b.offset, b.grad_data.numel(), b.numel_unpadded] for b in buf.buckets]
        # and what record() reads off live objects is what the rules give
        leaf = types.SimpleNamespace(buffers=buffers, data_parallel_group=_Group(world, 0),
                                     ddp_config=types.SimpleNamespace(num_distributed_optimizer_instances=1,
                                                                      pad_buckets_for_high_nccl_busbw=
                                                                      LAYOUTS[layout][0][3]))
        chunks = [types.SimpleNamespace(buffers=[b], bucket_size=spec[2]) for b, spec in zip(buffers, LAYOUTS[layout])]
        assert dl.record(leaf, chunks, {id(p): n for p, n in names.items()}) == rec
        dl.check_record(rec)
        for r in range(world):
            assert dl.rank_order(rec, _groups(layout), 2, world, r) == per_rank[r], (layout, world, r)


def test_a_recorded_layout_the_rules_do_not_give_is_refused():
    rec = _record("small_buckets", 4)
    rec["buffers"][0]["starts"][1] += 64
    with pytest.raises(dl.LayoutError, match=r"starts at 640 \(recorded 704\).*tested: 0.16.1"):
        dl.check_record(rec)


def test_default_bucket_size_follows_the_data_parallel_size():
    assert dl.bucket_size_at(None, 4, 2) is None
    assert dl.bucket_size_at(40_000_000, 8, 64) == 64_000_000   # DDP's default at 8 ranks, recomputed
    assert dl.bucket_size_at(64_000_000, 64, 8) == 40_000_000
    assert dl.bucket_size_at(12345, 64, 8) == 12345              # a configured size stays


# ---- 2. re-partitioning synthetic snapshots ----------------------------------------------------------------------

class _Snap:
    def __init__(self, tensors, meta):
        self.tensors, self.meta = tensors, meta


def _full_values(layout: str) -> dict[str, dict[str, torch.Tensor]]:
    """Distinct values for every element of every parameter's main copy and moments."""
    out, at = {}, 0
    for bi, (_, params, _, _) in enumerate(LAYOUTS[layout]):
        for i, (n, _, _) in enumerate(params):
            out[f"b{bi}.p{i}"] = {k: torch.arange(at + j * 10 ** 6, at + j * 10 ** 6 + n, dtype=torch.float32)
                                  for j, k in enumerate(("param", "exp_avg", "exp_avg_sq"))}
            at += n
    return out


def _snapshots(layout: str, world: int, batch: dict, step: float = 3.0) -> list[_Snap]:
    full = _full_values(layout)
    snaps = []
    for d in range(world):
        rec = _record(layout, world, d)
        tensors = {"rng/torch_cpu": torch.full((8,), d, dtype=torch.uint8), "buf/c0.bias": torch.ones(3),
                   "opt0/g0/hp/step": torch.tensor(7.0)}
        groups = []
        for gi, group in enumerate(dl.rank_order(rec, _groups(layout), 2, world, d)):
            params = []
            for pi, (name, a, b) in enumerate(group):
                for k, v in full[name].items():
                    tensors[f"opt0/g{gi}/p{pi}/{k}"] = v[a:b].clone()
                tensors[f"opt0/g{gi}/p{pi}/step"] = torch.tensor(step)
                params.append({"name": name, "shape": [b - a], "range": [a, b], "state_meta": {},
                               "state": ["exp_avg", "exp_avg_sq", "step"]})
            groups.append({"hparams": {"lr": 1e-3 * (gi + 1), "betas": [0.9, 0.95]}, "params": params,
                           "hparam_tensors": ["step"] if gi == 0 else []})
        meta = {"format": FORMAT, "engine": "megatron", "iteration": 5, "batch": batch,
                "counters": {"consumed_train_samples": 160}, "scheduler": {"num_steps": 160},
                "coords": {"tp": 1, "tp_size": 2, "pp": 0, "pp_size": 1, "dp": d, "dp_size": world, "cp_size": 1,
                           "ep_size": 1, "rank": 2 * d + 1, "dp_ranks": list(range(1, 2 * world, 2))},
                "optimizers": [{"type": "DistributedOptimizer", "stub": False, "distopt": rec, "groups": groups,
                                "grad_scaler": None}],
                "extra": {"note": d}, "fp8": [], "buffers": ["c0.bias"],
                "rng": {"base": {"rng/python": {"rank": d}}, "tracker": []}}
        snaps.append(_Snap(tensors, meta))
    return snaps


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reshard_puts_every_element_where_the_rules_do(layout):
    full = _full_values(layout)
    for world, new_world in product(SIZES, SIZES):
        if world == new_world:
            continue
        batch = {"global_batch_size": 48, "micro_batch_size": 2, "num_microbatches": 24 // world}
        res = reshard(_snapshots(layout, world, batch), new_world, MegatronResharder())
        assert [r.rank for r in res.ranks] == list(range(new_world))
        moved = 0
        for tr in res.ranks:
            m, t = tr.meta, tr.tensors
            want = dl.rank_order(_record(layout, new_world), _groups(layout), 2, new_world, tr.rank)
            got = [[(pm["name"], *pm["range"]) for pm in g["params"]] for g in m["optimizers"][0]["groups"]]
            assert got == want, (layout, world, new_world, tr.rank)
            for gi, group in enumerate(want):
                for pi, (name, a, b) in enumerate(group):
                    for k, v in full[name].items():
                        assert torch.equal(t[f"opt0/g{gi}/p{pi}/{k}"], v[a:b]), (name, k)
                    assert t[f"opt0/g{gi}/p{pi}/step"].item() == 3.0
                    moved += b - a
            # what the D' optimizer records about itself
            assert m["optimizers"][0]["distopt"] == _record(layout, new_world, tr.rank)
            assert m["coords"]["dp"] == tr.rank and m["coords"]["dp_size"] == new_world
            assert "rank" not in m["coords"] and "dp_ranks" not in m["coords"]   # the old job's world ranks
            assert m["batch"]["num_microbatches"] == 24 // new_world
            assert m["resharded"]["num_microbatches"] == [24 // world, 24 // new_world]
            assert (m["iteration"], m["counters"], m["scheduler"]) == (5, {"consumed_train_samples": 160},
                                                                       {"num_steps": 160})
            # RNG, buffers, extra, group hyperparameters: data-parallel rank 0's (Megatron-LM's rng_state[0])
            assert t["rng/torch_cpu"].tolist() == [0] * 8 and m["rng"]["base"]["rng/python"] == {"rank": 0}
            assert m["extra"] == {"note": 0} and torch.equal(t["buf/c0.bias"], torch.ones(3))
            assert t["opt0/g0/hp/step"].item() == 7.0 and m["optimizers"][0]["groups"][1]["hparams"]["lr"] == 2e-3
        # every element exactly once: 12 bytes (fp32 main + two moments) per element through the plan, 4 per shard
        # (its step), and per target rank the replicated RNG (8), buffer (12) and group step (4)
        assert moved == sum(n for _, params, _, _ in LAYOUTS[layout] for n, _, _ in params)
        assert sum(s.length for s in res.plan.segments) == moved
        shards = sum(len(n) for n in res.plan.dst.numels)
        total = sum(t.local_bytes + t.remote_bytes for t in res.traffic.values())
        assert total == 12 * moved + 4 * shards + new_world * (8 + 12 + 4)


def test_traffic_counts_local_and_remote_bytes():
    batch = {"global_batch_size": 16, "micro_batch_size": 2, "num_microbatches": 4}
    res = reshard(_snapshots("two_buffers", 2, batch), 1, MegatronResharder())
    total = sum(n for _, ps, _, _ in LAYOUTS["two_buffers"] for n, _, _ in ps)
    tr = res.traffic[0]
    shards = len(res.plan.dst.numels[0])
    from_1 = sum(res.plan.into(0, t)[0].src_rank == 1 for t in range(shards))   # their step comes from rank 1
    # target 0 runs where source 0 ran: source 1's elements come over the network, source 0's from its own node
    assert tr.from_ranks == {1: tr.remote_bytes}
    assert tr.local_bytes + tr.remote_bytes == 12 * total + 4 * shards + 8 + 12 + 4
    assert tr.remote_bytes == 12 * res.plan.elements_between(1, 0) + 4 * from_1


def test_ranks_and_explicit_batch():
    snaps = _snapshots("one_bucket", 4, None)
    with pytest.raises(ReshardError, match=r"pass MegatronResharder\(global_batch_size"):
        reshard(snaps, 2, MegatronResharder())
    res = reshard(snaps, 2, MegatronResharder(global_batch_size=32, micro_batch_size=4), ranks=[1])
    assert [r.rank for r in res.ranks] == [1] and res.ranks[0].meta["resharded"]["num_microbatches"] == [2, 4]


# ---- 3. refusals -------------------------------------------------------------------------------------------------

def _refused(snaps, new_world=2, match="", **kw):
    with pytest.raises(ReshardError, match=match):
        reshard(snaps, new_world, MegatronResharder(**kw))


def test_refusals_name_what_to_do():
    batch = {"global_batch_size": 24, "micro_batch_size": 2, "num_microbatches": 3}
    snaps = _snapshots("small_buckets", 4, {**batch, "global_batch_size": 24})
    _refused(snaps, 5, "cannot be shared evenly by 5 data-parallel ranks.*divides 12")
    _refused(list(reversed(snaps)), 2, "pass one slice's snapshots in data-parallel rank order")
    _refused(snaps[:3], 2, "taken at data-parallel size 4, 3 were given")
    bad = copy.deepcopy(snaps)
    bad[1].tensors["opt0/g0/p0/step"] = torch.tensor(9.0)
    bad[1].meta["optimizers"][0]["groups"][0]["params"][0]["range"][1] -= 1
    _refused(bad, 2, "megatron-core's rules as shardsafe reads them give")
    bad = copy.deepcopy(snaps)
    bad[2].meta["iteration"] = 6
    _refused(bad, 2, "differs from rank 0's in 'iteration'")
    bad = copy.deepcopy(snaps)
    bad[1].meta["optimizers"][0]["groups"][1]["hparams"]["lr"] = 5.0
    _refused(bad, 2, "group 1's hyperparameters differ")
    bad = copy.deepcopy(snaps)
    for s in bad:
        s.meta["optimizers"][0]["distopt"]["buffers"][0]["expert"] = True
    _refused(bad, 2, "MoE expert parameters")
    bad = copy.deepcopy(snaps)
    for s in bad:
        s.meta["coords"]["cp_size"] = 2
    _refused(bad, 2, "context parallelism")
    bad = copy.deepcopy(snaps)
    for s in bad:
        del s.meta["optimizers"][0]["distopt"]
    _refused(bad, 2, "does not record the DistributedOptimizer's buffer layout")
    bad = copy.deepcopy(snaps)
    for s in bad:
        s.meta["optimizers"][0]["type"] = "Float16OptimizerWithFloat16Params"
    _refused(bad, 2, "full replica on every data-parallel rank")
    # a step that differs between two pieces of one parameter cannot be merged
    world4 = _snapshots("one_bucket", 4, batch)
    owners = [d for d, s in enumerate(world4) for pm in s.meta["optimizers"][0]["groups"][0]["params"]
              if pm["name"] == "b0.p2"]
    assert len(owners) > 1
    d = owners[1]
    pi = [pm["name"] for pm in world4[d].meta["optimizers"][0]["groups"][0]["params"]].index("b0.p2")
    world4[d].tensors[f"opt0/g0/p{pi}/step"] = torch.tensor(4.0)
    _refused(world4, 1, "optimizer state 'step' differs between its source shards")
    # per-rank RNG streams (--data-parallel-random-init): target r continues source r's; growing past D is refused
    res = reshard(_snapshots("one_bucket", 4, batch), 2, MegatronResharder(data_parallel_random_init=True))
    assert [r.tensors["rng/torch_cpu"][0].item() for r in res.ranks] == [0, 1]
    _refused(_snapshots("one_bucket", 2, {**batch, "num_microbatches": 6}), 4, "data-parallel-random-init",
             data_parallel_random_init=True)
    with pytest.raises(Exception, match="together"):
        MegatronResharder(global_batch_size=8)


def test_a_group_step_only_ranks_holding_the_group_advance_is_taken_from_them():
    """TE/Apex FusedAdam keeps ``step`` in the param group and does not advance it where the group is empty."""
    batch = {"global_batch_size": 16, "micro_batch_size": 2, "num_microbatches": 1}
    snaps = _snapshots("one_bucket", 8, batch)
    holding = [bool(s.meta["optimizers"][0]["groups"][1]["params"]) for s in snaps]
    assert any(holding) and not all(holding), holding
    for s, h in zip(snaps, holding):
        s.meta["optimizers"][0]["groups"][1]["hparams"]["step"] = 5 if h else 0
    res = reshard(snaps, 2, MegatronResharder())
    assert [r.meta["optimizers"][0]["groups"][1]["hparams"]["step"] for r in res.ranks] == [5, 5]
    snaps[holding.index(True)].meta["optimizers"][0]["groups"][1]["hparams"]["step"] = 4
    _refused(snaps, 2, "group 1's hyperparameters differ")


@pytest.mark.parametrize("layout", ["small_buckets", "two_buffers"])
def test_a_target_given_only_what_reads_names_builds_what_it_builds_from_everything(layout):
    """MegatronResharder.reads, from metadata and manifest entries alone, names every byte reshard reads for a
    target (the restore at another size moves just these: shardsafe/snapshot/reshard_restore.py): given only those
    pieces and the whole small tensors, each target's state is the same, tensor for tensor."""
    from shardsafe.payload import manifest as mf
    from shardsafe.snapshot.reshard import Pieces
    batch = {"global_batch_size": 48, "micro_batch_size": 2, "num_microbatches": 6}
    for world, new_world in ((4, 3), (2, 4), (3, 1)):
        snaps = _snapshots(layout, world, dict(batch, num_microbatches=24 // world))
        reads = MegatronResharder().reads([s.meta for s in snaps], [mf.layout(s.tensors)[0] for s in snaps], new_world)
        full = reshard(snaps, new_world, MegatronResharder())
        for t in range(new_world):
            partial = []
            for d, s in enumerate(snaps):
                ts = {n: Pieces(n, v.shape, v.dtype) for n, v in s.tensors.items()}
                for name, start, count in reads[t].get(d, ()):
                    if count < 0:
                        ts[name] = s.tensors[name].clone()
                    else:
                        ts[name].add(start, s.tensors[name][start: start + count].clone())
                partial.append(_Snap(ts, s.meta))
            got = reshard(partial, new_world, MegatronResharder(), ranks=[t]).ranks[0]
            want = full.ranks[t]
            assert sorted(got.tensors) == sorted(want.tensors) and got.meta == want.meta, (world, new_world, t)
            assert all(torch.equal(got.tensors[n], want.tensors[n]) for n in want.tensors), (world, new_world, t)
