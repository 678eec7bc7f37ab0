"""Re-partitioning snapshots from D to D' data-parallel ranks (shardsafe.snapshot.reshard, adapters/deepspeed/reshard.py),
without processes: DeepSpeed's layouts worked out by hand for small cases, the plan's guarantees (every element
once, padding zero, byte copies) over a grid of sizes, round trips, the metadata a target rank gets, and the
refusals. tests/dist/test_ds_reshard_oracle.py compares the same code against DeepSpeed's universal checkpoint.
"""
import itertools
import random

import pytest
import torch

from shardsafe.adapters.deepspeed.reshard import (BF16, ZERO12, ZERO3, DeepSpeedPartitioning, DeepSpeedResharder,
                                           layout_problems)
from shardsafe.snapshot import reshard as core
from shardsafe.snapshot.reshard import ReshardError, Segment


def reshard(snapshots, new_world, **kw):
    return core.reshard(snapshots, new_world, DeepSpeedResharder(), **kw)


class Snap:
    def __init__(self, tensors, meta):
        self.tensors, self.meta = tensors, meta


def _meta(kind, groups, world, *, gas=1, micro=None, align_pad=(), sub_group_size=None, zero=None):
    """Rank metas of a DeepSpeed snapshot at ``world`` for parameter ``groups`` ([[(name, numel)]]), with what
    ds_layout.checkpoint_layout records (the size-dependent fields from DeepSpeedPartitioning, which the hand
    cases below pin). ``align_pad``: names followed by one element of parameter-alignment padding (ZeRO-1/2)."""
    lay = {"ds_config": {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
                         "train_batch_size": 2 * gas * world, "zero_optimization": dict(zero or {})},
           "ds_version": "0.19.8", "seq_dp_world_size": world, "lp_dtype": "bfloat16",
           "param_shapes": [[[n, [k]] for n, k in g] for g in groups]}
    if kind == ZERO12:
        flats, pads = [], []
        for g in groups:
            at, f, p = 0, [], []
            for i, (n, k) in enumerate(g):
                f.append([n, at, k])
                pad = 1 if n in align_pad and i < len(g) - 1 else 0
                p.append(pad)
                at += k + pad
            flats.append(f)
            pads.append(p)
        lay.update(flat_params=flats, param_alignment_paddings=pads)
    if kind == ZERO3:
        lay.update(sub_group_size=sub_group_size or 10 ** 12, sub_group_to_group=list(range(len(groups))))
    base = {"engine": "deepspeed", "optimizer": kind, "zero_stage": 3 if kind == ZERO3 else 1,
            "dp_world_size": world, "parallel": {"tp": 0, "tp_size": 1},
            "param_groups": [{"lr": 1e-3, "weight_decay": 0.01} for _ in groups], "opt_scalars": {},
            "lr_scheduler": {"last_batch_iteration": 4}, "program_schedulers": None,
            "counters": {"global_steps": 5, "global_samples": 5 * 2 * gas * world,
                         "micro_steps": 5 * gas if micro is None else micro, "skipped_steps": 0},
            "loss_scaler": {"cur_scale": 1.0}, "overflow": False, "extra": {"where": "rank0"},
            "base_optimizer": "FusedAdam", "adam_powers": None, "rng_trackers": {},
            "rng/python": {"version": 3, "gauss": None}, "state_devices": {}, "ds_checkpoint": lay}
    part = DeepSpeedPartitioning(base)
    metas = []
    for r in range(world):
        m = {**base, "ds_checkpoint": {**lay, **part.sized_fields(world, r)}}
        metas.append(m)
    return metas


def _truth(groups, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(k, generator=g) for grp in groups for n, k in grp}


def _snapshots(kind, groups, world, truth, **kw):
    """Snapshots at ``world`` holding ``truth`` (per parameter: master; x2 exp_avg; x3 exp_avg_sq) where the
    layout puts it, zero elsewhere; per-rank module buffers and RNG."""
    metas = _meta(kind, groups, world, **kw)
    lay = DeepSpeedPartitioning(metas[0]).layout(world)
    snaps = []
    for r in range(world):
        t = {}
        for j, k in enumerate(lay.numels[r]):
            for key, f in (("opt/master/{}", 1.0), ("opt/state/{}/exp_avg", 2.0), ("opt/state/{}/exp_avg_sq", 3.0)):
                t[key.format(j)] = torch.zeros(k)
            t[f"opt/state/{j}/step"] = torch.tensor(5.0)
        for (name, _), runs in zip(lay.params, lay.runs):
            for run in runs:
                if run.rank == r:
                    src = truth[name][run.start: run.start + run.length]
                    for key, f in (("opt/master/{}", 1.0), ("opt/state/{}/exp_avg", 2.0),
                                   ("opt/state/{}/exp_avg_sq", 3.0)):
                        t[key.format(run.tensor)][run.offset: run.offset + run.length] = src * f
        t["module/buffer/running"] = torch.full((3,), float(r))
        t["rng/torch_cpu"] = torch.full((8,), r, dtype=torch.uint8)
        snaps.append(Snap(t, metas[r]))
    return snaps


# ---- DeepSpeed's layouts by hand ---------------------------------------------------------------------------

def test_zero12_layout_by_hand():
    """a (5 elements), b (3) in one group. D=2: flat 8 = multiple of 2x2, partitions of 4: rank 0 a[0:4], rank 1
    a[4] b[0:3]. D=3: flat padded to 12 (multiple of 6), partitions of 4: rank 2 holds padding only."""
    m = _meta(ZERO12, [[("a", 5), ("b", 3)]], 2)[0]
    p = DeepSpeedPartitioning(m)
    two, three = p.layout(2), p.layout(3)
    assert two.numels == [[4], [4]] and three.numels == [[4], [4], [4]]
    assert [(r.start, r.length, r.rank, r.offset) for r in two.runs[0]] == [(0, 4, 0, 0), (4, 1, 1, 0)]
    assert [(r.start, r.length, r.rank, r.offset) for r in two.runs[1]] == [(0, 3, 1, 1)]
    assert [p.sized_fields(3, r)["group_paddings"] for r in range(3)] == [[0], [0], [4]]
    assert p.sized_fields(3, 1)["param_slice_mappings"] == [[["a", 1, 0], ["b", 3, 1]]]
    assert p.sized_fields(3, 2)["param_slice_mappings"] == [[]]
    assert p.sized_fields(2, 0)["partition_count"] == [2]
    # D=4: flat 8 (a multiple of 8): partitions of 2, no padding
    assert [p.sized_fields(4, r)["group_paddings"] for r in range(4)] == [[0]] * 4


def test_zero12_parameter_alignment_padding_is_kept_and_not_moved():
    m = _meta(ZERO12, [[("a", 5), ("b", 3)]], 2, align_pad=("a",))[0]   # a, 1 padding element, b: flat end 9
    p = DeepSpeedPartitioning(m)
    two = p.layout(2)   # 9 -> 12: partitions of 6; b at flat 6..8 = rank 1 offsets 0..2
    assert two.numels == [[6], [6]]
    assert [(r.start, r.length, r.rank, r.offset) for r in two.runs[1]] == [(0, 3, 1, 0)]
    assert p.sized_fields(2, 1)["group_paddings"] == [3]


def test_zero3_layout_by_hand():
    """Each parameter partitioned by itself: a (5) -> 3 per rank at D=2, 2 at D=3; b (3) -> 2 / 1."""
    p = DeepSpeedPartitioning(_meta(ZERO3, [[("a", 5), ("b", 3)]], 2)[0])
    two, three = p.layout(2), p.layout(3)
    assert two.numels == [[5], [5]] and three.numels == [[3], [3], [3]]
    assert [(r.start, r.length, r.rank, r.offset) for r in two.runs[0]] == [(0, 3, 0, 0), (3, 2, 1, 0)]
    assert [(r.start, r.length, r.rank, r.offset) for r in two.runs[1]] == [(0, 2, 0, 3), (2, 1, 1, 3)]
    assert [(r.start, r.length, r.rank, r.offset) for r in three.runs[0]] == [(0, 2, 0, 0), (2, 2, 1, 0),
                                                                                (4, 1, 2, 0)]


def test_zero3_sub_groups_follow_the_partition_sizes():
    """_create_fp16_sub_groups cuts when the partitions reach sub_group_size: at D=1, a (6), b (6), c (6) with
    size 10 -> [a, b], [c]; at D=3 (partitions of 2) one sub-group."""
    groups = [[("a", 6), ("b", 6), ("c", 6)]]
    m = _meta(ZERO3, groups, 3, sub_group_size=10)[0]
    p = DeepSpeedPartitioning(m)
    assert [[n for n, _ in s] for _, s in p.sub_groups(1)] == [["a", "b"], ["c"]]
    assert [[n for n, _ in s] for _, s in p.sub_groups(3)] == [["a", "b", "c"]]
    assert p.sized_fields(1, 0)["sub_group_to_group"] == [0, 0]


def test_bf16_optimizer_layout_is_back_to_back():
    p = DeepSpeedPartitioning(_meta(BF16, [[("a", 5), ("b", 3)], [("c", 7)]], 2)[0])
    lay = p.layout(2)
    assert lay.numels == [[4, 4], [4, 4]]
    assert [(r.start, r.length, r.rank, r.tensor, r.offset) for r in lay.runs[2]] == [(0, 4, 0, 1, 0), (4, 3, 1, 1, 0)]


# ---- the plan's guarantees -----------------------------------------------------------------------------

def _expected_at(kind, groups, world, truth, **kw):
    return _snapshots(kind, groups, world, truth, **kw)


GRID = [(kind, d, d2) for kind in (ZERO12, ZERO3, BF16) for d, d2 in itertools.product((1, 2, 3, 4, 6), repeat=2)]


@pytest.mark.parametrize("kind,d,d2", GRID)
def test_every_element_moves_once_and_lands_where_the_layout_at_d2_puts_it(kind, d, d2):
    rnd = random.Random(d * 100 + d2)
    groups = [[(f"g{g}p{i}", rnd.randint(1, 40)) for i in range(rnd.randint(1, 5))] for g in range(2)]
    truth = _truth(groups, seed=d + d2)
    kw = {"gas": 12, "sub_group_size": 25} if kind == ZERO3 else {"gas": 12}
    if kind == ZERO12:
        kw["align_pad"] = (groups[0][0][0],)
    src = _snapshots(kind, groups, d, truth, **kw)
    res = reshard(src, d2)
    want = _expected_at(kind, groups, d2, truth, gas=12 * d // d2, **{k: v for k, v in kw.items() if k != "gas"})
    assert [r.rank for r in res.ranks] == list(range(d2))
    for r, got in enumerate(res.ranks):
        for name, t in want[r].tensors.items():
            if name.startswith("opt/"):
                assert torch.equal(got.tensors[name], t), (name, r)
        assert not any(n.startswith("rng/") for n in got.tensors)
        assert torch.equal(got.tensors["module/buffer/running"], torch.zeros(3))   # data-parallel rank 0's
    total = sum(k for g in groups for _, k in g)
    assert sum(s.length for s in res.plan.segments) == total   # each element exactly once
    # round trip: back at D, every tensor is what it was (padding zero on both sides)
    back = reshard([Snap(r.tensors, r.meta) for r in res.ranks], d)
    for r in range(d):
        for name, t in src[r].tensors.items():
            if name.startswith("opt/"):
                assert torch.equal(back.ranks[r].tensors[name], t), (name, r)


def test_the_plan_is_coalesced_and_counts_local_and_remote_bytes():
    """ZeRO-2, one group of 1001 elements in 10 parameters, 4 -> 2: flat 1008 in partitions of 252 becomes flat
    1004 in partitions of 502; one segment per (source, target) overlap, whatever the parameter boundaries."""
    groups = [[(f"p{i}", 100) for i in range(9)] + [("p9", 101)]]
    res = reshard(_snapshots(ZERO12, groups, 4, _truth(groups)), 2)
    assert res.plan.segments == [Segment(0, 0, 0, 0, 0, 0, 252), Segment(1, 0, 0, 0, 0, 252, 250),
                                 Segment(1, 0, 250, 1, 0, 0, 2), Segment(2, 0, 0, 1, 0, 2, 252),
                                 Segment(3, 0, 0, 1, 0, 254, 245)]
    # 12 bytes per element (fp32 master, exp_avg, exp_avg_sq) + 12 bytes of rank 0's module buffer; by default
    # target r runs where source r ran
    t0, t1 = res.traffic[0], res.traffic[1]
    assert (t0.local_bytes, t0.remote_bytes, t0.from_ranks) == (252 * 12 + 12, 250 * 12, {1: 250 * 12})
    assert (t1.local_bytes, t1.from_ranks) == (2 * 12, {2: 252 * 12, 3: 245 * 12, 0: 12})
    assert res.plan.elements_into(1, colocated=[2, 3]) == (497, 2)
    # target 1 on the node that held sources 2 and 3: only 2 elements and the buffer cross the network
    res2 = reshard(_snapshots(ZERO12, groups, 4, _truth(groups)), 2, colocated={0: [0, 1], 1: [2, 3]})
    assert res2.traffic[1].remote_bytes == 2 * 12 + 12 and res2.traffic[0].remote_bytes == 0


def test_a_rank_builds_only_its_own_target():
    groups = [[("a", 50)]]
    res = reshard(_snapshots(ZERO12, groups, 4, _truth(groups)), 2, ranks=[1])
    assert [r.rank for r in res.ranks] == [1] and set(res.traffic) == {0, 1}


# ---- metadata ------------------------------------------------------------------------------------------

def test_target_metadata_counters_accumulation_and_rng():
    groups = [[("a", 50), ("b", 7)]]
    res = reshard(_snapshots(ZERO12, groups, 4, _truth(groups), gas=1), 2)
    m = res.ranks[1].meta
    assert m["dp_world_size"] == 2
    assert m["counters"] == {"global_steps": 5, "global_samples": 40, "micro_steps": 10, "skipped_steps": 0}
    assert m["ds_checkpoint"]["ds_config"]["gradient_accumulation_steps"] == 2
    assert m["ds_checkpoint"]["ds_config"]["train_batch_size"] == 8   # the global batch is kept
    assert m["resharded"] == {"from_dp_world_size": 4, "gradient_accumulation_steps": 2, "rng": "program",
                              "buffers_from_dp_rank": 0}
    assert not any(k.startswith("rng/") for k in m) and m["extra"] == {"where": "rank0"}
    assert torch.equal(res.ranks[1].tensors["opt/state/0/step"], torch.tensor(5.0))
    assert m["ds_checkpoint"]["seq_dp_world_size"] == 2 and m["ds_checkpoint"]["partition_count"] == [2]
    assert layout_problems(m, m["ds_checkpoint"]) == []
    live = dict(m["ds_checkpoint"], group_paddings=[4])   # the engine pads 3 there
    assert "group_paddings" in layout_problems(m, live)[0]


def test_scalar_optimizer_state_per_flat_tensor_follows_its_group():
    """FusedAdam keeps ``step`` as an int per flat tensor (meta opt_scalars); ZeRO-3 sub-groups regroup."""
    groups = [[("a", 30), ("b", 30), ("c", 30)]]
    snaps = _snapshots(ZERO3, groups, 1, _truth(groups), sub_group_size=40, gas=2)
    for s in snaps:
        s.meta = dict(s.meta, opt_scalars={str(j): {"step": 5} for j in range(2)})
    assert len([n for n in snaps[0].tensors if n.startswith("opt/master/")]) == 2
    res = reshard(snaps, 2)
    assert len([n for n in res.ranks[0].tensors if n.startswith("opt/master/")]) == 1
    assert res.ranks[0].meta["opt_scalars"] == {"0": {"step": 5}}
    snaps[0].meta["opt_scalars"]["1"]["step"] = 4
    with pytest.raises(ReshardError, match="optimizer scalar 'step' differs"):
        reshard(snaps, 2)


# ---- refusals ------------------------------------------------------------------------------------------

def test_a_batch_that_does_not_divide_is_refused():
    groups = [[("a", 50)]]
    with pytest.raises(ReshardError, match="cannot share evenly.*divides 4"):
        reshard(_snapshots(ZERO12, groups, 4, _truth(groups)), 3)


@pytest.mark.parametrize("change,match", [
    (lambda s: s[1].meta.update(counters={**s[1].meta["counters"], "global_steps": 4}), "rank 1's snapshot differs"),
    (lambda s: s.pop(), "2 were given"),
    (lambda s: s.reverse(), "out of rank order"),
    (lambda s: [x.meta.update(engine="megatron") for x in s], "re-partitions 'deepspeed' snapshots: pass the"),
    (lambda s: [x.meta.update(parallel={"experts": {"m": [4, 0, 1]}}) for x in s], "MoE"),
    (lambda s: [x.meta["ds_checkpoint"]["ds_config"]["zero_optimization"].update(round_robin_gradients=True)
                for x in s], "round_robin_gradients"),
    (lambda s: s[0].tensors.update({"new/kind": torch.zeros(1)}), "does not know how to place"),
])
def test_inconsistent_or_unsupported_snapshots_are_refused(change, match):
    groups = [[("a", 50), ("b", 3)]]
    snaps = _snapshots(ZERO12, groups, 3, _truth(groups), gas=2)
    for s in snaps:
        s.meta = {**s.meta, "ds_checkpoint": {**s.meta["ds_checkpoint"],
                                              "ds_config": {**s.meta["ds_checkpoint"]["ds_config"],
                                                            "zero_optimization": {}}}}
    change(snaps)
    with pytest.raises(ReshardError, match=match):
        reshard(snaps, 2)


def test_snapshots_of_different_versions_are_refused():
    groups = [[("a", 50)]]
    snaps = _snapshots(ZERO12, groups, 2, _truth(groups))
    for v, s in zip((4, 5), snaps):
        s.manifest = {"version": v}
    with pytest.raises(ReshardError, match="different versions"):
        reshard(snaps, 1)


def test_the_plan_from_metadata_alone_is_the_reshards():
    groups = [[("a", 50), ("b", 7)], [("c", 13)]]
    snaps = _snapshots(ZERO3, groups, 4, _truth(groups), sub_group_size=9)
    metas = [s.meta for s in snaps]
    assert core.transfer_plan(metas, 2, DeepSpeedResharder()).segments == reshard(snaps, 2).plan.segments
    with pytest.raises(ReshardError, match="cannot share evenly"):
        core.transfer_plan(metas, 3, DeepSpeedResharder())


# ---- a target that holds only the pieces it reads (the restore at another size: snapshot/reshard_restore.py) ----

def _partial(snaps, reads, target):
    """The sources as one target sees them when no rank holds them all: what it reads (pieces in core.Pieces, whole
    tensors as themselves), every other tensor an empty Pieces of its shape."""
    out = []
    for d, s in enumerate(snaps):
        t = {n: core.Pieces(n, v.shape, v.dtype) for n, v in s.tensors.items()}
        for name, start, count in reads[target].get(d, ()):
            if count < 0:
                t[name] = s.tensors[name].clone()
            else:
                t[name].add(start, s.tensors[name].reshape(-1)[start: start + count].clone())
        out.append(Snap(t, s.meta))
    return out


def _entries(snap):
    from shardsafe.payload import manifest as mf
    return mf.layout(snap.tensors)[0]


@pytest.mark.parametrize("kind,d,d2", [(k, d, d2) for k in (ZERO12, ZERO3, BF16) for d, d2 in ((4, 3), (3, 2), (2, 4),
                                                                                            (4, 1), (1, 3))])
def test_a_target_given_only_what_reads_names_builds_what_it_builds_from_everything(kind, d, d2):
    """DeepSpeedResharder.reads, from metadata and manifest entries alone, names every byte reshard reads for a
    target: given only those (the pieces of the masters and moments, the per-tensor state, rank 0's buffers), the
    target's state is the same, tensor for tensor; and it reads no more than its share of the state."""
    rnd = random.Random(d * 10 + d2)
    groups = [[(f"g{g}p{i}", rnd.randint(1, 40)) for i in range(rnd.randint(1, 5))] for g in range(2)]
    kw = {"gas": 12, "sub_group_size": 25} if kind == ZERO3 else {"gas": 12}
    snaps = _snapshots(kind, groups, d, _truth(groups, seed=d), **kw)
    reads = DeepSpeedResharder().reads([s.meta for s in snaps], [_entries(s) for s in snaps], d2)
    full = reshard(snaps, d2)
    for t in range(d2):
        got = reshard(_partial(snaps, reads, t), d2, ranks=[t]).ranks[0]
        want = full.ranks[t]
        assert sorted(got.tensors) == sorted(want.tensors) and got.meta == want.meta
        assert all(torch.equal(got.tensors[n], want.tensors[n]) for n in want.tensors), t
        pieces = sum(c for r in reads[t].values() for n, _, c in r if c > 0 and n.startswith("opt/master/"))
        assert pieces == sum(s.length for s in full.plan.into(t))   # each element of its share, once


def test_a_piece_that_was_not_received_is_an_error_never_a_zero():
    p = core.Pieces("opt/master/0", [10], torch.float32)
    p.add(2, torch.arange(4, dtype=torch.float32))
    assert torch.equal(p.reshape(-1)[3:5], torch.tensor([1.0, 2.0]))
    with pytest.raises(ReshardError, match="elements 5..7 were not received"):
        p.reshape(-1)[5:7]
    with pytest.raises(ReshardError, match="flat view"):
        p.reshape(2, 5)


def test_a_deferred_assembly_writes_nothing_until_filled_then_the_same_bytes_into_the_live_tensors():
    """Inside core.Deferred the resharder returns shapes only (the restore's checks and vote read those), a piece
    that was not received still raises there, and fill() writes each flat tensor into the live tensor of its name
    (garbage in its padding overwritten by zeros), or a new one where the live tensor does not fit: bit for bit what
    the assembly into new tensors gives."""
    groups = [[("a", 50), ("b", 7)], [("c", 13)]]
    snaps = _snapshots(ZERO12, groups, 4, _truth(groups), gas=3)
    want = reshard(snaps, 3, ranks=[1]).ranks[0]
    d = core.Deferred()
    with d:
        got = reshard(snaps, 3, ranks=[1]).ranks[0]
    flat = [n for n in want.tensors if n.startswith("opt/master/") or n.startswith("opt/state/") and
            want.tensors[n].dim() == 1]
    assert flat and all(got.tensors[n].device.type == "meta" and d.deferred(got.tensors[n]) for n in flat)
    assert all(got.tensors[n].shape == want.tensors[n].shape and got.tensors[n].dtype == want.tensors[n].dtype
               for n in flat)
    assert core._DEFERRED.get() is None   # outside the context, assemble copies again
    live = {n: torch.full_like(want.tensors[n], float("nan")) for n in flat}
    live[flat[0]] = torch.full((want.tensors[flat[0]].numel() + 1,), 7.0)   # does not fit: left alone
    before = {n: t.clone() for n, t in live.items()}
    seen = []   # the fault hook (kill-restore-apply) runs once, with half of the live tensors written

    def halfway():
        seen.append([n for n in flat[1:] if not torch.isnan(live[n]).all()])   # NaN until written

    filled = d.fill(got.tensors, live, halfway=halfway)
    assert len(seen) == 1 and 0 < len(seen[0]) < len(flat) - 1, (seen, len(flat))
    assert sorted(filled) == sorted(want.tensors)
    assert all(torch.equal(filled[n], want.tensors[n]) for n in want.tensors)
    assert all(filled[n] is live[n] for n in flat[1:]) and filled[flat[0]] is not live[flat[0]]
    assert torch.equal(live[flat[0]], before[flat[0]])
    reads = DeepSpeedResharder().reads([s.meta for s in snaps], [_entries(s) for s in snaps], 3)
    short = _partial(snaps, reads, 1)
    src, name = next((src, n) for src, r in sorted(reads[1].items()) for n, _, c in r if c > 0)
    short[src].tensors[name] = core.Pieces(name, snaps[src].tensors[name].shape, torch.float32)
    with pytest.raises(ReshardError, match="not received"), core.Deferred():
        reshard(short, 3, ranks=[1])


def test_a_deferred_assembly_fills_a_live_parameter_that_requires_grad():
    """DeepSpeed's fp32 partitions are leaf parameters: written in place as the apply writes them (no autograd)."""
    groups = [[("a", 50), ("b", 7)]]
    snaps = _snapshots(ZERO12, groups, 2, _truth(groups), gas=2)
    want = reshard(snaps, 1).ranks[0]
    d = core.Deferred()
    with d:
        got = reshard(snaps, 1).ranks[0]
    live = torch.nn.Parameter(torch.full_like(want.tensors["opt/master/0"], float("nan")))
    filled = d.fill(got.tensors, {"opt/master/0": live})
    assert filled["opt/master/0"] is live and torch.equal(live.detach(), want.tensors["opt/master/0"])
