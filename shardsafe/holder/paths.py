"""Where a holder for (job, node) lives: socket, lock and log, in a directory private to this user; and the
checks that keep another user of a shared node out of it (docs/operations.md "Security model").

Every directory shardsafe keeps files in is **private**: owned by this user, no access for group or others
(mode 0700), not a symbolic link. :func:`check_private_dir` verifies that before any file in it is read,
written or deleted: by the trainer (the job-id claim, the holder client, the early open), by the holder, and by
``shardsafe status`` and export. Files in it are opened with ``O_NOFOLLOW`` (:func:`open_private`); names read
from files or listings that become paths pass :func:`safe_name`; a client talks only to a holder process of its
own uid (:func:`peer_credentials`).

A directory the user names (``SHARDSAFE_HOLDER_DIR``, ``shardsafe.holder_dir``, ``--holder-dir``) is never
changed: it may be a group's setgid directory or ``$HOME``. shardsafe keeps its files in its own private
``shardsafe-<uid>`` inside it (:func:`private_dir`). The default, ``$XDG_RUNTIME_DIR/shardsafe-<uid>`` or
``/tmp/shardsafe-<uid>``, already is that directory and is used as it is.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import socket
import stat
import struct
from dataclasses import dataclass


from .. import env
from ..errors import ConfigError, ShardsafeError

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


class HolderSecurityError(PermissionError, ShardsafeError):
    """Another user owns, or could change, a holder directory or the process behind a holder socket: shardsafe
    does not use it. The message names it and what to do."""


class UnsafeHolderDir(HolderSecurityError):
    """A holder directory that is not private to this user: another owner, access for group or others, or a
    symbolic link."""


class ForeignHolder(HolderSecurityError):
    """The process serving a holder socket runs as another user (SO_PEERCRED)."""


# The parts of a holder's path the environment names (the default holder directory, the node) are resolved in
# shardsafe.env; the modules that build holder paths (the early open, the CLI, the DeepSpeed prewarm) take them from
# here, beside the checks.
default_holder_dir = env.holder_dir
default_node_name = env.node_name
private_dir = env.private_dir
private_name = env.private_name


# ---- the checks -------------------------------------------------------------------------------------------

def safe_name(name: object) -> bool:
    """Whether ``name`` (read from a file or a directory listing) may become one component of a path: 1-128
    characters of ``[A-Za-z0-9._-]``, not ``.`` or ``..``."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None and name not in (".", "..")


def path_component(name: str, what: str) -> str:
    """``name`` if it is one path component (no '/', no NUL, not '.' or '..'; the config's own rule for job ids and
    node names); else ConfigError naming ``what``."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ConfigError(f"{what} must be one path component (no '/', not '.' or '..'); got {name!r}")
    return name


def _user(uid: int) -> str:
    try:
        import pwd
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_private_dir(path: str, *, create: bool = False) -> bool:
    """Verify that ``path`` is a directory private to this user: owned by this uid, no access for group or
    others, not a symbolic link (checked on an ``O_NOFOLLOW`` open, not on the path). With ``create``, a missing
    one is made first (0700), and the directory above it too where that is missing (an existing one is left as
    it is: it may be the user's). Returns whether it exists (always True with ``create``).

    Raises:
        UnsafeHolderDir: it exists and is not private to this user; the message names it and what to do.
    """
    if create:
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, mode=0o700, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            raise
        return False
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        if os.path.islink(path):   # O_NOFOLLOW with O_DIRECTORY: ENOTDIR (or ELOOP) for a link
            try:
                target = f" (to {os.readlink(path)!r})"
            except OSError:
                target = ""
            raise UnsafeHolderDir(
                f"holder directory {path} is a symbolic link{target}: shardsafe does not follow "
                "links there (whoever can change the link chooses where the job's sockets go). Remove the link, or "
                "point SHARDSAFE_HOLDER_DIR (shardsafe.holder_dir) at the real directory") from None
        raise UnsafeHolderDir(f"holder directory {path} is not a directory: remove it, or set "
                              "SHARDSAFE_HOLDER_DIR (shardsafe.holder_dir) to another directory") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    me = os.getuid()
    if st.st_uid != me:
        raise UnsafeHolderDir(
            f"holder directory {path} belongs to {_user(st.st_uid)}, not to you ({_user(me)}): whoever owns it could "
            "read this job's snapshots or serve it fake ones, so shardsafe does not use it. Set SHARDSAFE_HOLDER_DIR "
            f"(or shardsafe.holder_dir) to a directory of yours, e.g. $HOME/.shardsafe (shardsafe keeps its files "
            f"in a private {private_name()} inside it), or have the owner or an administrator remove {path}")
    if st.st_mode & 0o077:
        raise UnsafeHolderDir(
            f"holder directory {path} is yours but has mode {stat.S_IMODE(st.st_mode):04o}: group or others can "
            "reach what is in it, so shardsafe does not use it (shardsafe creates it 0700). If you made it yourself "
            f"and trust its contents: chmod 700 {path}; otherwise remove it (rm -r {path})")
    return True


def open_private(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` of a file in a verified holder directory: never through a symbolic link (``O_NOFOLLOW``) and not
    inherited by child processes.

    Raises:
        UnsafeHolderDir: ``path`` is a symbolic link (nothing was opened).
    """
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
    raise UnsafeHolderDir(f"{path} is a symbolic link: shardsafe never opens a file in its directory through one "
                          "(it could point anywhere). Remove the link; if you did not make it, find out who could")


_UCRED = struct.Struct("iII")   # struct ucred: pid_t, uid_t, gid_t


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, as the kernel recorded them
    when it connected (a client) or listened (a server): SO_PEERCRED."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


@dataclass(frozen=True)
class HolderPaths:
    """The files of the holder of ``job_id`` on ``node``. ``root`` is shardsafe's private directory for the
    directory given (:func:`private_dir`; the given one is never changed)."""
    root: str
    job_id: str
    node: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", private_dir(self.root))
        path_component(self.job_id, "the job id")
        path_component(self.node, "the node name")

    @property
    def dir(self) -> str:
        return os.path.join(self.root, self.job_id)

    @property
    def socket(self) -> str:
        return os.path.join(self.dir, f"{self.node}.sock")

    @property
    def lock(self) -> str:
        return os.path.join(self.dir, f"{self.node}.lock")

    @property
    def log(self) -> str:
        return os.path.join(self.dir, f"{self.node}.log")

    def ensure_dir(self) -> None:
        """Create the root and the job's directory (0700) where missing, and verify both (:func:`check_private_dir`).

        Raises:
            UnsafeHolderDir: one of them is not private to this user."""
        check_private_dir(self.root, create=True)
        check_private_dir(self.dir, create=True)

    def check_dir(self) -> bool:
        """Verify the root and the job's directory where they exist; returns whether both do (creates nothing).

        Raises:
            UnsafeHolderDir: one of them is not private to this user."""
        return check_private_dir(self.root) and check_private_dir(self.dir)

    @staticmethod
    def list_jobs(root: str) -> list[str]:
        """The jobs with a holder socket under the holder directory ``root`` (verified first; [] if missing)."""
        root = private_dir(root)
        if not check_private_dir(root):
            return []
        return sorted(j for j in os.listdir(root) if safe_name(j) and HolderPaths.list_nodes(root, j))

    @staticmethod
    def list_nodes(root: str, job_id: str) -> list[str]:
        """The nodes with a socket of ``job_id`` under ``root`` (each directory verified before it is listed)."""
        root = private_dir(root)
        d = os.path.join(root, job_id)
        try:
            if not safe_name(job_id) or not check_private_dir(root) or not stat.S_ISDIR(os.lstat(d).st_mode):
                return []   # a file in the root (py-cpuinfo's answer) or a link is no job
        except FileNotFoundError:
            return []
        check_private_dir(d)
        return sorted(n for n in (f[:-5] for f in os.listdir(d) if f.endswith(".sock")) if safe_name(n))
