"""TOR at cluster scale, the closed form: per failure class, per strategy, at the optimal interval (docs/tor.md).

For a strategy with snapshot interval tau (productive seconds) and stall C per snapshot, each failure class c
arrives at the job rate Lambda_c = N x rate_c and costs D_c seconds of wall time per event (recovery steps,
replacement wait, lost work, fail-slow slowdown). To first order in Lambda x D:

    TOR = (1 - sum_c Lambda_c D_c) x tau / (tau + C)                                            (P)

which is equation (M) of the single-run model with the failure term split by class. The breakdown of
``T_obs - T_opt`` over ``T_obs``: class c takes Lambda_c D_c, snapshot stalls take (1 - sum) C / (tau + C);
with TOR they sum to 1 exactly. (P) neglects failures during a recovery and assumes Lambda_c D_c << 1: where
the MTBF approaches the recovery time it is too optimistic, and :mod:`.simulate` gives the value to use.

Four strategies: ``shardsafe`` (holder memory + parity m, persistent tier behind; a node loss with no idle spare
waits for a replacement), ``shardsafe_shrink`` (the same, but a node loss with no idle spare continues at a
smaller data-parallel size and grows back when the replacement arrives: :mod:`.shrink`), ``memory_only`` (m = 0:
every node loss goes to the persistent tier) and ``disk`` (synchronous disk checkpoints at their own optimal
interval; every failure loads one). The last two wait for a spare, as every system without in-memory resharding
must.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .classes import CLASSES, Cluster, Costs, Rates
from .errors import TorError
from .recovery import (PARTS, ClassCost, _recovery_parts, away_distribution, flush_every, node_loss_rate, p_beyond_m,
                       p_no_spare)
from .shrink import shrink_class_costs, shrink_info

__all__ = ["STRATEGIES", "PARITY_STRATEGIES", "PARTS", "policy_of", "ClassCost", "Projection", "node_loss_rate",
           "away_distribution", "p_no_spare", "p_beyond_m", "class_costs", "flush_every", "tor_at", "project", "optimal_interval", "at_scale", "sweep", "recommend",
           "DEFAULT_SWEEP_GPUS", "FIRST_ORDER_LIMIT", "first_order_note", "break_note", "closed_point",
           "DEFAULT_SIM_REPLICAS", "SIM_FAILURES_PER_REPLICA"]

STRATEGIES = ("shardsafe", "shardsafe_shrink", "memory_only", "disk")
# The strategies with parity m (the others have none).
PARITY_STRATEGIES = ("shardsafe", "shardsafe_shrink")
DEFAULT_SWEEP_GPUS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 100000)
_TAU_MIN_S, _TAU_MAX_S = 1.0, 30 * 86400.0
# Beyond this share of the wall time taken by failures, (P) is off by more than ~0.01 TOR (measured against the
# simulator, docs/tor.md "Closed form against the simulator"): the projection notes it, and the report
# (:mod:`.projection_report`) replaces (P) by the simulator's value there.
FIRST_ORDER_LIMIT = 0.1
DEFAULT_SIM_REPLICAS = 16
"""Replicas per simulated point of ``tor project`` (``--sim-replicas``): the default 8-scale sweep simulates its
points past the limit in seconds, not minutes; the CI shrinks as 1/sqrt(replicas)."""
SIM_FAILURES_PER_REPLICA = 400
"""The horizon of a simulated point: whole days holding about this many job failures per replica (so every
point costs about the same and its CI stays a few 0.001 TOR), and at least 4 x ``repair_h``."""


@dataclass(kw_only=True)
class Projection:
    """TOR of one strategy on one cluster, with its breakdown (fractions of T_obs that sum to 1 - TOR)."""

    strategy: str
    gpus: int
    nodes: int
    parity_m: int
    spares: int
    interval_s: float
    stall_s: float
    young_interval_s: float
    persist_interval_s: float | None
    mtbf_s: float
    tor: float
    stall_fraction: float
    classes: dict[str, ClassCost] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    shrink: dict[str, Any] | None = None
    """Shrink policy: the sizes it shrinks to and its degraded shares (:func:`shardsafe.tor.shrink.shrink_info`)."""

    @property
    def failure_fraction(self) -> float:
        """Share of T_obs the failures take to first order: sum_c Lambda_c D_c (> 1 when they eat it all)."""
        return math.fsum(cc.fraction for cc in self.classes.values())

    @property
    def second_order(self) -> float:
        """What (P) neglects, to second order: F^2/2 for failures taking F of the wall time (one failing during
        another's recovery), plus, under the shrink policy, W x L for W of the wall time at reduced size losing
        L of it (a loss while degraded is charged the reduced throughput again)."""
        extra = 0.0
        if self.shrink:
            extra = self.shrink["degraded_wall_fraction"] * self.shrink["degraded_fraction"]
        return self.failure_fraction ** 2 / 2.0 + extra

    @property
    def first_order_ok(self) -> bool:
        """Whether (P) holds here to ~0.01 TOR: what it neglects stays within what failures taking
        :data:`FIRST_ORDER_LIMIT` of the wall time leave out (so, without the shrink policy: failures take at most
        that share)."""
        return self.failure_fraction <= FIRST_ORDER_LIMIT and self.second_order <= FIRST_ORDER_LIMIT ** 2 / 2.0

    @property
    def tor_upper_bound(self) -> float:
        """A cheap optimistic TOR where (P) breaks: tau/(tau+C) / (1 + sum Lambda D). A failure during a recovery
        costs less than (P) charges, but every failure that lands while the job runs costs at least D_c, and
        those arrive at Lambda x (share of time running): running <= 1 / (1 + Lambda D). Used to skip
        simulating points that cannot reach a target; not a value to report."""
        return self.interval_s / (self.interval_s + self.stall_s) / (1.0 + max(0.0, self.failure_fraction))

    def breakdown(self) -> dict[str, float]:
        """Fractions of T_obs: per class, plus ``snapshot_stall``; sums to ``1 - tor`` (before clamping at 0)."""
        out = {c: cc.fraction for c, cc in self.classes.items()}
        out["snapshot_stall"] = self.stall_fraction
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy, "gpus": self.gpus, "nodes": self.nodes, "parity_m": self.parity_m,
            "spares": self.spares, "interval_s": self.interval_s, "stall_s": self.stall_s,
            "young_interval_s": self.young_interval_s, "persist_interval_s": self.persist_interval_s,
            "mtbf_s": self.mtbf_s, "tor": self.tor, "failure_fraction": self.failure_fraction,
            "breakdown": self.breakdown(), "policy": "shrink" if self.strategy == "shardsafe_shrink" else "spares",
            "classes": {c: {"per_hour": cc.per_hour, "tiers": cc.tiers, "seconds_per_event": cc.seconds,
                            "parts_s": cc.parts, "fraction": cc.fraction, "p_no_spare": cc.p_no_spare,
                            "p_beyond_m": cc.p_beyond_m, "p_shrink": cc.p_shrink,
                            "degraded_wall_s": cc.degraded_wall_s} for c, cc in self.classes.items()},
            "notes": list(self.notes), "shrink": self.shrink,
        }


def _mix(paths: Sequence[tuple[float, dict[str, float]]]) -> dict[str, float]:
    return {p: math.fsum(w * parts[p] for w, parts in paths) for p in PARTS}


def class_costs(strategy: str, cluster: Cluster, rates: Rates, costs: Costs, *, interval_s: float,
                stall_s: float) -> dict[str, ClassCost]:
    """Expected cost of one event of each class under ``strategy`` at snapshot interval ``interval_s`` (for
    ``disk``: the checkpoint interval) with ``stall_s`` per snapshot (docs/tor.md, table of recovery paths)."""
    if strategy not in STRATEGIES:
        raise TorError(f"strategy={strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if strategy == "shardsafe_shrink":
        return shrink_class_costs(cluster, rates, costs, interval_s=interval_s, stall_s=stall_s)
    tau, c = interval_s, stall_s
    lost_snap = (tau + c) / 2.0                      # wall time since the last committed snapshot, on average
    m = cluster.parity_m if strategy == "shardsafe" else 0
    cl = dataclasses.replace(cluster, parity_m=m) if m != cluster.parity_m else cluster
    # Persistent versions are every k-th snapshot: a persistent restore loses half of k cycles.
    k = flush_every(costs, tau)
    lost_persist = k * (tau + c) / 2.0
    r = cluster.rack_nodes
    ns1, ns_rack = p_no_spare(cl, rates, costs, 1), p_no_spare(cl, rates, costs, r)
    wait1, wait_rack = ns1 * costs.replace_wait_s, ns_rack * costs.replace_wait_s
    # Slow: the job runs at (1 - s) for the detection time and until the next snapshot commits, then evicts.
    s = costs.slowdown
    slow_wall = costs.slow_detect_s + (tau + c) / (2.0 * (1.0 - s))
    out: dict[str, ClassCost] = {}
    per_hour = {cname: cluster.nodes * getattr(rates, cname) for cname in CLASSES}

    if strategy == "disk":
        disk = _recovery_parts(costs, costs.disk_load_s, 0.0, lost_snap)
        for cname, wait, pns in (("process", 0.0, 0.0), ("node", wait1, ns1), ("rack", wait_rack, ns_rack)):
            out[cname] = ClassCost(name=cname, per_hour=per_hour[cname], tiers={"disk": 1.0},
                                   parts={**disk, "replacement_wait": wait}, p_no_spare=pns)
        slow = {**_recovery_parts(costs, costs.disk_load_s, wait1, 0.0), "slowdown": s * slow_wall}
        out["slow"] = ClassCost(name="slow", per_hour=per_hour["slow"], tiers={"disk": 1.0}, parts=slow,
                                p_no_spare=ns1)
        return out

    mem = _recovery_parts(costs, costs.restore_memory_s, 0.0, lost_snap)
    out["process"] = ClassCost(name="process", per_hour=per_hour["process"], tiers={"memory": 1.0}, parts=mem)
    # A node loss: parity unless the group loses more than m before it is healed, i.e. before the replacement
    # restored and the next snapshot re-encoded the group's parity.
    par = _recovery_parts(costs, costs.restore_parity_s, wait1, lost_snap)
    per = _recovery_parts(costs, costs.restore_persistent_s, wait1, lost_persist)
    window = math.fsum(par.values()) - par["lost_work"] + tau + c
    pb = p_beyond_m(cl, rates, window, 1)
    out["node"] = ClassCost(name="node", per_hour=per_hour["node"], tiers=_tiers(pb),
                            parts=_mix([(1 - pb, par), (pb, per)]), p_no_spare=ns1, p_beyond_m=pb)
    # A rack event hits rack_nodes groups (spread) with members_per_rack members each: beyond m if any does.
    k_rack = cl.members_per_rack
    groups_hit = r if cl.spread else max(1, math.ceil(r / cl.group_nodes))
    p_one = p_beyond_m(cl, rates, window, k_rack)
    pr = 1.0 - (1.0 - p_one) ** groups_hit
    rpar = {**par, "replacement_wait": wait_rack}
    rper = {**per, "replacement_wait": wait_rack}
    out["rack"] = ClassCost(name="rack", per_hour=per_hour["rack"], tiers=_tiers(pr),
                            parts=_mix([(1 - pr, rpar), (pr, rper)]), p_no_spare=ns_rack, p_beyond_m=pr)
    # Fail-slow: eviction right after a snapshot commits, so no work is lost; the evicted node is rebuilt like a
    # lost one (parity; or, beyond m and always for memory-only, the persistent tier, which rolls the whole job
    # back to the last flushed version: half a flush interval lost).
    ps = p_beyond_m(cl, rates, window, 1)
    spar = {**_recovery_parts(costs, costs.restore_parity_s, wait1, 0.0), "slowdown": s * slow_wall}
    sper = {**_recovery_parts(costs, costs.restore_persistent_s, wait1, lost_persist), "slowdown": s * slow_wall}
    out["slow"] = ClassCost(name="slow", per_hour=per_hour["slow"], tiers=_tiers(ps),
                            parts=_mix([(1 - ps, spar), (ps, sper)]), p_no_spare=ns1, p_beyond_m=ps)
    return out


def _tiers(p_persistent: float) -> dict[str, float]:
    return {"parity": 1.0 - p_persistent, "persistent": p_persistent}


# ---------------------------------------------------------------------------------------------------------------
# TOR, the optimal interval, a projection, a sweep, a recommendation
# ---------------------------------------------------------------------------------------------------------------

def _stall(strategy: str, costs: Costs) -> float:
    return costs.disk_save_s if strategy == "disk" else costs.snapshot_stall_s


def tor_at(strategy: str, cluster: Cluster, rates: Rates, costs: Costs, interval_s: float) -> float:
    """Equation (P) at one interval, not clamped (negative when failures eat more than the wall time)."""
    c = _stall(strategy, costs)
    cc = class_costs(strategy, cluster, rates, costs, interval_s=interval_s, stall_s=c)
    return (1.0 - math.fsum(x.fraction for x in cc.values())) * interval_s / (interval_s + c)


def optimal_interval(strategy: str, cluster: Cluster, rates: Rates, costs: Costs, *,
                     min_interval_s: float = _TAU_MIN_S) -> float:
    """The interval maximising (P): a log-spaced scan, then golden-section refinement around the best point.
    (Young's sqrt(2 C M) is the optimum when only lost work and stalls depend on the interval; here the
    fail-slow wait for the next snapshot, the parity healing window and the persistent cadence do too.)"""
    f = lambda t: tor_at(strategy, cluster, rates, costs, t)  # noqa: E731
    lo_b, hi_b = math.log(max(min_interval_s, 1e-3)), math.log(max(_TAU_MAX_S, min_interval_s * 2))
    grid = [lo_b + (hi_b - lo_b) * i / 160 for i in range(161)]
    vals = [f(math.exp(g)) for g in grid]
    i = max(range(len(grid)), key=lambda j: vals[j])
    a, b = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    g = (math.sqrt(5) - 1) / 2
    x1, x2 = b - g * (b - a), a + g * (b - a)
    f1, f2 = f(math.exp(x1)), f(math.exp(x2))
    for _ in range(60):
        if f1 < f2:
            a, x1, f1 = x1, x2, f2
            x2 = a + g * (b - a)
            f2 = f(math.exp(x2))
        else:
            b, x2, f2 = x2, x1, f1
            x1 = b - g * (b - a)
            f1 = f(math.exp(x1))
    best = math.exp((a + b) / 2)
    return best if f(best) >= vals[i] else math.exp(grid[i])


def project(strategy: str, cluster: Cluster, rates: Rates, costs: Costs, *, interval_s: float | None = None,
            min_interval_s: float = _TAU_MIN_S) -> Projection:
    """TOR of ``strategy`` at ``interval_s`` (default: its optimal interval) with the breakdown per class."""
    tau = interval_s if interval_s is not None else optimal_interval(strategy, cluster, rates, costs,
                                                                      min_interval_s=min_interval_s)
    if not (tau > 0 and math.isfinite(tau)):
        raise TorError(f"interval_s={interval_s!r}: expected a finite number of seconds > 0")
    c = _stall(strategy, costs)
    cc = class_costs(strategy, cluster, rates, costs, interval_s=tau, stall_s=c)
    fail = math.fsum(x.fraction for x in cc.values())
    tor = (1.0 - fail) * tau / (tau + c)
    lam = cluster.nodes * rates.total() / 3600.0
    notes: list[str] = []
    info = None
    if strategy == "shardsafe_shrink":
        info = shrink_info(cluster, costs, cc, notes)
    p = Projection(
        strategy=strategy, gpus=cluster.gpus, nodes=cluster.nodes,
        parity_m=cluster.parity_m if strategy in PARITY_STRATEGIES else 0, spares=cluster.spares, interval_s=tau,
        stall_s=c, young_interval_s=math.sqrt(2.0 * c / lam), mtbf_s=1.0 / lam,
        persist_interval_s=None if strategy == "disk" else flush_every(costs, tau) * tau,
        tor=max(0.0, tor), stall_fraction=(1.0 - fail) * c / (tau + c), classes=cc, notes=notes, shrink=info)
    note = break_note(p)
    if note:
        notes.insert(0, note)
    if tor < 0:
        notes.append("failures cost more than the wall time: the job makes no progress; TOR clamped at 0")
    return p


def first_order_note(fail: float, simulated: str | None = None) -> str:
    """The note for a point where failures take ``fail`` > :data:`FIRST_ORDER_LIMIT` of the wall time; with
    ``simulated`` (what replaced (P), e.g. "0.8125 +- 0.0043"), says that the value shown is the simulator's."""
    head = (f"failures take {100 * fail:.0f}% of the wall time: beyond ~{100 * FIRST_ORDER_LIMIT:.0f}% the "
            "first-order form (P) is pessimistic by more than ~0.01 TOR (it charges a failure during a recovery "
            "the lost work and the whole recovery again); ")
    if simulated is None:
        return head + "use `shardsafe tor simulate` for this point"
    return head + f"TOR here is the simulator's, {simulated}"


def break_note(p: Projection, simulated: str | None = None) -> str | None:
    """Why (P) does not hold at ``p`` (None where it does): failures take too much of the wall time
    (:func:`first_order_note`), or the shrink policy's degraded periods overlap too often; with ``simulated``,
    says that the value shown is the simulator's."""
    if p.failure_fraction > FIRST_ORDER_LIMIT:
        return first_order_note(p.failure_fraction, simulated)
    if p.first_order_ok or not p.shrink:
        return None
    wall, lost = p.shrink["degraded_wall_fraction"], p.shrink["degraded_fraction"]
    head = (f"the job runs at reduced size {100 * wall:.0f}% of the wall time and loses {100 * lost:.1f}% there: "
            "(P) charges a node loss while degraded the reduced throughput again, off by ~their product; ")
    if simulated is None:
        return head + "use `shardsafe tor simulate` for this point"
    return head + f"TOR here is the simulator's, {simulated}"


def at_scale(cluster: Cluster, gpus: int) -> Cluster:
    """The same cluster at ``gpus`` GPUs: nodes rounded up, spares scaled with the node count (same fraction),
    the global batch with the data-parallel size (the same micro-batches per rank)."""
    nodes = max(cluster.group_nodes, math.ceil(gpus / cluster.gpus_per_node))
    spares = math.ceil(cluster.spares * nodes / cluster.nodes)
    batch = cluster.global_batch
    if batch is not None:
        dp = nodes * cluster.gpus_per_node // (cluster.model_parallel_gpus or cluster.gpus_per_node)
        batch = batch // cluster.dp * max(1, dp)
    return dataclasses.replace(cluster, nodes=nodes, spares=spares, global_batch=batch)


def sweep(cluster: Cluster, rates: Rates, costs: Costs, gpus: Sequence[int] = DEFAULT_SWEEP_GPUS,
          strategies: Sequence[str] = STRATEGIES, intervals: dict[str, float | None] | None = None, *,
          refine: Callable[[Cluster, Projection], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """TOR at each scale for each strategy, at ``intervals[strategy]`` or else its optimal interval:
    ``[{gpus, nodes, spares, <strategy>: tor, <strategy>_interval_s: s, points: {<strategy>: point}}, ...]``.
    Spares scale with the nodes. A point is ``refine(cluster, projection)`` (the simulator's value where (P)
    breaks, :class:`shardsafe.tor.projection_report.Refiner`), or else (P) alone: ``{tor, tor_closed,
    tor_source: "closed", ci95: None, ci: None, failure_fraction, simulation: None}``."""
    rows = []
    for g in gpus:
        cl = at_scale(cluster, g)
        row: dict[str, Any] = {"gpus": cl.gpus, "nodes": cl.nodes, "spares": cl.spares}
        points: dict[str, Any] = {}
        for s in strategies:
            p = project(s, cl, rates, costs, interval_s=(intervals or {}).get(s))
            pt = refine(cl, p) if refine is not None else closed_point(p)
            row[s], row[s + "_interval_s"] = pt["tor"], p.interval_s
            points[s] = pt
        row["points"] = points
        rows.append(row)
    return rows


def closed_point(p: Projection) -> dict[str, Any]:
    """One point of a projection where (P) is the value: the fields a simulated point fills in are None."""
    return {"tor": p.tor, "tor_closed": p.tor, "tor_source": "closed", "ci95": None, "ci": None,
            "failure_fraction": p.failure_fraction, "simulation": None}


def recommend(cluster: Cluster, rates: Rates, costs: Costs, target_tor: float, *,
              max_m: int = 3, refine: Callable[[Cluster, Projection], dict[str, Any]] | None = None,
              strategy: str = "shardsafe") -> dict[str, Any]:
    """The cheapest setup of ``strategy`` (``shardsafe`` or ``shardsafe_shrink``) reaching ``target_tor``: the
    smallest m, then the fewest spares, each at the optimal interval. Spares are tried from 0 up to the number
    that makes a wait for a node rare (P < 1e-3);
    more spares than that buy nothing. Returns the setup, or the best reachable one with ``reached: False``.

    ``refine(cluster, projection)`` gives the better value where (P) breaks (``{"tor", "tor_source", "ci95",
    ...}``, :class:`shardsafe.tor.projection_report.Refiner`); it is asked only for candidates past
    :data:`FIRST_ORDER_LIMIT` whose optimistic bound (:attr:`Projection.tor_upper_bound`) can reach the target,
    and for the setup returned when it is past the limit. Without it every candidate is (P) alone."""
    if not 0 < target_tor < 1:
        raise TorError(f"target_tor={target_tor!r}: expected a fraction in (0, 1)")
    best: tuple[dict[str, Any], Cluster, Projection] | None = None
    cap = _spares_for(cluster, rates, costs, 1e-3)

    def value(cl: Cluster, p: Projection, *, force: bool = False) -> dict[str, Any]:
        # The bound is approximate (as good as (P)'s D_c), hence the slack.
        if refine is None or p.first_order_ok or not (force or p.tor_upper_bound + 0.01 >= target_tor):
            return closed_point(p)
        return refine(cl, p)

    for m in range(0, min(max_m, cluster.group_nodes - 1) + 1):
        for spares in _spare_steps(cap):
            cl = dataclasses.replace(cluster, parity_m=m, spares=spares)
            p = project(strategy, cl, rates, costs)
            cand = {"parity_m": m, "spares": spares, "interval_s": p.interval_s, **value(cl, p),
                    "p_no_spare": p.classes["node"].p_no_spare, "p_beyond_m": p.classes["node"].p_beyond_m}
            if best is None or cand["tor"] > best[0]["tor"] + 1e-12:
                best = (cand, cl, p)
            if cand["tor"] >= target_tor:
                return {**cand, "target_tor": target_tor, "reached": True, "policy": policy_of(strategy)}
    assert best is not None
    cand, cl, p = best
    if cand["tor_source"] == "closed" and refine is not None and not p.first_order_ok:
        cand = {**cand, **value(cl, p, force=True)}    # report the better value of the best one found
    return {**cand, "target_tor": target_tor, "reached": cand["tor"] >= target_tor, "policy": policy_of(strategy)}


def policy_of(strategy: str) -> str:
    """What a strategy does about a node loss with no idle spare: ``shrink`` or wait (``spares``)."""
    return "shrink" if strategy == "shardsafe_shrink" else "spares"


def _spares_for(cluster: Cluster, rates: Rates, costs: Costs, p: float) -> int:
    s = 0
    while p_no_spare(dataclasses.replace(cluster, spares=s), rates, costs, cluster.rack_nodes) > p and s < 10 * cluster.nodes:
        s += 1
    return s


def _spare_steps(cap: int) -> list[int]:
    steps, s = [0], 1
    while s < cap:
        steps.append(s)
        s = s * 2 if s >= 4 else s + 1
    if cap not in steps:
        steps.append(cap)
    return steps
