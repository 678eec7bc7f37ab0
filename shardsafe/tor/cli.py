"""``shardsafe tor ...`` and ``python -m shardsafe.tor ...``: the TOR command line."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence

from .accounting import compute_tor
from .classes import CLASSES, Cluster, Costs, Rates
from .events import EVENTS_FILE, read_events
from .inputs import costs_from_mapping, load_mapping, measured_costs, rates_from_file, resolve_run_dir
from .plot import plot_timeline
from .project import DEFAULT_SIM_REPLICAS, DEFAULT_SWEEP_GPUS, SIM_FAILURES_PER_REPLICA, STRATEGIES
from .report import report_dict, report_text
from .errors import TorError

__all__ = ["register_cli", "main"]


def _finite(what: str = ""):
    """An argparse type: a finite number >= 0 (``what`` names it in the message)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or v < 0:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what + ', ' if what else ''}a finite number >= 0")
        return v
    return parse


_seconds = _finite("seconds")


def _whole(low: int, what: str = ""):
    """An argparse type: a whole number >= ``low`` (``what`` names its unit in the message)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < low:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number{' of ' + what if what else ''} "
                                             f">= {low}")
        return v
    return parse


_iterations = _whole(1, "iterations")


def _cmd_report(args: argparse.Namespace) -> int:
    try:
        where = resolve_run_dir(args.run_dir)
        if where != Path(args.run_dir):
            # A demo's --run-dir holds reference/ (no failures) and run/ (the protected run): report the latter.
            print(f"shardsafe tor report: no {EVENTS_FILE} in {args.run_dir}; reporting the protected run in {where}",
                  file=sys.stderr)
        events = read_events(where)
        report = compute_tor(events, ideal_iteration_s=args.ideal_iteration_s, ckpt_save_s=args.ckpt_save_s,
                             ckpt_load_s=args.ckpt_load_s, mtbf_s=args.mtbf_s,
                             snapshot_interval=args.snapshot_interval)
    except (OSError, ValueError) as e:  # TorError is a ValueError
        print(f"shardsafe tor report: {e}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            out = plot_timeline(events, report, args.plot)
        except (OSError, ImportError) as e:
            print(f"shardsafe tor report: cannot write the plot {args.plot}: {e}", file=sys.stderr)
            return 2
        print(f"timeline written to {out}", file=sys.stderr)  # stderr: --json keeps stdout to one object
    if args.json:
        sys.stdout.write(json.dumps(report_dict(report), allow_nan=False) + "\n")
    else:
        sys.stdout.write(report_text(report))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# project / simulate
# ---------------------------------------------------------------------------------------------------------------

_COST_HELP = {
    "detect_s": "fault to detection", "restart_s": "detection to trainers started (scheduler, rendezvous)",
    "startup_s": "trainer start to ready, restore excluded", "restore_memory_s": "restore from holder memory",
    "restore_parity_s": "restore with lost members rebuilt from parity",
    "restore_persistent_s": "restore from shardsafe's persistent tier",
    "snapshot_stall_s": "training stall per in-memory snapshot (C)",
    "persist_interval_s": "productive seconds between versions flushed to the persistent tier",
    "disk_save_s": "blocking save of one disk checkpoint", "disk_load_s": "load of one disk checkpoint",
    "replace_wait_s": "wait for a replacement node when no spare is idle",
    "repair_h": "hours a lost node is away before it is a spare again",
    "slow_detect_s": "fail-slow onset to detection", "slowdown": "fraction of throughput lost while a node is slow",
}


_positive_int = _whole(0)


_number = _finite()


def _gpu_list(text: str) -> list[int]:
    try:
        vals = [int(float(x)) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected GPU counts separated by commas, "
                                         "e.g. 1024,16384,100000") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: expected GPU counts >= 1 separated by commas")
    return vals


def _add_inputs(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=_positive_int, metavar="N", help="GPUs of the job (default 16384; or --nodes)")
    c.add_argument("--nodes", type=_positive_int, metavar="N", help="nodes of the job (spares not included)")
    c.add_argument("--gpus-per-node", type=_positive_int, default=8, metavar="G")
    c.add_argument("--rack-nodes", type=_positive_int, default=16, metavar="R",
                   help="nodes per rack: what one correlated (rack) event takes (default 16)")
    c.add_argument("--group-nodes", type=_positive_int, default=8, metavar="n", help="parity group size n (default 8)")
    c.add_argument("--parity-m", type=_positive_int, default=1, metavar="m",
                   help="members a group may lose and still rebuild from parity (default 1)")
    c.add_argument("--spares", type=_positive_int, default=0, metavar="S", help="idle spare nodes (default 0)")
    c.add_argument("--no-spread", action="store_true",
                   help="parity groups of consecutive nodes instead of one member per rack (the placement rule)")
    r = p.add_argument_group("failure rates (default: --profile llama3)")
    r.add_argument("--profile", metavar="NAME", help="a published profile: " + ", ".join(_profile_names()))
    r.add_argument("--rates", metavar="FILE", help="JSON/YAML {process, node, rack, slow} per node-hour "
                                                   "(or per: gpu-hour with gpus_per_node)")
    for cl in CLASSES:
        r.add_argument(f"--rate-{cl}", type=_number, metavar="R", help=f"{cl} failures per node-hour (overrides)")
    r.add_argument("--per-gpu-hour", action="store_true", help="the --rate-* flags are per GPU-hour")
    k = p.add_argument_group("shardsafe's costs (defaults < --costs < --from < flags)")
    k.add_argument("--from", dest="from_run", metavar="RUN_DIR",
                   help="costs measured by a run (its events.jsonl; a demo's --run-dir too), as `tor report` prints them")
    k.add_argument("--costs", metavar="FILE", help="JSON/YAML of Costs fields, or a bench/snapshot_bench.py --json output")
    for f in Costs.field_names():
        k.add_argument("--" + f.replace("_", "-"), dest="cost_" + f, type=_number, metavar="X", help=_COST_HELP.get(f))
    o = p.add_argument_group("intervals")
    o.add_argument("--interval-s", type=_seconds, metavar="S", help="snapshot interval (default: optimal)")
    o.add_argument("--disk-interval-s", type=_seconds, metavar="S", help="disk checkpoint interval (default: optimal)")


def _profile_names() -> list[str]:
    from .profiles import PROFILES
    return list(PROFILES)


def _build_inputs(args: argparse.Namespace) -> tuple[Cluster, Rates, Costs, dict[str, float], dict | None, list[str]]:
    """Cluster, rates, costs from the flags (ValueError with the flag to fix); also what was measured, the
    profile (for the output) and notes for stderr."""
    from .profiles import get_profile

    notes: list[str] = []
    profile = None
    if args.rates and args.profile:
        raise TorError("pass --profile or --rates, not both")
    if args.rates:
        rates = rates_from_file(args.rates)
        base = rates.as_dict()
        source = rates.source
    else:
        explicit = any(getattr(args, "rate_" + c) is not None for c in CLASSES)
        name = args.profile or (None if explicit else "llama3")
        base = dict.fromkeys(CLASSES, 0.0)
        source = "flags"
        if name:
            prof = get_profile(name)
            profile = prof.as_dict()
            base = prof.rates().as_dict()
            source = f"profile {name}: {prof.source}"
    scale = float(args.gpus_per_node) if args.per_gpu_hour else 1.0
    flagged = {c: getattr(args, "rate_" + c) * scale for c in CLASSES if getattr(args, "rate_" + c) is not None}
    if flagged:
        source += " + flags (" + ", ".join(flagged) + ")"
    rates = Rates(**{**base, **flagged}, source=source)

    if args.nodes is not None and args.gpus is not None:
        raise TorError("pass --gpus or --nodes, not both")
    nodes = args.nodes if args.nodes is not None else -(-(args.gpus or 16384) // args.gpus_per_node)
    cluster = Cluster(nodes=nodes, gpus_per_node=args.gpus_per_node, rack_nodes=args.rack_nodes,
                      group_nodes=args.group_nodes, parity_m=args.parity_m, spares=args.spares,
                      spread=not args.no_spread)

    vals: dict[str, float] = {}
    sources = []
    if args.costs:
        vals.update(costs_from_mapping(load_mapping(args.costs, "--costs"), f"file {args.costs}"))
        sources.append(f"file {args.costs}")
    measured: dict[str, float] = {}
    if args.from_run:
        measured, rep, where = measured_costs(args.from_run)
        if not measured:
            notes.append(f"--from {where}: the run measured no costs (no failures, no snapshots); defaults kept")
        vals.update(measured)
        n = sum(d["failures"] for d in rep.by_class.values())
        sources.append(f"run {where} ({n} failure(s))")
    flags = {f: getattr(args, "cost_" + f) for f in Costs.field_names() if getattr(args, "cost_" + f) is not None}
    if flags:
        sources.append("flags")
    vals.update(flags)
    costs = Costs(**vals, source=" + ".join(["defaults", *sources]))
    return cluster, rates, costs, measured, profile, notes


def _fail(cmd: str, e: BaseException) -> int:
    print(f"shardsafe tor {cmd}: {e}", file=sys.stderr)
    return 2


def _cmd_project(args: argparse.Namespace) -> int:
    from .projection_report import projection_dict, projection_text

    try:
        cluster, rates, costs, measured, profile, notes = _build_inputs(args)
        if args.target_tor is not None and not 0 < args.target_tor < 1:
            raise TorError(f"--target-tor {args.target_tor}: expected a fraction in (0, 1), e.g. 0.95")
        if args.no_simulate and (args.sim_replicas is not None or args.sim_seed is not None):
            raise TorError("pass --no-simulate or --sim-replicas/--sim-seed, not both")
        sweep_gpus = args.sweep if args.sweep is not None else (list(DEFAULT_SWEEP_GPUS) if args.plot else None)
        d = projection_dict(cluster, rates, costs, interval_s=args.interval_s, disk_interval_s=args.disk_interval_s,
                            sweep_gpus=sweep_gpus, target_tor=args.target_tor, measured=measured, profile=profile,
                            simulate_flagged=not args.no_simulate,
                            sim_replicas=args.sim_replicas or DEFAULT_SIM_REPLICAS, sim_seed=args.sim_seed or 0)
    except (OSError, ValueError) as e:  # TorError is a ValueError
        return _fail("project", e)
    for n in notes:
        print(f"shardsafe tor project: {n}", file=sys.stderr)
    if args.plot:
        from .plot import plot_sweep
        try:
            out = plot_sweep(d["sweep"], args.plot, title=f"TOR vs GPUs; rates: {rates.source[:90]}")
        except (OSError, ImportError, ValueError) as e:
            return _fail("project", f"cannot write the plot {args.plot}: {e}")
        print(f"sweep plot written to {out}", file=sys.stderr)
    sys.stdout.write(json.dumps(d, allow_nan=False) + "\n" if args.json else projection_text(d))
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from .projection_report import simulation_dict, simulation_text

    try:
        cluster, rates, costs, measured, profile, notes = _build_inputs(args)
        strategies = STRATEGIES if args.strategy == "all" else (args.strategy,)
        d = simulation_dict(cluster, rates, costs, strategies=strategies, gpus=args.sweep,
                            interval_s=args.interval_s, disk_interval_s=args.disk_interval_s,
                            horizon_s=args.horizon_days * 86400.0, replicas=args.replicas, seed=args.seed,
                            measured=measured, profile=profile)
    except (OSError, ValueError) as e:
        return _fail("simulate", e)
    for n in notes:
        print(f"shardsafe tor simulate: {n}", file=sys.stderr)
    sys.stdout.write(json.dumps(d, allow_nan=False) + "\n" if args.json else simulation_text(d))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``tor report|project|simulate`` to a ``shardsafe`` subparsers object; dispatch via ``args.func(args)``."""
    p = subparsers.add_parser("tor", help="Training Overhead Ratio: report a run; project and simulate a cluster",
                              description="Training Overhead Ratio accounting (docs/tor.md).")
    sub = p.add_subparsers(dest="tor_command", metavar="COMMAND", required=True)
    r = sub.add_parser("report", help="TOR of a run from RUN_DIR/events.jsonl",
                       description="Print TOR, where T_obs - T_opt went, and the TOR model for a run.")
    r.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding events.jsonl (or the file itself)")
    r.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    r.add_argument("--plot", metavar="FILE.png", help="also write a PNG timeline")
    r.add_argument("--ideal-iteration-s", type=_seconds, metavar="S",
                   help="ideal seconds per iteration (default: median over attempts without failures)")
    r.add_argument("--ckpt-save-s", type=_seconds, metavar="S",
                   help="disk checkpoint save time for the baseline (default: baseline_checkpoint events)")
    r.add_argument("--ckpt-load-s", type=_seconds, metavar="S",
                   help="disk checkpoint load time for the baseline (default: baseline_checkpoint events)")
    r.add_argument("--mtbf-s", type=_seconds, metavar="S", help="MTBF for the model (default: observed)")
    r.add_argument("--snapshot-interval", type=_iterations, metavar="N",
                   help="snapshot interval in iterations for the model (default: from snapshot versions)")
    r.set_defaults(func=_cmd_report)

    pj = sub.add_parser("project", help="TOR at cluster scale: shardsafe vs memory-only vs disk, per failure class",
                        description="Project TOR to a cluster (docs/tor.md, \"TOR at cluster scale\"): shardsafe at "
                                    "its optimal interval and parity m, memory-only snapshots, and disk checkpoints "
                                    "at their own optimal interval; T_obs - T_opt by failure class; a sweep over scale.")
    _add_inputs(pj)
    pj.add_argument("--target-tor", type=float, metavar="T", help="recommend interval, m and spares for this TOR")
    pj.add_argument("--sweep", type=_gpu_list, metavar="GPUS", nargs="?", const=list(DEFAULT_SWEEP_GPUS),
                    help="also TOR at these GPU counts (comma-separated; default "
                         + ",".join(map(str, DEFAULT_SWEEP_GPUS)) + ")")
    sv = pj.add_argument_group("where the closed form breaks (failures take > 10% of the wall time)")
    sv.add_argument("--sim-replicas", type=_whole(2, "replicas"), metavar="K",
                    help=f"simulate such points with K replicas (default {DEFAULT_SIM_REPLICAS}; "
                         f"each of ~{SIM_FAILURES_PER_REPLICA} failures) and report the simulated TOR")
    sv.add_argument("--sim-seed", type=_positive_int, metavar="N", help="seed of those simulations (default 0)")
    sv.add_argument("--no-simulate", action="store_true",
                    help="report the first-order closed form (P) everywhere, with a note where it is off")
    pj.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    pj.add_argument("--plot", metavar="FILE.png", help="write TOR versus GPUs for the three strategies (implies --sweep)")
    pj.set_defaults(func=_cmd_project)

    sm = sub.add_parser("simulate", help="Monte Carlo of the same cluster: checks the closed form, with a 95%% CI",
                        description="A discrete-event simulation of the cluster, its failure processes and costs "
                                    "(docs/tor.md, \"The simulator\"), at the closed form's intervals; prints both.")
    _add_inputs(sm)
    sm.add_argument("--strategy", choices=("all", *STRATEGIES), default="all")
    sm.add_argument("--sweep", type=_gpu_list, metavar="GPUS", nargs="?", const=list(DEFAULT_SWEEP_GPUS),
                    help="simulate at these GPU counts instead of the one cluster")
    sm.add_argument("--replicas", type=_iterations, default=40, metavar="K", help="independent runs (default 40)")
    sm.add_argument("--horizon-days", type=_seconds, default=30.0, metavar="D", help="simulated days per run (30)")
    sm.add_argument("--seed", type=_positive_int, default=0)
    sm.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    sm.set_defaults(func=_cmd_simulate)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shardsafe.tor report|project|simulate ...`` (the same as ``shardsafe tor ...``)."""
    parser = argparse.ArgumentParser(prog="python -m shardsafe.tor")
    sub = parser.add_subparsers(dest="command", required=True)
    register_cli(sub)
    args = parser.parse_args(["tor", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)

