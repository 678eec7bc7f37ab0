"""`shardsafe holder|status|demo|tor|launch|agent|control|export ...` — the command-line entry point.

Usage errors are one line on stderr with exit code 2, and ``--help`` shows every option's default
(:mod:`shardsafe.cliargs`).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from shardsafe import env
from shardsafe.cliargs import Parser, positive_seconds, seconds, usage_error, whole


UNIX_PATH_MAX = 107
"""Bytes of a Unix socket's path (sockaddr_un.sun_path is 108 with its NUL); a longer one fails at bind."""


def _setup_logging(prefix: str = "") -> None:
    logging.basicConfig(level=env.get(env.LOG, default="INFO"),
                        format=f"%(asctime)s shardsafe{prefix} %(levelname)s %(message)s", stream=sys.stderr)


def cmd_holder(a: argparse.Namespace) -> int:
    from shardsafe.holder.paths import HolderPaths, HolderSecurityError, open_private
    from shardsafe.holder.server import Holder
    from shardsafe.config import ShardsafeConfig
    # A holder serves one job: its id comes from the command line or the job's environment, never from a
    # digest of this holder's own command line (shardsafe.jobid's last rule, meant for trainers).
    job_id = a.job_id or env.launcher_job_id()
    if not job_id:
        return usage_error("shardsafe holder", "which job? pass --job-id (the trainers' job id; `shardsafe status` "
                                               "lists the jobs with holders) or set SHARDSAFE_JOB_ID")
    from shardsafe.launch.holders import budget_problem
    if budget_problem(a.memory_budget_gb):   # said with the flag's name, and against this node's RAM
        return usage_error("shardsafe holder", budget_problem(a.memory_budget_gb))
    cfg = ShardsafeConfig(job_id=job_id, node=a.node or env.node_name(),
                          holder_dir=a.holder_dir or env.holder_dir(), memory_budget_gb=a.memory_budget_gb)
    paths = HolderPaths(cfg.holder_dir, cfg.job_id, cfg.node)
    if len(os.fsencode(paths.socket)) > UNIX_PATH_MAX:
        return usage_error("shardsafe holder", f"the socket path {paths.socket} is {len(os.fsencode(paths.socket))} "
                                               f"bytes; a Unix socket's path holds at most {UNIX_PATH_MAX}: pass a "
                                               "shorter --holder-dir (or a shorter --job-id / --node)")
    try:
        paths.ensure_dir()
    except (HolderSecurityError, OSError) as e:   # not this user's directory, or one that cannot be made
        print(f"shardsafe holder: {e}", file=sys.stderr)
        return 2
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
    logf = open_private(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
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
    from shardsafe.config import ConfigError
    from shardsafe.holder.paths import HolderSecurityError, private_dir
    root = private_dir(a.holder_dir or env.holder_dir())
    job = a.job_id or env.launcher_job_id()
    try:
        return _status(a, root, job)
    except (HolderSecurityError, ConfigError) as e:   # not this user's directory or holder (nothing read), a bad name
        print(f"shardsafe status: {e}", file=sys.stderr)
        return 2


def _status(a: argparse.Namespace, root: str, job: str) -> int:
    from shardsafe.holder.client import HolderClient, HolderUnavailable
    from shardsafe.holder.paths import HolderPaths
    if not job:   # every job of this user with a holder on this node (derived ids are not guessable)
        jobs = HolderPaths.list_jobs(root)
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
    # The same exit code with and without --json: 0 when every holder of the job answered, 1 when none was
    # found or one did not answer (the output says which), 2 for a usage error.
    rc = 0 if out and all("error" not in h for h in out) else 1
    if a.json:
        print(json.dumps({"job_id": job, "holders": out}))
        return rc
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
        for who, st in sorted((h.get("protection") or {}).items()):   # each rank's last report (shardsafe.protection)
            state = ("protected" if st.get("protected") else "NOT protected: " + "; ".join(
                f"{c}: {d}" for c, d in (st.get("causes") or {}).items()))
            print(f"  rank {who}: {state} (step {st.get('step')}, newest committed version {st.get('committed')}, "
                  f"{st.get('age_steps')} step(s) old, {st.get('lapses', 0)} lapse(s))")
        scoped = [("", h["ranks"])] + sorted((h.get("scopes") or {}).items())   # a process's later engines
        for scope, ranks in scoped:
            for rank, kinds in ranks.items():
                for kind, slots in kinds.items():
                    desc = ", ".join(f"free slot {s['capacity'] / 2**20:.1f} MiB" if s["state"] == "free" else
                                     f"v{s['version']} {s['state']}{' committed' if s['committed'] else ''} "
                                     f"{s['nbytes'] / 2**20:.1f} MiB" for s in slots)
                    print(f"  {scope + ' ' if scope else ''}rank {rank} {kind}: {desc}")
    return rc


HOLDER_DIR_DEFAULT = "shardsafe-<uid> in $SHARDSAFE_HOLDER_DIR, else under $XDG_RUNTIME_DIR or /tmp"


LIGHT_COMMANDS = ("holder", "status")
"""Commands that start without the other commands' modules (demo, tor, launch import much more): every job starts
a holder per node, and `status` is run by hand and by scripts."""


def build_parser(light: bool = False) -> argparse.ArgumentParser:
    """The whole command line; ``light``: only the :data:`LIGHT_COMMANDS` (what ``main`` builds for them)."""
    from shardsafe import __version__
    p = Parser(prog="shardsafe", description="In-memory, erasure-coded fault tolerance for DeepSpeed and Megatron "
                                             "pretraining. Every usage error is one line on stderr and exit code 2.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    h = sub.add_parser("holder", help="run the per-node snapshot holder",
                       description="Run one node's holder for one job: it keeps the snapshots of the node's ranks in "
                                   "shared memory (and their parity) and outlives the trainers. Launchers and the "
                                   "sbatch scripts start it; a protected rank starts one when none is running.")
    h.add_argument("--job-id", default="", help="the trainers' job id (default: $SHARDSAFE_JOB_ID, else $SLURM_JOB_ID)")
    h.add_argument("--node", default="",
                   help="this node's name (default: $SHARDSAFE_NODE, else $SLURMD_NODENAME, else the host name)")
    h.add_argument("--holder-dir", default="", help=f"where the socket lives (default: {HOLDER_DIR_DEFAULT})")
    h.add_argument("--memory-budget-gb", type=float, default=0.0, metavar="GB",
                   help="memory the holder may use, in GiB; 0 = half the node's RAM")
    h.add_argument("--idle-exit-s", type=seconds, default=0.0, metavar="S",
                   help="exit after this long with no client connected and no flush pending (0 = never; holders "
                        "started by a rank or a launcher get 600)")
    from shardsafe.holder.server import DEFAULT_MAX_CLIENTS, DEFAULT_READ_TIMEOUT_S
    h.add_argument("--read-timeout-s", type=positive_seconds, default=DEFAULT_READ_TIMEOUT_S, metavar="S",
                   help="a client must say hello, send the rest of a started frame and take its reply within this")
    h.add_argument("--max-clients", type=whole(1, "connections"), default=DEFAULT_MAX_CLIENTS, metavar="N",
                   help="connections served at once; more are answered 'busy' and closed")
    h.add_argument("--run-dir", default=env.get(env.RUN_DIR),
                   help="append TOR events to RUN_DIR/events.jsonl (default: $SHARDSAFE_RUN_DIR, else none)")
    h.add_argument("--scrub-interval-s", type=seconds, default=300.0, metavar="S",
                   help="re-verify every held version this often (0 = never); bad ones are marked unusable")
    h.add_argument("--daemonize", action="store_true", help="detach (double fork + setsid) once serving")
    h.set_defaults(func=cmd_holder)

    s = sub.add_parser("status", help="print what each holder of a job holds",
                       description="What the holders of a job on this node hold. Exit code 0: every holder of the "
                                   "job answered (without --job-id: the jobs with holders are listed); 1: no holder "
                                   "found, or one did not answer (the output says which); 2: a usage error. The "
                                   "same with and without --json.")
    s.add_argument("--job-id", default="",
                   help="the job (default: $SHARDSAFE_JOB_ID, else $SLURM_JOB_ID, else the one job with holders "
                        "here; several are listed)")
    s.add_argument("--node", default="", help="only this node's holder (default: every node's under --holder-dir)")
    s.add_argument("--holder-dir", default="", help=f"where the holders' sockets live (default: {HOLDER_DIR_DEFAULT})")
    s.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    s.set_defaults(func=cmd_status)
    if light:
        return p

    from shardsafe import demo_cli, tor
    from shardsafe.launch import cli as launch_cli
    demo_cli.register_cli(sub)
    tor.register_cli(sub)
    launch_cli.register_cli(sub)
    _register_export(sub)
    return p


def _register_export(sub) -> None:
    """`shardsafe export` (its module imports torch: only when the command runs, so `shardsafe holder`
    and `status` start in a fraction of a second). The job's command comes after ``--`` only (:func:`main`
    splits it off), so options after SRC DST are parsed as options."""
    p = sub.add_parser("export", help="write a committed snapshot as a DeepSpeed or Megatron checkpoint",
                       usage="shardsafe export --format {deepspeed,megatron} [options] SRC DST [-- COMMAND ...]",
                       description="deepspeed: offline, from the snapshot files (ZeRO-1/2/3, data parallel), or with "
                                   "the job's command after -- (any layout: pipeline, tensor/expert parallel, "
                                   "BF16_Optimizer) run once with SHARDSAFE_EXPORT_DIR; megatron: the job's own command "
                                   "(after --) run once with --shardsafe-export-dir. A replayed job restores and saves. "
                                   "Options may come before or after SRC DST; everything after -- is the job's command.")
    p.add_argument("--format", required=True, choices=["deepspeed", "megatron"], help="the checkpoint format to write")
    p.add_argument("src", metavar="SRC", help="persistent run directory PERSIST_DIR/RUN_NAME, or holder://JOB_ID")
    p.add_argument("dst", metavar="DST", help="checkpoint directory to write (as engine.save_checkpoint / Megatron --save)")
    p.add_argument("--version", type=whole(0, "iterations"), default=None, metavar="N",
                   help="iteration to export (default: the newest complete)")
    p.add_argument("--tag", default="", help="DeepSpeed tag (default: global_step<N>)")
    p.add_argument("--holder-dir", default="",
                   help=f"with holder://JOB_ID: where the holders' sockets live (default: {HOLDER_DIR_DEFAULT})")
    p.set_defaults(func=_run_export, command=[])


def _run_export(a: argparse.Namespace) -> int:
    from shardsafe.export.replay import cmd_export
    return cmd_export(a)


def _split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``shardsafe export ... -- COMMAND``: the arguments before the first ``--`` and the command after it
    (None when there is no ``--``). argparse would take a positional after SRC DST for the command and an
    option after them for the end of the options; only ``export`` carries a command this way (``launch`` and
    ``agent`` take the script as their last positional, as torchrun does)."""
    cmd = next((x for x in argv if not x.startswith("-")), None)
    if cmd != "export" or "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def main(argv: list[str] | None = None) -> int:
    from shardsafe.errors import ConfigError
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, command = _split_command(argv)
    first = next((x for x in argv if not x.startswith("-")), None)
    parser = build_parser(light=first in LIGHT_COMMANDS)
    a, extra = parser.parse_known_args(argv)
    if extra and getattr(a, "cmd", "") == "export":
        return usage_error("shardsafe export", f"unexpected {' '.join(extra)!r} after SRC DST: the job's command "
                                               "goes after --, e.g. shardsafe export --format megatron SRC DST -- "
                                               "torchrun ... pretrain_gpt.py ARGS")
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if command is not None:
        a.command = command
    try:
        return int(a.func(a) or 0)
    except ConfigError as e:   # a setting given to the command cannot be honoured: said once, not as a traceback
        return usage_error(f"shardsafe {a.cmd}", str(e))


if __name__ == "__main__":
    sys.exit(main())
