"""What ``shardsafe tor project`` and ``shardsafe tor simulate`` print: one JSON-ready dict each, and its text.

The text is rendered from the dict, so ``--json`` and the table always show the same numbers.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .classes import CLASSES, Cluster, Costs, Rates
from .project import (DEFAULT_SIM_REPLICAS, FIRST_ORDER_LIMIT, PARITY_STRATEGIES, PARTS, SIM_FAILURES_PER_REPLICA,
                      STRATEGIES, Projection, at_scale, break_note, closed_point, project, recommend, sweep)
from .policy import compare_policies, policy_lines, strategies_for
from .shrink import SHRINK
from .simulate import simulate
from .errors import TorError

__all__ = ["PROJECT_SCHEMA", "SIMULATE_SCHEMA", "DEFAULT_SIM_REPLICAS", "SIM_FAILURES_PER_REPLICA", "Refiner",
           "projection_dict", "projection_text", "simulation_dict", "simulation_text"]

PROJECT_SCHEMA = "shardsafe.tor.project/1"
SIMULATE_SCHEMA = "shardsafe.tor.simulate/1"
_LABEL = {"shardsafe": "shardsafe", SHRINK: "shardsafe+shrink", "memory_only": "memory-only", "disk": "disk ckpt"}
_SHORT = {"detection": "detect", "restart": "restart", "startup": "startup", "restore": "restore",
          "replacement_wait": "wait", "lost_work": "lost", "slowdown": "slow", "degraded": "degraded",
          "grow": "grow"}


# ---------------------------------------------------------------------------------------------------------------
# Where (P) breaks: the simulator's value instead
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Refiner:
    """The value ``tor project`` reports at one (cluster, strategy) point: (P) where failures take at most
    :data:`~shardsafe.tor.project.FIRST_ORDER_LIMIT` of the wall time, else the simulator's mean and 95 % CI
    (:func:`~shardsafe.tor.simulate.simulate`, at (P)'s interval, ``seed``, ``replicas`` runs of
    :meth:`horizon_s`). ``enabled=False`` keeps (P) everywhere. Results are cached per point, so the single
    point, the sweep and the recommendation simulate a shared point once."""

    enabled: bool = True
    replicas: int = DEFAULT_SIM_REPLICAS
    seed: int = 0
    failures_per_replica: int = SIM_FAILURES_PER_REPLICA
    rates: Rates | None = None
    costs: Costs | None = None
    simulated: int = 0
    """How many points were simulated (cache misses)."""
    _cache: dict[tuple, dict[str, Any]] = field(default_factory=dict, repr=False)

    def horizon_s(self, cluster: Cluster, rates: Rates, costs: Costs) -> float:
        per_day = cluster.nodes * rates.total() * 24.0
        days = max(math.ceil(self.failures_per_replica / per_day), math.ceil(4 * costs.repair_h / 24.0), 1)
        return 86400.0 * min(days, 3650)

    def settings(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "limit_failure_fraction": FIRST_ORDER_LIMIT, "replicas": self.replicas,
                "seed": self.seed, "failures_per_replica": self.failures_per_replica}

    def __call__(self, cluster: Cluster, p: Projection) -> dict[str, Any]:
        """The point for projection ``p`` of ``cluster`` (with the rates and costs given at construction)."""
        if self.rates is None or self.costs is None:
            raise TorError("Refiner: pass rates= and costs= (the ones the projection used)")
        return self.point(p.strategy, cluster, self.rates, self.costs, p)

    def point(self, strategy: str, cluster: Cluster, rates: Rates, costs: Costs, p: Projection) -> dict[str, Any]:
        base = closed_point(p)
        if not self.enabled or p.first_order_ok:
            return base
        horizon = self.horizon_s(cluster, rates, costs)
        key = (strategy, tuple(dataclasses.astuple(cluster)), tuple(rates.as_dict().values()),
               tuple(costs.as_dict()[f] for f in Costs.field_names()), p.interval_s, horizon, self.replicas,
               self.seed)
        sim = self._cache.get(key)
        if sim is None:
            r = simulate(strategy, cluster, rates, costs, interval_s=p.interval_s, horizon_s=horizon,
                         replicas=self.replicas, seed=self.seed)
            self.simulated += 1
            sim = self._cache[key] = {
                "tor": r.tor, "ci95": r.ci95, "ci": [r.tor - r.ci95, r.tor + r.ci95],
                "simulation": {"replicas": r.replicas, "horizon_s": r.horizon_s, "seed": r.seed,
                               "interval_s": r.interval_s, "failures": sum(r.events.values()),
                               "failures_during_recovery": r.during_recovery, "replacement_waits": r.waits,
                               "tiers": dict(r.tiers)}}
        return {**base, **sim, "simulation": dict(sim["simulation"]), "tor_source": "simulated"}


def _inputs(cluster: Cluster, rates: Rates, costs: Costs, measured: dict[str, float] | None,
            profile: dict[str, Any] | None) -> dict[str, Any]:
    per_h = cluster.nodes * rates.total()
    return {
        "cluster": cluster.as_dict(),
        "rates": {"per_node_hour": rates.as_dict(), "source": rates.source, "job_failures_per_hour": per_h,
                  "job_mtbf_s": 3600.0 / per_h},
        "costs": {**costs.as_dict(), "measured": dict(measured or {})},
        "profile": profile,
    }


def projection_dict(cluster: Cluster, rates: Rates, costs: Costs, *, interval_s: float | None = None,
                    disk_interval_s: float | None = None, sweep_gpus: Sequence[int] | None = None,
                    target_tor: float | None = None, measured: dict[str, float] | None = None,
                    profile: dict[str, Any] | None = None, simulate_flagged: bool = True,
                    sim_replicas: int = DEFAULT_SIM_REPLICAS, sim_seed: int = 0, growth: dict[str, Any] | None = None,
                    costs_at: Callable[[int], Costs] | None = None, policy: str = "both") -> dict[str, Any]:
    """Everything ``shardsafe tor project`` reports (schema :data:`PROJECT_SCHEMA`, see docs/tor.md).

    ``policy`` (``spares``, ``shrink`` or ``both``): what shardsafe does about a node loss with no idle spare
    (:func:`shardsafe.tor.policy.strategies_for`); with ``both`` the two are compared over spare counts and one
    setup is recommended (``policies``, :func:`shardsafe.tor.policy.compare_policies`).

    Every point (strategy at the cluster, at each sweep scale, the recommendation) past
    :data:`~shardsafe.tor.project.FIRST_ORDER_LIMIT` reports the simulator's TOR (``tor_source: "simulated"``,
    ``ci95``) with (P) kept as ``tor_closed``, unless ``simulate_flagged`` is False (then (P) everywhere).
    ``growth``: the fitted costs of a bench (``--from-bench``), reported as they are; ``costs_at(gpus)``: the costs
    at each sweep scale (default: ``costs`` everywhere)."""
    refine = Refiner(enabled=simulate_flagged, replicas=sim_replicas, seed=sim_seed, rates=rates, costs=costs)
    chosen = strategies_for(policy)
    intervals = {"shardsafe": interval_s, SHRINK: interval_s, "memory_only": interval_s, "disk": disk_interval_s}
    strategies = {}
    for s in chosen:
        p = project(s, cluster, rates, costs, interval_s=intervals[s])
        pt = refine(cluster, p)
        d = {**p.as_dict(), **pt}
        if pt["tor_source"] == "simulated":
            sim = f"{pt['tor']:.4f} ± {pt['ci95']:.4f} (closed form {p.tor:.4f})"
            d["notes"] = [break_note(p, sim) if n == break_note(p) else n for n in p.notes]
        strategies[s] = d
    out = {"schema": PROJECT_SCHEMA, **_inputs(cluster, rates, costs, measured, profile), "policy": policy,
           "strategies": strategies, "recommendation": None, "recommendation_shrink": None, "policies": None,
           "sweep": None, "simulation": refine.settings()}
    ref = refine if simulate_flagged else None
    if target_tor is not None and "shardsafe" in chosen:
        out["recommendation"] = recommend(cluster, rates, costs, target_tor, refine=ref)
    if target_tor is not None and SHRINK in chosen:
        out["recommendation_shrink"] = recommend(cluster, rates, costs, target_tor, refine=ref, strategy=SHRINK)
    if policy == "both":
        out["policies"] = compare_policies(cluster, rates, costs, refine=ref)
    if sweep_gpus and costs_at is None:
        out["sweep"] = sweep(cluster, rates, costs, sweep_gpus, chosen, intervals=intervals, refine=refine)
    elif sweep_gpus:   # the costs grow with the scale: one sweep point at a time, each with its own
        out["sweep"] = []
        for g in sweep_gpus:
            c = costs_at(at_scale(cluster, g).gpus)
            out["sweep"] += sweep(cluster, rates, c, [g], chosen, intervals=intervals, refine=dataclasses.replace(
                refine, costs=c, _cache={}))
    out["growth"] = growth
    return out


def _fmt_s(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


def _header(d: dict[str, Any]) -> list[str]:
    c, r, co = d["cluster"], d["rates"], d["costs"]
    lines = [f"  cluster  {c['gpus']} GPUs = {c['nodes']} nodes x {c['gpus_per_node']}; racks of {c['rack_nodes']} "
             f"nodes; parity groups of {c['group_nodes']} {'spread over racks' if c['spread'] else 'NOT spread (consecutive nodes)'}; "
             f"{c['spares']} spare node(s)"]
    rates = "  ".join(f"{k} {v:.3g}" for k, v in r["per_node_hour"].items())
    lines.append(f"  rates    per node-hour: {rates}  ({r['source']})")
    lines.append(f"           job: {r['job_failures_per_hour']:.3f} failures/h, MTBF {_fmt_s(r['job_mtbf_s'])}")
    meas = co["measured"]
    cost = (f"detect {co['detect_s']:g} s, restart {co['restart_s']:g} s, startup {co['startup_s']:g} s, restore "
            f"memory/parity/persistent {co['restore_memory_s']:g}/{co['restore_parity_s']:g}/"
            f"{co['restore_persistent_s']:g} s, snapshot stall {co['snapshot_stall_s']:g} s, flush every "
            f"{_fmt_s(co['persist_interval_s'])}")
    lines.append(f"  costs    {cost}")
    lines.append(f"           disk save {co['disk_save_s']:g} s, load {co['disk_load_s']:g} s; no spare: wait "
                 f"{co['replace_wait_s']:g} s; repair {co['repair_h']:g} h; fail-slow {co['slowdown']:.0%} "
                 f"slower until detected ({co['slow_detect_s']:g} s)  ({co['source']})")
    if SHRINK in d.get("strategies", {}):
        lines.append(f"           shrink: wait {co['shrink_after_s']:g} s for a spare, then restore at the new size "
                     f"(re-partition included) {co['reshard_restore_s']:g} s; grow back with the replacement node")
    if meas:
        lines.append("           measured: " + ", ".join(f"{k}={v:.4g}" for k, v in meas.items()))
    return lines


def _growth_lines(g: dict[str, Any] | None) -> list[str]:
    """The fitted costs of ``--from-bench``: each law with its coefficients and its value at the job's ranks, and
    which costs are measured and which assumed."""
    if not g:
        return []
    m = g.get("machine") or {}
    host = f" on {m['cpus']} CPUs" if m.get("cpus") else ""
    beyond = (f", {g['factor_beyond_measured']:.0f}x beyond the largest measured: the growth law alone decides"
              if g["extrapolated"] and g["factor_beyond_measured"] > 1 else "")
    lines = [f"  growth   {g['source']}: measured at {', '.join(map(str, g['ranks_measured']))} ranks{host}; fitted "
             f"({g['form']}) and taken at {g['at_ranks']} ranks, one per GPU{beyond}"]
    for key, f in g["fits"].items():
        gives = f"-> {f['gives']}" if f["gives"] else ("(old design, not used)" if "ring" in key else
                                                       "(not used)")
        plus = " (+ the stall)" if f["gives"] == "snapshot_stall_s" else ""
        lines.append(f"    {key:<17}{gives:<24}{f['law']:<28}{f['form']:>6}, {100 * f['rel_rmse']:.0f}% err: "
                     f"{_fmt_s(f['at_ranks'])}{plus}")
    if g.get("vote_series"):
        lines.append(f"    the commit vote runs beside training; it is charged on top of the copy stall "
                     f"({g['base_stall_s']:g} s) as if it were not: an upper bound")
    lines.append(f"    measured: {', '.join(g['measured_fields']) or 'none'}; assumed (defaults, --costs, flags): "
                 f"{', '.join(g['assumed_fields'])}")
    if g.get("overridden_by_flags"):
        lines.append(f"    flags override the bench for: {', '.join(g['overridden_by_flags'])}")
    if g.get("missing"):
        lines.append(f"    not in the bench (kept as assumed): {', '.join(g['missing'])}")
    lines.extend(f"    warning: {w}" for w in g.get("warnings") or [])
    return lines


def _tor_cells(pt: dict[str, Any], wide: bool = True) -> str:
    """TOR (9: a trailing * when simulated), its 95 % CI half-width (8) and (P) where it was replaced (8); just
    TOR (8) when no point of the table was simulated (``wide=False``: the layout of (P) alone)."""
    if not wide:
        return f"{pt['tor']:>8.4f}"
    if pt.get("tor_source") == "simulated":
        return f"{pt['tor']:>8.4f}*{'±' + format(pt['ci95'], '.4f'):>8}{pt['tor_closed']:>8.4f}"
    return f"{pt['tor']:>8.4f} {'':>8}{'':>8}"


def _legend(d: dict[str, Any], again: bool = False) -> list[str]:
    if again:
        return ["  * simulated, as above (closed = the closed form (P) it replaces)"]
    sim = d.get("simulation") or {}
    return [f"  * simulated: failures take > {100 * sim.get('limit_failure_fraction', FIRST_ORDER_LIMIT):.0f}% of the "
            "wall time here, where the first-order form (P) drifts by ~0.01 TOR or more;",
            f"    closed = the closed form (P) it replaces; ±95% = half-width of the simulator's 95% CI "
            f"({sim.get('replicas')} replicas of",
            f"    ~{sim.get('failures_per_replica')} failures each, seed {sim.get('seed')}; --sim-replicas N "
            "narrows it, --no-simulate keeps (P) alone)"]


def projection_text(d: dict[str, Any]) -> str:
    st = d["strategies"]
    any_sim = any(p.get("tor_source") == "simulated" for p in st.values())
    title = ("TOR projection (first-order closed form, docs/tor.md equation (P); the simulator's value where it "
             "breaks)" if (d.get("simulation") or {}).get("enabled") else
             "TOR projection (first-order closed form, docs/tor.md equation (P))")
    lines = [title, *_header(d), *_growth_lines(d.get("growth")), ""]
    lines.append("  T_obs - T_opt as % of T_obs, by failure class and snapshot stall, from (P) (sums to 1 - closed):"
                 if any_sim else "  T_obs - T_opt as % of T_obs, by failure class and snapshot stall (sums to 1 - TOR):")
    width = max(16, *(len(_LABEL[x]) + 7 for x in st if x in PARITY_STRATEGIES))
    lines.append(f"  {'strategy':<{width}}{'interval':>10}{'TOR':>8}"
                 + (f" {'±95%':>8}{'closed':>8}" if any_sim else "") + "".join(f"{c:>9}" for c in (*CLASSES, "stall")))
    for s, p in st.items():
        br = p["breakdown"]
        cells = "".join(f"{100 * br[c]:>8.2f}%" for c in (*CLASSES, "snapshot_stall"))
        m = f" (m={p['parity_m']})" if s in PARITY_STRATEGIES else ""
        lines.append(f"  {_LABEL[s] + m:<{width}}{_fmt_s(p['interval_s']):>10}{_tor_cells(p, any_sim)}{cells}")
    if any_sim:
        lines += _legend(d)
    for s in (x for x in PARITY_STRATEGIES if x in st):
        lines += _class_lines(s, st[s])
    for s, p in st.items():
        lines.extend(f"  note ({_LABEL[s]}): {n}" for n in p["notes"])
    for key in ("recommendation", "recommendation_shrink"):
        rec = d.get(key)
        if not rec:
            continue
        lines.append("")
        verb = "reaches" if rec["reached"] else "does NOT reach; best found"
        tor = f"TOR {rec['tor']:.4f}"
        if rec.get("tor_source") == "simulated":
            tor += f" ± {rec['ci95']:.4f}* (closed form {rec['tor_closed']:.4f})"
        how = " (shrink)" if key == "recommendation_shrink" else ""
        lines.append(f"  target TOR {rec['target_tor']:.3f}{how}: m={rec['parity_m']}, {rec['spares']} spare(s), "
                     f"snapshot every {_fmt_s(rec['interval_s'])} {verb}: {tor} (no spare: P={rec['p_no_spare']:.2g}, "
                     f"beyond m: P={rec['p_beyond_m']:.2g})")
        if not rec["reached"]:
            lines.append("    the recovery path itself (detection + restart + startup) then dominates: shorten it "
                         "(--detect-s, --restart-s, --startup-s) or add spares")
        if rec.get("tor_source") == "simulated":
            lines += _legend(d, again=any_sim)
            any_sim = True
    if d.get("policies"):
        lines += policy_lines(d["policies"], st.get(SHRINK, {}).get("shrink"))
        if any(pt.get("tor_source") == "simulated" for r in d["policies"]["rows"] for pt in r["policies"].values()):
            lines += _legend(d, again=any_sim)
            any_sim = True
    if d.get("sweep"):
        rows = d["sweep"]
        names = [x for x in STRATEGIES if x in (rows[0].get("points") or rows[0])]
        pts = [row.get("points") or {s: {"tor": row[s]} for s in names} for row in rows]
        wide = any(pt.get("tor_source") == "simulated" for r in pts for pt in r.values())
        col = max(13, *(len(_LABEL[x]) + 1 for x in names))
        lines += ["", "  TOR versus scale (each strategy at its optimal interval unless one was given; spares scale "
                      "with the nodes):"]
        if wide:
            lines += [(f"    {'':>24}" + "".join(f"{_LABEL[s]:^25}" for s in names)).rstrip(),
                      f"    {'GPUs':>8}{'nodes':>8}{'spares':>8}"
                      + f"{'TOR':>8} {'±95%':>8}{'closed':>8}" * len(names)]
        else:
            lines.append(f"    {'GPUs':>8}{'nodes':>8}{'spares':>8}" + "".join(f"{_LABEL[s]:>{col}}" for s in names))
        for row, pt in zip(rows, pts):
            cells = "".join(_tor_cells(pt[s]) for s in names) if wide else \
                "".join(f"{pt[s]['tor']:>{col}.4f}" for s in names)
            lines.append(f"    {row['gpus']:>8}{row['nodes']:>8}{row['spares']:>8}{cells}".rstrip())
        if wide:
            lines += _legend(d, again=any_sim)
    return "\n".join(lines) + "\n"


def _class_lines(s: str, p: dict[str, Any]) -> list[str]:
    """One shardsafe policy per failure class: rate, tiers and the mean cost of an event by part (the parts
    that are not 0 for any class)."""
    parts = [x for x in PARTS if any(cc["parts_s"][x] for cc in p["classes"].values()) or x in PARTS[:7]]
    what = ("wait = for a spare before shrinking; degraded = throughput lost at D'; grow = restart + startup + "
            "restore back to D" if s == SHRINK else "wait = for a replacement node")
    lines = ["", f"  {_LABEL[s]} per class: job events per hour, restore tiers, mean seconds per event ({what}; "
                 f"persistent versions every {_fmt_s(p['persist_interval_s'])})"]
    lines.append(f"    {'class':<8}{'per h':>8}  {'tiers':<32}" + "".join(f"{_SHORT[x]:>9}" for x in parts)
                 + f"{'total':>9}")
    for c, cc in p["classes"].items():
        tiers = ", ".join(f"{t} {v:.3g}" for t, v in cc["tiers"].items() if v > 0)
        lines.append(f"    {c:<8}{cc['per_hour']:>8.4f}  {tiers:<32}"
                     + "".join(f"{cc['parts_s'][x]:>9.1f}" for x in parts) + f"{cc['seconds_per_event']:>9.1f}")
    node = p["classes"]["node"]
    lines.append(f"    a node loss finds no idle spare with P = {node['p_no_spare']:.3g}; its group loses more than "
                 f"m before it is healed with P = {node['p_beyond_m']:.3g}")
    if s == SHRINK and p.get("shrink"):
        sh = p["shrink"]
        lines.append(f"    it shrinks on P = {sh['p_shrink_node']:.3g} of node losses; the job runs at reduced size "
                     f"{100 * sh['degraded_wall_fraction']:.2f}% of the wall time and loses "
                     f"{100 * sh['degraded_fraction']:.3f}% there")
    return lines


def simulation_dict(cluster: Cluster, rates: Rates, costs: Costs, *, strategies: Sequence[str] = STRATEGIES,
                    gpus: Sequence[int] | None = None, interval_s: float | None = None,
                    disk_interval_s: float | None = None, horizon_s: float, replicas: int, seed: int,
                    measured: dict[str, float] | None = None, profile: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """The simulator against the closed form at each scale and strategy, at the closed form's interval
    (schema :data:`SIMULATE_SCHEMA`)."""
    from .project import at_scale

    intervals = {"shardsafe": interval_s, SHRINK: interval_s, "memory_only": interval_s, "disk": disk_interval_s}
    points = []
    scales = list(gpus) if gpus else [cluster.gpus]
    # Seeds by position among the waiting strategies (as before the shrink policy existed); the shrink policy
    # takes shardsafe's seed, so the two meet the same failures and differ by what they do about them.
    waiting = [x for x in strategies if x != SHRINK]
    for k, g in enumerate(scales):
        cl = cluster if not gpus else at_scale(cluster, g)
        for s in strategies:
            twin = "shardsafe" if s == SHRINK else s
            j = waiting.index(twin) if twin in waiting else len(waiting)
            p = project(s, cl, rates, costs, interval_s=intervals.get(s))
            r = simulate(s, cl, rates, costs, interval_s=p.interval_s, horizon_s=horizon_s, replicas=replicas,
                         seed=seed + 1000 * k + j)
            fail = math.fsum(p.breakdown()[c] for c in CLASSES)
            points.append({"gpus": cl.gpus, "nodes": cl.nodes, "spares": cl.spares, "strategy": s,
                           "interval_s": p.interval_s, "closed_form": p.tor, "failure_fraction": fail,
                           "simulated": r.tor, "ci95": r.ci95, "ci": [r.tor - r.ci95, r.tor + r.ci95],
                           "delta": p.tor - r.tor, "within_ci": abs(p.tor - r.tor) <= r.ci95,
                           "within_1pct": abs(p.tor - r.tor) <= 0.01, "events": r.events, "tiers": r.tiers,
                           "failures_during_recovery": r.during_recovery, "replacement_waits": r.waits,
                           "seed": r.seed, "shrink": None if s != SHRINK else {
                               "shrinks": r.shrinks, "grows": r.grows,
                               "degraded_wall_fraction": r.degraded_fraction,
                               "degraded_fraction": r.degraded_loss_fraction,
                               "closed_degraded_wall_fraction": p.shrink["degraded_wall_fraction"],
                               "closed_degraded_fraction": p.shrink["degraded_fraction"]}})
    return {"schema": SIMULATE_SCHEMA, **_inputs(cluster, rates, costs, measured, profile),
            "horizon_s": horizon_s, "replicas": replicas, "seed": seed, "points": points}


def simulation_text(d: dict[str, Any]) -> str:
    lines = [f"TOR: closed form (P) vs discrete-event simulation ({d['replicas']} replicas x "
             f"{_fmt_s(d['horizon_s'])}, seed {d['seed']})", *_header(d), ""]
    width = max(12, *(len(_LABEL[p["strategy"]]) + 1 for p in d["points"]))
    lines.append(f"  {'GPUs':>7} {'strategy':<{width}}{'interval':>10}{'closed':>9}{'simulated':>11}{'95% CI':>9}"
                 f"{'delta':>9}  {'failures':>8} {'during rec.':>11}  agree")
    for p in d["points"]:
        ok = "yes" if p["within_ci"] else ("~ (<1%)" if p["within_1pct"] else "NO: use the simulated value")
        nev = sum(p["events"].values())
        lines.append(f"  {p['gpus']:>7} {_LABEL[p['strategy']]:<{width}}{_fmt_s(p['interval_s']):>10}"
                     f"{p['closed_form']:>9.4f}{p['simulated']:>11.4f}{'±' + format(p['ci95'], '.4f'):>9}"
                     f"{p['delta']:>+9.4f}  {nev:>8} {p['failures_during_recovery']:>11}  {ok}")
    shrunk = [p for p in d["points"] if p.get("shrink")]
    if shrunk:
        lines += ["", "  shrink policy: share of the wall time at reduced size, and lost there (1 - D'/D of it), "
                      "simulated (closed form)"]
        for p in shrunk:
            sh = p["shrink"]
            lines.append(f"  {p['gpus']:>7}  {sh['shrinks']} shrinks, {sh['grows']} grows; at reduced size "
                         f"{100 * sh['degraded_wall_fraction']:.2f}% ({100 * sh['closed_degraded_wall_fraction']:.2f}%)"
                         f", lost {100 * sh['degraded_fraction']:.3f}% ({100 * sh['closed_degraded_fraction']:.3f}%)")
    lines.append("")
    lines.append("  agree: yes = the closed form is inside the simulator's 95 % CI; ~ = outside it but within 0.01 TOR;")
    lines.append("  NO = the first-order form is off (failures during recovery, MTBF near the recovery time).")
    return "\n".join(lines) + "\n"
