"""Spares or shrink: the two answers to a node loss that finds no idle spare, side by side over the number of
spares, and the setup to recommend for the cluster (docs/tor.md, "Continuing at a smaller data-parallel size").

The spares policy waits for a replacement node; the shrink policy continues at D' < D and grows back when the
replacement arrives (:mod:`.shrink`). Spares make both rarer, but they are nodes the job holds without training
on them, so besides TOR each setup is scored by ``tor_per_node`` = TOR x N / (N + spares): the share of the time
of every node held, spares included, that became kept training. The recommendation is the setup with the highest
``tor_per_node`` (ties: fewer spares, then the spares policy, which needs no resharding); the table shows TOR
itself too, for spares that other work uses while idle.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .classes import Cluster, Costs, Rates
from .errors import TorError
from .project import STRATEGIES, Projection, _spares_for, closed_point, project
from .shrink import SHRINK

__all__ = ["POLICY_CHOICES", "strategies_for", "spare_ladder", "compare_policies", "policy_lines"]

POLICY_CHOICES = ("spares", "shrink", "both")
_STRATEGY = {"spares": "shardsafe", "shrink": SHRINK}


def strategies_for(policy: str) -> tuple[str, ...]:
    """The strategies ``tor project``/``tor simulate`` show for ``--policy``: shardsafe under the chosen policy
    (both: side by side) beside memory-only snapshots and disk checkpoints, which wait for spares."""
    if policy not in POLICY_CHOICES:
        raise TorError(f"--policy {policy!r}: expected one of {', '.join(POLICY_CHOICES)}")
    drop = {"spares": {SHRINK}, "shrink": {"shardsafe"}, "both": set()}[policy]
    return tuple(s for s in STRATEGIES if s not in drop)


def spare_ladder(cluster: Cluster, rates: Rates, costs: Costs) -> list[int]:
    """The spare counts compared: 0, powers of two, the cluster's own, and the count beyond which a rack event
    waits with P < 1e-3 (more spares buy nothing)."""
    cap = _spares_for(cluster, rates, costs, 1e-3)
    steps = {0, cluster.spares, cap}
    k = 1
    while k < cap:
        steps.add(k)
        k *= 2
    return sorted(steps)


def compare_policies(cluster: Cluster, rates: Rates, costs: Costs, *,
                     refine: Callable[[Cluster, Projection], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Both policies at each count of :func:`spare_ladder`, each at its optimal interval, and the recommendation.

    ``refine`` gives the value where (P) breaks (the simulator's, :class:`shardsafe.tor.projection_report.Refiner`);
    without it every point is (P). Returns ``{rows: [{spares, nodes_share, policies: {spares|shrink: point}}],
    recommended, best_wait, highest_tor, at_spares, summary}``; a point is ``{tor, tor_closed, tor_source, ci95,
    ci, failure_fraction, simulation, interval_s, tor_per_node, p_no_spare, degraded_wall_fraction}``."""
    n = cluster.nodes
    rows = []
    for s in spare_ladder(cluster, rates, costs):
        cl = dataclasses.replace(cluster, spares=s)
        row: dict[str, Any] = {"spares": s, "nodes_share": s / n, "policies": {}}
        for policy, strategy in _STRATEGY.items():
            p = project(strategy, cl, rates, costs)
            pt = refine(cl, p) if refine is not None else closed_point(p)
            row["policies"][policy] = {
                **pt, "interval_s": p.interval_s, "tor_per_node": pt["tor"] * n / (n + s),
                "p_no_spare": p.classes["node"].p_no_spare,
                "degraded_wall_fraction": (p.shrink or {}).get("degraded_wall_fraction", 0.0)}
        rows.append(row)
    cands = [(row, policy) for row in rows for policy in _STRATEGY]

    def pick(key: Callable[[dict[str, Any], str], float], among: list) -> dict[str, Any]:
        # Highest first; ties (within 0.001, below what these inputs tell apart) go to fewer spares, then to the
        # spares policy (it needs no resharding).
        best = max(key(r, p) for r, p in among)
        row, policy = min(((r, p) for r, p in among if key(r, p) >= best - 1e-3),
                          key=lambda rp: (rp[0]["spares"], rp[1] != "spares"))
        return {"policy": policy, "spares": row["spares"], **{k: row["policies"][policy][k] for k in (
            "tor", "tor_per_node", "tor_source", "ci95", "tor_closed", "interval_s", "p_no_spare",
            "degraded_wall_fraction")}}

    per_node = lambda r, p: r["policies"][p]["tor_per_node"]  # noqa: E731
    rec = pick(per_node, cands)
    wait = pick(per_node, [(r, p) for r, p in cands if p == "spares"])
    top = pick(lambda r, p: r["policies"][p]["tor"], cands)
    here = next(r for r in rows if r["spares"] == cluster.spares)["policies"]
    at = {"spares": cluster.spares, "policies": {
        p: {k: here[p][k] for k in ("tor", "tor_per_node", "tor_source", "ci95")} for p in _STRATEGY}}
    return {"rows": rows, "recommended": rec, "best_wait": wait, "highest_tor": top, "at_spares": at,
            "objective": "tor_per_node = TOR x nodes / (nodes + spares)", "summary": _summary(rec, wait, top, n)}


def _setup(x: dict[str, Any]) -> str:
    how = "shrink" if x["policy"] == "shrink" else "wait for spares"
    return f"{how} with {x['spares']} spare(s)"


def _summary(rec: dict[str, Any], wait: dict[str, Any], top: dict[str, Any], nodes: int) -> str:
    out = (f"{_setup(rec)}: TOR {rec['tor']:.4f}, {rec['tor_per_node']:.4f} per node held (spares included)")
    if rec["policy"] == "shrink":
        out += (f"; waiting for spares does best per node held with {wait['spares']} spare(s): TOR "
                f"{wait['tor']:.4f}, {wait['tor_per_node']:.4f} per node held")
    if (top["policy"], top["spares"]) != (rec["policy"], rec["spares"]):
        out += (f"; the highest TOR, {top['tor']:.4f}, takes {_setup(top)} "
                f"({100 * top['spares'] / nodes:.1f}% more nodes)")
    return out


def _cell(pt: dict[str, Any]) -> str:
    star = "*" if pt.get("tor_source") == "simulated" else " "
    ci = f"±{pt['ci95']:.4f}" if pt.get("ci95") is not None else ""
    return f"{pt['tor']:>8.4f}{star}{ci:>8}{pt['tor_per_node']:>9.4f}"


def policy_lines(d: dict[str, Any], shrink: dict[str, Any] | None) -> list[str]:
    """The comparison as text: the sizes the job shrinks to, a row per spare count, the recommendation."""
    lines = ["", "  a node loss with no idle spare: wait for a replacement (spares) or continue at a smaller "
                 "data-parallel size D' (shrink)"]
    if shrink:
        lines.append(f"    D = {shrink['dp']} ({shrink['model_parallel_gpus']} GPUs per model replica"
                     + (f", global batch {shrink['global_batch']} micro-batches" if shrink["global_batch"] else "")
                     + f"); without a node D' = {shrink['dp_after_node']} (throughput "
                     f"{shrink['throughput_after_node']:.4f}), without a rack D' = {shrink['dp_after_rack']} "
                     f"({shrink['throughput_after_rack']:.4f})")
    lines.append(f"    {'spares':>7}{'+nodes':>8}   {'wait: TOR':>10}{'±95%':>8}{'per node':>9}"
                 f"   {'shrink: TOR':>11}{'±95%':>7}{'per node':>9}{'degraded':>10}")
    for r in d["rows"]:
        wait, shrink_pt = r["policies"]["spares"], r["policies"]["shrink"]
        lines.append(f"    {r['spares']:>7}{100 * r['nodes_share']:>7.1f}%   {_cell(wait)}   {_cell(shrink_pt)}"
                     f"{100 * shrink_pt['degraded_wall_fraction']:>9.1f}%")
    lines.append("    per node = TOR x nodes / (nodes + spares): idle spares are nodes held without training; "
                 "degraded = wall time at D' (shrink)")
    lines.append(f"  recommended: {d['summary']}")
    return lines
