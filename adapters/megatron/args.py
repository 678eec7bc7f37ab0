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
import logging
import os
from typing import Any, Callable, Mapping, Optional

from shardsafe import env
from shardsafe.config import ON_UNPROTECTED, PARITY_TRANSPORTS, RESTORE_H2D, RESUME, ConfigError, ShardsafeConfig

log = logging.getLogger(__name__)

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


def keep_global_batch(args: Any, environ: Optional[Mapping[str, str]] = None) -> Any:
    """Megatron-LM's parsed arguments for a job the launcher re-formed at another world size (``WORLD_SIZE`` ranks
    of ``SHARDSAFE_FULL_WORLD_SIZE``, the model-parallel size unchanged): the global batch stays the full-size job's,
    so its snapshots re-partition and its training is the same run. Megatron-LM computes the micro-batches per step
    as ``global_batch_size / (micro_batch_size x data-parallel size)``; given ``--global-batch-size`` that already
    keeps it, and without one Megatron would default it to ``micro_batch_size x`` the *current* data-parallel size,
    another batch: it is set to ``micro_batch_size x`` the full-size data-parallel size instead (rank 0 says so).
    Unchanged when the variable is unset or equal to the world size. Returns ``args``, changed in place.

    Raises:
        ConfigError: the global batch is no multiple of ``micro_batch_size x`` this data-parallel size; the message
            names the data-parallel sizes that keep it.
    """
    full = env.get(env.FULL_WORLD_SIZE, environ)
    # Megatron-LM's own world size: torchrun's WORLD_SIZE, which its parse_args reads right after parsing.
    world = int((os.environ if environ is None else environ).get("WORLD_SIZE") or 0)
    micro = getattr(args, "micro_batch_size", None)
    if not full or not world or int(full) == world or not micro:
        return args   # not re-formed (or no micro-batch yet: Megatron's validate_args reports that)
    model_parallel = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model_parallel *= int(getattr(args, name, None) or 1)
    full, micro = int(full), int(micro)
    if full % model_parallel or world % model_parallel:
        raise ConfigError(f"this job runs {world} of its {full} ranks (SHARDSAFE_FULL_WORLD_SIZE), and the "
                          f"model-parallel size (tensor x pipeline x context = {model_parallel}) does not divide both: "
                          "a job re-formed at another size keeps its model-parallel layout and changes only the "
                          "data-parallel size. Restart with a world size that is a multiple of it.")
    full_dp, dp = full // model_parallel, world // model_parallel
    derived = getattr(args, "global_batch_size", None) is None
    gbs = micro * full_dp if derived else int(args.global_batch_size)
    if gbs % (micro * dp):
        fits = [d for d in range(1, full_dp + 1) if gbs % (micro * d) == 0]
        raise ConfigError(f"this job runs {world} of its {full} ranks (SHARDSAFE_FULL_WORLD_SIZE), data-parallel size "
                          f"{dp} of {full_dp}: keeping its global batch of {gbs} samples needs {gbs} / "
                          f"(--micro-batch-size {micro} x {dp}) micro-batches per step, which is no integer. "
                          f"Data-parallel sizes that keep it: {fits} (world sizes "
                          f"{[d * model_parallel for d in fits]}). Continue at one of those (the launcher's shrink "
                          "rule picks one when the global batch allows), or wait for a node to come back")
    if derived:
        args.global_batch_size = gbs
        if int((os.environ if environ is None else environ).get("RANK") or 0) == 0:
            log.warning("shardsafe: this job runs %d of its %d ranks (SHARDSAFE_FULL_WORLD_SIZE): --global-batch-size "
                        "%d (--micro-batch-size %d x the full-size data-parallel size %d) keeps the global batch; "
                        "Megatron runs %d micro-batches per step", world, full, gbs, micro, full_dp,
                        gbs // (micro * dp))
    return args


def _keeping_global_batch(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM parses right after the extra_args_provider returns the parser (``parser.parse_args()`` or
    ``parse_known_args()``, both through ``parse_known_args``) and validates right after that, deriving the
    micro-batches per step from the global batch: :func:`keep_global_batch` has to run in between, so it runs at the
    end of this parser's ``parse_known_args`` (set on the instance: Megatron's parser is not changed otherwise)."""
    if getattr(parser.parse_known_args, "__shardsafe_batch__", False):
        return parser
    parse = parser.parse_known_args

    def parse_known_args(*a: Any, **kw: Any) -> Any:
        ns, rest = parse(*a, **kw)
        return keep_global_batch(ns), rest

    parse_known_args.__shardsafe_batch__ = True  # type: ignore[attr-defined]
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    return parser


def compose_extra_args_provider(
        user_provider: Optional[Callable[[argparse.ArgumentParser], argparse.ArgumentParser]]
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """An extra_args_provider adding the user's flags (if any) and then shardsafe's, for Megatron-LM's parser: a job
    the launcher re-formed at another size keeps its global batch (:func:`keep_global_batch`)."""
    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if user_provider is not None:
            parser = user_provider(parser)
        if not any(a.dest == "shardsafe" for a in parser._actions):  # idempotent: Megatron may re-parse
            parser = add_arguments(parser)
        return _keeping_global_batch(parser)
    return provider
