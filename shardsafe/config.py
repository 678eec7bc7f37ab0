"""One config dataclass for shardsafe, built from a DeepSpeed JSON block or Megatron CLI args.

Every field is checked in ``__post_init__``; an error names the key, what was expected, what came,
and what to do. Unknown keys are rejected (a typo must not silently disable protection). What a field leaves to
the environment (the job id, the node, the holder and run directories, the persistent tier) is filled in by
:meth:`ShardsafeConfig.resolved`, at the edge where a job starts (the runtime, the adapters' entry points):
constructing a config reads nothing.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

from . import env
from .errors import ConfigError


def default_job_id(environ: Mapping[str, str] | None = None) -> str:
    """The job id when none is configured (rules in shardsafe.jobid and docs/operations.md "Job ids").

    Raises:
        ConfigError: nothing identifies the job (no launcher id, no command line); set SHARDSAFE_JOB_ID.
    """
    from .jobid import AmbiguousJobId, derive_job_id
    try:
        return derive_job_id(environ)[0]
    except AmbiguousJobId as e:
        raise ConfigError(str(e)) from None


PARITY_TRANSPORTS = ("host", "device")
RESUME_CLIENT_STATES = ("auto", "neox", "megatron-deepspeed", "none")
RESTORE_H2D = ("pinned", "pageable")   # shardsafe/snapshot/pinning.py
_RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
ON_UNPROTECTED = ("warn", "fail")       # shardsafe/protection.py
RESUME = ("auto", "force", "never")      # shardsafe/fingerprint.py


@dataclass(kw_only=True)
class ShardsafeConfig:
    enabled: bool = True
    """Switch protection on. With false the adapters return the framework's objects untouched."""
    interval: int = 1
    """Snapshot every `interval` optimizer steps (1 = every iteration)."""
    memory_budget_gb: float = 0.0
    """Holder memory budget in GiB for the whole node (0 = half of the node's RAM)."""
    holder_dir: str = ""
    """Directory for the holder's socket, lock and log files. shardsafe keeps them in its own private
    ``shardsafe-<uid>`` inside the directory named here (the default already is that directory), created 0700 and
    verified; the named directory itself is never changed (docs/operations.md "Security model"). Empty:
    SHARDSAFE_HOLDER_DIR, else ``shardsafe-<uid>`` under XDG_RUNTIME_DIR or /tmp."""
    job_id: str = ""
    """Scopes sockets, shared memory and, without a run_name, the persistent directory; two jobs on one node never
    see each other. Empty: derived when protection is enabled (SHARDSAFE_JOB_ID, SLURM_JOB_ID, torchrun's
    --rdzv-id, else a digest of the launch command; docs/operations.md "Job ids")."""
    node: str = ""
    """Failure-domain name of this process. Empty: SHARDSAFE_NODE, else SLURM's node name, else the hostname."""
    start_holder: bool = True
    """Start a detached holder when none is running for this node and job."""
    holder_idle_exit_s: float = 600.0
    """A holder this job's ranks start (detached) exits after this many seconds with no client connected and no
    flush pending, so a holder whose job is gone does not keep its memory forever (0 = never; holder.protocol
    DEFAULT_IDLE_EXIT_S). A job resubmitted later than this restores from the persistent tier, not memory."""
    restore: bool = True
    """Restore from the newest recoverable snapshot at start. false is ``resume: "never"``."""
    resume: str = "auto"
    """Which snapshot a starting job may restore. "auto": the newest recoverable one whose run fingerprint (the
    framework config without the shardsafe block, the model's parameter names, shapes and dtypes, the parallel
    layout, the optimizer and its hyperparameters at step 0) equals this run's; another fingerprint is refused
    before anything is applied, naming the first field that differs. "force": restore it anyway (the differences
    are logged). "never": start fresh and drop every version this job's holders and persistent tier keep.
    docs/operations.md "Run identity"."""
    on_unprotected: str = "warn"
    """What happens when protection lapses (no holder, a budget that cannot keep two versions, a failed vote, no
    version committed for max(3, 2 * interval) steps): "warn" logs it at WARNING on rank 0 every
    warn_interval_s while it lasts and records it; "fail" raises an error in the training loop so that the
    job's scheduler restarts it (a budget too small is an error at start)."""
    warn_interval_s: float = 60.0
    """While protection has lapsed, rank 0 repeats its warning this often (seconds)."""
    parity_shards: int = 1
    """m: members of a parity group that may be lost (Reed-Solomon parity shares)."""
    parity_group_size: int = 0
    """n: members per parity group (0 = the data-parallel size capped at 8; 1 disables parity)."""
    parity_transport: str = "host"
    """How stripes move and are encoded: "host" (from the holders' shared memory over gloo, ISA-L on the CPU;
    works everywhere) or "device" (staged into GPU memory, moved over NCCL, CUDA kernels; parity copied back
    into the holder). "device" needs CUDA, NCCL and the built kernels (docs/parity.md)."""
    timeout_s: float = 60.0
    """How long a holder request or the background agreement may take before the snapshot is skipped."""
    run_dir: str = ""
    """Where trainers append TOR events (events.jsonl); empty = SHARDSAFE_RUN_DIR or no event log."""
    persist_dir: str = ""
    """Persistent tier: holders write committed versions under PERSIST_DIR/RUN_NAME/ (run_name; empty =
    SHARDSAFE_PERSIST_DIR, else off)."""
    run_name: str = ""
    """Names the run in the persistent tier: holders flush to PERSIST_DIR/RUN_NAME/ and a restore from disk reads
    there. The job id scopes what lives in memory (holders, sockets, shared memory) and changes with every SLURM
    requeue or resubmission; the run name stays the same for every allocation of one run, so a requeued or
    resubmitted job finds the versions its predecessor flushed. Empty: SHARDSAFE_RUN_NAME (the sbatch scripts set
    it from SS_RUN_NAME), else the job id. 1-64 of the characters A-Z a-z 0-9 . _ -; the run fingerprint keeps
    another run that reuses the name from restoring (docs/operations.md "Run names")."""
    persist_every: int = 10
    """Flush every K-th snapshot (in snapshots, not steps) when persist_dir is set."""
    persist_keep: int = 2
    """Keep the newest N flushed versions on disk."""
    persist_mbps: float = 0.0
    """Cap a holder's flush bandwidth in MB/s (0 = uncapped)."""
    hash_threads: int = 0
    """Threads per rank that compute the snapshot checksums and verify a restore (xxh3 off the GIL,
    shardsafe/payload/checksum.py); 0 = the node's usable cores over its local ranks, at most 8."""
    restore_h2d: str = "pinned"
    """How a restore into GPU tensors reads the holder's memory: "pinned" page-locks the verified mapping
    (cudaHostRegister, read-only) while its segments verify, so the copies are DMA at the link's speed;
    "pageable" copies through the driver's staging buffers. Pinned falls back to pageable, with one warning,
    when the driver refuses the registration. No effect on CPU tensors."""
    resume_client_state: str = "auto"
    """DeepSpeed programs that resume through ``engine.load_checkpoint(dir)`` and take their iteration, data
    position and RNG from the client state it returns: when a snapshot was restored and the directory holds no
    checkpoint yet (a crash before the first save), load_checkpoint returns the client state such a program would
    have saved at the snapshot's step, in its layout: "neox" (GPT-NeoX), "megatron-deepspeed", "none" (DeepSpeed's
    own answer, (None, None): for programs that loop from ``engine.global_steps``), or "auto" (recognised from the
    ``args`` given to deepspeed.initialize; else "none"). docs/deepspeed.md "Resuming through the program's own restart
    logic"."""
    export_dir: str = ""
    """Export run: right after the restore at start, write the restored state with the framework's own checkpoint
    writer into this directory and exit before training. Set by `shardsafe export ... -- COMMAND` through
    SHARDSAFE_EXPORT_DIR (empty = SHARDSAFE_EXPORT_DIR, else a normal run)."""

    def __post_init__(self) -> None:
        _check_type(self)
        if self.interval < 1:
            raise ConfigError(f"shardsafe.interval must be an integer >= 1 (snapshot every N steps); got {self.interval}. "
                              "Use 1 to snapshot every iteration.")
        if self.memory_budget_gb < 0:
            raise ConfigError(f"shardsafe.memory_budget_gb must be >= 0 GiB (0 = half the node's RAM); got {self.memory_budget_gb}.")
        if self.parity_shards < 1:
            raise ConfigError(f"shardsafe.parity_shards (m) must be >= 1; got {self.parity_shards}.")
        if self.parity_group_size < 0:
            raise ConfigError(f"shardsafe.parity_group_size (n) must be >= 0; got {self.parity_group_size}.")
        if self.parity_transport not in PARITY_TRANSPORTS:
            raise ConfigError(f"shardsafe.parity_transport must be one of {', '.join(map(repr, PARITY_TRANSPORTS))}; "
                              f"got {self.parity_transport!r}.")
        if self.restore_h2d not in RESTORE_H2D:
            raise ConfigError(f"shardsafe.restore_h2d must be one of {', '.join(map(repr, RESTORE_H2D))}; "
                              f"got {self.restore_h2d!r}.")
        if self.resume_client_state not in RESUME_CLIENT_STATES:
            raise ConfigError(f"shardsafe.resume_client_state must be one of {', '.join(map(repr, RESUME_CLIENT_STATES))}; "
                              f"got {self.resume_client_state!r}.")
        if self.persist_every < 1 or self.persist_keep < 1:
            raise ConfigError(f"shardsafe.persist_every and persist_keep must be >= 1; got {self.persist_every} and "
                              f"{self.persist_keep}.")
        if self.hash_threads < 0:
            raise ConfigError(f"shardsafe.hash_threads must be >= 0 (0 = cores per local rank); got {self.hash_threads}.")
        if self.persist_mbps < 0:
            raise ConfigError(f"shardsafe.persist_mbps must be >= 0 MB/s (0 = uncapped); got {self.persist_mbps}.")
        if self.timeout_s <= 0:
            raise ConfigError(f"shardsafe.timeout_s must be > 0 seconds; got {self.timeout_s}.")
        if self.resume not in RESUME:
            raise ConfigError(f"shardsafe.resume must be one of {', '.join(map(repr, RESUME))}; got {self.resume!r}.")
        if self.on_unprotected not in ON_UNPROTECTED:
            raise ConfigError(f"shardsafe.on_unprotected must be one of {', '.join(map(repr, ON_UNPROTECTED))}; got "
                              f"{self.on_unprotected!r}.")
        if self.warn_interval_s <= 0:
            raise ConfigError(f"shardsafe.warn_interval_s must be > 0 seconds; got {self.warn_interval_s}.")
        if not self.restore:
            self.resume = "never"
        if self.holder_idle_exit_s < 0:
            raise ConfigError(f"shardsafe.holder_idle_exit_s must be >= 0 seconds (0 = the holder never exits on its "
                              f"own); got {self.holder_idle_exit_s}.")
        for key in ("job_id", "node"):
            v = getattr(self, key)
            if v and (any(c in v for c in "/\0") or len(v) > 64):
                raise ConfigError(f"shardsafe.{key} must be 1-64 characters without '/'; got {v!r}.")
        _check_run_name(self.run_name, "shardsafe.run_name")

    def resolved(self, environ: Mapping[str, str] | None = None) -> "ShardsafeConfig":
        """This config with what it leaves to the environment filled in (shardsafe.env): the holder directory, the
        node, the run and persistent directories, the run name, the export directory, and, when protection is on,
        the job id (derived by shardsafe.jobid when none is set). Called where a job starts; idempotent.

        Raises:
            ConfigError: nothing identifies the job, or the launcher's holder budget differs from the config's.
        """
        e = os.environ if environ is None else environ
        run_name = self.run_name or env.get(env.RUN_NAME, e)
        if not self.run_name:
            _check_run_name(run_name, f"{env.RUN_NAME} (the default of shardsafe.run_name)")
        out = dataclasses.replace(
            self, holder_dir=self.holder_dir or env.holder_dir(e), node=self.node or env.node_name(e),
            run_dir=self.run_dir or env.get(env.RUN_DIR, e), persist_dir=self.persist_dir or env.get(env.PERSIST_DIR, e),
            run_name=run_name, export_dir=self.export_dir or env.get(env.EXPORT_DIR, e))
        if out.enabled and not out.job_id:
            out.job_id = default_job_id(e)
        for key in ("job_id", "node") if out.enabled or out.job_id else ("node",):
            v = getattr(out, key)
            if not v or any(c in v for c in "/\0") or len(v) > 64:
                raise ConfigError(f"shardsafe.{key} must be 1-64 characters without '/'; got {v!r}.")
        if out.enabled:
            out._check_launcher_budget(env.get(env.HOLDER_BUDGET_GB, e))
        return out

    @property
    def persist_name(self) -> str:
        """The run's directory under persist_dir: run_name, else the job id."""
        return self.run_name or self.job_id

    def _check_launcher_budget(self, launched: str) -> None:
        """Under a launcher that started the holders (SHARDSAFE_HOLDER_BUDGET_GB: ``launched``), a budget in the config
        must be the holders' budget: a running holder's budget cannot change."""
        if not launched or self.memory_budget_gb == 0:
            return   # no launcher-started holder, or the config leaves the budget to whoever starts it
        try:
            theirs = float(launched)
        except ValueError:
            return
        if abs(theirs - self.memory_budget_gb) > 1e-9 * max(1.0, theirs):
            have = "half of the node's RAM (its default, 0)" if theirs == 0 else f"{theirs:g} GiB"
            raise ConfigError(
                f"shardsafe.memory_budget_gb is {self.memory_budget_gb:g} GiB in this job's config, but the launcher "
                f"started this node's holder with --memory-budget-gb {theirs:g} ({have}), and a running holder's "
                f"budget cannot change. Use one value: pass --memory-budget-gb {self.memory_budget_gb:g} to the "
                "launcher (shardsafe launch / LaunchConfig.memory_budget_gb), or drop memory_budget_gb from the config.")

    @property
    def memory_budget_bytes(self) -> int:
        if self.memory_budget_gb == 0:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
        return int(self.memory_budget_gb * (1 << 30))

    @classmethod
    def from_dict(cls, block: Mapping[str, Any] | None, *, where: str = '"shardsafe" block') -> "ShardsafeConfig":
        """Build from a JSON-like mapping (the DeepSpeed block). Unknown keys are errors."""
        if block is None:
            return cls(enabled=False)
        if not isinstance(block, Mapping):
            raise ConfigError(f"the {where} must be a JSON object, got {type(block).__name__}: {block!r}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(block) - known)
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} in the {where}; valid keys are {sorted(known)}.")
        return cls(**dict(block))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_run_name(value: str, where: str) -> None:
    """A run name names a directory under persist_dir: one path component, never '.' or '..'."""
    if value and (not _RUN_NAME.fullmatch(value) or value.strip(".") == ""):
        raise ConfigError(f"{where} must be 1-64 of the characters A-Z a-z 0-9 . _ - (and not only dots): it names "
                          f"the run's directory under persist_dir; got {value!r}. Choose a name such as "
                          "'gpt-1b-lr3e-4' (the sbatch scripts: SS_RUN_NAME).")


_TYPES = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}


def _check_type(cfg: ShardsafeConfig) -> None:
    hints = {"bool": bool, "int": int, "float": float, "str": str}
    for f in fields(cfg):
        want = hints[f.type] if isinstance(f.type, str) else f.type
        v = getattr(cfg, f.name)
        ok = isinstance(v, _TYPES[want]) and not (want in (int, float) and isinstance(v, bool))
        if not ok:
            raise ConfigError(f"shardsafe.{f.name} must be of type {want.__name__}; got {type(v).__name__} {v!r}.")
