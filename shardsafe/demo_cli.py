"""`shardsafe demo`: its arguments, which run they start (shardsafe/demo.py; ``--shrink``: shardsafe/demo_shrink.py),
and how the result is printed."""
from __future__ import annotations

import argparse
import json
import os
import time

from .cliargs import hidden_alias, seconds, whole
from .env import RESTART_MODES
from .launch.cli import fault_spec_arg, preload_arg
from .launch.presets import PRESETS


def cmd_demo(a: argparse.Namespace) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    t0 = time.time()
    if a.shrink:
        from .demo_shrink import run_shrink_demo
        out = run_shrink_demo(a)
    else:
        from .demo import run_demo
        out = run_demo(a)
    report = out.pop("tor_report", "")
    if a.json:
        print(json.dumps(out))
    else:
        print()
        print(f"shardsafe demo: {out['ranks']} ranks on {out['nodes']} nodes, {out['engine']} {out['layout']}, "
              f"{out['steps']} steps")
        print(f"  failures injected : {out['failures_injected']} (SIGKILL)")
        if out.get("restart") == "in-place":
            print(f"  restarts in place : {out['restarts_in_place']} of {out['attempts'] - 1} (only the killed "
                  "rank started again; the others went on in their processes)")
        print(f"  restores          : {out['restores']} from tiers {out['restore_tiers']} "
              f"(versions {out['restored_versions']}), {out['restore_seconds']:.3f} s in all")
        print(f"  node losses       : {out['node_losses']}; {out['rebuilt_bytes'] / 2**20:.1f} MiB rebuilt from parity "
              f"in {out['rebuild_seconds']:.3f} s")
        print(f"  lost iterations   : {out['lost_iterations']}")
        print(f"  snapshot stall    : median {out['snapshot_stall_ms_median']} ms over {out['snapshots']} snapshots "
              f"({out['snapshots_committed']} committed)")
        print(f"  bit-identical     : {out['bit_identical']}" + ("" if out["bit_identical"] else f"  {out['mismatches']}"))
        print(f"  resumed           : {out['resumed']}" + ("" if out["resumed"] else f"  {out['resume_problems']}"))
        pw = out.get("prewarm")
        starts = {k: (out.get("tor_breakdown") or {}).get(k, 0.0) for k in ("startup", "restart")}
        print("  trainer starts    : " + (f"forked from a fork server that imported {','.join(pw['preload'])} "
                                         f"once in {pw['seconds']:.2f} s" if pw else "cold (every trainer imports "
                                         "its modules itself)")
              + f"; startup {starts['startup']:.2f} s + restart {starts['restart']:.2f} s over all attempts")
        if a.shrink:
            o = out["oracle"]
            print(f"  data-parallel     : sizes {out['data_parallel_sizes']}: {out['shrinks']} shrink(s), "
                  f"{out['grows']} grow(s)")
            print(f"  oracle            : {o['kind']}, stretches "
                  + ", ".join(f"{g['dp']} ranks steps {g['first'] + 1}-{g['last']}" for g in o["segments"])
                  + ("" if o["ran"] else f"  (not run: {o['error'] or 'the protected run failed'})"))
        print(f"  wall time         : {time.time() - t0:.1f} s (" + (f"reference {out['reference_wall_s']} s, "
              if out["reference_wall_s"] is not None else "") + f"protected {out['wall_s']} s)")
        if "tor_t_obs" in out:
            print(f"  TOR accounting    : T_obs {out['tor_t_obs']:.3f} s vs {out['measured_wall_s']:.3f} s measured "
                  f"({100 * out['tor_t_obs_vs_wall']:.2f}% apart, limit 2%); breakdown sums to T_obs - T_opt "
                  f"(gap {out['tor_breakdown_gap_s']:.1e} s): {'ok' if out['tor_accounted'] else 'MISMATCH'}")
        if out["run_dir"]:
            print(f"  run directory     : {out['run_dir']}  (shardsafe tor report {out['run_dir']})")
        print()
        print(report)
    return 0 if out["bit_identical"] and out["resumed"] and out.get("tor_accounted", True) else 1


def register_cli(sub) -> None:
    p = sub.add_parser("demo", help="kill a trainer mid-run, restore from the holders, compare bit for bit")
    p.add_argument("--engine", default="deepspeed", choices=["deepspeed", "deepspeed-3d", "megatron"],
                   help="deepspeed: examples/ds_pretrain_gpt.py (ZeRO); deepspeed-3d: the same GPT as a DeepSpeed "
                        "PipelineModule (PP x DP, tied embedding; BF16_Optimizer in bf16, ZeRO-1 in fp32); megatron: "
                        "examples/megatron_pretrain_gpt.py (megatron-core GPT, DDP + DistributedOptimizer, TP/PP/DP)")
    p.add_argument("--steps", type=whole(1, "steps"), default=None,
                   help="training steps (default: 100 for deepspeed and deepspeed-3d, 40 for megatron)")
    p.add_argument("--zero-stage", type=int, default=2, choices=[1, 2, 3], help="deepspeed only: the ZeRO stage")
    p.add_argument("--tp", type=whole(1), default=2, help="megatron only: tensor-parallel size")
    p.add_argument("--pp", type=whole(1), default=1, help="megatron: pipeline-parallel size; deepspeed-3d: stages "
                                                         "(default: 1 for megatron, 2 for deepspeed-3d)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"], help="training precision")
    p.add_argument("--optimizer", default="torch-adamw", choices=["torch-adamw", "fused-adamw"],
                   help="deepspeed and deepspeed-3d: torch.optim.AdamW (torch_adam) or DeepSpeed's default FusedAdam, "
                        "whose CPU build compiles once (about a minute) on first use")
    hidden_alias(p, "--nodes", p.add_argument(
        "--nnodes", dest="nodes", type=whole(1, "nodes"), default=None, metavar="N",
        help="simulated nodes (default: 2, 4 with deepspeed-3d)"))
    hidden_alias(p, "--nproc_per_node", p.add_argument(
        "--nproc-per-node", type=whole(1, "processes"), default=None, metavar="N",
        help="trainers per node (default: 2, 1 with deepspeed-3d)"))
    p.add_argument("--kill-at", type=whole(0, "steps"), default=0, metavar="STEP",
                   help="step at which the last rank is SIGKILLed (default: 0, 2/5 of the run; the last node is "
                        "lost at 3/4)")
    p.add_argument("--inject", type=fault_spec_arg, default="", metavar="FAULTS",
                   help="a fault spec replacing the demo's two faults (default: none; see shardsafe.faults)")
    p.add_argument("--restart", choices=RESTART_MODES, default="full",
                   help="full (default): a killed trainer restarts every trainer; in-place: only the killed rank "
                        "starts again and the others go on in their processes, building their engines again (the "
                        "examples' --in-place). The lost node still restarts every trainer")
    p.add_argument("--memory-budget-gb", type=float, default=1.0, metavar="GB", help="memory budget of each holder")
    p.add_argument("--preload", type=preload_arg, default=None, metavar="PRESET|MODULES",
                   help="what the protected run's fork server imports once; its trainers (first start and every "
                        f"restart) are forked from it: a preset ({', '.join(PRESETS)}) or modules separated by commas "
                        "(default: the engine's preset, megatron or deepspeed; none or '' starts every trainer cold). "
                        "The reference run always starts cold")
    p.add_argument("--run-dir", default="",
                   help="keep both runs (event logs included) under this directory (default: a temporary one, "
                        "removed at the end)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--shrink", action="store_true",
                   help="continue at a smaller data-parallel size instead: 4 nodes, no spare, the last node is lost at "
                        "2/5 of the run (--kill-at) and returns a fifth of the run later; compared with the "
                        "framework's own reshard of the same versions: DeepSpeed's universal checkpoint (deepspeed, or "
                        "deepspeed-3d on nodes of one rank per stage) or Megatron's fully reshardable dist checkpoint "
                        "(megatron, nodes of TP x PP ranks); default 30 steps")
    p.add_argument("--shrink-after-s", type=seconds, default=1.0, metavar="S",
                   help="--shrink: how long the launcher waits for a node before continuing on the nodes left")
    p.set_defaults(func=cmd_demo)
