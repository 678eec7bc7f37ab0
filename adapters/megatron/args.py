"""Megatron command-line flags for shardsafe, and their conversion into :class:`ShardsafeConfig`.

``add_arguments`` has the shape of Megatron-LM's ``extra_args_provider`` (takes the parser, returns it):
Megatron-LM calls ``parser = extra_args_provider(parser)`` from ``parse_args`` in every version we
support, whether the provider reaches it through ``pretrain(..., extra_args_provider=)`` (megatron-core
<= 0.17) or through ``parse_and_validate_args(extra_args_provider=)`` in the entry script (>= 0.18,
where ``pretrain`` takes a config container instead). The same function also works on a plain
``argparse.ArgumentParser`` for megatron-core users with their own loop.

Argparse only checks types; ``config_from_args`` turns the namespace into a checked
``ShardsafeConfig`` and raises :class:`ConfigError` naming the flag, before any model is built.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

from shardsafe.config import ON_UNPROTECTED, PARITY_TRANSPORTS, RESTORE_H2D, RESUME, ConfigError, ShardsafeConfig

GROUP_TITLE = "shardsafe"

# flag -> ShardsafeConfig field. Every flag is "--shardsafe-" + field with '_' -> '-', except the switch.
_FIELDS = (
    "interval",
    "memory_budget_gb",
    "holder_dir",
    "job_id",
    "node",
    "parity_shards",
    "parity_group_size",
    "parity_transport",
    "timeout_s",
    "run_dir",
    "persist_dir",
    "run_name",
    "persist_every",
    "persist_keep",
    "persist_mbps",
    "hash_threads",
    "restore_h2d",
    "holder_idle_exit_s",
    "resume",
    "on_unprotected",
    "warn_interval_s",
)


def _flag(field: str) -> str:
    return "--shardsafe-" + field.replace("_", "-")


def _dest(field: str) -> str:
    return "shardsafe_" + field


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the shardsafe flags in their own argument group and return the parser (extra_args_provider).

    Defaults are ``None`` ("not given") so that ``config_from_args`` can fall back to the
    ``ShardsafeConfig`` defaults (which read SHARDSAFE_JOB_ID / SLURM_JOB_ID etc. at run time).
    """
    d = ShardsafeConfig.__dataclass_fields__
    g = parser.add_argument_group(title=GROUP_TITLE, description="in-memory, erasure-coded snapshots (shardsafe)")
    g.add_argument("--shardsafe", dest="shardsafe", action="store_true", default=False,
                   help="Protect this run with shardsafe: snapshot every rank's state into the node's holder "
                        "and restore it after a crash.")
    g.add_argument("--shardsafe-no-restore", dest="shardsafe_no_restore", action="store_true", default=False,
                   help="Do not restore from a snapshot at start (start fresh or from --load).")
    g.add_argument("--shardsafe-no-start-holder", dest="shardsafe_no_start_holder", action="store_true",
                   default=False, help="Do not start a holder process when none is running (shardsafe launch "
                                       "or the sbatch scripts start them).")
    g.add_argument("--shardsafe-export-dir", dest="shardsafe_export_dir", default=None,
                   help="Restore the newest snapshot, write it with Megatron's own save_checkpoint into this "
                        "directory (in --ckpt-format) and exit: what `shardsafe export --format megatron` runs (default: "
                        "none, a normal run).")
    helps = {
        "interval": f"Snapshot every N optimizer steps (default {d['interval'].default}).",
        "memory_budget_gb": "Holder memory budget in GiB for the whole node (default 0 = half of the node's RAM).",
        "holder_dir": "Directory for the holder's socket, lock and log files, kept in a private shardsafe-<uid> "
                      "inside it (default SHARDSAFE_HOLDER_DIR, else $XDG_RUNTIME_DIR/shardsafe-<uid> or "
                      "/tmp/shardsafe-<uid>).",
        "job_id": "Scope of sockets and shared memory (default SHARDSAFE_JOB_ID, SLURM_JOB_ID, torchrun's "
                  "--rdzv-id, else a digest of the launch command).",
        "node": "Failure-domain name of this process (default SHARDSAFE_NODE, SLURMD_NODENAME or the hostname).",
        "parity_shards": f"m: parity-group members that may be lost (default {d['parity_shards'].default}).",
        "parity_group_size": "n: members per parity group, data-parallel peers on different nodes "
                             "(default 0 = the data-parallel size capped at 8; 1 disables parity).",
        "parity_transport": "How parity stripes move and are encoded: host (gloo from the holders' memory, "
                            "ISA-L) or device (NCCL between GPUs, CUDA kernels) (default host).",
        "timeout_s": f"Seconds a holder request or agreement may take before the snapshot is skipped "
                     f"(default {d['timeout_s'].default}).",
        "run_dir": "Directory for the TOR event log events.jsonl (default SHARDSAFE_RUN_DIR, or none).",
        "persist_dir": "Persistent tier: holders write committed versions under DIR/RUN_NAME in the background "
                       "(default off). Restore falls back to it when memory cannot serve.",
        "run_name": "The run's directory under --shardsafe-persist-dir, the same for every requeue and resubmission "
                    "of the run (default SHARDSAFE_RUN_NAME, else the job id).",
        "persist_every": f"Write every K-th snapshot to --shardsafe-persist-dir (default {d['persist_every'].default}).",
        "persist_keep": f"Newest versions kept on disk (default {d['persist_keep'].default}).",
        "persist_mbps": "Cap each holder's write bandwidth to the persistent tier in MB/s (default 0 = uncapped).",
        "hash_threads": "Threads per rank for snapshot checksums and restore verification (default 0 = usable "
                        "cores / local ranks, at most 8).",
        "restore_h2d": "How a restore into GPU tensors reads the holder's memory: pinned (page-locked while it "
                       "verifies, DMA copies; pageable if the driver refuses) or pageable (default pinned).",
        "holder_idle_exit_s": f"A holder this job's ranks start exits after this many seconds with no client and no "
                              f"flush pending (default {d['holder_idle_exit_s'].default}; 0 = never).",
        "resume": "Which snapshot a starting run may restore: auto (the newest of this run: same config, model, "
                  "layout and optimizer hyperparameters), force (also another run's), never (start fresh, drop "
                  "the old versions) (default auto).",
        "on_unprotected": "When protection lapses (no holder, budget, failed vote, no commit for a few intervals): "
                          "warn (say so on rank 0 at WARNING, repeatedly) or fail (end the run) (default warn).",
        "warn_interval_s": f"How often rank 0 repeats that protection lapsed while it lasts, in seconds (default "
                           f"{d['warn_interval_s'].default}).",
    }
    types: dict[str, Callable[[str], Any]] = {"interval": int, "memory_budget_gb": float, "parity_shards": int,
                                              "parity_group_size": int, "timeout_s": float, "persist_every": int,
                                              "persist_keep": int, "persist_mbps": float,
                                              "hash_threads": int, "holder_idle_exit_s": float,
                                              "warn_interval_s": float}
    for f in _FIELDS:
        extra = {"choices": {"parity_transport": PARITY_TRANSPORTS, "restore_h2d": RESTORE_H2D, "resume": RESUME,
                             "on_unprotected": ON_UNPROTECTED}[f]} \
            if f in ("parity_transport", "restore_h2d", "resume", "on_unprotected") else {}
        g.add_argument(_flag(f), dest=_dest(f), type=types.get(f, str), default=None, help=helps[f], **extra)
    return parser


def config_from_args(args: Any) -> ShardsafeConfig:
    """Build the checked config from a parsed namespace (Megatron's ``get_args()`` or argparse's).

    Raises:
        ConfigError: a value is out of range or the flags were never added; the message names the flag.
    """
    if not hasattr(args, "shardsafe"):
        raise ConfigError("the shardsafe flags are missing from the parsed arguments: pass "
                          "extra_args_provider=shardsafe.adapters.megatron.args.add_arguments to Megatron's "
                          "pretrain() (megatron-core <= 0.17) or parse_and_validate_args() (>= 0.18).")
    kw: dict[str, Any] = {"enabled": bool(args.shardsafe),
                          "restore": not bool(getattr(args, "shardsafe_no_restore", False)),
                          "start_holder": not bool(getattr(args, "shardsafe_no_start_holder", False))}
    for f in _FIELDS:
        v = getattr(args, _dest(f), None)
        if v is not None:
            kw[f] = v
    try:
        return ShardsafeConfig(**kw)
    except ConfigError as e:
        raise ConfigError(_flagged(str(e))) from None


def _flagged(msg: str) -> str:
    """Name the command-line flag instead of the config key: users typed the flag."""
    for f in _FIELDS:
        msg = msg.replace(f"shardsafe.{f} ", f"{_flag(f)} ")
    return msg


def compose_extra_args_provider(
        user_provider: Optional[Callable[[argparse.ArgumentParser], argparse.ArgumentParser]]
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """An extra_args_provider adding the user's flags (if any) and then shardsafe's."""
    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if user_provider is not None:
            parser = user_provider(parser)
        if not any(a.dest == "shardsafe" for a in parser._actions):  # idempotent: Megatron may re-parse
            parser = add_arguments(parser)
        return parser
    return provider
