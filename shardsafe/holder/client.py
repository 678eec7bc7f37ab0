"""Trainer-side client of the node's holder, and the detached start of a holder when none runs."""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, NamedTuple

from ..errors import ConfigError
from .paths import ForeignHolder, HolderPaths, open_private, peer_credentials
from .protocol import (DEFAULT_IDLE_EXIT_S, FLUSH_DRAIN_S, SCOPE_RE, HolderError, HolderFailure, ProtocolError, close_fds,
                       recv_msg, send_msg)

log = logging.getLogger(__name__)


class HolderUnavailable(HolderFailure):
    """No holder answers for this job and node."""


class OpenedSlot(NamedTuple):
    """A sealed version opened for reading: its manifest, a read-only mapping of its shared memory (the
    caller closes it), ``ident``: (device, inode, size) of that memory, equal for two mappings of one slot
    and different once the holder has given the version another slot, and ``sealing``: which of the holder's
    seals made its content (equal for two opens only if nobody was handed the slot to write in between;
    0 from a holder that does not say)."""
    manifest: dict
    mm: mmap.mmap
    ident: tuple[int, int, int]
    sealing: int = 0


# Mappings fenced off by HolderClient.fence: kept until the process ends, since a thread may still write through them.
_FENCED: list[mmap.mmap] = []


class HolderClient:
    """One connection to the holder. Thread-safe: the snapshot worker and the main thread share it.

    Writable mappings are cached per slot id: re-mapping a 1 GiB segment every snapshot would pay
    the page-table faults again.

    ``scope`` names the engine whose snapshots this connection reads and writes (shardsafe.runtime: "" for a
    process's first protected engine); every slot request carries it, so two engines of one process never see
    each other's versions.
    """

    # Requests about the holder as a whole: no scope.
    _UNSCOPED = frozenset({"hello", "status", "scrub", "shutdown"})

    def __init__(self, paths: HolderPaths, *, timeout_s: float = 60.0, scope: str = ""):
        if not isinstance(scope, str) or not SCOPE_RE.fullmatch(scope):
            raise ConfigError(f"holder scope must be up to 64 characters of [A-Za-z0-9._-], got {scope!r}")
        self.paths = paths
        self.scope = scope
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._maps: dict[int, mmap.mmap] = {}
        self.holder_pid = 0            # from the hello: tells a restarted holder from the one we knew
        self.started_holder = False    # set by connect_or_start when this connection's holder was started by it

    # ---- connection -------------------------------------------------------------------------------
    def connect(self) -> "HolderClient":
        """Connect and say hello. The holder's directories are verified first and the process serving the socket
        must run as this user (SO_PEERCRED): another user's would receive the job's state and could hand back
        a self-consistent fake, so nothing is sent to it.

        Raises:
            HolderUnavailable: no holder answers.
            UnsafeHolderDir: the holder directory is not private to this user.
            ForeignHolder: the socket is served by another user's process (also logged at ERROR).
        """
        self.paths.check_dir()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_s)
        try:
            s.connect(self.paths.socket)
        except OSError as e:
            s.close()
            raise HolderUnavailable(f"no holder for job {self.paths.job_id!r} on node {self.paths.node!r} "
                                    f"at {self.paths.socket} ({e.strerror or e})") from None
        try:
            pid, uid, _ = peer_credentials(s)
        except OSError:
            s.close()
            raise
        if uid != os.getuid():
            s.close()
            err = ForeignHolder(
                f"the process serving {self.paths.socket} (pid {pid}) runs as uid {uid}, not as you (uid "
                f"{os.getuid()}): it is not your holder of job {self.paths.job_id!r}, and shardsafe sent it nothing. "
                f"Check who made it (ls -la {self.paths.dir}; ps -o user,pid,cmd -p {pid}); remove the socket, or set "
                "SHARDSAFE_HOLDER_DIR (shardsafe.holder_dir) to a directory of yours")
            log.error("%s", err)
            raise err
        self._sock = s
        self._hello()
        return self

    def _hello(self) -> None:
        """The first request of every connection (the holder refuses anything else first). A holder that
        cannot take the connection (``busy``: its connection cap) answers before reading the hello and
        closes: its reply is read even when sending the hello already failed on the closed socket."""
        sock = self._sock
        try:
            send_msg(sock, {"op": "hello", "job_id": self.paths.job_id})
        except OSError:
            pass   # maybe refused before our hello: its reason is waiting in the receive buffer
        try:
            resp, fds = recv_msg(sock)
        except (ProtocolError, OSError) as e:
            self.close()
            raise HolderUnavailable(f"holder of job {self.paths.job_id!r} on node {self.paths.node!r} at "
                                    f"{self.paths.socket} closed the connection during hello ({e})") from None
        close_fds(fds)
        if not resp.get("ok"):
            self.close()
            code, msg = resp.get("code", "error"), resp.get("error", "unknown holder error")
            if code == "busy":
                raise HolderUnavailable(msg)
            raise HolderError(code, msg)
        self.holder_pid = int(resp.get("pid") or 0)

    @property
    def connected(self) -> bool:
        """The connection is open (a broken one is closed by the request that found it broken)."""
        return self._sock is not None

    def mapped_slots(self) -> dict[int, mmap.mmap]:
        """The writable mappings this connection caches, by slot id (a copy of the mapping): the pipeline unregisters
        the CUDA-pinned ones before closing a broken connection."""
        return dict(self._maps)

    def fence(self) -> int:
        """Turn this connection's writable mappings of holder memory into private, anonymous memory at the same
        addresses (the contents are dropped): a thread that may still write through them (a snapshot abandoned for a
        restart in place, shardsafe.inplace) can no longer reach the holder's pages, which go to other slots once
        this connection closes. The mappings are kept for the life of the process (never unmapped under a thread that
        may use them). Returns the bytes fenced.

        Raises:
            OSError: the kernel refused the new mapping (the caller must not go on with a writer left behind).
        """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        remap = libc.mmap
        remap.restype, remap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                          ctypes.c_int, ctypes.c_int, ctypes.c_long]
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10   # 0x10: MAP_FIXED (Linux), over the shared mapping
        total = 0
        for slot, m in list(self._maps.items()):
            addr, n = ctypes.addressof(ctypes.c_char.from_buffer(m)), len(m)
            if remap(addr, n, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0) != addr:
                err = ctypes.get_errno()
                raise OSError(err, f"fencing holder slot {slot} ({n} bytes): {os.strerror(err)}")
            _FENCED.append(self._maps.pop(slot))
            total += n
        return total

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass
        self._maps.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def request(self, op: str, **kw: Any) -> tuple[dict, list[int]]:
        with self._lock:
            # close() does not wait for a request in flight (another thread's, such as the protection reporter's):
            # it closes the socket under it, and the request fails as if the holder had gone.
            sock = self._sock
            if sock is None:
                raise HolderUnavailable(f"not connected to the holder of node {self.paths.node!r}")
            if self.scope and op not in self._UNSCOPED:
                kw["scope"] = self.scope
            try:
                send_msg(sock, {"op": op, **kw})
                resp, fds = recv_msg(sock)
            except (ProtocolError, OSError) as e:
                sock.close()
                self._sock = None
                raise HolderUnavailable(f"holder of node {self.paths.node!r} went away during {op!r}: {e}") from None
        if not resp.get("ok"):
            for fd in fds:
                os.close(fd)
            raise HolderError(resp.get("code", "error"), resp.get("error", "unknown holder error"))
        return resp, fds

    # ---- operations -------------------------------------------------------------------------------
    def acquire(self, *, rank: int, version: int, nbytes: int, kind: str = "data") -> tuple[int, mmap.mmap]:
        """A writable mapping of at least ``nbytes`` for ``version`` (pre-faulted, reused)."""
        resp, fds = self.request("acquire", rank=rank, version=version, nbytes=nbytes, kind=kind)
        slot, cap = resp["slot"], resp["capacity"]
        if "live" in resp:
            live = set(resp["live"])
            for gone in [s for s in self._maps if s not in live]:
                self.forget_mapping(gone)
        try:
            m = self._maps.get(slot)
            if m is None:
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                m = mmap.mmap(fds[0], cap, flags, mmap.PROT_READ | mmap.PROT_WRITE)
                self._maps[slot] = m
        finally:
            for fd in fds:
                os.close(fd)
        return slot, m

    def forget_mapping(self, slot: int) -> None:
        m = self._maps.pop(slot, None)
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass

    def seal(self, *, rank: int, version: int, manifest: dict, kind: str = "data") -> None:
        self.request("seal", rank=rank, version=version, manifest=manifest, kind=kind)

    def commit(self, *, ranks: list[int], version: int, kind: str = "data") -> None:
        self.request("commit", ranks=ranks, version=version, kind=kind)

    def list(self, rank: int | None = None) -> dict[str, Any]:
        return self.request("list", **({} if rank is None else {"rank": rank}))[0]["ranks"]

    def sealed_versions(self, rank: int, kind: str = "data") -> list[int]:
        info = self.list(rank).get(str(rank), {}).get(kind, [])
        return sorted(s["version"] for s in info if s["state"] == "sealed")

    def open(self, *, rank: int, version: int, kind: str = "data", populate: bool = True) -> tuple[dict, mmap.mmap]:
        """(manifest, read-only mapping) of a sealed version. The caller closes the mapping."""
        held = self.open_slot(rank=rank, version=version, kind=kind, populate=populate)
        return held.manifest, held.mm

    def open_slot(self, *, rank: int, version: int, kind: str = "data", populate: bool = True) -> "OpenedSlot":
        """:meth:`open`, with the identity of the shared memory behind the mapping (which slot it is)."""
        resp, fds = self.request("open", rank=rank, version=version, kind=kind)
        try:
            st = os.fstat(fds[0])
            # Populate the page tables in one go when every byte is read (checksums, then the copy);
            # a reader of a part of the payload (a peer's shard) faults in only what it touches.
            # (CPython's mmap() releases the GIL: a populating thread does not stop the others.)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            m = mmap.mmap(fds[0], st.st_size, flags, mmap.PROT_READ)
        finally:
            for fd in fds:
                os.close(fd)
        sealing = resp.get("sealing", 0)
        return OpenedSlot(resp["manifest"], m, (st.st_dev, st.st_ino, st.st_size),
                          sealing if isinstance(sealing, int) and not isinstance(sealing, bool) else 0)

    def drop(self, *, rank: int | None = None, ranks: list[int] | None = None, version: int | None = None,
             kind: str = "data") -> int:
        kw: dict[str, Any] = {"kind": kind, "ranks": ranks if ranks is not None else [rank]}
        if version is not None:
            kw["version"] = version
        return self.request("drop", **kw)[0]["freed"]

    def flush(self, *, rank: int, version: int, dir: str, job_id: str, keep: int, mbps: float = 0.0) -> None:
        """Ask the holder to write a committed version to the persistent directory (asynchronous)."""
        self.request("flush", rank=rank, version=version, dir=dir, job_id=job_id, keep=keep, mbps=mbps)

    def scrub(self) -> dict:
        """Re-verify every held version now; returns what was found corrupt."""
        return self.request("scrub")[0]

    def status(self) -> dict:
        return self.request("status")[0]

    def report(self, *, rank: int, state: dict) -> None:
        """Leave ``rank``'s protection state with the holder (``shardsafe status`` shows it)."""
        self.request("report", rank=rank, state=state)

    def reserve(self, *, rank: int, nbytes: int) -> dict:
        """Tell the holder one version of ``rank`` takes ``nbytes`` (data and parity slots); raises HolderError
        code "budget" when it cannot keep two versions of every rank that told it."""
        return self.request("reserve", rank=rank, nbytes=int(nbytes))[0]

    def shutdown(self) -> int:
        """Ask the holder to exit; returns how many flushes it still writes to disk before it does."""
        return int(self.request("shutdown")[0].get("pending_flushes", 0))


def stop_holder(paths: HolderPaths, proc: "subprocess.Popen", *, grace_s: float = 10.0) -> None:
    """Shut down the holder ``proc`` serves ``paths``; wait ``grace_s`` (plus FLUSH_DRAIN_S while it
    still writes queued flushes) and SIGKILL it only after that, saying what was lost."""
    pending = 0
    try:
        c = HolderClient(paths, timeout_s=grace_s).connect()
        try:
            pending = c.shutdown()
        finally:
            c.close()
    except (HolderFailure, OSError):
        proc.kill()
    wait_s = grace_s + (FLUSH_DRAIN_S if pending else 0.0)
    if pending:
        log.info("holder of node %s writes %d queued flush(es) to disk before it exits (waiting up to %.0f s)",
                 paths.node, pending, wait_s)
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        log.error("holder of node %s did not exit within %.1f s of its shutdown%s: killed", paths.node, wait_s,
                  f"; {pending} queued flush(es) may be missing on disk (the previous flushed version is intact)"
                  if pending else "")
        proc.kill()
        proc.wait()


def stop_holders(holders: "list[tuple[HolderPaths, subprocess.Popen]]") -> None:
    """:func:`stop_holder` for several holders at once: each drains its own queued flushes, so one by
    one their drains would add up."""
    threads = [threading.Thread(target=stop_holder, args=(paths, proc)) for paths, proc in holders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def holder_command(paths: HolderPaths, *, budget_gb: float, idle_exit_s: float = DEFAULT_IDLE_EXIT_S,
                   run_dir: str = "", daemonize: bool = False, scrub_interval_s: float | None = None,
                   read_timeout_s: float | None = None, max_clients: int | None = None) -> list[str]:
    """The command line of a holder started by a program (a rank, a launcher, a test). Such a holder exits
    after ``idle_exit_s`` with no client and no flush pending (0 = never): if its starter dies without
    stopping it, its memory does not stay taken forever."""
    cmd = [sys.executable, "-m", "shardsafe.cli", "holder", "--job-id", paths.job_id, "--node", paths.node,
           "--holder-dir", paths.root, "--memory-budget-gb", repr(float(budget_gb)),
           "--idle-exit-s", repr(float(idle_exit_s))]
    if read_timeout_s is not None:
        cmd += ["--read-timeout-s", repr(float(read_timeout_s))]
    if max_clients is not None:
        cmd += ["--max-clients", str(int(max_clients))]
    if run_dir:
        cmd += ["--run-dir", run_dir]
    if scrub_interval_s is not None:
        cmd += ["--scrub-interval-s", repr(float(scrub_interval_s))]
    if daemonize:
        cmd.append("--daemonize")
    return cmd


def connect_or_start(paths: HolderPaths, *, budget_gb: float, start: bool, timeout_s: float = 60.0,
                     idle_exit_s: float = DEFAULT_IDLE_EXIT_S, run_dir: str = "", scope: str = "") -> HolderClient:
    """Connect to the node's holder; if none runs and ``start``, start one detached first (the returned
    client's ``started_holder`` then says so). The detached holder exits after ``idle_exit_s`` without
    clients and flushes (0 = never): nobody else would stop it. ``scope``: the returned client's (HolderClient).

    Several local ranks may race here: an flock on the job directory makes exactly one of them
    start the holder. The holder double-forks and ``setsid``s, so neither torchrun's process-group
    kill nor the deepspeed launcher's tree kill (it signals every descendant) reaches it.
    """
    try:
        return HolderClient(paths, timeout_s=timeout_s, scope=scope).connect()
    except HolderUnavailable:
        if not start:
            raise
    paths.ensure_dir()
    lk = open_private(paths.lock, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        fcntl.flock(lk, fcntl.LOCK_EX)
        try:
            return HolderClient(paths, timeout_s=timeout_s, scope=scope).connect()
        except HolderUnavailable:
            pass
        cmd = holder_command(paths, budget_gb=budget_gb, idle_exit_s=idle_exit_s, run_dir=run_dir, daemonize=True)
        log.info("starting a detached holder for job %s on node %s", paths.job_id, paths.node)
        t0 = time.monotonic()
        rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, timeout=timeout_s, start_new_session=True).returncode
        if rc != 0:
            raise HolderUnavailable(f"starting the holder failed (exit {rc}); see {paths.log}")
        log.info("holder ready in %.2f s", time.monotonic() - t0)
        c = HolderClient(paths, timeout_s=timeout_s, scope=scope).connect()
        c.started_holder = True
        return c
    finally:
        os.close(lk)   # releases the lock
