"""DeepSpeed's ZeRO partitioning at any data-parallel size, and snapshots re-partitioned by it from D to D' ranks
(the framework-neutral half, plans and copies, is shardsafe.snapshot.reshard).

Where DeepSpeed 0.19 keeps a rank's share (from its source; before anything is computed, the rules are checked
against the layout the snapshot itself recorded at D, so a DeepSpeed that cut differently is refused, not misread):

* ZeRO-1/2 (``DeepSpeedZeroOptimizer``, stage_1_and_2.py): per parameter group one flat buffer: the parameters in
  order, each followed by its ``parameter_alignment`` padding (none by default; these offsets do not depend on D),
  padded at the end to a multiple of 2 x D (``nccl_start_alignment_factor`` x D, ``align_dense_tensors``) and cut
  into D equal partitions: rank r's fp32 master, exp_avg and exp_avg_sq are partition r. ``round_robin_gradients``
  reorders the parameters by D (and DeepSpeed's own fragment map then ignores the order): refused.
* ``BF16_Optimizer`` (bf16, ZeRO-1, fp32 gradient accumulation): the same, without parameter alignment.
* ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): every parameter partitioned by itself, p = ceil(numel / D) elements
  per rank (rank r: elements [r p, (r + 1) p), the last ranks padded); per parameter group, parameters are cut into
  sub-groups once their partitions reach ``sub_group_size`` (``_create_fp16_sub_groups``): the sub-groups, and with
  them the number of flat tensors and their steps, change with D.

What else a target rank gets, by the rules of DeepSpeed's own resume at D' from a universal checkpoint
(``ds_to_universal`` + ``load_universal``; tests/dist/test_ds_reshard_oracle.py compares against it):

* padding elements are zero (a fresh engine's, and what ``load_universal`` leaves there);
* optimizer steps, hyperparameters, LR scheduler, loss scaler, DeepSpeed's CPU Adam beta powers and ``extra``:
  the same on every source rank (checked), carried over; a step per flat tensor is its parameter group's;
* module buffers: data-parallel rank 0's, as a same-size ``load_checkpoint`` gives every rank (DeepSpeed saves rank
  0's module state; its ``load_universal`` skips the module state and would leave buffers, a BatchNorm's running
  statistics, at the program's initial values);
* counters: global_steps, global_samples and skipped_steps unchanged (the global batch is the same: gradient
  accumulation G becomes G' = G x D / D', refused when that is no integer); micro_steps becomes
  micro_steps x D / D', the micro-batches so far counted as a rank at D' counts them (DeepSpeed's checkpoints do
  not carry it: a loaded engine counts from 0). A multiple of G' keeps the accumulation boundaries in place;
* RNG: none. DeepSpeed's checkpoints carry no RNG, so a natively resumed rank runs with what the program seeded at
  start, and so does a re-partitioned one: ``DeepSpeedStateAdapter.apply_resharded`` leaves the RNG alone (a
  program seeding ``seed + rank`` gets per-rank streams by its own rule, at D' as at D). A rank at D' draws for
  other samples than any rank at D did, so no stream of D could be continued anyway.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Mapping, Optional, Sequence

import torch

from shardsafe.snapshot.reshard import (FlatLayout, Read, Reshard, ReshardedRank, Resharder, ReshardError, Run,
                                        Traffic, TransferPlan, assemble, default_colocation, plan, reads_by_plan)

ZERO12, BF16, ZERO3 = "DeepSpeedZeroOptimizer", "BF16_Optimizer", "DeepSpeedZeroOptimizer_Stage3"
NCCL_START_ALIGNMENT = 2   # stage_1_and_2.py and bf16_optimizer.py: nccl_start_alignment_factor
SUB_GROUP_SIZE_DEFAULT = 10 ** 9   # DeepSpeedZeroConfig.sub_group_size
# size-dependent fields of ds_layout.checkpoint_layout, compared with the live engine at D' before applying
SIZED_FIELDS = ("param_shapes", "flat_params", "group_paddings", "param_alignment_paddings", "partition_count",
                "param_slice_mappings", "sub_group_to_group", "seq_dp_world_size")
# meta every source rank must agree on (one step of one run)
SHARED_META = ("engine", "optimizer", "zero_stage", "dp_world_size", "parallel", "param_groups", "lr_scheduler",
               "program_schedulers", "counters", "loss_scaler", "overflow", "base_optimizer", "adam_powers",
               "rng_trackers")
KNOWN_PREFIXES = ("opt/master/", "opt/state/", "module/buffer/", "loss_scaler/", "rng/")


def _numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class DeepSpeedPartitioning:
    """DeepSpeed's layout of one snapshot's optimizer (``meta["ds_checkpoint"]``) at any data-parallel size."""

    def __init__(self, meta: Mapping[str, Any]):
        self.kind = meta.get("optimizer")
        lay = meta.get("ds_checkpoint")
        if lay is None:
            raise ReshardError("the snapshot has no DeepSpeed layout (meta 'ds_checkpoint'; taken by a shardsafe "
                               "before export existed): take a new snapshot with this version")
        if self.kind not in (ZERO12, BF16, ZERO3):
            raise ReshardError(f"the snapshot's optimizer is {self.kind}; re-partitioning supports ZeRO-1/2 "
                               f"({ZERO12}), {BF16} and ZeRO-3 ({ZERO3})")
        self.lay, self.world = lay, int(meta["dp_world_size"])
        zero = (lay.get("ds_config") or {}).get("zero_optimization") or {}
        if zero.get("round_robin_gradients"):
            raise ReshardError("zero_optimization.round_robin_gradients=true orders the parameters by the data-"
                               "parallel size; re-partitioning supports it false (the default)")
        if (meta.get("parallel") or {}).get("experts"):
            raise ReshardError("MoE expert parameters are partitioned over the expert-data-parallel group; "
                               "re-partitioning supports dense models only")
        if int(lay.get("seq_dp_world_size", self.world)) != self.world:
            raise ReshardError(f"sequence parallelism (sequence x data-parallel size {lay.get('seq_dp_world_size')} "
                               f"!= data-parallel size {self.world}) is not supported by re-partitioning")
        shapes = [[(n, list(s)) for n, s in g] for g in lay["param_shapes"]]
        self.shapes = {n: s for g in shapes for n, s in g}
        if self.kind == ZERO3:
            n_groups = len(meta["param_groups"])
            to_group = lay.get("sub_group_to_group")
            if to_group is None:
                if len(shapes) != n_groups:
                    raise ReshardError(f"the ZeRO-3 snapshot has {len(shapes)} sub-groups over {n_groups} parameter "
                                       "groups and predates the sub-group map: take a new snapshot with this version")
                to_group = list(range(n_groups))
            self.sub_group_size = lay.get("sub_group_size", zero.get("sub_group_size", SUB_GROUP_SIZE_DEFAULT))
            # a parameter group's parameters in order = its sub-groups' at D, concatenated
            self.groups: list[list[tuple[str, int, int]]] = [[] for _ in range(n_groups)]
            for j, g in enumerate(shapes):
                self.groups[to_group[j]] += [(n, _numel(s), 0) for n, s in g]
        elif self.kind == ZERO12:
            self.groups = [[(n, int(k), int(o)) for n, o, k in g] for g in lay["flat_params"]]
            if [[n for n, _, _ in g] for g in self.groups] != [[n for n, _ in g] for g in shapes]:
                raise ReshardError("the snapshot's flat parameter order differs from its parameter shapes' order "
                                   "(round-robin ordering?): re-partitioning needs the parameters in group order")
        else:   # BF16_Optimizer: the parameters back to back
            self.groups = []
            for g in shapes:
                at, members = 0, []
                for n, s in g:
                    members.append((n, _numel(s), at))
                    at += _numel(s)
                self.groups.append(members)

    # ---- the layout at a size -----------------------------------------------------------------------------

    def params(self) -> list[tuple[str, int]]:
        return [(n, k) for g in self.groups for n, k, _ in g]

    def _flat_end(self, g: int) -> int:
        """ZeRO-1/2 ``padded_group_numel``: the end of the group's last parameter (alignment padding included)."""
        members = self.groups[g]
        return max((o + k for _, k, o in members), default=0)

    def _partition(self, g: int, world: int) -> int:
        align = NCCL_START_ALIGNMENT * world
        return _ceil_div(self._flat_end(g), align) * align // world

    def sub_groups(self, world: int) -> list[tuple[int, list[tuple[str, int]]]]:
        """ZeRO-3: (parameter group, its parameters) of every sub-group at ``world`` (``_create_fp16_sub_groups``)."""
        out = []
        size = self.sub_group_size
        for g, members in enumerate(self.groups):
            params = [(n, k) for n, k, _ in members]
            parts = [_ceil_div(k, world) for _, k in params]
            if size is None or size >= sum(parts):
                out.append((g, params))
                continue
            cur, acc = [], 0
            for i, (p, part) in enumerate(zip(params, parts)):
                cur.append(p)
                acc += part
                if acc >= size or i == len(params) - 1:
                    out.append((g, cur))
                    cur, acc = [], 0
        return out

    def layout(self, world: int) -> FlatLayout:
        params = self.params()
        index = {n: i for i, (n, _) in enumerate(params)}
        runs: list[list[Run]] = [[] for _ in params]
        if self.kind == ZERO3:
            subs = self.sub_groups(world)
            numels = [[0] * len(subs) for _ in range(world)]
            for j, (_, members) in enumerate(subs):
                off = 0
                for name, k in members:
                    part = _ceil_div(k, world)
                    for r in range(world):
                        length = max(0, min(part, k - r * part))
                        if length:
                            runs[index[name]].append(Run(index[name], r * part, length, r, j, off))
                    off += part
                for r in range(world):
                    numels[r][j] = off
            return FlatLayout(world, params, numels, runs)
        numels = [[0] * len(self.groups) for _ in range(world)]
        for g, members in enumerate(self.groups):
            part = self._partition(g, world)
            for r in range(world):
                numels[r][g] = part
            for name, k, o in members:
                for r in range(o // part, _ceil_div(o + k, part)) if k else ():
                    a, b = max(o, r * part), min(o + k, (r + 1) * part)
                    runs[index[name]].append(Run(index[name], a - o, b - a, r, g, a - r * part))
        return FlatLayout(world, params, numels, runs)

    def tensor_group(self, world: int) -> list[int]:
        """The parameter group of each flat tensor at ``world``."""
        if self.kind == ZERO3:
            return [g for g, _ in self.sub_groups(world)]
        return list(range(len(self.groups)))

    # ---- what the engine records about its layout (ds_layout.checkpoint_layout) at a size and rank ---------

    def sized_fields(self, world: int, rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {"seq_dp_world_size": world}
        if self.kind == ZERO3:
            subs = self.sub_groups(world)
            out.update(param_shapes=[[[n, self.shapes[n]] for n, _ in members] for _, members in subs],
                       sub_group_to_group=[g for g, _ in subs], partition_count=world)
            return out
        out["param_shapes"] = [[[n, self.shapes[n]] for n, _, _ in g] for g in self.groups]
        out["partition_count"] = [world] * len(self.groups)
        if self.kind == BF16:
            return out
        paddings, mappings = [], []
        for g, members in enumerate(self.groups):
            part, end = self._partition(g, world), self._flat_end(g)
            left = rank * part
            paddings.append(part if end <= left else left + part - end if end < left + part else 0)
            mappings.append([[n, min(o + k, left + part) - max(o, left), max(o, left) - left]
                             for n, k, o in members if k and max(o, left) < min(o + k, left + part)])
        out.update(flat_params=[[[n, o, k] for n, k, o in g] for g in self.groups], group_paddings=paddings,
                   param_alignment_paddings=self.lay.get("param_alignment_paddings"), param_slice_mappings=mappings)
        return out


def layout_problems(meta: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """Differences between a re-partitioned state's layout (``meta["ds_checkpoint"]``) and the live engine's
    (``DeepSpeedStateAdapter.checkpoint_layout()``), one sentence each; empty when the engine at D' cuts its
    state exactly where the re-partition put it."""
    lay = meta.get("ds_checkpoint") or {}
    out = []
    for key in SIZED_FIELDS:
        if key in lay and lay[key] != live.get(key):
            out.append(f"the re-partitioned state's {key} differs from this engine's ({str(lay[key])[:200]} vs "
                       f"{str(live.get(key))[:200]}): this engine partitions its ZeRO state differently from DeepSpeed "
                       f"{lay.get('ds_version')}'s rules as shardsafe reads them (another DeepSpeed version or "
                       "zero_optimization setting?); restart at the original data-parallel size")
    return out


def gradient_accumulation(lay: Mapping[str, Any], world: int, new_world: int) -> tuple[int, int]:
    """(G at ``world``, G' at ``new_world``) keeping the global batch; refused when G' is no integer."""
    cfg = lay.get("ds_config") or {}
    g = cfg.get("gradient_accumulation_steps")
    if g is None:
        tbs, mb = cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu")
        if not (tbs and mb):
            raise ReshardError("the DeepSpeed config names neither gradient_accumulation_steps nor train_batch_size "
                               "with train_micro_batch_size_per_gpu: the global batch to keep is unknown")
        g = int(tbs) // (int(mb) * world)
    g = int(g)
    if (g * world) % new_world:
        mb = cfg.get("train_micro_batch_size_per_gpu", "?")
        raise ReshardError(f"the global batch is {g * world} micro-batches of {mb} (gradient_accumulation_steps {g} x "
                           f"data-parallel size {world}), which {new_world} ranks cannot share evenly: the batch "
                           f"would change. Pick a data-parallel size that divides {g * world}, or wait for a spare")
    return g, g * world // new_world


def _check_sources(snapshots: Sequence[Any]) -> None:
    m0 = snapshots[0].meta
    if int(m0.get("dp_world_size", -1)) != len(snapshots):
        raise ReshardError(f"the snapshots were taken at data-parallel size {m0.get('dp_world_size')}, "
                           f"{len(snapshots)} were given: pass the snapshot of every data-parallel rank of one "
                           "model-parallel slice")
    for i, s in enumerate(snapshots[1:], 1):
        for key in SHARED_META:
            if s.meta.get(key) != m0.get(key):
                raise ReshardError(f"data-parallel rank {i}'s snapshot differs from rank 0's in {key!r} "
                                   f"({str(s.meta.get(key))[:120]} vs {str(m0.get(key))[:120]}): they are not one "
                                   "step of one run's slice")
    unknown = sorted(n for n in snapshots[0].tensors if not n.startswith(KNOWN_PREFIXES))
    if unknown:
        raise ReshardError(f"the snapshot holds tensors re-partitioning does not know how to place: {unknown[:5]}")


def _state_kinds(snapshots: Sequence[Any], n_src: int) -> tuple[list[str], list[str]]:
    """(flat state kinds: one element per master element, scalar kinds: one per flat tensor), the same for every
    source flat tensor, or none at all (a snapshot from before the first step)."""
    flat, scalar, seen = set(), set(), None
    for d, s in enumerate(snapshots):
        for t in range(n_src):
            master = s.tensors[f"opt/master/{t}"]
            prefix = f"opt/state/{t}/"
            kinds = {n[len(prefix):]: v for n, v in s.tensors.items() if n.startswith(prefix)}
            kinds_scalar = set((s.meta.get("opt_scalars") or {}).get(str(t), {}))
            if seen is None:
                seen = (set(kinds), kinds_scalar)
            elif seen != (set(kinds), kinds_scalar):
                raise ReshardError(f"data-parallel rank {d} flat tensor {t} has optimizer state {sorted(kinds)} + "
                                   f"{sorted(kinds_scalar)}, others {sorted(seen[0])} + {sorted(seen[1])}")
            for k, v in kinds.items():
                if v.shape == master.shape and v.dim() == 1:
                    flat.add(k)
                elif v.dim() == 0:
                    scalar.add(k)
                else:
                    raise ReshardError(f"optimizer state {k!r} of shape {list(v.shape)} beside a master of "
                                       f"{list(master.shape)}: neither per element nor per tensor")
    return sorted(flat), sorted(scalar)


def _group_value(values: list[tuple[str, Any]], what: str) -> Any:
    """The one value every source flat tensor of a parameter group has for ``what``."""
    (w0, v0) = values[0]
    for w, v in values[1:]:
        same = torch.equal(v, v0) if torch.is_tensor(v) else v == v0
        if not same:
            raise ReshardError(f"{what} differs between {w0} ({v0}) and {w} ({v}) of one parameter group: "
                               "a re-partition cannot decide which one the merged tensor continues with")
    return v0


class DeepSpeedResharder(Resharder):
    """DeepSpeed's rules for shardsafe.snapshot.reshard (``reshard(snaps, new_world, DeepSpeedResharder())``)."""

    engine = "deepspeed"

    def transfer_plan(self, metas: Sequence[Mapping[str, Any]], new_world: int) -> TransferPlan:
        return deepspeed_plan(metas, new_world)

    def reshard(self, snapshots: Sequence[Any], new_world: int, *, ranks: Optional[Sequence[int]] = None,
                colocated: Optional[Mapping[int, Sequence[int]]] = None) -> Reshard:
        return reshard_deepspeed(snapshots, new_world, ranks=ranks, colocated=colocated)

    def reads(self, metas: Sequence[Mapping[str, Any]], entries: Sequence[Sequence[Mapping[str, Any]]],
              new_world: int) -> dict[int, dict[int, list[Read]]]:
        """The plan's pieces of every master and per-element state (what :func:`reshard_deepspeed` assembles), each
        source's per-tensor optimizer state (compared across a parameter group's sources), and data-parallel rank
        0's module buffers and loss scaler (what every target gets)."""
        shapes = [{e["name"]: list(e["shape"]) for e in es} for es in entries]
        master0 = shapes[0].get("opt/master/0")
        kinds = sorted(n[len("opt/state/0/"):] for n, sh in shapes[0].items()
                       if n.startswith("opt/state/0/") and sh == master0 and len(sh) == 1)
        p = deepspeed_plan(metas, new_world)

        def whole(d: int) -> list[str]:
            scalars = [n for n, sh in shapes[d].items() if n.startswith("opt/state/") and not sh]
            return scalars + ([n for n in shapes[0] if n.startswith(("module/buffer/", "loss_scaler/"))] if d == 0
                              else [])
        return reads_by_plan(p, lambda d, t: [f"opt/master/{t}"] + [f"opt/state/{t}/{k}" for k in kinds], whole)


def deepspeed_plan(metas: Sequence[Mapping[str, Any]], new_world: int) -> TransferPlan:
    """The transfer plan from the D snapshots' metadata alone, before any payload is read: what each target rank
    needs from which source rank."""
    if int(metas[0].get("dp_world_size", -1)) != len(metas):
        raise ReshardError(f"the snapshots were taken at data-parallel size {metas[0].get('dp_world_size')}, "
                           f"{len(metas)} metadata were given")
    part = DeepSpeedPartitioning(metas[0])
    gradient_accumulation(part.lay, len(metas), new_world)
    return plan(part.layout(len(metas)), part.layout(new_world))


def reshard_deepspeed(snapshots: Sequence[Any], new_world: int, *, ranks: Optional[Sequence[int]] = None,
                      colocated: Optional[Mapping[int, Sequence[int]]] = None) -> Reshard:
    """The target ranks' states (shardsafe.snapshot.reshard.reshard with DeepSpeed's rules; this module's docstring
    says what each rank gets)."""
    _check_sources(snapshots)
    m0 = snapshots[0].meta
    world = len(snapshots)
    part = DeepSpeedPartitioning(m0)
    src, dst = part.layout(world), part.layout(new_world)
    for r, s in enumerate(snapshots):   # the rules reproduce what the engine recorded at D, rank by rank
        for t, k in enumerate(src.numels[r]):
            have = s.tensors.get(f"opt/master/{t}")
            if have is None or have.numel() != k:
                raise ReshardError(f"data-parallel rank {r}'s master {t} has "
                                   f"{None if have is None else have.numel()} elements, DeepSpeed's rules give {k} at "
                                   f"size {world}: snapshots out of rank order, or DeepSpeed cut differently")
        if f"opt/master/{len(src.numels[r])}" in s.tensors:
            raise ReshardError(f"data-parallel rank {r} has more flat tensors than DeepSpeed's rules give at size "
                               f"{world}: another DeepSpeed, or zero_optimization settings the rules do not know")
        want = part.sized_fields(world, r)
        got = {k: s.meta["ds_checkpoint"].get(k) for k in want if k in s.meta["ds_checkpoint"]}
        diff = [k for k in got if k != "param_alignment_paddings" and got[k] != want[k]]
        if diff:
            raise ReshardError(f"data-parallel rank {r}'s recorded {diff[0]} ({str(got[diff[0]])[:160]}) is not what "
                               f"DeepSpeed's rules give ({str(want[diff[0]])[:160]}): snapshots out of rank order, or "
                               "a DeepSpeed that partitions differently")
    _, g_new = gradient_accumulation(part.lay, world, new_world)
    micro = int(m0["counters"].get("micro_steps", 0))
    if (micro * world) % new_world:
        raise ReshardError(f"micro_steps {micro} x {world} is not divisible by {new_world}: the snapshot is not at an "
                           "accumulation boundary of the global batch")
    p = plan(src, dst)
    flat_kinds, scalar_kinds = _state_kinds(snapshots, len(src.numels[0]))
    src_group, dst_group = part.tensor_group(world), part.tensor_group(new_world)
    where = colocated if colocated is not None else default_colocation(world, new_world)
    targets = list(range(new_world)) if ranks is None else list(ranks)
    out, traffic = [], {}
    replicated = {n: t for n, t in snapshots[0].tensors.items() if n.startswith(("module/buffer/", "loss_scaler/"))}
    # bytes per element moved: the master and every per-element state (fp32 Adam: 4 + 4 + 4)
    elem = [snapshots[0].tensors["opt/master/0"].element_size()] + \
        [snapshots[0].tensors[f"opt/state/0/{k}"].element_size() for k in flat_kinds]
    for r in range(new_world):
        near = set(where.get(r, ()))
        tr = traffic[r] = Traffic(r)
        for s in p.into(r):
            tr.add(s.src_rank, s.length * sum(elem), s.src_rank in near)
        tr.add(0, sum(t.numel() * t.element_size() for t in replicated.values()), 0 in near)
    for r in targets:
        tensors, scalars = _target_tensors(snapshots, p, r, flat_kinds, scalar_kinds, src_group, dst_group)
        tensors.update({n: t.clone() for n, t in replicated.items()})
        out.append(ReshardedRank(r, tensors, _target_meta(m0, part, r, world, new_world, g_new, scalars, tensors)))
    return Reshard(world, new_world, out, p, traffic)


def _target_tensors(snapshots: Sequence[Any], p: TransferPlan, rank: int, flat_kinds: list[str],
                    scalar_kinds: list[str], src_group: list[int], dst_group: list[int]) -> tuple[dict, dict]:
    """Target ``rank``'s flat masters and per-element state assembled by the plan, and its per-tensor state (a
    tensor such as torch Adam's ``step``, or a meta scalar such as FusedAdam's) from its parameter group."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    world = len(snapshots)
    meta_scalars = (snapshots[0].meta.get("opt_scalars") or {}).get("0", {})
    for t, g in enumerate(dst_group):
        for name in ["opt/master/{}"] + ["opt/state/{}/" + k for k in flat_kinds]:
            dtype = snapshots[0].tensors[name.format(0)].dtype
            tensors[name.format(t)] = assemble(p, rank, t, lambda sr, st, n=name: snapshots[sr].tensors[n.format(st)],
                                               dtype=dtype)
        members = [(d, st) for d in range(world) for st, sg in enumerate(src_group) if sg == g]
        for k in scalar_kinds:
            tensors[f"opt/state/{t}/{k}"] = _group_value(
                [(f"rank {d} tensor {st}", snapshots[d].tensors[f"opt/state/{st}/{k}"]) for d, st in members],
                f"optimizer state {k!r}").clone()
        for k in meta_scalars:
            scalars.setdefault(str(t), {})[k] = _group_value(
                [(f"rank {d} tensor {st}", snapshots[d].meta["opt_scalars"][str(st)][k]) for d, st in members],
                f"optimizer scalar {k!r}")
    return tensors, scalars


def _target_meta(m0: Mapping[str, Any], part: DeepSpeedPartitioning, rank: int, world: int, new_world: int,
                 g_new: int, scalars: dict, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    meta = {k: copy.deepcopy(v) for k, v in m0.items() if not k.startswith("rng/")}
    meta["dp_world_size"] = new_world
    counters = dict(meta["counters"])
    counters["micro_steps"] = int(counters.get("micro_steps", 0)) * world // new_world
    meta["counters"] = counters
    meta["opt_scalars"] = scalars
    devices = m0.get("state_devices") or {}

    def device_of(name: str) -> str:
        parts = name.split("/")
        if name.startswith("opt/") and len(parts) >= 3:   # opt/master/T, opt/state/T/KIND: as tensor 0's
            return devices.get("/".join(parts[:2] + ["0"] + parts[3:]), "cpu")
        return devices.get(name, "cpu")
    meta["state_devices"] = {n: device_of(n) for n in tensors}
    lay = dict(meta["ds_checkpoint"])
    lay.update(part.sized_fields(new_world, rank))
    cfg = dict(lay.get("ds_config") or {})
    if "gradient_accumulation_steps" in cfg:
        cfg["gradient_accumulation_steps"] = g_new
    lay["ds_config"] = cfg
    meta["ds_checkpoint"] = lay
    meta["resharded"] = {"from_dp_world_size": world, "gradient_accumulation_steps": g_new, "rng": "program",
                         "buffers_from_dp_rank": 0}
    return meta
