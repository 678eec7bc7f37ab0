"""Where a holder for (job, node) lives: socket, lock, pid and log, in a 0700 directory."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping


def default_node_name(environ: Mapping[str, str] = os.environ) -> str:
    """The failure domain this process lives in (simulated nodes set SHARDSAFE_NODE)."""
    return environ.get("SHARDSAFE_NODE") or environ.get("SLURMD_NODENAME") or socket.gethostname()


def default_holder_dir(environ: Mapping[str, str] = os.environ) -> str:
    """Where holders put their sockets when the config does not say: SHARDSAFE_HOLDER_DIR, else a directory
    of this user's under XDG_RUNTIME_DIR or /tmp."""
    if environ.get("SHARDSAFE_HOLDER_DIR"):
        return environ["SHARDSAFE_HOLDER_DIR"]
    base = environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return os.path.join(base, f"shardsafe-{os.getuid()}")


@dataclass(frozen=True)
class HolderPaths:
    root: str
    job_id: str
    node: str

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
        """Create root and job dir private to this user; refuse a directory someone else owns."""
        for d in (self.root, self.dir):
            os.makedirs(d, mode=0o700, exist_ok=True)
            st = os.stat(d)
            if st.st_uid != os.getuid():
                raise PermissionError(f"holder directory {d} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
                                      "set shardsafe.holder_dir to a directory you own")
            if st.st_mode & 0o077:
                os.chmod(d, 0o700)

    @staticmethod
    def list_nodes(root: str, job_id: str) -> list[str]:
        d = os.path.join(root, job_id)
        try:
            return sorted(f[:-5] for f in os.listdir(d) if f.endswith(".sock"))
        except (FileNotFoundError, NotADirectoryError):   # a file in the root (py-cpuinfo's answer) is no job
            return []
