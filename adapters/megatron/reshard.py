"""megatron-core DistributedOptimizer snapshots re-partitioned from D to D' data-parallel ranks (the framework-neutral
half, plans and copies, is shardsafe.snapshot.reshard; Megatron's partitioning rules are in :mod:`.distopt_layout`).

The unit is one model-parallel slice: the D snapshots of the ranks with the same tensor- and pipeline-parallel
coordinates, in data-parallel rank order; TP and PP do not change, so every slice is re-partitioned by itself.
Re-partitioned, element for element (byte copies, no arithmetic): each DistributedOptimizer's fp32 main-parameter
shards and every per-element optimizer state (Adam's exp_avg, exp_avg_sq). What else a rank at D' gets, by the rules
of Megatron's own resharded resume (``dist_checkpointing`` with the ``fully_reshardable`` DistributedOptimizer
format, save at D, load at D'; tests/dist/test_megatron_reshard_oracle.py compares against it):

* per-parameter scalar state (torch Adam's ``step``) and the parameter groups' hyperparameters (lr, weight decay,
  TE/Apex FusedAdam's ``step``): the same on every source rank (checked), carried over -- Megatron saves them once,
  in the optimizer's param_groups;
* the LR scheduler, the iteration and the loop counters (consumed samples): unchanged. The global batch is kept,
  so Megatron's number of micro-batches grows from G to G x D / D' (``global_batch_size / (micro_batch_size x
  D')``; refused when that is no integer) and the sequence of samples is the run's own;
* the RNGs (torch, python, numpy, Megatron's RNG tracker): data-parallel rank 0's of the slice, which is what
  Megatron-LM's load gives every rank (it saves one RNG state per (PP, TP) coordinate and loads ``rng_state[0]``);
  with ``--data-parallel-random-init`` it loads ``rng_state[dp_rank]``: target r gets source r's
  (``MegatronResharder(data_parallel_random_init=True)``; growing past D is refused there, as Megatron cannot);
* persistent module buffers, the ``extra`` dict and the grad scaler (fp16): data-parallel rank 0's (buffers and the
  scaler are identical on every data-parallel rank; ``extra`` is user state and is documented as rank 0's);
* the low-precision model parameters are not part of a snapshot: ``apply`` re-derives them from the fp32 shards and
  all-gathers them over the new data-parallel group, exactly as after an optimizer step.

Not supported (refused, naming the setting): MoE expert parameters (sharded over the expert-data-parallel group),
context parallelism, ``num_distributed_optimizer_instances > 1``, FP8 / precision-aware optimizers, and optimizers
other than DistributedOptimizer (non-distributed ones keep full replicas: restart at the same size instead).
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Optional, Sequence

import torch

from shardsafe.errors import ConfigError
from shardsafe.snapshot.reshard import (FlatLayout, Read, Reshard, ReshardedRank, Resharder, ReshardError, Run,
                                        Traffic, TransferPlan, assemble, default_colocation, plan, reads_by_plan)

from . import distopt_layout as dl
from .state_checks import FORMAT, batch_record

ENGINE = "megatron"
_SUPPORTED_DTYPES = ("torch.float32",) + dl.FP16_DTYPES
_WORLD_FIELDS = ("rank", "world_size", "dp_ranks", "tp_ranks", "pp_ranks", "edp_ranks")   # the old job's world ranks
_SHARED = ("format", "iteration", "counters", "scheduler", "batch")   # one step of one run: equal on every source


class MegatronResharder(Resharder):
    """Megatron's rules for shardsafe.snapshot.reshard (``reshard(snaps, new_world, MegatronResharder())``).

    Args:
        global_batch_size / micro_batch_size: the run's batch, when the snapshots do not carry it (meta ``batch``,
            recorded when Megatron's num-microbatches calculator is initialised, as in Megatron-LM's loop).
        data_parallel_random_init: the run used ``--data-parallel-random-init`` (per-rank RNG streams).
    """

    engine = ENGINE

    def __init__(self, *, global_batch_size: Optional[int] = None, micro_batch_size: Optional[int] = None,
                 data_parallel_random_init: bool = False) -> None:
        if (global_batch_size is None) != (micro_batch_size is None):
            raise ConfigError("MegatronResharder: pass global_batch_size and micro_batch_size together, or neither "
                              "(then the snapshots' recorded batch is used)")
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.data_parallel_random_init = data_parallel_random_init

    def batch(self, meta: Mapping[str, Any], world: int, new_world: int) -> tuple[int, int]:
        """(micro-batches per rank at ``world``, at ``new_world``) keeping the global batch; refused when the
        global batch does not split into whole micro-batches over ``new_world`` ranks."""
        rec = meta.get("batch") or {}
        gbs = self.global_batch_size if self.global_batch_size is not None else rec.get("global_batch_size")
        mbs = self.micro_batch_size if self.micro_batch_size is not None else rec.get("micro_batch_size")
        if gbs is None or mbs is None:
            raise ReshardError("the snapshots do not record the global batch (Megatron's num-microbatches calculator "
                               "was not initialised) and none was given: pass MegatronResharder(global_batch_size=..., "
                               "micro_batch_size=...)")
        gbs, mbs = int(gbs), int(mbs)
        if gbs % (mbs * world):
            raise ReshardError(f"the global batch {gbs} is no multiple of micro-batch {mbs} x data-parallel size "
                               f"{world}: the batch given is not the one the snapshots were trained with")
        if gbs % (mbs * new_world):
            raise ReshardError(f"the global batch {gbs} (micro-batch {mbs}) cannot be shared evenly by {new_world} "
                               f"data-parallel ranks: the batch would change. Pick a data-parallel size that divides "
                               f"{gbs // mbs}, or wait for a spare node")
        return gbs // (mbs * world), gbs // (mbs * new_world)

    def transfer_plan(self, metas: Sequence[Mapping[str, Any]], new_world: int) -> TransferPlan:
        part = _Partitioning(metas)
        self.batch(metas[0], len(metas), new_world)
        return plan(part.layout(len(metas))[0], part.layout(new_world)[0])

    def reshard(self, snapshots: Sequence[Any], new_world: int, *, ranks: Optional[Sequence[int]] = None,
                colocated: Optional[Mapping[int, Sequence[int]]] = None) -> Reshard:
        return _reshard(self, snapshots, new_world, ranks, colocated)

    def reads(self, metas: Sequence[Mapping[str, Any]], entries: Sequence[Sequence[Mapping[str, Any]]],
              new_world: int) -> dict[int, dict[int, list[Read]]]:
        """The plan's pieces of every shard's main parameters and per-element optimizer state (what :func:`_reshard`
        assembles), and every other tensor of every source whole: the per-shard scalars and group hyperparameters
        are compared across the sources (their donors vary by group), the buffers, RNG and scaler are rank 0's (or
        each source's RNG with data_parallel_random_init). Those are small; the shards are the state."""
        part = _Partitioning(metas)
        self.batch(metas[0], len(metas), new_world)
        src, orders = part.layout(len(metas))
        p = plan(src, part.layout(new_world)[0])
        shapes = [{e["name"]: list(e["shape"]) for e in es} for es in entries]

        def name(d: int, t: int, kind: str) -> str:
            return "opt{}/g{}/p{}/{}".format(*orders[d][t][:3], kind)

        per_elem = ["param"]
        if orders[0]:
            li, gi, pi, *_ = orders[0][0]
            pm0 = metas[0]["optimizers"][li]["groups"][gi]["params"][pi]
            per_elem += [k for k in pm0["state"] if k not in pm0["state_meta"] and len(shapes[0][name(0, 0, k)]) == 1]
        flat = [{name(d, t, k) for t in range(len(orders[d])) for k in per_elem} for d in range(len(metas))]
        return reads_by_plan(p, lambda d, t: [name(d, t, k) for k in per_elem],
                             lambda d: [n for n in shapes[d] if n not in flat[d]])


class _Partitioning:
    """The DistributedOptimizers of one slice's D snapshots, checked: their recorded layouts follow Megatron's rules,
    and each rank's optimizer groups hold exactly the shards the rules give it."""

    def __init__(self, metas: Sequence[Mapping[str, Any]]):
        self.world = len(metas)
        m0 = metas[0]
        if m0.get("format") != FORMAT:
            raise ReshardError(f"snapshot format {m0.get('format')!r} is not {FORMAT!r}: written by another shardsafe")
        coords = m0.get("coords") or {}
        if int(coords.get("dp_size", -1)) != self.world:
            raise ReshardError(f"the snapshots were taken at data-parallel size {coords.get('dp_size')}, {self.world} "
                               "were given: pass the snapshot of every data-parallel rank of one model-parallel slice")
        for k, what in (("cp_size", "context parallelism"), ("ep_size", "expert parallelism")):
            if int(coords.get(k, 1)) != 1:
                raise ReshardError(f"{what} ({k} {coords.get(k)}) is not supported by re-partitioning: restart at the "
                                   "original data-parallel size, or wait for a spare node")
        for d, m in enumerate(metas):
            c = m.get("coords") or {}
            if int(c.get("dp", -1)) != d or any(c.get(k) != coords.get(k) for k in ("tp", "tp_size", "pp", "pp_size")):
                raise ReshardError(f"snapshot {d} is of data-parallel rank {c.get('dp')} at (tp {c.get('tp')}, pp "
                                   f"{c.get('pp')}), expected rank {d} of the slice (tp {coords.get('tp')}, pp "
                                   f"{coords.get('pp')}): pass one slice's snapshots in data-parallel rank order")
            if m.get("fp8"):
                raise ReshardError("the snapshots hold TE FP8 scaling state, which re-partitioning does not support")
        self.leaves: list[tuple[int, dict, dict[str, int], int]] = []   # (li, record, group of param, groups)
        for li, om in enumerate(m0["optimizers"]):
            if om["type"] != "DistributedOptimizer":
                raise ReshardError(f"optimizer {li} is a {om['type']}, which keeps a full replica on every data-"
                                   "parallel rank; re-partitioning supports DistributedOptimizer "
                                   "(--use-distributed-optimizer)")
            if om.get("stub"):
                continue
            rec = om.get("distopt")
            if rec is None:
                raise ReshardError("the snapshot does not record the DistributedOptimizer's buffer layout (taken by a "
                                   "shardsafe before re-partitioning existed): restart at the original size")
            self._check_leaf(li, rec, metas)
            group_of: dict[str, int] = {}
            for d, m in enumerate(metas):
                for gi, gm in enumerate(m["optimizers"][li]["groups"]):
                    for pm in gm["params"]:
                        if group_of.setdefault(pm["name"], gi) != gi:
                            raise ReshardError(f"parameter {pm['name']} is in optimizer group {gi} on data-parallel "
                                               f"rank {d} and group {group_of[pm['name']]} on another")
            n_groups = len(om["groups"])
            for d, m in enumerate(metas):
                want = dl.rank_order(rec, group_of, n_groups, self.world, d)
                got = [[(pm["name"], *pm["range"]) for pm in gm["params"]] for gm in m["optimizers"][li]["groups"]]
                if want != got:
                    g = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
                    raise ReshardError(f"data-parallel rank {d}, optimizer {li} group {g}: the snapshot holds "
                                       f"{got[g][:3]}..., megatron-core's rules as shardsafe reads them give "
                                       f"{want[g][:3]}...: this megatron-core shards differently (tested: 0.16.1, "
                                       "0.17.1); restart at the original data-parallel size")
            self.leaves.append((li, rec, group_of, n_groups))

    def _check_leaf(self, li: int, rec: Mapping[str, Any], metas: Sequence[Mapping[str, Any]]) -> None:
        if int(rec.get("instances", 1)) != 1:
            raise ReshardError(f"optimizer {li}: num_distributed_optimizer_instances={rec['instances']} is not "
                               "supported by re-partitioning")
        for buf in rec["buffers"]:
            if buf.get("expert"):
                raise ReshardError(f"optimizer {li} shards MoE expert parameters over the expert-data-parallel group, "
                                   "which re-partitioning does not support")
            if buf["param_dtype"] not in _SUPPORTED_DTYPES:
                raise ReshardError(f"optimizer {li} has a {buf['param_dtype']} parameter buffer (FP8?); "
                                   f"re-partitioning supports {', '.join(_SUPPORTED_DTYPES)}")
        for d, m in enumerate(metas):
            r = m["optimizers"][li].get("distopt") or {}
            if (r.get("dp_size"), r.get("dp_rank")) != (self.world, d) or r.get("buffers") != rec["buffers"]:
                same = "the same" if r.get("buffers") == rec["buffers"] else "another"
                raise ReshardError(f"optimizer {li}: snapshot {d} records data-parallel rank {r.get('dp_rank')} of "
                                   f"{r.get('dp_size')} and {same} buffer layout; expected rank {d} of {self.world} "
                                   "of one run")
        try:
            dl.check_record(rec)
        except dl.LayoutError as e:
            raise ReshardError(f"optimizer {li}: {e}") from None

    def params(self) -> list[tuple[str, int]]:
        return [(f"{li}/{p[0]}", int(p[1])) for li, rec, _, _ in self.leaves for buf in rec["buffers"]
                for p in buf["params"]]

    def order(self, world: int, rank: int) -> list[tuple[int, int, int, str, int, int]]:
        """Rank ``rank``'s shards at ``world`` in tensor order: (leaf, group, index in group, name, first, end)."""
        out = []
        for li, rec, group_of, n_groups in self.leaves:
            for gi, group in enumerate(dl.rank_order(rec, group_of, n_groups, world, rank)):
                out.extend((li, gi, pi, name, a, b) for pi, (name, a, b) in enumerate(group))
        return out

    def layout(self, world: int) -> tuple[FlatLayout, list[list[tuple[int, int, int, str, int, int]]]]:
        """The flat layout at ``world`` (one flat tensor per shard) and each rank's shards in tensor order."""
        params = self.params()
        index = {n: i for i, (n, _) in enumerate(params)}
        runs: list[list[Run]] = [[] for _ in params]
        orders = [self.order(world, r) for r in range(world)]
        numels = []
        for r, order in enumerate(orders):
            numels.append([b - a for *_, a, b in order])
            for t, (li, _, _, name, a, b) in enumerate(order):
                i = index[f"{li}/{name}"]
                runs[i].append(Run(i, a, b - a, r, t, 0))
        for rs in runs:
            rs.sort(key=lambda run: run.start)
        return FlatLayout(world, params, numels, runs), orders

    def target_record(self, li: int, new_world: int, rank: int) -> dict[str, Any]:
        """The ``distopt`` record a DistributedOptimizer at ``new_world`` ranks has on ``rank``."""
        rec = next(r for i, r, _, _ in self.leaves if i == li)
        out = {**copy.deepcopy(rec), "dp_size": new_world, "dp_rank": rank}
        for buf in out["buffers"]:
            lay = dl.layout_of(buf, self.world, new_world)
            buf["bucket_size"] = dl.bucket_size_at(buf.get("bucket_size"), self.world, new_world)
            buf["starts"] = list(lay.starts)
            buf["buckets"] = [[b.offset, b.numel, b.numel_unpadded] for b in lay.buckets]
        return out


def _check_shared(snapshots: Sequence[Any]) -> dict[tuple[int, int], int]:
    """Refuse snapshots that are not one step of one run; return, per (optimizer, group), the source rank whose
    hyperparameters every target takes: the first that holds a shard of the group. TE/Apex FusedAdam does not
    advance a group's ``step`` on a rank where the group is empty, and Megatron's checkpoint aligns every group's
    step to the optimizer's; so ``step`` is compared only between ranks holding shards of the group."""
    m0 = snapshots[0].meta
    for d, s in enumerate(snapshots[1:], 1):
        for k in _SHARED:
            if s.meta.get(k) != m0.get(k):
                raise ReshardError(f"data-parallel rank {d}'s snapshot differs from rank 0's in {k!r} "
                                   f"({str(s.meta.get(k))[:120]} vs {str(m0.get(k))[:120]}): they are not one step of "
                                   "one run's slice")
    donors = {}
    for li, om0 in enumerate(m0["optimizers"]):
        for gi in range(len(om0["groups"])):
            groups = [s.meta["optimizers"][li]["groups"][gi] for s in snapshots]
            donor = next((d for d, gm in enumerate(groups) if gm["params"]), 0)
            donors[(li, gi)] = donor

            def values(d: int, with_step: bool) -> tuple:
                gm = groups[d]
                hp = {k: v for k, v in gm["hparams"].items() if with_step or k != "step"}
                ts = [snapshots[d].tensors[f"opt{li}/g{gi}/hp/{k}"] for k in gm["hparam_tensors"]
                      if with_step or k != "step"]
                return hp, [k for k in gm["hparam_tensors"] if with_step or k != "step"], ts

            for d in range(len(snapshots)):
                with_step = bool(groups[d]["params"]) and bool(groups[donor]["params"])
                (hp, keys, ts), (hp0, keys0, ts0) = values(d, with_step), values(donor, with_step)
                if hp != hp0 or keys != keys0 or any(not torch.equal(a, b) for a, b in zip(ts, ts0)):
                    raise ReshardError(f"optimizer {li} group {gi}'s hyperparameters differ between data-parallel "
                                       f"ranks {donor} and {d}: a re-partition cannot decide which to continue with")
    return donors


def _rng_source(res: MegatronResharder, snapshots: Sequence[Any], rank: int) -> int:
    """The source rank whose RNGs target ``rank`` continues with (module docstring)."""
    if not res.data_parallel_random_init:
        return 0
    if rank >= len(snapshots):
        raise ReshardError(f"with --data-parallel-random-init every rank has its own RNG streams and target rank {rank}"
                           f" has no source rank among {len(snapshots)} (Megatron's own load fails there too): grow "
                           "only with MegatronResharder(data_parallel_random_init=False) semantics, or restart")
    return rank


def _reshard(res: MegatronResharder, snapshots: Sequence[Any], new_world: int, ranks: Optional[Sequence[int]],
             colocated: Optional[Mapping[int, Sequence[int]]]) -> Reshard:
    world = len(snapshots)
    part = _Partitioning([s.meta for s in snapshots])
    donors = _check_shared(snapshots)
    g_old, g_new = res.batch(snapshots[0].meta, world, new_world)
    src, src_orders = part.layout(world)
    dst, dst_orders = part.layout(new_world)
    p = plan(src, dst)

    def pm_of(d: int, t: int) -> Mapping[str, Any]:
        li, gi, pi, *_ = src_orders[d][t]
        return snapshots[d].meta["optimizers"][li]["groups"][gi]["params"][pi]

    def name_of(order: Sequence[tuple], t: int, kind: str) -> str:
        li, gi, pi, *_ = order[t]
        return f"opt{li}/g{gi}/p{pi}/{kind}"

    kinds0 = pm_of(0, 0)["state"] if src_orders[0] else []
    per_elem = ["param"] + [k for k in kinds0 if k not in pm_of(0, 0)["state_meta"]
                            and snapshots[0].tensors[name_of(src_orders[0], 0, k)].dim() == 1]
    for d in range(world):
        for t in range(len(src_orders[d])):
            pm = pm_of(d, t)
            if pm["state"] != kinds0:
                raise ReshardError(f"data-parallel rank {d} shard {pm['name']} has optimizer state {pm['state']}, "
                                   f"others {kinds0}: not one step of one optimizer")
    elem_bytes = sum(snapshots[0].tensors[name_of(src_orders[0], 0, k)].element_size() for k in per_elem) \
        if src_orders[0] else 0
    where = colocated if colocated is not None else default_colocation(world, new_world)
    replicated = [n for n in snapshots[0].tensors if n.startswith(("buf/", "extra/", "rng/")) or "/grad_scaler/" in n]
    hparam_bytes = sum(t.numel() * t.element_size() for n, t in snapshots[0].tensors.items() if "/hp/" in n)
    nbytes = {n: t.numel() * t.element_size() for n, t in snapshots[0].tensors.items()}
    # per-shard scalars (torch Adam's step) come with the shard's first piece
    scalar_bytes = sum(nbytes[name_of(src_orders[0], 0, k)] for k in kinds0
                       if k not in per_elem and k not in pm_of(0, 0)["state_meta"]) if src_orders[0] else 0
    traffic = {}
    for r in range(new_world):
        near = set(where.get(r, ()))
        tr = traffic[r] = Traffic(r)
        for s in p.into(r):
            tr.add(s.src_rank, s.length * elem_bytes, s.src_rank in near)
        for t in range(len(dst_orders[r])):
            first = p.into(r, t)[0].src_rank
            tr.add(first, scalar_bytes, first in near)
        for n in replicated:   # data-parallel rank 0's (the RNG: its own source's with data_parallel_random_init)
            src_rank = r if n.startswith("rng/") and res.data_parallel_random_init else 0
            tr.add(src_rank, nbytes[n], src_rank in near)
        tr.add(0, hparam_bytes, 0 in near)
    out = []
    for r in (range(new_world) if ranks is None else ranks):
        if not 0 <= r < new_world:
            raise ReshardError(f"target rank {r} is not among the {new_world} data-parallel ranks")
        out.append(_target(res, part, snapshots, p, src_orders, dst_orders[r], r, new_world, per_elem, kinds0,
                           replicated, (g_old, g_new), donors))
    return Reshard(world, new_world, out, p, traffic)


def _target(res: MegatronResharder, part: _Partitioning, snapshots: Sequence[Any], p: TransferPlan,
            src_orders: list, order: list, rank: int, new_world: int, per_elem: list[str], kinds: list[str],
            replicated: list[str], microbatches: tuple[int, int], donors: Mapping[tuple[int, int], int]
            ) -> ReshardedRank:
    world = len(snapshots)
    m0 = snapshots[0].meta
    tensors: dict[str, torch.Tensor] = {}
    meta = copy.deepcopy(m0)
    for li, om in enumerate(meta["optimizers"]):
        for gi, gm in enumerate(om["groups"]):
            donor = snapshots[donors.get((li, gi), 0)]
            gm.update(copy.deepcopy(donor.meta["optimizers"][li]["groups"][gi]), params=[])
            for k in gm["hparam_tensors"]:
                tensors[f"opt{li}/g{gi}/hp/{k}"] = donor.tensors[f"opt{li}/g{gi}/hp/{k}"].clone()
    for t, (li, gi, pi, name, a, b) in enumerate(order):
        pre = f"opt{li}/g{gi}/p{pi}"
        segs = p.into(rank, t)
        for k in per_elem:
            src_name = lambda sr, st, k=k: snapshots[sr].tensors[  # noqa: E731
                "opt{}/g{}/p{}/{}".format(*src_orders[sr][st][:3], k)]
            dtype = src_name(segs[0].src_rank, segs[0].src_tensor).dtype
            tensors[f"{pre}/{k}"] = assemble(p, rank, t, src_name, dtype=dtype)
        pieces = [(s.src_rank, s.src_tensor) for s in segs]
        state_meta = {}
        for k in kinds:
            if k in per_elem:
                continue
            values = [(d, st, snapshots[d].meta["optimizers"][src_orders[d][st][0]]["groups"][src_orders[d][st][1]]
                       ["params"][src_orders[d][st][2]]) for d, st in pieces]
            if k in values[0][2]["state_meta"]:
                vs = [v["state_meta"][k] for _, _, v in values]
                if any(v != vs[0] for v in vs):
                    raise ReshardError(f"{name}: optimizer state {k!r} differs between its source shards {vs}")
                state_meta[k] = vs[0]
                continue
            ts = [snapshots[d].tensors["opt{}/g{}/p{}/{}".format(*src_orders[d][st][:3], k)] for d, st in pieces]
            if any(x.shape != ts[0].shape or not torch.equal(x, ts[0]) for x in ts):
                raise ReshardError(f"{name}: optimizer state {k!r} differs between its source shards "
                                   f"({[x.tolist() for x in ts][:4]}): a merged shard cannot continue with both")
            tensors[f"{pre}/{k}"] = ts[0].clone()
        meta["optimizers"][li]["groups"][gi]["params"].append(
            {"name": name, "shape": [b - a], "range": [a, b], "state": list(kinds), "state_meta": state_meta})
    rng_from = _rng_source(res, snapshots, rank)
    for n in replicated:
        tensors[n] = (snapshots[rng_from] if n.startswith("rng/") else snapshots[0]).tensors[n].clone()
    meta["rng"] = copy.deepcopy(snapshots[rng_from].meta.get("rng"))
    coords = {k: v for k, v in (m0.get("coords") or {}).items() if k not in _WORLD_FIELDS}
    coords.update(dp=rank, dp_size=new_world)
    meta["coords"] = coords
    for li, *_ in part.leaves:
        meta["optimizers"][li]["distopt"] = part.target_record(li, new_world, rank)
    if meta.get("batch"):
        meta["batch"] = {**meta["batch"], "num_microbatches": microbatches[1]}
    meta["resharded"] = {"from_dp_world_size": world, "num_microbatches": list(microbatches),
                         "rng_from_dp_rank": rng_from, "buffers_from_dp_rank": 0, "extra_from_dp_rank": 0}
    return ReshardedRank(rank, tensors, meta)


# ---- the live side: MegatronStateAdapter.resharder() / apply_resharded() ------------------------------------

def layout_problems(adapter: Any, meta: Mapping[str, Any]) -> list[str]:
    """Differences between a re-partitioned state's DistributedOptimizer layouts and batch and the live ones, one
    sentence each; empty when this optimizer at D' cuts its state exactly where the re-partition put it."""
    out = []
    for li, om in enumerate(meta.get("optimizers") or []):
        if "distopt" not in om or li >= len(adapter.leaves):
            continue
        live = dl.record(adapter.leaves[li], adapter.model_chunks, adapter._param_names)
        if live != om["distopt"]:
            diff = next((k for k in ("dp_size", "dp_rank", "instances") if live.get(k) != om["distopt"].get(k)),
                        "buffers")
            out.append(f"optimizer {li}: the re-partitioned state's {diff} ({str(om['distopt'].get(diff))[:200]}) "
                       f"differs from this DistributedOptimizer's ({str(live.get(diff))[:200]}): it partitions its "
                       "state differently from megatron-core's rules as shardsafe reads them (another megatron-core "
                       "or DDP setting such as --ddp-bucket-size?); restart at the original data-parallel size")
    want, live = (meta.get("batch") or {}).get("num_microbatches"), (batch_record() or {}).get("num_microbatches")
    if want is not None and live is not None and want != live:
        out.append(f"this run computes {live} micro-batches per step, the re-partitioned state continues the global "
                   f"batch {meta['batch'].get('global_batch_size')} with {want}: keep --global-batch-size and "
                   "--micro-batch-size unchanged")
    return out


class ReshardingMixin:
    """``resharder()`` / ``apply_resharded()`` of :class:`~.state.MegatronStateAdapter`, which it is mixed into (it
    reads the adapter's ``leaves``, ``model_chunks``, ``_param_names`` and calls its ``apply``)."""

    @staticmethod
    def resharder(**kwargs: Any) -> MegatronResharder:
        """Megatron's re-partitioning rules, for shardsafe.snapshot.reshard (keyword arguments: MegatronResharder)."""
        return MegatronResharder(**kwargs)

    def resharded_problems(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> list[str]:
        """Why :meth:`apply_resharded` would refuse this state (empty: it fits): the restore votes on it on every rank
        before any applies, so a layout or batch that does not fit refuses the version everywhere, not on one rank
        after others applied."""
        if "resharded" not in meta:
            return ["the state given to apply_resharded was not re-partitioned (no 'resharded' in its meta): use apply"]
        return layout_problems(self, meta) + list(self.validate(tensors, meta))  # type: ignore[attr-defined]

    def apply_resharded(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """A state re-partitioned to this job's data-parallel size from snapshots taken at another one: refused
        unless every DistributedOptimizer here cuts its state exactly where the re-partition put it (and the loop
        runs the re-partition's number of micro-batches, when Megatron's calculator says), then applied as a
        snapshot is (collective, like ``apply``)."""
        problems = layout_problems(self, meta) if "resharded" in meta else \
            ["the state given to apply_resharded was not re-partitioned (no 'resharded' in its meta): use apply"]
        if problems:
            raise ConfigError("; ".join(problems))
        self.apply(tensors, meta)  # type: ignore[attr-defined]
