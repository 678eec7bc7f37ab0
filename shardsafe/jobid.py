"""Which job a trainer belongs to: the default job id, and the claim that keeps two running jobs apart.

The job id scopes holders, sockets, shared memory and the persistent directory. It must be

* **the same for every rank of a job and across its restarts** (in place by torch elastic, or the whole
  job resubmitted by the same command), or a restarted job cannot find its snapshots;
* **different for two jobs that run at the same time**, or they share a holder and restore each other's
  state (issue 15: two plain ``torchrun`` jobs of one user on one node did exactly that).

Rules, first match wins (docs/operations.md "Job ids"):

1. ``SHARDSAFE_JOB_ID`` (``shardsafe launch``, the sbatch scripts, or the user);
2. ``SLURM_JOB_ID`` (kept by restarts inside the allocation and by a requeue);
3. torchrun's run id ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``) unless it is torchrun's placeholder ``none``;
4. otherwise a digest of the launch command: the script and its arguments (``sys.argv``), the working
   directory, ``MASTER_ADDR``, ``MASTER_PORT`` and ``WORLD_SIZE``. A resubmission of the same command
   derives the same id; two jobs running at once on one node differ at least in their port (the
   second torchrun could not bind the first one's) or in their arguments. Without a command line
   (``python -c``, an interactive interpreter) nothing identifies the job: :class:`AmbiguousJobId`.

A digest can still collide (two identical single-process runs in one directory, two job steps of one
SLURM allocation): :func:`claim` makes the second *running* job fail with a clear error instead of
sharing. Every trainer holds a shared ``flock`` on a file named after its job *instance* for as long as
it lives; the node's owner file names the instance that holds the job id. A trainer of another instance
takes the id over only when no process holds the owner's instance lock any more (the old job is gone:
that is a resubmission), else it gets :class:`JobConflict`. The kernel drops the locks of a SIGKILLed
process, so a crash never leaves a stale claim behind.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import sys
import threading
import time
from typing import Mapping, Sequence

from .errors import ShardsafeError

ENV_JOB_ID = "SHARDSAFE_JOB_ID"
ENV_INSTANCE = "SHARDSAFE_INSTANCE"
"""Set by shardsafe's launchers: one value per launcher run, shared by all its trainers and restarts."""

_LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
"""Any of these: a launcher started this process, so the parent is the job instance on this node."""

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class AmbiguousJobId(ValueError, ShardsafeError):
    """No launcher id and no command line identify this job: refusing to guess one that others may share."""


class JobConflict(RuntimeError, ShardsafeError):
    """Another running job already uses this job id on this node."""


def _sanitize(v: str) -> str:
    """A launcher's id as a file-name-safe job id (holder paths use it as a directory name)."""
    return _SAFE.sub("_", v)[:64]


def command_digest(argv: Sequence[str], cwd: str, env: Mapping[str, str]) -> str:
    """``cmd-`` + 16 hex digits of what identifies a job started by a launcher without an id.

    The inputs are what every rank of one launch sees alike and a resubmission of the same command
    reproduces: argv (script + arguments), the working directory, MASTER_ADDR/PORT and WORLD_SIZE.
    """
    parts = {"argv": list(argv), "cwd": cwd,
             **{k: env.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}}
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return "cmd-" + hashlib.sha256(blob).hexdigest()[:16]


def derive_job_id(env: Mapping[str, str] | None = None, argv: Sequence[str] | None = None,
                  cwd: str | None = None) -> tuple[str, str]:
    """``(job_id, source)`` by the rules in the module docstring; ``source`` names the rule that applied.

    Raises:
        AmbiguousJobId: rule 4 applies but there is no command line to digest.
    """
    env = os.environ if env is None else env
    for var in (ENV_JOB_ID, "SLURM_JOB_ID"):
        if env.get(var):
            return _sanitize(env[var]), var
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return _sanitize(run_id), "TORCHELASTIC_RUN_ID"
    argv = list(sys.argv if argv is None else argv)
    interactive = hasattr(sys, "ps1") and argv is sys.argv
    if not argv or argv[0] in ("", "-c", "-") or interactive:
        raise AmbiguousJobId(
            "cannot tell which job this is: no SHARDSAFE_JOB_ID, SLURM_JOB_ID or torchrun run id is set "
            f"(TORCHELASTIC_RUN_ID={run_id or 'unset'}), and there is no script command line to derive one from "
            f"(sys.argv={argv!r}). Refusing to guess an id another job could share: set SHARDSAFE_JOB_ID=<name> "
            "(the same value for every restart of this job), or start it with torchrun --rdzv-id <name>, or set "
            "shardsafe.job_id in the config.")
    return command_digest(argv, os.getcwd() if cwd is None else cwd, env), "command"


def _proc_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): pids get reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()[19].decode()
    except (OSError, ValueError, IndexError):
        return "0"


def instance_token(env: Mapping[str, str] | None = None) -> str:
    """What all trainers of one *running* job on this node share, and a different running job does not:
    the launcher's SHARDSAFE_INSTANCE; else the process that launched this trainer (torchrun's agent, the
    deepspeed launcher, slurmstepd, orted: one per job and node, alive as long as the job); else, for a
    process nobody launched, the process itself. ``pid.starttime``, so a reused pid is another instance."""
    env = os.environ if env is None else env
    if env.get(ENV_INSTANCE):
        return _sanitize(env[ENV_INSTANCE])
    pid = os.getppid() if any(env.get(v) for v in _LAUNCHER_VARS) else os.getpid()
    return f"{pid}.{_proc_start(pid)}"


# ---- the claim ------------------------------------------------------------------------------------------

_held: dict[str, int] = {}      # instance-lock path -> fd held (shared flock) for the life of this process
_held_lock = threading.Lock()


def _owner_paths(root: str, job_id: str, node: str) -> tuple[str, str]:
    d = os.path.join(root, job_id)
    return os.path.join(d, f"{node}.owner"), os.path.join(d, f"{node}.owner.lock")


def _instance_path(root: str, job_id: str, node: str, token: str) -> str:
    return os.path.join(root, job_id, f"{node}.instance.{token}")


def _alive(path: str) -> bool:
    """Does any process hold a lock on the instance file ``path``?"""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)   # also drops the probe's own lock
    return False


def claim(root: str, job_id: str, node: str, *, token: str | None = None) -> str:
    """Claim ``job_id`` on ``node`` for this process's job instance (idempotent); returns the token.

    Call it before connecting to the node's holder. The directory ``root/job_id`` is the holder's own
    (created 0700 by the caller or here).

    Raises:
        JobConflict: another instance that still has live processes holds the id on this node.
    """
    token = token or instance_token()
    for d in (root, os.path.join(root, job_id)):   # the holder's directories: private to this user
        os.makedirs(d, mode=0o700, exist_ok=True)
    owner_path, mutex_path = _owner_paths(root, job_id, node)
    mine = _instance_path(root, job_id, node, token)
    with _held_lock:
        if mine in _held:
            return token
        mutex = os.open(mutex_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(mutex, fcntl.LOCK_EX)
            try:
                with open(owner_path) as f:
                    owner = json.load(f)
            except (FileNotFoundError, ValueError):
                owner = None
            if owner and owner.get("token") != token:
                theirs = _instance_path(root, job_id, node, str(owner.get("token")))
                if _alive(theirs):
                    raise JobConflict(
                        f"job id {job_id!r} on node {node!r} is in use by another running job (its trainer pid "
                        f"{owner.get('pid')} started {time.strftime('%H:%M:%S', time.localtime(owner.get('t', 0)))}: "
                        f"{' '.join(owner.get('argv', []))[:200]!r}, in {owner.get('cwd')!r}). Two jobs would "
                        "share one holder and restore each other's snapshots: give each job its own id "
                        "(SHARDSAFE_JOB_ID=<name>, torchrun --rdzv-id <name>, or shardsafe.job_id in the config).")
                try:
                    os.unlink(theirs)   # that job is gone: its instance file is stale
                except FileNotFoundError:
                    pass
            fd = os.open(mine, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.set_inheritable(fd, False)
            _held[mine] = fd
            if not owner or owner.get("token") != token:
                tmp = f"{owner_path}.tmp{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump({"token": token, "pid": os.getpid(), "t": time.time(), "argv": list(sys.argv),
                               "cwd": os.getcwd()}, f)
                os.replace(tmp, owner_path)
        finally:
            os.close(mutex)   # releases the mutex
    return token


def release_all() -> None:
    """Drop this process's claims (tests; a process's claims otherwise end with it)."""
    with _held_lock:
        for fd in _held.values():
            os.close(fd)
        _held.clear()
