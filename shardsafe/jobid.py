"""Which job a trainer belongs to: the default job id, and the claim that keeps two running jobs apart.

The job id scopes holders, sockets, shared memory and the persistent directory. It must be

* **the same for every rank of a job and across its restarts** (in place by torch elastic, or the whole
  job resubmitted by the same command), or a restarted job cannot find its snapshots;
* **different for two jobs that run at the same time**, or they share a holder and restore each other's
  state (e.g. two plain ``torchrun`` jobs of one user on one node).

Rules, first match wins (docs/operations.md "Job ids"):

1. ``SHARDSAFE_JOB_ID`` (``shardsafe launch``, the sbatch scripts, or the user);
2. ``SLURM_JOB_ID`` (kept by restarts inside the allocation and by a requeue);
3. torchrun's run id ``TORCHELASTIC_RUN_ID`` when the user chose it (``--rdzv-id``). torchrun also sets it
   for runs without one: the placeholder ``none``, or a fresh UUID per launch for ``--standalone`` and
   for a one-node run with neither a rendezvous endpoint nor ``--master-port``. Which case applies is read
   from the torchrun agent's own command line (the worker's parent, or the one above a wrapper script that
   ``torchrun --no-python`` runs; :func:`agent_command`), parsed by torchrun's own argument parser
   (:func:`torchrun_rendezvous`);
4. otherwise a digest of the launch command (:func:`command_digest`): the script and its arguments
   (``sys.argv`` but a per-process ``--local_rank=N``), the working directory, ``WORLD_SIZE``, and the
   rendezvous as the command names it: ``MASTER_ADDR``/``MASTER_PORT`` for a static rendezvous
   (``--master-port``, the deepspeed launcher, ``srun``/``mpirun`` tasks), ``--rdzv-backend``:
   ``--rdzv-endpoint`` for a dynamic one (its workers' ``MASTER_PORT`` is a free port drawn per launch),
   ``local`` for torchrun's per-launch one-node rendezvous. A resubmission of the same command derives
   the same id. Two jobs running at once on one node differ in their rendezvous port or arguments, except
   two identical one-node commands in one directory: :func:`claim` refuses the second. Where nothing a
   resubmission reproduces identifies the rendezvous (no torchrun command line above the worker), rank 0
   says so in one warning.
   Without a command line (``python -c``, an interactive interpreter) nothing identifies the job:
   :class:`AmbiguousJobId`.

A digest can still collide (two identical single-process runs in one directory, two job steps of one
SLURM allocation): :func:`claim` makes the second *running* job fail with a clear error instead of
sharing. Every trainer holds a shared ``flock`` on a file named after its job *instance* for as long as
it lives; the node's owner file names the instance that holds the job id. A trainer of another instance
takes the id over only when no process holds the owner's instance lock any more (the old job is gone:
that is a resubmission); while one does, it waits up to :data:`CLAIM_WAIT_S` for it to exit (a relaunch can
find the previous attempt's hung trainer still being stopped), then gets :class:`JobConflict`. The kernel
drops the locks of a SIGKILLed process, so a crash never leaves a stale claim behind. The claim's files live
in the holder's private directory, verified before any of them is touched, and opened without following links;
the instance token read back from the owner file becomes a file name only if it is one plain name
(:mod:`shardsafe.holder.paths`).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import sys
import threading
import time
from typing import Mapping, Sequence

from .errors import ConfigError, ShardsafeError
from . import env as shardsafe_env
from .holder.paths import HolderPaths, open_private, safe_name

log = logging.getLogger(__name__)

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


_LOCAL_RANK_ARG = re.compile(r"--local[-_]rank=\d+")   # per process: deepspeed launcher, torch.distributed.launch


def command_digest(argv: Sequence[str], cwd: str, env: Mapping[str, str], rendezvous: str | None = None) -> str:
    """``cmd-`` + 16 hex digits of what identifies a job started by a launcher without an id.

    The inputs are what every rank of one launch sees alike and a resubmission of the same command
    reproduces: argv (script + arguments), the working directory, WORLD_SIZE, and the rendezvous:
    ``rendezvous`` when given (a dynamic rendezvous's ``backend:endpoint``, or ``local``), else
    MASTER_ADDR/PORT (a static rendezvous: the address the command names). The ``--local_rank=N`` that the
    deepspeed launcher and torch.distributed.launch append for each process is left out: it differs per rank.
    """
    where = ({"rdzv": rendezvous} if rendezvous is not None
             else {k: env.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT")})
    argv = [a for a in argv if not _LOCAL_RANK_ARG.fullmatch(a)]
    parts = {"argv": argv, "cwd": cwd, "WORLD_SIZE": env.get("WORLD_SIZE", ""), **where}
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return "cmd-" + hashlib.sha256(blob).hexdigest()[:16]


_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def _parent(pid: int) -> int:
    """The parent of ``pid`` (/proc/PID/stat field 4), 0 when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def agent_command(pid: int | None = None) -> list[str] | None:
    """torchrun's own arguments (what follows ``torchrun`` or ``-m torch.distributed.run|launch``) from the
    command line of process ``pid``, with the module name first; None when that process is no torchrun or
    cannot be read. Default: this process's parent (torchrun's agent for its workers), else the next two
    ancestors (``torchrun --no-python wrapper.sh`` starts the trainer from a shell)."""
    if pid is None:
        pid = os.getppid()
        for _ in range(3):
            found = agent_command(pid) if pid > 1 else None
            if found is not None:
                return found
            pid = _parent(pid)
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return None
    for i, a in enumerate(cmd):
        if os.path.basename(a) == "torchrun":
            return [_TORCHRUN_MODULES[0], *cmd[i + 1:]]
        if a == "-m" and i + 1 < len(cmd) and cmd[i + 1] in _TORCHRUN_MODULES:
            return [cmd[i + 1], *cmd[i + 2:]]
        if a.startswith("-m") and a[2:] in _TORCHRUN_MODULES:
            return [a[2:], *cmd[i + 1:]]
    return None


def torchrun_rendezvous(agent: Sequence[str]) -> tuple[str, str | None] | None:
    """What torchrun's arguments (``agent``: :func:`agent_command`) say about the job's identity across launches:

    * ``("local", None)``: torchrun draws the rendezvous for each launch on this node (``--standalone``, or one
      node without ``--rdzv-endpoint`` and ``--master-port``; torch.distributed.run ``run()``): its run id is a
      fresh UUID and its workers' MASTER_PORT a free port, so only the command identifies a resubmission;
    * ``("run_id", None)``: the user's ``--rdzv-id``, which torchrun hands the workers as TORCHELASTIC_RUN_ID;
    * ``("rendezvous", "BACKEND:ENDPOINT")``: a dynamic rendezvous (c10d, etcd) without a run id: the endpoint
      the command names identifies it (the workers' MASTER_ADDR/PORT are drawn at each rendezvous);
    * ``("static", None)``: the static rendezvous at MASTER_ADDR:MASTER_PORT, which the command names.

    None when the arguments do not parse (not a torchrun this torch knows).
    """
    import contextlib
    import io
    try:
        from torch.distributed.run import get_args_parser, parse_min_max_nnodes
        parser = get_args_parser()   # reads torchrun's PET_* defaults from the environment, as torchrun did
        if agent and agent[0] == "torch.distributed.launch":
            parser.add_argument("--use-env", "--use_env", default=False, action="store_true")
        with contextlib.redirect_stderr(io.StringIO()):
            args = parser.parse_args(list(agent[1:]))
        max_nodes = parse_min_max_nnodes(args.nnodes)[1]
    except (ImportError, SystemExit, ValueError, RuntimeError, AttributeError, TypeError):
        return None
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                           and max_nodes == 1):
        return "local", None
    if args.rdzv_id and args.rdzv_id != "none":
        return "run_id", None
    if args.rdzv_backend != "static":
        return "rendezvous", f"{args.rdzv_backend}:{args.rdzv_endpoint}"
    return "static", None


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_said: set[str] = set()


def _say_once(env: Mapping[str, str], msg: str) -> None:
    """One warning per process, on rank 0 only (every rank derives the same id)."""
    if env.get("RANK", "0") == "0" and msg not in _said:
        _said.add(msg)
        log.warning("%s", msg)


def derive_job_id(env: Mapping[str, str] | None = None, argv: Sequence[str] | None = None,
                  cwd: str | None = None, agent: Sequence[str] | None = None) -> tuple[str, str]:
    """``(job_id, source)`` by the rules in the module docstring; ``source`` names the rule that applied.

    Args:
        env, argv, cwd: default to this process's.
        agent: torchrun's arguments (:func:`agent_command`; ``[]``: no torchrun command line); default: read from
            the parent's command line when TORCHELASTIC_RUN_ID says a torch elastic agent started this process.

    Raises:
        AmbiguousJobId: rule 4 applies but there is no command line to digest.
    """
    env = os.environ if env is None else env
    for var in (shardsafe_env.JOB_ID, "SLURM_JOB_ID"):
        value = shardsafe_env.get(var, env) if var == shardsafe_env.JOB_ID else env.get(var)
        if value:
            return _sanitize(value), var
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    rendezvous, unsure = None, ""
    if run_id:
        agent = agent_command() if agent is None else agent
        form = torchrun_rendezvous(agent) if agent else None
        if form is None:   # not torchrun's command line (torch's launch API in a program, torchx, ...)
            if run_id != "none":
                if _UUID.fullmatch(run_id.lower()):
                    _say_once(env, f"shardsafe job id {_sanitize(run_id)!r} is torch elastic's run id, which has the "
                                   "form of the random id torchrun draws for each launch: a resubmitted job would get "
                                   "another id and not find this job's snapshots. To resume after a resubmission, set "
                                   "SHARDSAFE_JOB_ID=<name> (or shardsafe.job_id), or launch with a run id you choose.")
                return _sanitize(run_id), "TORCHELASTIC_RUN_ID"
            unsure = (f"the process that started this worker is not a torchrun command line, so whether a resubmission "
                      f"reproduces MASTER_ADDR:MASTER_PORT={env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')} "
                      "(a dynamic rendezvous draws the port per launch) is unknown")
        elif form[0] == "local":
            rendezvous = "local"
        elif form[0] == "run_id":
            return _sanitize(run_id), "TORCHELASTIC_RUN_ID"
        elif form[0] == "rendezvous":
            rendezvous = form[1]
    argv = list(sys.argv if argv is None else argv)
    interactive = hasattr(sys, "ps1") and argv is sys.argv
    if not argv or argv[0] in ("", "-c", "-") or interactive:
        raise AmbiguousJobId(
            "cannot tell which job this is: no SHARDSAFE_JOB_ID, SLURM_JOB_ID or torchrun run id is set "
            f"(TORCHELASTIC_RUN_ID={run_id or 'unset'}), and there is no script command line to derive one from "
            f"(sys.argv={argv!r}). Refusing to guess an id another job could share: set SHARDSAFE_JOB_ID=<name> "
            "(the same value for every restart of this job), or start it with torchrun --rdzv-id <name>, or set "
            "shardsafe.job_id in the config.")
    job = command_digest(argv, os.getcwd() if cwd is None else cwd, env, rendezvous=rendezvous)
    if unsure:
        _say_once(env, f"shardsafe job id {job} digests the launch command, but {unsure}: if it is not, a resubmitted "
                       "job gets another id and does not find this job's snapshots. To be sure, set "
                       "SHARDSAFE_JOB_ID=<name> (or shardsafe.job_id), or launch with a run id you choose.")
    return job, "command"


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
    if shardsafe_env.get(shardsafe_env.INSTANCE, env):
        return _sanitize(shardsafe_env.get(shardsafe_env.INSTANCE, env))
    pid = os.getppid() if any(env.get(v) for v in _LAUNCHER_VARS) else os.getpid()
    return f"{pid}.{_proc_start(pid)}"


# ---- the claim ------------------------------------------------------------------------------------------

_held: dict[str, int] = {}      # instance-lock path -> fd held (shared flock) for the life of this process
_held_lock = threading.Lock()

CLAIM_WAIT_S = 60.0
"""How long :func:`claim` waits for another running instance of the job id to exit before JobConflict. A relaunch
can find the previous attempt's trainer still alive for a while: hung, or being stopped by its launcher or by
SLURM (SIGTERM, then SIGKILL after its grace period: KillWait defaults to 30 s). docs/operations.md "Job ids"."""
CLAIM_POLL_S = 0.5


def _owner_paths(d: str, node: str) -> tuple[str, str]:
    return os.path.join(d, f"{node}.owner"), os.path.join(d, f"{node}.owner.lock")


def _instance_path(d: str, node: str, token: str) -> str:
    # ``token`` becomes part of a file name: only one that passed safe_name (claim checks both sources of it).
    return os.path.join(d, f"{node}.instance.{token}")


def _alive(path: str) -> bool:
    """Does any process hold a lock on the instance file ``path``?"""
    try:
        fd = open_private(path, os.O_RDWR)
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


def _read_owner(path: str) -> dict | None:
    """The node's owner record, or None (absent, unreadable, or naming its instance with anything but one plain
    file-name component: such a token would become a path that reaches outside the directory)."""
    try:
        fd = open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            log.warning("ignoring %s: not a regular file", path)
            return None
        try:
            owner = json.loads(f.read(1 << 20))
        except ValueError:
            return None
    if not isinstance(owner, dict):
        return None
    if not safe_name(owner.get("token")):
        log.warning("ignoring the owner record %s: its token %r is not a plain name ([A-Za-z0-9._-], not . or ..); "
                    "this instance takes the job id over", path, str(owner.get("token"))[:80])
        return None
    return owner


def _conflict(job_id: str, node: str, owner: dict, waited_s: float) -> JobConflict:
    t = owner.get("t", 0)
    argv = owner.get("argv", [])
    return JobConflict(
        f"job id {job_id!r} on node {node!r} is in use by another running job (its trainer pid "
        f"{owner.get('pid')} started {time.strftime('%H:%M:%S', time.localtime(t if isinstance(t, (int, float)) else 0))}: "
        f"{' '.join(str(a) for a in argv)[:200] if isinstance(argv, list) else ''!r}, in {owner.get('cwd')!r}; still "
        f"running after {waited_s:.0f} s of waiting for it to exit). Two jobs would share one holder and restore each "
        "other's snapshots: give each job its own id (SHARDSAFE_JOB_ID=<name>, torchrun --rdzv-id <name>, or "
        "shardsafe.job_id in the config), or stop the other job.")


def claim(root: str, job_id: str, node: str, *, token: str | None = None, wait_s: float = CLAIM_WAIT_S) -> str:
    """Claim ``job_id`` on ``node`` for this process's job instance (idempotent); returns the token.

    Call it before connecting to the node's holder. The holder's directories (``root``: shardsafe's private
    directory for it, :func:`~shardsafe.holder.paths.private_dir`, and the job's inside it) are created where
    missing and verified before any file in them is touched. While another instance still has live processes,
    waits up to ``wait_s`` seconds (:data:`CLAIM_WAIT_S`) for them to exit, saying so once.

    Raises:
        UnsafeHolderDir: a holder directory is not private to this user (another owner, a link, open to others).
        JobConflict: another instance still has live processes after ``wait_s``.
        ConfigError: ``token`` is not a plain name.
    """
    token = token or instance_token()
    if not safe_name(token):
        raise ConfigError(f"job instance token must be 1-128 characters of [A-Za-z0-9._-] (not . or ..); got {token!r}")
    paths = HolderPaths(root, job_id, node)
    paths.ensure_dir()
    deadline = time.monotonic() + max(0.0, wait_s)
    t0, said = time.monotonic(), False
    while True:
        owner = _claim_once(paths, token)
        if owner is None:
            if said:
                log.info("job id %r on node %r: the other instance exited after %.1f s; claimed", job_id, node,
                         time.monotonic() - t0)
            return token
        if time.monotonic() >= deadline:
            raise _conflict(job_id, node, owner, time.monotonic() - t0)
        if not said:
            said = True
            log.warning("job id %r on node %r is held by another running instance (trainer pid %s, %r): waiting up to "
                        "%.0f s for it to exit (a previous attempt still being stopped?)", job_id, node, owner.get("pid"),
                        str(owner.get("token"))[:80], wait_s)
        time.sleep(min(CLAIM_POLL_S, max(0.0, deadline - time.monotonic())))


def _claim_once(paths: HolderPaths, token: str) -> dict | None:
    """One try: None when this instance holds the id now, else the owner record of the live instance holding it."""
    d, node = paths.dir, paths.node
    owner_path, mutex_path = _owner_paths(d, node)
    mine = _instance_path(d, node, token)
    with _held_lock:
        if mine in _held:
            return None
        mutex = open_private(mutex_path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(mutex, fcntl.LOCK_EX)
            owner = _read_owner(owner_path)
            if owner and owner["token"] != token:
                theirs = _instance_path(d, node, owner["token"])
                if _alive(theirs):
                    return owner
                try:
                    os.unlink(theirs)   # that job is gone: its instance file is stale
                except FileNotFoundError:
                    pass
            fd = open_private(mine, os.O_RDWR | os.O_CREAT)
            fcntl.flock(fd, fcntl.LOCK_SH)
            _held[mine] = fd
            if not owner or owner["token"] != token:
                tmp = f"{owner_path}.tmp{os.getpid()}"
                try:
                    os.unlink(tmp)   # a leftover of a process that had this pid (unlink never follows a link)
                except FileNotFoundError:
                    pass
                with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as f:
                    json.dump({"token": token, "pid": os.getpid(), "t": time.time(), "argv": list(sys.argv),
                               "cwd": os.getcwd()}, f)
                os.replace(tmp, owner_path)
        finally:
            os.close(mutex)   # releases the mutex
    return None


def release_all() -> None:
    """Drop this process's claims (tests; a process's claims otherwise end with it)."""
    with _held_lock:
        for fd in _held.values():
            os.close(fd)
        _held.clear()
