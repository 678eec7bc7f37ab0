"""The shrink policy at cluster scale, closed form (docs/tor.md, "Continuing at a smaller data-parallel size").

Under the spares policy (:mod:`.project`, strategy ``shardsafe``), a node loss that finds no idle spare waits
``replace_wait_s`` for a replacement node, idle. Under the shrink policy (strategy ``shardsafe_shrink``) the
launcher waits ``shrink_after_s`` for a spare, then re-forms the job on the nodes it has at the largest
data-parallel size D' < D the layout allows, restoring the committed version re-partitioned from memory
(``reshard_restore_s``); it trains at D'/D of full throughput (the same global batch: every iteration is the
same work and takes D/D' as long) until the replacement arrives -- ``replace_wait_s`` after the detection, the
same node the spares policy waits for -- and grows back at the next committed snapshot (one more restart,
startup and re-partitioning restore; no work lost). With enough idle spares both policies do the same thing.

One event of a class that needs q nodes costs, with P(idle = j) the stationary chance of j idle spares:

    D = (1 - P_ns) D_spare + sum_{j < q} P(idle = j) D_short(q - j)

D_spare is the spares policy's cost without a wait; D_short(k) the shrink path with k nodes missing when the job
can re-form without them (D'(k) >= 1), shrinking is on (``shrink_after_s`` > 0) and the replacement takes longer
than the launcher waits for it (:func:`shrinks`), else the spares policy's path with the whole wait:

    D_short(k) = detect + shrink_after + restart + startup + restore_X + lost
                 + (1 - theta_k) g_k                                          (degraded)
                 + restart + startup + reshard_restore                        (grow)
    theta_k = D'(k) / D
    T_sh = shrink_after + restart + startup + restore_X                       (detection to training at D')
    g_k = replace_wait - T_sh + (tau + C) / (2 theta_k)    if replace_wait > T_sh
          (tau + C) / theta_k                              otherwise (the replacement is there when D' starts)

restore_X is ``reshard_restore_s`` from parity and the persistent tier's restore beyond m; g_k is the wall time at
D' (the replacement arrives, then the next commit follows, on average half a cycle later, cycles being 1/theta_k
longer at D'). Losing more than m is as in :mod:`.project`, with the healing window of the path taken.
"""
from __future__ import annotations

import functools
import math
from typing import Any

from .classes import Cluster, Costs, Rates
from .recovery import ClassCost, _recovery_parts, away_distribution, flush_every, p_beyond_m

__all__ = ["SHRINK", "POLICIES", "dp_after_loss", "throughput_after_loss", "shrinks", "idle_shortfall",
           "shrink_class_costs", "shrink_info"]

SHRINK = "shardsafe_shrink"
POLICIES = ("spares", "shrink")


@functools.lru_cache(maxsize=8192)
def _largest_divisor_at_most(n: int, cap: int) -> int:
    for d in range(min(cap, n), 0, -1):
        if n % d == 0:
            return d
    return 0


def dp_after_loss(cluster: Cluster, lost_nodes: int) -> int:
    """D': the largest data-parallel size the job can re-form at without ``lost_nodes`` of its nodes (whole model
    replicas on the remaining GPUs, and a divisor of the global batch when one is given); 0 = it cannot."""
    mp = cluster.model_parallel_gpus or cluster.gpus_per_node
    avail = max(0, (cluster.nodes - lost_nodes) * cluster.gpus_per_node // mp)
    avail = min(avail, cluster.dp)
    if cluster.global_batch is None:
        return avail
    return _largest_divisor_at_most(cluster.global_batch, avail)


def throughput_after_loss(cluster: Cluster, lost_nodes: int) -> float:
    """theta = D'/D: the job's throughput without ``lost_nodes`` nodes, as a fraction of full size."""
    return dp_after_loss(cluster, lost_nodes) / cluster.dp


_SHORT_MEMO: dict[tuple, dict[int, float]] = {}


def idle_shortfall(cluster: Cluster, rates: Rates, costs: Costs, need: int) -> dict[int, float]:
    """{k: P(a loss needing ``need`` nodes finds need - k idle spares)} for k = 1..need: the nodes it is short.
    The values sum to P_nospare (:func:`shardsafe.tor.recovery.p_no_spare`); idle = spares - away, with the nodes
    away from :func:`shardsafe.tor.recovery.away_distribution` (a loss sees its stationary distribution)."""
    s = cluster.spares
    key = (cluster.nodes, cluster.rack_nodes, s, need, rates.node, rates.rack, rates.slow, costs.repair_h)
    out = _SHORT_MEMO.get(key)
    if out is None:
        p = away_distribution(cluster, rates, costs, s)           # P(away = a), a = 0..s
        out = {}
        for j in range(0, min(need - 1, s) + 1):                  # j idle spares, fewer than needed
            w = max(0.0, 1.0 - math.fsum(p[:s])) if j == 0 else p[s - j]
            if w > 0:
                out[need - j] = w
        if len(_SHORT_MEMO) > 4096:
            _SHORT_MEMO.clear()
        _SHORT_MEMO[key] = out
    return out


def shrinks(costs: Costs) -> bool:
    """Whether the launcher ever shrinks: ``shrink_after_s`` > 0 (0 turns it off, as the launcher's option does)
    and the replacement takes longer than that wait (else it arrives while the launcher still waits for it)."""
    return 0 < costs.shrink_after_s < costs.replace_wait_s


def _mix(paths: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    keys = paths[0][1].keys()
    return {k: math.fsum(w * parts[k] for w, parts in paths) for k in keys}


def shrink_class_costs(cluster: Cluster, rates: Rates, costs: Costs, *, interval_s: float,
                       stall_s: float) -> dict[str, ClassCost]:
    """Expected cost of one event of each class under the shrink policy (module docstring), at snapshot interval
    ``interval_s`` with ``stall_s`` per snapshot. ``process`` is the spares policy's (no node is lost)."""
    co, tau, c = costs, interval_s, stall_s
    cyc = tau + c
    lost_snap, lost_persist = cyc / 2.0, flush_every(co, tau) * cyc / 2.0
    r = cluster.rack_nodes
    s = co.slowdown
    slow_part = s * (co.slow_detect_s + cyc / (2.0 * (1.0 - s)))
    fixed = co.detect_s + co.restart_s + co.startup_s
    per_hour = {cname: cluster.nodes * getattr(rates, cname) for cname in ("process", "node", "rack", "slow")}

    def beyond(window: float, members: int, groups: int) -> float:
        return 1.0 - (1.0 - p_beyond_m(cluster, rates, window, members)) ** groups

    def tiered(restore_par: float, wait: float, lost_par: float, slow: float, members: int,
               groups: int) -> tuple[float, dict[str, float], dict[str, float]]:
        """(P(beyond m), parity path, persistent path) of a fail-stop that restores from parity after ``wait``;
        the group heals when that restore is done and the next snapshot re-encoded its parity."""
        par = {**_recovery_parts(co, restore_par, wait, lost_par), "slowdown": slow}
        per = {**_recovery_parts(co, co.restore_persistent_s, wait, lost_persist), "slowdown": slow}
        return beyond(fixed + restore_par + wait + cyc, members, groups), par, per

    def shrunk(parts: dict[str, float], theta: float) -> tuple[dict[str, float], float]:
        t_sh = co.shrink_after_s + co.restart_s + co.startup_s + parts["restore"]
        g = (co.replace_wait_s - t_sh + cyc / (2.0 * theta) if co.replace_wait_s > t_sh else cyc / theta)
        return {**parts, "degraded": (1.0 - theta) * g,
                "grow": co.restart_s + co.startup_s + co.reshard_restore_s}, g

    def loss_class(name: str, need: int, lost_par: float, slow: float, members: int, groups: int) -> ClassCost:
        short = idle_shortfall(cluster, rates, costs, need)
        ns = math.fsum(short.values())
        paths: list[tuple[float, dict[str, float]]] = []
        p_persist = p_shrink = deg_wall = 0.0
        pb, par, per = tiered(co.restore_parity_s, 0.0, lost_par, slow, members, groups)
        paths += [((1 - ns) * (1 - pb), par), ((1 - ns) * pb, per)]
        p_persist += (1 - ns) * pb
        for k, w in short.items():
            theta = throughput_after_loss(cluster, k)
            if theta > 0 and shrinks(co):
                # Re-formed at D' after the launcher's wait; the lost ranks rebuilt from parity, re-partitioned.
                pb, par, per = tiered(co.reshard_restore_s, co.shrink_after_s, lost_par, slow, members, groups)
                (par, g_par), (per, g_per) = shrunk(par, theta), shrunk(per, theta)
                p_shrink += w
                deg_wall += w * ((1 - pb) * g_par + pb * g_per)
            else:   # cannot shrink that far, or the replacement comes before the launcher gives up on it: wait
                pb, par, per = tiered(co.restore_parity_s, co.replace_wait_s, lost_par, slow, members, groups)
            paths += [(w * (1 - pb), par), (w * pb, per)]
            p_persist += w * pb
        return ClassCost(name=name, per_hour=per_hour[name], tiers={"parity": 1.0 - p_persist,
                                                                     "persistent": p_persist},
                         parts=_mix(paths), p_no_spare=ns, p_beyond_m=p_persist, p_shrink=p_shrink,
                         degraded_wall_s=deg_wall)

    out = {"process": ClassCost(name="process", per_hour=per_hour["process"], tiers={"memory": 1.0},
                                parts=_recovery_parts(co, co.restore_memory_s, 0.0, lost_snap))}
    out["node"] = loss_class("node", 1, lost_snap, 0.0, 1, 1)
    groups_hit = r if cluster.spread else max(1, math.ceil(r / cluster.group_nodes))
    out["rack"] = loss_class("rack", r, lost_snap, 0.0, cluster.members_per_rack, groups_hit)
    # Fail-slow: evicted right after a commit (no work lost), then a node loss like any other.
    out["slow"] = loss_class("slow", 1, 0.0, slow_part, 1, 1)
    return out


def shrink_info(cluster: Cluster, costs: Costs, classes: dict[str, ClassCost], notes: list[str]) -> dict[str, Any]:
    """What the projection of the shrink policy reports beside TOR: the sizes it shrinks to, and the shares of
    the wall time spent at a reduced size and lost there (first order, like (P)). Adds a note where the policy
    never shrinks."""
    d1, dr = dp_after_loss(cluster, 1), dp_after_loss(cluster, cluster.rack_nodes)
    wall = math.fsum(cc.per_hour / 3600.0 * cc.degraded_wall_s for cc in classes.values())
    lost = math.fsum(cc.per_hour / 3600.0 * cc.parts["degraded"] for cc in classes.values())
    grow = math.fsum(cc.per_hour / 3600.0 * cc.parts["grow"] for cc in classes.values())
    grow_s = costs.restart_s + costs.startup_s + costs.reshard_restore_s
    mtbf_s = 3600.0 / max(1e-300, math.fsum(cc.per_hour for cc in classes.values()))
    theta = d1 / cluster.dp
    # Growing back is a restart of its own; near D'/D = 1 the reduced size costs less than that restart until long
    # after the next failure's restart, which could re-form the job at full size for free.
    break_even_s = grow_s / (1.0 - theta) if theta < 1 else math.inf
    if grow > 0 and break_even_s > mtbf_s:
        notes.append(f"growing back takes {100 * grow:.1f}% of the wall time (a restart of "
                     f"{grow_s:g} s per shrink); at D'/D = {theta:.4f} the reduced size costs that much only after "
                     f"{break_even_s / 3600:.3g} h, beyond the job's MTBF of {mtbf_s / 3600:.3g} h: growing back at "
                     "the next failure's restart instead would save most of it")
    if costs.shrink_after_s == 0:
        notes.append("shrink_after_s 0 turns shrinking off: it waits for a spare as before")
    elif not shrinks(costs):
        notes.append(f"a replacement node comes within {costs.replace_wait_s:g} s, before the "
                     f"launcher stops waiting for one ({costs.shrink_after_s:g} s): it never shrinks here")
    elif d1 == 0:
        notes.append("without one node the job cannot re-form at any data-parallel size "
                     "(--model-parallel-gpus, --global-batch): it waits for a spare as before")
    return {"dp": cluster.dp, "dp_after_node": d1, "dp_after_rack": dr,
            "throughput_after_node": d1 / cluster.dp, "throughput_after_rack": dr / cluster.dp,
            "model_parallel_gpus": cluster.model_parallel_gpus or cluster.gpus_per_node,
            "global_batch": cluster.global_batch, "degraded_wall_fraction": wall, "degraded_fraction": lost,
            "grow_fraction": grow, "grow_break_even_s": break_even_s if math.isfinite(break_even_s) else None,
            "p_shrink_node": classes["node"].p_shrink}
