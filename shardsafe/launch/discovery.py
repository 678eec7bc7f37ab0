"""Who am I in the job: rank, world size, local rank and node, from torchrun, SLURM or MPI.

torchrun (and ``shardsafe launch``) export ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``; ``torch.distributed``'s ``env://`` init reads them. Jobs started without torchrun do
not have them:

* plain ``srun`` tasks (one task per rank): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
  ``SLURMD_NODENAME``; the master is the first node of the step (``SLURM_STEP_NODELIST``);
* ``mpirun``/``mpiexec`` with mpi4py: the rank and size of ``MPI.COMM_WORLD``, the local rank from a
  shared-memory split (``OMPI_COMM_WORLD_LOCAL_RANK`` and friends when set), and the master address
  broadcast from rank 0, as DeepSpeed's ``mpi_discovery`` does.

:func:`discover` finds the first source that applies (in that order: torchrun, SLURM, MPI, single
process) and, with ``set_env=True``, exports the torchrun variables, so any ``env://`` initialisation
(``deepspeed.init_distributed``, ``torch.distributed.init_process_group``) works unchanged. It also
exports ``SHARDSAFE_NODE`` (the failure domain the holder is keyed by) when it is not set. Nothing here
imports torch; mpi4py is imported only when MPI variables are present.
"""
from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Mapping, MutableMapping

from .. import env as shardsafe_env
from ..errors import ShardsafeError

DEFAULT_PORT = 29500

_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_LOCAL_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                   "PMIX_LOCAL_RANK")
_MPI_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE")


class DiscoveryError(RuntimeError, ShardsafeError):
    """The environment describes an inconsistent job; the message names the variables."""


@dataclass(frozen=True)
class DistEnv:
    """One process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: str
    master_addr: str
    master_port: int
    source: str
    """``torchrun``, ``slurm``, ``mpi`` or ``single``."""

    def as_env(self) -> dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


# ---- SLURM hostlists ---------------------------------------------------------------------------------

def expand_hostlist(spec: str) -> list[str]:
    """``node[1-3,7],gpu[01-02]x`` -> ``[node1, node2, node3, node7, gpu01x, gpu02x]`` (SLURM's syntax,
    zero padding kept, several bracket groups per name); the same as ``scontrol show hostnames``."""
    out: list[str] = []
    for item in _split_top(spec.strip()):
        if item:
            out.extend(_expand_one(item))
    return out


def _split_top(spec: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in spec:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise DiscoveryError(f"bad SLURM hostlist {spec!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise DiscoveryError(f"bad SLURM hostlist {spec!r}: unbalanced '['")
    parts.append("".join(cur))
    return parts


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item]
    head, tail = item[:m.start()], item[m.end():]
    out = []
    for rng in m.group(1).split(","):
        if "-" in rng:
            a, b = rng.split("-", 1)
            if not (a.isdigit() and b.isdigit()) or int(b) < int(a):
                raise DiscoveryError(f"bad range {rng!r} in SLURM hostlist {item!r}")
            width = len(a) if a.startswith("0") else 0
            names = [str(i).zfill(width) for i in range(int(a), int(b) + 1)]
        else:
            names = [rng]
        for n in names:
            out.extend(_expand_one(head + n + tail))
    return out


def _slurm_tasks_per_node(spec: str) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1] (SLURM_TASKS_PER_NODE / SLURM_STEP_TASKS_PER_NODE)."""
    out = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise DiscoveryError(f"bad SLURM tasks-per-node spec {spec!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def slurm_node_addr(node: str, run: Callable[..., str] | None = None) -> str:
    """The address other nodes reach ``node`` at: ``NodeAddr`` from ``scontrol show node`` (node names
    need not resolve, e.g. on a local test cluster), else the name itself."""
    run = run or _run
    try:
        out = run(["scontrol", "show", "node", "-o", node])
    except (OSError, subprocess.SubprocessError):
        return node
    m = re.search(r"\bNodeAddr=(\S+)", out)
    return m.group(1) if m else node


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout


def slurm_master_port(env: Mapping[str, str]) -> int:
    """A port per job step (so a relaunched step does not meet the previous step's lingering store)."""
    job = int(env.get("SLURM_JOB_ID", "0") or 0)
    step = int(env.get("SLURM_STEP_ID", "0") or 0) if str(env.get("SLURM_STEP_ID", "0")).isdigit() else 0
    return 20000 + (job * 7 + step) % 20000


# ---- the sources ---------------------------------------------------------------------------------------

def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise DiscoveryError(f"${name}={env.get(name)!r}: expected an integer") from None


def from_torchrun(env: Mapping[str, str]) -> DistEnv | None:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local = int(env.get("LOCAL_RANK", 0) or 0)
    lws = int(env.get("LOCAL_WORLD_SIZE", 0) or 0) or 1
    if not 0 <= rank < world:
        raise DiscoveryError(f"RANK={rank} is outside WORLD_SIZE={world}")
    node = shardsafe_env.node_name(env)
    return DistEnv(rank, world, local, lws, node, env.get("MASTER_ADDR", "127.0.0.1"),
                   int(env.get("MASTER_PORT", DEFAULT_PORT)), "torchrun")


def from_slurm(env: Mapping[str, str], *, node_addr: Callable[[str], str] = slurm_node_addr) -> DistEnv | None:
    """Plain ``srun`` tasks. Only inside a step (``SLURM_STEP_ID``): a batch script itself has
    SLURM_PROCID=0 too, but it is not a rank."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env or "SLURM_STEP_ID" not in env:
        return None
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    local = int(env.get("SLURM_LOCALID", 0) or 0)
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    node_id = int(env.get("SLURM_NODEID", 0) or 0)
    counts = _slurm_tasks_per_node(per_node) if per_node else []
    lws = counts[node_id] if node_id < len(counts) else (int(env.get("SLURM_NTASKS_PER_NODE", 0) or 0) or 1)
    node = shardsafe_env.node_name(env)
    if env.get("MASTER_ADDR"):
        addr = env["MASTER_ADDR"]
    else:
        hosts = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "")
        addr = node_addr(hosts[0]) if hosts else "127.0.0.1"
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else slurm_master_port(env)
    return DistEnv(rank, world, local, lws, node, addr, port, "slurm")


def _mpi_in_env(env: Mapping[str, str]) -> bool:
    return any(v in env for v in _MPI_RANK_VARS)


def from_mpi(env: Mapping[str, str], *, comm=None) -> DistEnv | None:
    """mpirun + mpi4py (``comm``: an mpi4py communicator, default ``MPI.COMM_WORLD``)."""
    if comm is None:
        if not _mpi_in_env(env):
            return None
        try:
            from mpi4py import MPI
        except ImportError:
            raise DiscoveryError("MPI variables are set (" + ", ".join(v for v in _MPI_RANK_VARS if v in env)
                                 + ") but mpi4py is not installed: pip install mpi4py, or launch with torchrun") from None
        comm = MPI.COMM_WORLD
        shared = getattr(MPI, "COMM_TYPE_SHARED", None)
        processor = MPI.Get_processor_name()
    else:
        shared, processor = None, socket.gethostname()
    rank, world = comm.Get_rank(), comm.Get_size()
    host = shardsafe_env.get(shardsafe_env.NODE, env) or env.get("SLURMD_NODENAME") or processor
    local = next((int(env[v]) for v in _MPI_LOCAL_VARS if env.get(v, "").isdigit()), None)
    lws = next((int(env[v]) for v in _MPI_LOCAL_SIZE_VARS if env.get(v, "").isdigit()), None)
    if local is None or lws is None:
        if shared is not None:
            sub = comm.Split_type(shared, key=rank)
            local, lws = sub.Get_rank(), sub.Get_size()
            sub.Free()
        else:   # ranks on the same host name share a node (DeepSpeed's mpi_discovery)
            names = comm.allgather(host)
            local, lws = names[:rank].count(host), names.count(host)
    addr = env.get("MASTER_ADDR") or comm.bcast(_my_addr() if rank == 0 else None, root=0)
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else DEFAULT_PORT
    return DistEnv(rank, world, local, lws, host, addr, port, "mpi")


def _my_addr() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def discover(env: MutableMapping[str, str] | None = None, *, set_env: bool = True, comm=None,
             node_addr: Callable[[str], str] = slurm_node_addr) -> DistEnv:
    """This process's :class:`DistEnv`; with ``set_env``, also export RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (unless already set) and SHARDSAFE_NODE.

    Args:
        env: the environment to read (and write with ``set_env``); default ``os.environ``.
        comm: an mpi4py communicator to use instead of ``MPI.COMM_WORLD`` (tests).
        node_addr: how a SLURM node name becomes an address (default: ``scontrol show node``).
    """
    env = os.environ if env is None else env
    found = (from_torchrun(env) or from_slurm(env, node_addr=node_addr)
             or (from_mpi(env, comm=comm) if comm is not None or _mpi_in_env(env) else None))
    if found is None:
        node = shardsafe_env.node_name(env)
        found = DistEnv(0, 1, 0, 1, node, env.get("MASTER_ADDR", "127.0.0.1"),
                        int(env.get("MASTER_PORT", 0) or 0) or free_port(), "single")
    if set_env:
        for k, v in found.as_env().items():
            if k.startswith("MASTER_"):
                env.setdefault(k, v)   # an explicit master wins
            else:
                env[k] = v
        env.setdefault(shardsafe_env.NODE, found.node)
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for a server that a process started next will bind (torchrun's
    ``MASTER_PORT``, a single process's own store).

    Drawn below the kernel's ephemeral range (``ip_local_port_range``) when it leaves room: a port from
    ``bind(0)`` is one the kernel hands out again to any ``connect()`` or ``bind(0)`` on the node (gloo makes
    many) in the seconds before the server binds it; one below the range goes only to an explicit bind."""
    lo, _ = _ephemeral_range()
    if lo > _LOWEST_DRAWN + 1024:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(_LOWEST_DRAWN, lo)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_LOWEST_DRAWN = 20000   # clear of the well-known and most registered service ports


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 0, 0


def wait_for_store(host: str, port: int, timeout_s: float, *, poll_s: float = 0.005) -> float:
    """Block until ``host:port`` accepts a TCP connection or ``timeout_s`` passed; returns the seconds waited."""
    t0 = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return time.monotonic() - t0
        except OSError:
            if time.monotonic() - t0 >= timeout_s:
                return time.monotonic() - t0
            time.sleep(poll_s)


def wait_before_store_connect() -> bool:
    """Make this process's ``env://`` / ``tcp://`` store clients wait until the server listens before torch connects.

    Why: every rank but 0 opens a c10d ``TCPStore`` client to the server rank 0 starts inside its
    ``init_process_group``. When that server is not listening yet, the client's connect retries after a back-off of
    about half a second (lost whole, however soon after the first try the server comes up), and forked trainers,
    which all start within milliseconds of each other, hit it on nearly every restart, where it is most of
    DeepSpeed's ``init_distributed``. A plain TCP probe every 5 ms, made
    only when the program creates such a client (``torch.distributed.rendezvous._create_c10d_store``, for a rank
    other than 0) and for at most the store's own timeout, lets torch's first connect succeed; a program that
    never initialises torch.distributed is not touched. Only where torch is already imported (the fork server
    preloads it). Returns whether the hook is in place."""
    import sys
    mod = sys.modules.get("torch.distributed.rendezvous")
    orig = getattr(mod, "_create_c10d_store", None) if mod is not None else None
    if orig is None:
        return False
    orig = getattr(orig, "__wrapped__", orig)

    def _create_c10d_store(hostname, port, rank, world_size, timeout, *args, **kwargs):
        if rank != 0:
            secs = timeout.total_seconds() if timeout is not None else 60.0
            wait_for_store(hostname, port, max(0.0, secs))
        return orig(hostname, port, rank, world_size, timeout, *args, **kwargs)

    _create_c10d_store.__wrapped__ = orig
    mod._create_c10d_store = _create_c10d_store
    return True
