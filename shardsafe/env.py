"""Every environment variable shardsafe reads, and how the values it derives from the environment are resolved.

This is the one module that reads the environment for a ``SHARDSAFE_*`` name (tests/unit/test_env.py scans the
source): everything else calls :func:`get` with a name defined here, or one of the resolvers below (the node, the
holder directory, the job id, the attempt). Launchers that *set* variables for their children use the same names.
Standard library only (and shardsafe.errors): the activation hook (adapters/autoload.py) imports it at every interpreter start.

docs/configuration.md lists the variables for users (tests/unit/test_docs.py holds the two equal).
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Mapping, Optional

from .errors import InternalError

log = logging.getLogger(__name__)

# ---- the names ------------------------------------------------------------------------------------------------
JOB_ID = "SHARDSAFE_JOB_ID"                  # the job id (shardsafe.jobid derives one when it is unset)
NODE = "SHARDSAFE_NODE"                      # this process's failure domain (simulated nodes set it)
HOLDER_DIR = "SHARDSAFE_HOLDER_DIR"          # where holders keep sockets (shardsafe's private subdirectory in it)
RUN_DIR = "SHARDSAFE_RUN_DIR"                # where TOR events, markers and fatal records go
PERSIST_DIR = "SHARDSAFE_PERSIST_DIR"        # the persistent tier (config persist_dir when it is unset)
RUN_NAME = "SHARDSAFE_RUN_NAME"              # the persistent tier's run name (config run_name when it is unset)
EXPORT_DIR = "SHARDSAFE_EXPORT_DIR"          # set by `shardsafe export`: restore, write a native checkpoint, exit
HOLDER_BUDGET_GB = "SHARDSAFE_HOLDER_BUDGET_GB"   # the budget the launcher started the holders with
ATTEMPT = "SHARDSAFE_ATTEMPT"                # the restart attempt (else torch elastic's TORCHELASTIC_RESTART_COUNT)
RESTART = "SHARDSAFE_RESTART"                # how a failed worker is restarted: full (every worker) or in-place
JOB_START_T = "SHARDSAFE_JOB_START_T"        # when the job started (TOR accounting)
FULL_WORLD_SIZE = "SHARDSAFE_FULL_WORLD_SIZE"   # the job's full world size, set by the launchers for every trainer
                                             # (a job re-formed at a smaller data-parallel size runs fewer ranks)
INSTANCE = "SHARDSAFE_INSTANCE"              # one value per launcher run (the job-id claim)
TRAINER = "SHARDSAFE_TRAINER"                # "pid:RANK:LOCAL_RANK" of the trainer, inherited by its children
INJECT = "SHARDSAFE_INJECT"                  # the fault spec (shardsafe.faults)
INJECT_STALL_S = "SHARDSAFE_INJECT_STALL_S"  # how long the stall-vote fault sleeps
EARLY_OPEN = "SHARDSAFE_EARLY_OPEN"          # the early open's mode: 1 (map and verify), map, 0
AUTO = "SHARDSAFE_AUTO"                      # 0 turns the automatic activation off
LOG = "SHARDSAFE_LOG"                        # the CLI's log level
PRELOAD = "SHARDSAFE_PRELOAD"                # `shardsafe launch --preload` default
XXH3_LIB = "SHARDSAFE_XXH3_LIB"              # a libxxhash to hash with instead of the system's
CPU_LIB = "SHARDSAFE_CPU_LIB"                # the fused copy+hash helper library
ISAL_LIB = "SHARDSAFE_ISAL_LIB"              # ISA-L's library
EC_LIB = "SHARDSAFE_EC_LIB"                  # the CUDA erasure-coding kernels' library

NAMES = frozenset(v for k, v in dict(globals()).items() if k.isupper() and isinstance(v, str)
                  and v.startswith("SHARDSAFE_"))
"""Every ``SHARDSAFE_*`` variable shardsafe reads."""


def _environ(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def get(name: str, environ: Optional[Mapping[str, str]] = None, default: str = "") -> str:
    """The value of ``name`` (one of :data:`NAMES`), or ``default`` when it is unset or empty."""
    if name not in NAMES:
        raise InternalError(f"{name!r} is not one of shardsafe's environment variables (shardsafe.env.NAMES): add it "
                            "there, with what it means")
    return _environ(environ).get(name) or default


# ---- what is derived from the environment -------------------------------------------------------------------------

def node_name(environ: Optional[Mapping[str, str]] = None) -> str:
    """This process's failure domain: SHARDSAFE_NODE (simulated nodes), else SLURM's node name, else the hostname."""
    env = _environ(environ)
    return get(NODE, env) or env.get("SLURMD_NODENAME") or socket.gethostname()


def private_name() -> str:
    """The name of shardsafe's own directory of this user: ``shardsafe-<uid>``."""
    return f"shardsafe-{os.getuid()}"


def private_dir(named: str) -> str:
    """The directory shardsafe keeps its files in for ``named`` (a default, or the directory the user set):
    ``named`` itself when it already is shardsafe's own (named ``shardsafe-<uid>``, as the defaults are), else
    ``named/shardsafe-<uid>``, so that the user's directory is never chmodded. Idempotent."""
    named = os.path.normpath(named)
    return named if os.path.basename(named) == private_name() else os.path.join(named, private_name())


_xdg_said: set[str] = set()


def holder_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    """Where holders put their sockets when the config does not say: shardsafe's directory in SHARDSAFE_HOLDER_DIR
    (:func:`private_dir`), else ``shardsafe-<uid>`` under XDG_RUNTIME_DIR or /tmp.

    An XDG_RUNTIME_DIR that does not exist on this node (SLURM hands the submitting host's environment to the
    compute nodes, where the user has no login session) falls back to /tmp, said once per process."""
    env = _environ(environ)
    if get(HOLDER_DIR, env):
        return private_dir(get(HOLDER_DIR, env))
    base = env.get("XDG_RUNTIME_DIR") or ""
    if base and not os.path.isdir(base):
        if base not in _xdg_said:
            _xdg_said.add(base)
            log.warning("XDG_RUNTIME_DIR=%s does not exist on this node%s: holder directory %s instead", base,
                        " (SLURM passed on the submitting host's environment)" if env.get("SLURM_JOB_ID") else "",
                        os.path.join("/tmp", private_name()))
        base = ""
    return os.path.join(base or "/tmp", private_name())


def holder_socket(environ: Optional[Mapping[str, str]] = None) -> str:
    """Where this node's holder of the job named by SHARDSAFE_JOB_ID listens ("" without a job id). Whether it
    exists is all the activation asks here; the early open verifies the directory and the holder before use."""
    env = _environ(environ)
    job = get(JOB_ID, env)
    return os.path.join(holder_dir(env), job, f"{node_name(env)}.sock") if job else ""


def attempt(environ: Optional[Mapping[str, str]] = None) -> int:
    """The restart attempt this process belongs to: SHARDSAFE_ATTEMPT (shardsafe's launchers), else torch elastic's
    TORCHELASTIC_RESTART_COUNT, else 0."""
    env = _environ(environ)
    return int(get(ATTEMPT, env) or env.get("TORCHELASTIC_RESTART_COUNT") or 0)


RESTART_MODES = ("full", "in-place")


def restart_mode(environ: Optional[Mapping[str, str]] = None) -> str:
    """How the launcher restarts after a worker dies: SHARDSAFE_RESTART, "full" (the default) or "in-place"."""
    mode = get(RESTART, environ, "full").strip().lower() or "full"
    if mode not in RESTART_MODES:
        from .errors import ConfigError
        raise ConfigError(f"{RESTART}={mode!r}: expected one of {', '.join(RESTART_MODES)}")
    return mode


def launcher_job_id(environ: Optional[Mapping[str, str]] = None) -> str:
    """The job id a launcher or the scheduler names: SHARDSAFE_JOB_ID, else SLURM_JOB_ID ("" without either)."""
    env = _environ(environ)
    return get(JOB_ID, env) or env.get("SLURM_JOB_ID") or ""


def auto_enabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    """The automatic activation is on unless SHARDSAFE_AUTO is 0 / false / no / off."""
    return get(AUTO, environ, "1").strip().lower() not in ("0", "false", "no", "off")


def gloo_interfaces(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """The network interfaces torch's gloo groups bind to: GLOO_SOCKET_IFNAME, comma-separated (torch's variable;
    empty: the address this host's name resolves to)."""
    return [x.strip() for x in _environ(environ).get("GLOO_SOCKET_IFNAME", "").split(",") if x.strip()]
