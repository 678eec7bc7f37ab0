"""``shardsafe export``: the command, and the export by replay (the job's own command run once more).

From a persistent job directory or the live holders, the job's command restores the newest snapshot and the
framework writes it with its own writer (DeepSpeed's ``save_checkpoint``, Megatron's ``save_checkpoint``), then
exits before training. Without a command, ``--format deepspeed`` assembles the files offline
(:func:`shardsafe.adapters.deepspeed.export.export_deepspeed`).
"""
from __future__ import annotations

import os
import shutil
from typing import Any

from .sources import ExportError, open_source


def _replay_job(src: str, command: list[str], extra: Any, *, holder_dir: str, timeout_s: float | None) -> None:
    """Run the job's own command once more so that it restores SRC and writes the export with the framework's own
    writer. From holder://JOB_ID it reads the job's live holders; from a persistent job directory, fresh empty
    holders in a private directory make the restore fall through to the persistent tier. ``extra(job_id,
    persist_dir, holder_dir)`` returns the (flags, environment) that say so: Megatron reads flags, a DeepSpeed
    program its JSON block, which the environment completes."""
    import subprocess
    import tempfile
    scratch = None
    if src.startswith("holder://"):
        job, persist, hdir = src[len("holder://"):], "", holder_dir
    else:
        if not os.path.isdir(src):
            raise ExportError(f"{src} is not a directory; SRC is a persistent run directory (PERSIST_DIR/RUN_NAME) "
                              "or holder://JOB_ID")
        job_dir = os.path.abspath(src)
        scratch = tempfile.mkdtemp(prefix="shardsafe-export-")
        job, persist, hdir = os.path.basename(job_dir), os.path.dirname(job_dir), scratch
    flags, env = extra(job, persist, hdir)
    try:
        p = subprocess.run([*command, *flags], env={**os.environ, **env}, timeout=timeout_s)
    finally:
        if scratch is not None:
            _stop_holders(scratch)
            shutil.rmtree(scratch, ignore_errors=True)
    if p.returncode != 0:
        raise ExportError(f"the export run exited with status {p.returncode}; its output above says why "
                          f"(command: {' '.join(command + flags)})")


def export_deepspeed_replay(src: str, dst: str, command: list[str], *, holder_dir: str = "",
                            timeout_s: float | None = None) -> str:
    """``shardsafe export --format deepspeed SRC DST -- COMMAND``: run the job's own command once more with
    SHARDSAFE_EXPORT_DIR=DST. Its engine restores the newest snapshot of SRC at ``deepspeed.initialize`` and
    writes it with DeepSpeed's own ``save_checkpoint``, then exits before training (adapters/deepspeed/), so
    every layout DeepSpeed can save is exported as that DeepSpeed version writes it: pipeline stages, tensor
    and expert parallelism, BF16_Optimizer -- what the offline writer (``export_deepspeed``) does not assemble.
    The command must run the job's layout (world size, pipeline stages, mpu)."""
    from shardsafe import env
    dst = os.path.abspath(dst)

    if not command:
        raise ExportError("the export run needs the job's launch command after `--`")

    def extra(job: str, persist: str, hdir: str) -> tuple[list[str], dict[str, str]]:
        variables = {env.EXPORT_DIR: dst, env.JOB_ID: job}
        if persist:
            # the directory is named after the run (run_name, else the job id): with no run name from the
            # environment, the job id names it
            variables.update({env.PERSIST_DIR: persist, env.RUN_NAME: ""})
        if hdir:
            variables[env.HOLDER_DIR] = hdir
        return [], variables

    _replay_job(src, command, extra, holder_dir=holder_dir, timeout_s=timeout_s)
    latest = os.path.join(dst, "latest")
    if not os.path.isfile(latest):
        raise ExportError(f"the export run finished but {latest} is missing: did the command call deepspeed.initialize "
                          "with the job's DeepSpeed config (its \"shardsafe\" block enabled)?")
    with open(latest) as f:
        return os.path.join(dst, f.read().strip())


def export_megatron(src: str, dst: str, command: list[str], *, holder_dir: str = "",
                    timeout_s: float | None = None) -> str:
    """Run the job's own Megatron-LM command once more with ``--shardsafe-export-dir``: it restores the
    newest snapshot of SRC and writes it with Megatron's ``save_checkpoint`` (the format and layout
    that Megatron version's ``--save`` writes), then exits before training. Megatron checkpoints hold
    the model's own sharding metadata (``sharded_state_dict`` of the live modules), which only the
    model code can produce; hence the replay instead of an offline writer as for DeepSpeed."""
    from shardsafe import env
    if not command:
        raise ExportError("--format megatron needs the job's launch command after `--` (e.g. `-- torchrun "
                          "--nproc-per-node 8 pretrain_gpt.py ARGS`), with the layout (TP/PP/DP) it was trained at.")

    def extra(job: str, persist: str, hdir: str) -> tuple[list[str], dict[str, str]]:
        flags = ["--shardsafe", "--shardsafe-export-dir", os.path.abspath(dst), "--shardsafe-parity-group-size", "1",
                 "--shardsafe-job-id", job]
        if persist:
            flags += ["--shardsafe-persist-dir", persist]
        if hdir:
            flags += ["--shardsafe-holder-dir", hdir]
        return flags, {env.RUN_NAME: ""} if persist else {}   # the job id names the directory (as for DeepSpeed)

    _replay_job(src, command, extra, holder_dir=holder_dir, timeout_s=timeout_s)
    marker = os.path.join(dst, "latest_checkpointed_iteration.txt")
    if not os.path.exists(marker):
        raise ExportError(f"the export run finished but {marker} is missing: was the command a Megatron-LM entry "
                          "script using shardsafe.adapters.megatron.pretrain?")
    with open(marker) as f:
        return os.path.join(dst, f"iter_{int(f.read().strip()):07d}")


def _stop_holders(holder_dir: str) -> None:
    from shardsafe.holder.client import HolderClient, HolderUnavailable
    from shardsafe.holder.paths import HolderPaths
    try:
        jobs = HolderPaths.list_jobs(holder_dir)   # verified: another user's directory is not touched
    except OSError:
        return
    for job in jobs:
        for node in HolderPaths.list_nodes(holder_dir, job):
            try:
                c = HolderClient(HolderPaths(holder_dir, job, node), timeout_s=5).connect()
                c.shutdown()
                c.close()
            except (HolderUnavailable, OSError):
                pass


def cmd_export(a: Any) -> int:
    cmd = list(a.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        if a.format == "megatron":
            if a.version is not None:
                raise ExportError("--version is not supported with --format megatron: the export run restores the "
                                  "newest restorable version (drop newer ones from the persistent directory first).")
            out = export_megatron(a.src, a.dst, cmd, holder_dir=a.holder_dir)
            print(f"exported {a.src} as a Megatron checkpoint: {out}", flush=True)
            return 0
        if cmd:
            if a.version is not None or a.tag:
                raise ExportError("--version and --tag are not supported with a command after `--`: the export run "
                                  "restores the newest restorable version and saves it as global_step<N>.")
            out = export_deepspeed_replay(a.src, a.dst, cmd, holder_dir=a.holder_dir)
            print(f"exported {a.src} as a DeepSpeed checkpoint written by save_checkpoint: {out}", flush=True)
            return 0
        from shardsafe.adapters.deepspeed.export import export_deepspeed
        version, ranks = open_source(a.src, holder_dir=a.holder_dir, version=a.version)
        out = export_deepspeed(ranks, a.dst, version=version, tag=a.tag or None)
    except ExportError as e:   # one line on stderr, exit code 2, as the CLI's usage errors
        from shardsafe.cliargs import usage_error
        return usage_error("shardsafe export", str(e), hint=False)
    print(f"exported version {version} ({len(ranks)} ranks) as a {a.format} checkpoint: {out}", flush=True)
    return 0
