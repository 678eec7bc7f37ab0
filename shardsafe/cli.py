"""`shardsafe holder|status|demo|tor|launch|agent|control ...` — the command-line entry point."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _setup_logging(prefix: str = "") -> None:
    logging.basicConfig(level=os.environ.get("SHARDSAFE_LOG", "INFO"),
                        format=f"%(asctime)s shardsafe{prefix} %(levelname)s %(message)s", stream=sys.stderr)


def cmd_holder(a: argparse.Namespace) -> int:
    from shardsafe.holder.paths import HolderPaths
    from shardsafe.holder.server import Holder
    from shardsafe.config import ShardsafeConfig, default_holder_dir, default_node_name
    # A holder serves one job: its id comes from the command line or the job's environment, never from a
    # digest of this holder's own command line (shardsafe.jobid's last rule, meant for trainers).
    job_id = a.job_id or os.environ.get("SHARDSAFE_JOB_ID") or os.environ.get("SLURM_JOB_ID") or ""
    if not job_id:
        print("shardsafe holder: which job? pass --job-id (the trainers' job id; `shardsafe status` lists the "
              "jobs with holders) or set SHARDSAFE_JOB_ID", file=sys.stderr)
        return 2
    cfg = ShardsafeConfig(job_id=job_id, node=a.node or default_node_name(),
                          holder_dir=a.holder_dir or default_holder_dir(), memory_budget_gb=a.memory_budget_gb)
    paths = HolderPaths(cfg.holder_dir, cfg.job_id, cfg.node)
    paths.ensure_dir()
    holder = Holder(paths, budget_bytes=cfg.memory_budget_bytes, idle_exit_s=a.idle_exit_s, run_dir=a.run_dir,
                    scrub_interval_s=a.scrub_interval_s, read_timeout_s=a.read_timeout_s, max_clients=a.max_clients)
    if not a.daemonize:
        _setup_logging(f"[holder {cfg.node}]")
        holder.serve(ready=lambda: print(f"holder ready: {paths.socket}", flush=True))
        return 0
    # Double fork + setsid: the holder must survive whatever kills the trainer's process tree.
    r, w = os.pipe()
    if os.fork() > 0:
        os.close(w)
        ok = os.read(r, 1)
        return 0 if ok == b"1" else 1
    os.close(r)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    logf = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(logf, 1)
    os.dup2(logf, 2)
    _setup_logging(f"[holder {cfg.node}]")

    def ready() -> None:
        os.write(w, b"1")
        os.close(w)
    try:
        holder.serve(ready=ready)
    finally:
        os._exit(0)


def cmd_status(a: argparse.Namespace) -> int:
    from shardsafe.config import default_holder_dir
    from shardsafe.holder.client import HolderClient, HolderUnavailable
    from shardsafe.holder.paths import HolderPaths
    root = a.holder_dir or default_holder_dir()
    job = a.job_id or os.environ.get("SHARDSAFE_JOB_ID") or os.environ.get("SLURM_JOB_ID") or ""
    if not job:   # every job of this user with a holder on this node (derived ids are not guessable)
        try:
            jobs = sorted(j for j in os.listdir(root) if HolderPaths.list_nodes(root, j))
        except FileNotFoundError:
            jobs = []
        if len(jobs) != 1:
            if a.json:
                print(json.dumps({"job_id": None, "jobs": jobs, "holders": []}))
                return 0 if jobs else 1
            print(f"jobs with holders under {root}: {', '.join(jobs) or 'none'}"
                  + ("; pass --job-id JOB to see one" if jobs else ""))
            return 0 if jobs else 1
        job = jobs[0]
    nodes = [a.node] if a.node else HolderPaths.list_nodes(root, job)
    out = []
    for node in nodes:
        try:
            c = HolderClient(HolderPaths(root, job, node), timeout_s=5).connect()
            out.append(c.status())
            c.close()
        except HolderUnavailable as e:
            out.append({"node": node, "job_id": job, "error": str(e)})
    if a.json:
        print(json.dumps({"job_id": job, "holders": out}))
        return 0
    if not out:
        print(f"no holder found for job {job!r} under {root}")
        return 1
    for h in out:
        if "error" in h:
            print(f"node {h['node']}: {h['error']}")
            continue
        print(f"node {h['node']} job {h['job_id']} pid {h['pid']}: {h['used'] / 2**20:.1f} MiB used "
              f"of {h['budget'] / 2**20:.1f} MiB budget, {h['clients']} client(s), health {h.get('health', '?')}"
              f" (scrubs {h.get('scrub', {}).get('runs', 0)}, flushes {h.get('flush', {}).get('done', 0)} ok / "
              f"{h.get('flush', {}).get('failed', 0)} failed), shmem_enabled={h.get('shmem_enabled') or '?'}")
        scoped = [("", h["ranks"])] + sorted((h.get("scopes") or {}).items())   # a process's later engines
        for scope, ranks in scoped:
            for rank, kinds in ranks.items():
                for kind, slots in kinds.items():
                    desc = ", ".join(f"free slot {s['capacity'] / 2**20:.1f} MiB" if s["state"] == "free" else
                                     f"v{s['version']} {s['state']}{' committed' if s['committed'] else ''} "
                                     f"{s['nbytes'] / 2**20:.1f} MiB" for s in slots)
                    print(f"  {scope + ' ' if scope else ''}rank {rank} {kind}: {desc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardsafe", description="In-memory, erasure-coded fault tolerance for pretraining")
    sub = p.add_subparsers(dest="cmd", required=True)

    h = sub.add_parser("holder", help="run the per-node snapshot holder")
    h.add_argument("--job-id", default="")
    h.add_argument("--node", default="")
    h.add_argument("--holder-dir", default="")
    h.add_argument("--memory-budget-gb", type=float, default=0.0, help="0 = half the node's RAM")
    h.add_argument("--idle-exit-s", type=float, default=0.0,
                   help="exit after this long with no client connected and no flush pending (0 = never; holders "
                        "started by a rank or a launcher get 600)")
    from shardsafe.holder.server import DEFAULT_MAX_CLIENTS, DEFAULT_READ_TIMEOUT_S
    h.add_argument("--read-timeout-s", type=float, default=DEFAULT_READ_TIMEOUT_S,
                   help="a client must say hello, send the rest of a started frame and take its reply within this")
    h.add_argument("--max-clients", type=int, default=DEFAULT_MAX_CLIENTS,
                   help="connections served at once; more are answered 'busy' and closed")
    h.add_argument("--run-dir", default=os.environ.get("SHARDSAFE_RUN_DIR", ""), help="append TOR events here")
    h.add_argument("--scrub-interval-s", type=float, default=300.0,
                   help="re-verify every held version this often (0 = never); bad ones are marked unusable")
    h.add_argument("--daemonize", action="store_true", help="detach (double fork + setsid) once serving")
    h.set_defaults(func=cmd_holder)

    s = sub.add_parser("status", help="print what each holder of a job holds")
    s.add_argument("--job-id", default="")
    s.add_argument("--node", default="")
    s.add_argument("--holder-dir", default="")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    try:
        from shardsafe import demo
        demo.register_cli(sub)
    except ImportError:
        pass
    try:
        from shardsafe import tor
        tor.register_cli(sub)
    except (ImportError, AttributeError):
        pass
    from shardsafe.launch import cli as launch_cli
    launch_cli.register_cli(sub)
    _register_export(sub)
    return p


def _register_export(sub) -> None:
    """`shardsafe export` (its module imports torch: only when the command runs, so `shardsafe holder`
    and `status` start in a fraction of a second)."""
    p = sub.add_parser("export", help="write a committed snapshot as a DeepSpeed or Megatron checkpoint",
                       description="deepspeed: offline, from the snapshot files (ZeRO-1/2/3, data parallel), or with "
                                   "the job's command after -- (any layout: pipeline, tensor/expert parallel, "
                                   "BF16_Optimizer) run once with SHARDSAFE_EXPORT_DIR; megatron: the job's own command "
                                   "(after --) run once with --shardsafe-export-dir. A replayed job restores and saves.")
    p.add_argument("--format", required=True, choices=["deepspeed", "megatron"])
    p.add_argument("src", help="persistent job directory PERSIST_DIR/JOB_ID, or holder://JOB_ID")
    p.add_argument("dst", help="checkpoint directory to write (as engine.save_checkpoint / Megatron --save)")
    p.add_argument("--version", type=int, default=None, help="iteration to export (default: the newest complete)")
    p.add_argument("--tag", default="", help="DeepSpeed tag (default global_step<N>)")
    p.add_argument("--holder-dir", default="", help="with holder://JOB_ID: the holders' directory")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- the job's launch command (torchrun ... pretrain_gpt.py ARGS): required for megatron, "
                        "and for deepspeed layouts the offline writer refuses")
    p.set_defaults(func=_run_export)


def _run_export(a: argparse.Namespace) -> int:
    from shardsafe.export.replay import cmd_export
    return cmd_export(a)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return int(a.func(a) or 0)


if __name__ == "__main__":
    sys.exit(main())
