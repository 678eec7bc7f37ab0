"""``shardsafe tor ...`` and ``python -m shardsafe.tor ...``: the TOR command line."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from .accounting import compute_tor
from .classes import CLASSES, Cluster, Costs, Rates
from .events import EVENTS_FILE, read_events
from . import growth
from .inputs import costs_from_mapping, load_mapping, measured_costs, rates_from_file, resolve_run_dir
from .plot import plot_timeline
from .policy import POLICY_CHOICES, strategies_for
from .project import DEFAULT_SIM_REPLICAS, DEFAULT_SWEEP_GPUS, SIM_FAILURES_PER_REPLICA, STRATEGIES
from .report import report_dict, report_text
from .errors import TorError
from ..cliargs import Parser, hidden_alias, number, usage_error, whole

__all__ = ["register_cli", "main"]

_seconds = number("seconds")
_positive_seconds = number("seconds", positive=True)
_iterations = whole(1, "iterations")


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
        return _fail("report", e)
    if args.plot:
        try:
            out = plot_timeline(events, report, args.plot)
        except (OSError, ImportError) as e:
            return _fail("report", f"cannot write the plot {args.plot}: {e}")
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
    "shrink_after_s": "shrink policy: the launcher's wait for a spare before it re-forms the job smaller",
    "reshard_restore_s": "shrink policy: a restore at another data-parallel size, the re-partition included",
}


_count = whole(0)
_at_least_one = whole(1)
_number = number()


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
    c.add_argument("--gpus", type=whole(1, "GPUs"), metavar="N",
                   help="GPUs of the job (default: 16384, or --nnodes x --gpus-per-node)")
    hidden_alias(c, "--nodes", c.add_argument(
        "--nnodes", dest="nodes", type=whole(1, "nodes"), metavar="N",
        help="nodes of the job, spares not included (default: --gpus / --gpus-per-node)"))
    c.add_argument("--gpus-per-node", type=whole(1, "GPUs"), default=8, metavar="G", help="GPUs per node")
    c.add_argument("--rack-nodes", type=_at_least_one, default=16, metavar="R",
                   help="nodes per rack: what one correlated (rack) event takes")
    c.add_argument("--group-nodes", type=_at_least_one, default=8, metavar="n", help="parity group size n")
    c.add_argument("--parity-m", type=_count, default=1, metavar="m",
                   help="members a group may lose and still rebuild from parity")
    c.add_argument("--spares", type=_count, default=0, metavar="S", help="idle spare nodes")
    c.add_argument("--no-spread", action="store_true",
                   help="parity groups of consecutive nodes instead of one member per rack (the placement rule)")
    c.add_argument("--model-parallel-gpus", type=_at_least_one, metavar="MP",
                   help="GPUs one model replica spans, TP x PP x CP (default: one node); the shrink policy's D' "
                        "counts whole replicas")
    c.add_argument("--global-batch", type=_at_least_one, metavar="B",
                   help="global batch in micro-batches, a multiple of the data-parallel size; a smaller size D' "
                        "must divide it (default: any D')")
    pol = p.add_argument_group("policy (docs/tor.md, \"Continuing at a smaller data-parallel size\")")
    pol.add_argument("--policy", choices=POLICY_CHOICES, default="both",
                     help="a node loss with no idle spare: wait for a replacement (spares), continue at a smaller "
                          "data-parallel size until it comes (shrink), or show both side by side (default: both)")
    r = p.add_argument_group("failure rates (default: --profile llama3)")
    r.add_argument("--profile", metavar="NAME", help="a published profile (default: llama3 unless --rates or a "
                                                     "--rate-* flag is given): " + ", ".join(_profile_names()))
    r.add_argument("--rates", metavar="FILE", help="JSON/YAML {process, node, rack, slow} per node-hour "
                                                   "(or per: gpu-hour with gpus_per_node) (default: none)")
    for cl in CLASSES:
        r.add_argument(f"--rate-{cl}", type=_number, metavar="R",
                       help=f"{cl} failures per node-hour (default: the profile's or the file's)")
    r.add_argument("--per-gpu-hour", action="store_true", help="the --rate-* flags are per GPU-hour")
    k = p.add_argument_group("shardsafe's costs (defaults < --costs < --from < flags)")
    k.add_argument("--from", dest="from_run", metavar="RUN_DIR|BENCH_JSON",
                   help="costs measured by a run (its events.jsonl; a demo's --run-dir too), as `tor report` prints "
                        "them; or a bench/control_plane_bench.py --json file, as --from-bench (default: none)")
    k.add_argument("--from-bench", metavar="FILE",
                   help="bench/control_plane_bench.py --json output: detection, restart (re-rendezvous), startup, "
                        "restore and the commit vote measured at several rank counts, fitted as functions of N and "
                        "evaluated at the job's GPUs, one rank each (default: none)")
    k.add_argument("--bench-fit", choices=("best", "power", "log"), default="best",
                   help="growth law fitted to the bench's costs: power a*N^b, log a + b*log2(N), or the better one "
                        "of the two per cost (default: best)")
    k.add_argument("--costs", metavar="FILE", help="JSON/YAML of Costs fields, or a bench/snapshot_bench.py --json "
                                                   "output (default: none)")
    defaults = Costs()
    for f in Costs.field_names():
        k.add_argument("--" + f.replace("_", "-"), dest="cost_" + f, type=_number, metavar="X",
                       help=f"{_COST_HELP.get(f, f)} (default: {getattr(defaults, f)!r}, or --costs / --from)")
    o = p.add_argument_group("intervals")
    o.add_argument("--interval-s", type=_positive_seconds, metavar="S", help="snapshot interval (default: optimal)")
    o.add_argument("--disk-interval-s", type=_positive_seconds, metavar="S",
                   help="disk checkpoint interval (default: optimal)")


def _profile_names() -> list[str]:
    from .profiles import PROFILES
    return list(PROFILES)


def _build_inputs(args: argparse.Namespace) -> tuple[Cluster, Rates, Costs, dict[str, float], dict | None, list[str],
                                                  "BenchInputs | None"]:
    """Cluster, rates, costs from the flags (ValueError with the flag to fix); also what was measured, the
    profile (for the output), notes for stderr, and the bench's fitted costs when one was given."""
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
        raise TorError("pass --gpus or --nnodes, not both")
    gpus = args.gpus if args.gpus is not None else 16384
    nodes = args.nodes if args.nodes is not None else -(-gpus // args.gpus_per_node)
    cluster = Cluster(nodes=nodes, gpus_per_node=args.gpus_per_node, rack_nodes=args.rack_nodes,
                      group_nodes=args.group_nodes, parity_m=args.parity_m, spares=args.spares,
                      spread=not args.no_spread, model_parallel_gpus=args.model_parallel_gpus,
                      global_batch=args.global_batch)

    vals: dict[str, float] = {}
    sources = []
    if args.costs:
        vals.update(costs_from_mapping(load_mapping(args.costs, "--costs"), f"file {args.costs}"))
        sources.append(f"file {args.costs}")
    measured: dict[str, float] = {}
    bench_path = args.from_bench
    if args.from_run and growth.is_bench_file(args.from_run):
        if bench_path:
            raise TorError("--from names a bench JSON and --from-bench another: pass one of them")
        bench_path = args.from_run
    elif args.from_run:
        measured, rep, where = measured_costs(args.from_run)
        if not measured:
            notes.append(f"--from {where}: the run measured no costs (no failures, no snapshots); defaults kept")
        vals.update(measured)
        n = sum(d["failures"] for d in rep.by_class.values())
        sources.append(f"run {where} ({n} failure(s))")
    flags = {f: getattr(args, "cost_" + f) for f in Costs.field_names() if getattr(args, "cost_" + f) is not None}
    bench = None
    if bench_path:
        bench = BenchInputs(growth.BenchGrowth(growth.load_bench(bench_path), form=args.bench_fit,
                                               source=f"bench {bench_path}"), vals, flags)
        vals = bench.values(cluster.gpus)
        measured.update(bench.measured(cluster.gpus))
        sources.append(f"bench {bench_path} (fitted, at {cluster.gpus} ranks)")
    else:
        vals.update(flags)
    if flags:
        sources.append("flags")
    costs = Costs(**vals, source=" + ".join(["defaults", *sources]))
    return cluster, rates, costs, measured, profile, notes, bench


class BenchInputs:
    """The costs of ``--from-bench`` at any scale: the layers below it (defaults, --costs, --from RUN_DIR) with the
    bench's fitted costs at that many ranks on top, then the flags. ``--snapshot-stall-s`` (else the layers') is the
    copy's stall; the bench's commit vote is added to it (shardsafe.tor.growth.BenchGrowth.costs)."""

    def __init__(self, fitted: "growth.BenchGrowth", below: dict[str, float], flags: dict[str, float]):
        self.fitted, self.below, self.flags = fitted, dict(below), dict(flags)
        self.base_stall_s = flags.get("snapshot_stall_s", below.get("snapshot_stall_s", Costs().snapshot_stall_s))

    def measured(self, ranks: int) -> dict[str, float]:
        return {k: v for k, v in self.fitted.costs(ranks, self.base_stall_s).items()
                if k not in self.flags or k == "snapshot_stall_s"}

    def values(self, ranks: int) -> dict[str, float]:
        flags = {k: v for k, v in self.flags.items() if k != "snapshot_stall_s"}
        return {**self.below, **self.fitted.costs(ranks, self.base_stall_s), **flags}

    def costs_at(self, gpus: int) -> Costs:
        return Costs(**self.values(gpus), source=f"defaults + {self.fitted.source} (fitted, at {gpus} ranks)")

    def as_dict(self, ranks: int) -> dict:
        d = self.fitted.as_dict(ranks, self.base_stall_s)
        d["measured_fields"] = sorted(self.measured(ranks))
        d["assumed_fields"] = [f for f in Costs.field_names() if f not in d["measured_fields"]]
        d["overridden_by_flags"] = sorted(k for k in self.flags if k != "snapshot_stall_s"
                                          and k in self.fitted.costs(ranks, 0.0))
        return d


def _fail(cmd: str, e: BaseException | str) -> int:
    """An input that cannot be used (a flag's value, a file): one line on stderr, exit code 2."""
    return usage_error(f"shardsafe tor {cmd}", str(e), hint=False)


def _cmd_project(args: argparse.Namespace) -> int:
    from .projection_report import projection_dict, projection_text

    try:
        cluster, rates, costs, measured, profile, notes, bench = _build_inputs(args)
        if args.target_tor is not None and not 0 < args.target_tor < 1:
            raise TorError(f"--target-tor {args.target_tor}: expected a fraction in (0, 1), e.g. 0.95")
        if args.no_simulate and (args.sim_replicas is not None or args.sim_seed is not None):
            raise TorError("pass --no-simulate or --sim-replicas/--sim-seed, not both")
        sweep_gpus = args.sweep if args.sweep is not None else (list(DEFAULT_SWEEP_GPUS) if args.plot else None)
        d = projection_dict(cluster, rates, costs, interval_s=args.interval_s, disk_interval_s=args.disk_interval_s,
                            sweep_gpus=sweep_gpus, target_tor=args.target_tor, measured=measured, profile=profile,
                            simulate_flagged=not args.no_simulate,
                            sim_replicas=args.sim_replicas or DEFAULT_SIM_REPLICAS, sim_seed=args.sim_seed or 0,
                            growth=bench.as_dict(cluster.gpus) if bench else None,
                            costs_at=bench.costs_at if bench else None, policy=args.policy)
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
        cluster, rates, costs, measured, profile, notes, bench = _build_inputs(args)
        if bench is not None and args.sweep:
            notes.append("--from-bench with --sweep: every scale is simulated with the costs at "
                         f"{cluster.gpus} GPUs (tor project --sweep evaluates them per scale)")
        strategies = strategies_for(args.policy)
        if args.strategy != "all":
            if args.strategy not in strategies:
                raise TorError(f"--strategy {args.strategy} is not shown with --policy {args.policy}; pass "
                               "--policy both, or another strategy")
            strategies = (args.strategy,)
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
    r.add_argument("--plot", metavar="FILE.png", help="also write a PNG timeline (default: none)")
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
    pj.add_argument("--target-tor", type=float, metavar="T",
                    help="recommend interval, m and spares for this TOR, a fraction in (0, 1) (default: none)")
    pj.add_argument("--sweep", type=_gpu_list, metavar="GPUS", nargs="?", const=list(DEFAULT_SWEEP_GPUS),
                    help="also TOR at these GPU counts (comma-separated; default "
                         + ",".join(map(str, DEFAULT_SWEEP_GPUS)) + ")")
    sv = pj.add_argument_group("where the closed form breaks (failures take > 10% of the wall time)")
    sv.add_argument("--sim-replicas", type=whole(2, "replicas"), metavar="K",
                    help=f"simulate such points with K replicas (default {DEFAULT_SIM_REPLICAS}; "
                         f"each of ~{SIM_FAILURES_PER_REPLICA} failures) and report the simulated TOR")
    sv.add_argument("--sim-seed", type=_count, metavar="N", help="seed of those simulations (default 0)")
    sv.add_argument("--no-simulate", action="store_true",
                    help="report the first-order closed form (P) everywhere, with a note where it is off")
    pj.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    pj.add_argument("--plot", metavar="FILE.png",
                    help="write TOR versus GPUs for the three strategies (implies --sweep; default: none)")
    pj.set_defaults(func=_cmd_project)

    sm = sub.add_parser("simulate", help="Monte Carlo of the same cluster: checks the closed form, with a 95%% CI",
                        description="A discrete-event simulation of the cluster, its failure processes and costs "
                                    "(docs/tor.md, \"The simulator\"), at the closed form's intervals; prints both.")
    _add_inputs(sm)
    sm.add_argument("--strategy", choices=("all", *STRATEGIES), default="all", help="the strategies to simulate")
    sm.add_argument("--sweep", type=_gpu_list, metavar="GPUS", nargs="?", const=list(DEFAULT_SWEEP_GPUS),
                    help="simulate at these GPU counts instead of the one cluster (default: the one cluster; "
                         "without GPUS: " + ",".join(map(str, DEFAULT_SWEEP_GPUS)) + ")")
    sm.add_argument("--replicas", type=whole(1, "replicas"), default=40, metavar="K", help="independent runs")
    sm.add_argument("--horizon-days", type=number("days", positive=True), default=30.0, metavar="D",
                    help="simulated days per run")
    sm.add_argument("--seed", type=_count, default=0, help="seed of the simulation")
    sm.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    sm.set_defaults(func=_cmd_simulate)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shardsafe.tor report|project|simulate ...`` (the same as ``shardsafe tor ...``)."""
    parser = Parser(prog="python -m shardsafe.tor")
    sub = parser.add_subparsers(dest="command", required=True)
    register_cli(sub)
    args = parser.parse_args(["tor", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)

