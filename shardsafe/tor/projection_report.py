"""What ``shardsafe tor project`` and ``shardsafe tor simulate`` print: one JSON-ready dict each, and its text.

The text is rendered from the dict, so ``--json`` and the table always show the same numbers.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from .classes import CLASSES, Cluster, Costs, Rates
from .project import PARTS, STRATEGIES, project, recommend, sweep
from .simulate import simulate

__all__ = ["PROJECT_SCHEMA", "SIMULATE_SCHEMA", "projection_dict", "projection_text", "simulation_dict",
           "simulation_text"]

PROJECT_SCHEMA = "shardsafe.tor.project/1"
SIMULATE_SCHEMA = "shardsafe.tor.simulate/1"
_LABEL = {"shardsafe": "shardsafe", "memory_only": "memory-only", "disk": "disk ckpt"}
_SHORT = {"detection": "detect", "restart": "restart", "startup": "startup", "restore": "restore",
          "replacement_wait": "wait", "lost_work": "lost", "slowdown": "slow"}


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
                    profile: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything ``shardsafe tor project`` reports (schema :data:`PROJECT_SCHEMA`, see docs/tor.md)."""
    intervals = {"shardsafe": interval_s, "memory_only": interval_s, "disk": disk_interval_s}
    strategies = {s: project(s, cluster, rates, costs, interval_s=intervals[s]).as_dict() for s in STRATEGIES}
    out = {"schema": PROJECT_SCHEMA, **_inputs(cluster, rates, costs, measured, profile),
           "strategies": strategies, "recommendation": None, "sweep": None}
    if target_tor is not None:
        out["recommendation"] = recommend(cluster, rates, costs, target_tor)
    if sweep_gpus:
        out["sweep"] = sweep(cluster, rates, costs, sweep_gpus, intervals=intervals)
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
    if meas:
        lines.append("           measured: " + ", ".join(f"{k}={v:.4g}" for k, v in meas.items()))
    return lines


def projection_text(d: dict[str, Any]) -> str:
    st = d["strategies"]
    lines = ["TOR projection (first-order closed form, docs/tor.md equation (P))", *_header(d), ""]
    lines.append("  T_obs - T_opt as % of T_obs, by failure class and snapshot stall (sums to 1 - TOR):")
    lines.append(f"  {'strategy':<16}{'interval':>10}{'TOR':>8}" + "".join(f"{c:>9}" for c in (*CLASSES, "stall")))
    for s in STRATEGIES:
        p = st[s]
        br = p["breakdown"]
        cells = "".join(f"{100 * br[c]:>8.2f}%" for c in (*CLASSES, "snapshot_stall"))
        m = f" (m={p['parity_m']})" if s == "shardsafe" else ""
        lines.append(f"  {_LABEL[s] + m:<16}{_fmt_s(p['interval_s']):>10}{p['tor']:>8.4f}{cells}")
    p = st["shardsafe"]
    lines += ["", f"  shardsafe per class: job events per hour, restore tiers, mean seconds per event (wait = for a "
                  f"replacement node; persistent versions every {_fmt_s(p['persist_interval_s'])})"]
    lines.append(f"    {'class':<8}{'per h':>8}  {'tiers':<32}" + "".join(f"{_SHORT[x]:>9}" for x in PARTS) + f"{'total':>9}")
    for c, cc in p["classes"].items():
        tiers = ", ".join(f"{t} {v:.3g}" for t, v in cc["tiers"].items() if v > 0)
        lines.append(f"    {c:<8}{cc['per_hour']:>8.4f}  {tiers:<32}"
                     + "".join(f"{cc['parts_s'][x]:>9.1f}" for x in PARTS) + f"{cc['seconds_per_event']:>9.1f}")
    node = p["classes"]["node"]
    lines.append(f"    a node loss finds no idle spare with P = {node['p_no_spare']:.3g}; its group loses more than "
                 f"m before it is healed with P = {node['p_beyond_m']:.3g}")
    for s in STRATEGIES:
        lines.extend(f"  note ({_LABEL[s]}): {n}" for n in st[s]["notes"])
    rec = d.get("recommendation")
    if rec:
        lines.append("")
        verb = "reaches" if rec["reached"] else "does NOT reach; best found"
        lines.append(f"  target TOR {rec['target_tor']:.3f}: m={rec['parity_m']}, {rec['spares']} spare(s), snapshot "
                     f"every {_fmt_s(rec['interval_s'])} {verb}: TOR {rec['tor']:.4f} (no spare: P={rec['p_no_spare']:.2g}, "
                     f"beyond m: P={rec['p_beyond_m']:.2g})")
        if not rec["reached"]:
            lines.append("    the recovery path itself (detection + restart + startup) then dominates: shorten it "
                         "(--detect-s, --restart-s, --startup-s) or add spares")
    if d.get("sweep"):
        lines += ["", "  TOR versus scale (each strategy at its optimal interval unless one was given; spares scale "
                      "with the nodes):",
                  f"    {'GPUs':>8}{'nodes':>8}{'spares':>8}" + "".join(f"{_LABEL[s]:>13}" for s in STRATEGIES)]
        for row in d["sweep"]:
            lines.append(f"    {row['gpus']:>8}{row['nodes']:>8}{row['spares']:>8}"
                         + "".join(f"{row[s]:>13.4f}" for s in STRATEGIES))
    return "\n".join(lines) + "\n"


def simulation_dict(cluster: Cluster, rates: Rates, costs: Costs, *, strategies: Sequence[str] = STRATEGIES,
                    gpus: Sequence[int] | None = None, interval_s: float | None = None,
                    disk_interval_s: float | None = None, horizon_s: float, replicas: int, seed: int,
                    measured: dict[str, float] | None = None, profile: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """The simulator against the closed form at each scale and strategy, at the closed form's interval
    (schema :data:`SIMULATE_SCHEMA`)."""
    from .project import at_scale

    intervals = {"shardsafe": interval_s, "memory_only": interval_s, "disk": disk_interval_s}
    points = []
    scales = list(gpus) if gpus else [cluster.gpus]
    for k, g in enumerate(scales):
        cl = cluster if not gpus else at_scale(cluster, g)
        for j, s in enumerate(strategies):
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
                           "seed": r.seed})
    return {"schema": SIMULATE_SCHEMA, **_inputs(cluster, rates, costs, measured, profile),
            "horizon_s": horizon_s, "replicas": replicas, "seed": seed, "points": points}


def simulation_text(d: dict[str, Any]) -> str:
    lines = [f"TOR: closed form (P) vs discrete-event simulation ({d['replicas']} replicas x "
             f"{_fmt_s(d['horizon_s'])}, seed {d['seed']})", *_header(d), ""]
    lines.append(f"  {'GPUs':>7} {'strategy':<12}{'interval':>10}{'closed':>9}{'simulated':>11}{'95% CI':>9}"
                 f"{'delta':>9}  {'failures':>8} {'during rec.':>11}  agree")
    for p in d["points"]:
        ok = "yes" if p["within_ci"] else ("~ (<1%)" if p["within_1pct"] else "NO: use the simulated value")
        nev = sum(p["events"].values())
        lines.append(f"  {p['gpus']:>7} {_LABEL[p['strategy']]:<12}{_fmt_s(p['interval_s']):>10}"
                     f"{p['closed_form']:>9.4f}{p['simulated']:>11.4f}{'±' + format(p['ci95'], '.4f'):>9}"
                     f"{p['delta']:>+9.4f}  {nev:>8} {p['failures_during_recovery']:>11}  {ok}")
    lines.append("")
    lines.append("  agree: yes = the closed form is inside the simulator's 95 % CI; ~ = outside it but within 0.01 TOR;")
    lines.append("  NO = the first-order form is off (failures during recovery, MTBF near the recovery time).")
    return "\n".join(lines) + "\n"
