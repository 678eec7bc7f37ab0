"""``shardsafe tor ...`` and ``python -m shardsafe.tor ...``: the TOR command line."""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Sequence

from .accounting import compute_tor
from .events import read_events
from .plot import plot_timeline
from .report import report_dict, report_text

__all__ = ["register_cli", "main"]


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds, a number > 0") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds, a finite number >= 0")
    return v


def _iterations(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of iterations >= 1") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of iterations >= 1")
    return v


def _cmd_report(args: argparse.Namespace) -> int:
    try:
        events = read_events(args.run_dir)
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


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``tor report RUN_DIR ...`` to a ``shardsafe`` subparsers object; dispatch via ``args.func(args)``."""
    p = subparsers.add_parser("tor", help="Training Overhead Ratio: report, breakdown, model, timeline plot",
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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shardsafe.tor report RUN_DIR ...`` (the same as ``shardsafe tor report``)."""
    parser = argparse.ArgumentParser(prog="python -m shardsafe.tor")
    sub = parser.add_subparsers(dest="command", required=True)
    register_cli(sub)
    args = parser.parse_args(["tor", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)

