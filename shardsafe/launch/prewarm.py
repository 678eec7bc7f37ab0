"""Pre-warmed trainer starts: a fork server that imports the heavy modules once, forks every trainer.

Why: after a failure the restore from the holder takes a fraction of a second, and the restarted trainer then spends
seconds of CPU importing torch, DeepSpeed and torch._dynamo (every rank of the node pays it at once, so where ranks
outnumber cores the wall time grows with them; on a cluster that reads site-packages from a shared file system it is
tens of seconds). Started cold, that start-up is the largest part of a recovery (docs/tor.md "startup"). The fork
server pays the imports once, before any failure, and forks the trainers of every attempt from that warm image: the
imported code is shared copy-on-write (the server imports with the garbage collector off and freezes its heap, so
the trainers' collections never write to those pages), and a restart skips straight to the training script
(bench/RESULTS.md "Restart: trainers forked from a fork server vs cold starts").

The server is a child of the launcher that talks JSON over an anonymous AF_UNIX SOCK_SEQPACKET socket
pair (private to the launcher: no path, no pickle; one message per datagram, the trainer's stdout and
stderr descriptors ride along with its spawn request as SCM_RIGHTS):

    <- {"op": "ready", "preloaded": [...], "seconds": s}       once, or {"op": "ready", "error": "..."}
    -> {"op": "spawn", "id": k, "argv": [...], "env": {...}, "cwd": "...", "fds": ["stdout", "stderr"]}
    <- {"op": "spawned", "id": k, "pid": p}                    or {"op": "error", "id": k, "error": "..."}
    <- {"op": "exit", "pid": p, "rc": rc}                      rc as subprocess reports it (-N: signal N)

A forked trainer sees what ``python [-u] SCRIPT ARGS`` (or ``python [-u] -m MODULE ARGS``) started cold would see:
its own session (``start_new_session``), stdin from /dev/null, the stdout and stderr it was given (else the
server's), exactly the environment it was given, sys.argv and sys.path[0] as the interpreter sets them, its own
python and numpy random seeds, the signal dispositions the launcher passes a cold one (``_AT_START``); the
script runs as ``__main__`` and the process ends as the interpreter's shutdown ends it (non-daemon threads
joined, atexit handlers run, open files flushed, the status ``sys.exit`` gives), less the teardown of its
modules and their finalizers (``_exit_without_teardown`` says why). What it shares with its siblings: modules
imported by the server (imported once, with the server's environment: the launcher starts it with the
environment its trainers share) and the str hash seed (PYTHONHASHSEED fixes that for cold starts too). The
server never initializes CUDA (it refuses to serve if a preloaded module did), so every trainer initializes its
own device. Forking after ``import torch`` is what torch's own DataLoader workers do.

Anything else (another interpreter, interpreter flags, a server that failed to start or died) falls back
to a cold start, with one log line saying why.
"""
from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import weakref
from typing import Mapping, Optional, Sequence

from ..errors import ConfigError, ShardsafeError
from ..inplace import ignore_until_run
# What every forked trainer would import at its start otherwise (imported here, the server's, once): the wait
# for the store (discovery) and the codec Python encodes host names with for a TCP connect.
from .discovery import wait_before_store_connect
import encodings.idna  # noqa: F401,E402

# The signal dispositions a cold interpreter started by the launcher would have: what this process inherited
# (recorded as the server starts, before any preload could install a handler) after Python's own start-up rule,
# SIGINT -> KeyboardInterrupt unless it came ignored. A launcher run under nohup, or as a shell's background job,
# passes SIGHUP or SIGINT ignored, and its cold trainers keep them ignored: so do the forked ones.
_RESET_SIGNALS = (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
_AT_START = {sig: signal.getsignal(sig) for sig in _RESET_SIGNALS}

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
"""How long the launcher waits for the server's imports (a cold shared file system can be slow)."""

PRELOADED: set[str] = set()
"""The preload entries this process (or the server it was forked from) imported or ran: a server forked from it
(:mod:`.agentforks`) does not run a ``module:function`` entry again."""


class PrewarmError(RuntimeError, ShardsafeError):
    """The fork server could not start or serve a request; the launcher starts trainers cold instead."""


# ---------------------------------------------------------------------------------------------------------
# launcher side


class ForkedProcess:
    """A trainer forked by the server, with the part of :class:`subprocess.Popen` the launchers use.

    It is the server's child, not the launcher's: its exit status arrives as a message, read by
    :meth:`ForkServer.pump` from inside :meth:`poll` and :meth:`wait`."""

    def __init__(self, server: "ForkServer", pid: int):
        self.server, self.pid = server, pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.server.pump()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout)
            self.server.pump(wait_s=0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkServer:
    """Launcher-side handle of one fork server. ``start()`` blocks until the preloads are imported.

    The server's own output (and a trainer's, when its spawn passes no descriptors) goes to ``log_path``,
    or, without one, wherever the launcher's goes."""

    MAX_MESSAGE = 200_000   # a spawn request (its environment) must fit one datagram of the socket pair

    def __init__(self, preload: Sequence[str], *, env: Mapping[str, str], log_path: str = ""):
        self.preload = [m for m in preload if m]
        self.env = dict(env)
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None
        self.sock: Optional[socket.socket] = None
        self.children: dict[int, ForkedProcess] = {}
        self.exits: dict[int, int] = {}   # exits that arrived before their spawn reply was read
        self._next_id = 0
        self.dead_reason = ""
        self.ready_s = 0.0
        self._cold_why = ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and not self.dead_reason

    def launch(self) -> "ForkServer":
        """Start the server process; :meth:`wait_ready` waits for its imports (overlap them with other set-up)."""
        self._t0 = time.monotonic()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = [sys.executable, "-m", "shardsafe.launch.prewarm", "--preload", ",".join(self.preload),
               "--fd", str(theirs.fileno())]
        logf = open(self.log_path, "ab") if self.log_path else None
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=self.env,
                                         pass_fds=(theirs.fileno(),), start_new_session=True)
        finally:
            theirs.close()
            if logf is not None:
                logf.close()
        self.sock = ours
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> "ForkServer":
        msg = None
        if self.sock is not None and select.select([self.sock], [], [], timeout_s)[0]:
            data = self.sock.recv(self.MAX_MESSAGE)
            msg = json.loads(data) if data else None
        if msg is None or msg.get("op") != "ready" or msg.get("error"):
            why = (msg or {}).get("error") or f"no ready message within {timeout_s:.0f} s (exit {self.proc.poll()})"
            self.close()
            where = f"; see {self.log_path}" if self.log_path else ""
            raise PrewarmError(f"the fork server did not start: {why}{where}")
        self.ready_s = time.monotonic() - self._t0
        self.sock.setblocking(False)
        log.info("fork server pid %d ready in %.2f s (preloaded %s)", self.proc.pid, self.ready_s,
                 ", ".join(msg.get("preloaded", [])) or "nothing")
        return self

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> "ForkServer":
        return self.launch().wait_ready(timeout_s)

    def accepts(self, cmd: Sequence[str], env: Mapping[str, str]) -> str:
        """'' if a trainer started as ``cmd`` can be forked from this server, else why not."""
        if not self.alive:
            return f"the fork server is gone ({self.dead_reason or 'not started'})"
        if len(cmd) < 2 or os.path.realpath(cmd[0]) != os.path.realpath(sys.executable):
            return f"{cmd[0] if cmd else '(empty command)'} is not the interpreter the fork server runs"
        try:
            _split_argv(cmd[1:])
        except ValueError as e:
            return str(e)
        # Modules imported by the server saw the server's environment; a trainer that differs in a variable
        # (other than the per-rank ones) would get a differently configured import.
        differ = sorted(k for k in set(self.env) | set(env) if env.get(k) != self.env.get(k) and not _per_rank(k))
        if differ:
            return f"its environment differs from the fork server's in {', '.join(differ[:5])}"
        return ""

    def fork_or_cold(self, cmd: Sequence[str], *, env: Mapping[str, str], stdout: Optional[int] = None,
                     stderr: Optional[int] = None, who: str = "trainers") -> Optional[ForkedProcess]:
        """:meth:`spawn` if the server :meth:`accepts` ``cmd``; else None, and the caller starts it cold. Each
        new reason for a cold start is logged once (``who`` names what starts cold in that line)."""
        why = self.accepts(cmd, env)
        if not why:
            try:
                return self.spawn(cmd, env=env, stdout=stdout, stderr=stderr)
            except PrewarmError as e:
                why = str(e)
        if why != self._cold_why:
            log.warning("%s start cold: %s", who, why)
            self._cold_why = why
        return None

    def spawn(self, cmd: Sequence[str], *, env: Mapping[str, str], stdout: Optional[int] = None,
              stderr: Optional[int] = None, cwd: str = "") -> ForkedProcess:
        """Fork ``cmd`` (see :meth:`accepts`). ``stdout``/``stderr``: descriptors the trainer writes to (None:
        the server's); the server gets its own copies, the caller keeps (and may close) its ones."""
        if not self.alive:
            raise PrewarmError(f"the fork server is gone ({self.dead_reason or 'not started'})")
        rid, self._next_id = self._next_id, self._next_id + 1
        fds, names = [], []
        for name, fd in (("stdout", stdout), ("stderr", stderr)):
            if fd is not None:
                fds.append(fd)
                names.append(name)
        req = {"op": "spawn", "id": rid, "argv": list(cmd[1:]), "env": dict(env), "cwd": cwd or os.getcwd(),
               "fds": names}
        data = json.dumps(req).encode()
        if len(data) > self.MAX_MESSAGE:
            raise PrewarmError(f"the spawn request is {len(data)} bytes (environment and arguments), over the "
                               f"{self.MAX_MESSAGE} a request may have")
        try:
            self.sock.setblocking(True)
            socket.send_fds(self.sock, [data], fds)
        except OSError as e:
            self._died(f"writing to it failed: {e}")
            raise PrewarmError(f"the fork server is gone: {e}") from None
        finally:
            if self.sock is not None:
                self.sock.setblocking(False)
        deadline = time.monotonic() + 60.0
        while True:
            for msg in self._drain():
                if msg.get("id") == rid and msg.get("op") == "spawned":
                    p = ForkedProcess(self, int(msg["pid"]))
                    self.children[p.pid] = p
                    if p.pid in self.exits:
                        p.returncode = self.exits.pop(p.pid)
                    return p
                if msg.get("id") == rid and msg.get("op") == "error":
                    raise PrewarmError(f"the fork server could not start {list(cmd[1:])}: {msg.get('error')}")
            if self.dead_reason:
                raise PrewarmError(f"the fork server is gone ({self.dead_reason})")
            if time.monotonic() > deadline:
                self._died("no answer to a spawn request within 60 s")
                raise PrewarmError("the fork server did not answer a spawn request within 60 s")
            self._wait_readable(0.05)

    def pump(self, wait_s: float = 0.0) -> None:
        """Read exit reports (non-blocking unless ``wait_s``)."""
        if wait_s:
            self._wait_readable(wait_s)
        for _ in self._drain():
            pass

    def close(self) -> None:
        """Stop the server. The launchers end their trainers first; one still running now would have no one
        to report its exit, so it is SIGKILLed and reported as killed (as when the server dies)."""
        self._died("closed")
        p, self.proc = self.proc, None
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()   # EOF: the server leaves its loop
        if p is None:
            return
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    # -- internals
    def _wait_readable(self, wait_s: float) -> None:
        if self.sock is not None and not self.dead_reason:
            select.select([self.sock], [], [], wait_s)

    def _drain(self) -> list[dict]:
        if self.sock is None or self.dead_reason:
            return []
        msgs = []
        while True:
            try:
                data = self.sock.recv(self.MAX_MESSAGE)
            except BlockingIOError:
                break
            except OSError as e:
                self._died(f"reading from it failed: {e}")
                break
            if not data:
                self._died(f"exit {self.proc.poll() if self.proc else None}")
                break
            msg = json.loads(data)
            if msg.get("op") == "exit":
                pid, rc = int(msg["pid"]), int(msg["rc"])
                child = self.children.pop(pid, None)
                if child is not None:
                    child.returncode = rc
                else:
                    self.exits[pid] = rc
            msgs.append(msg)
        return msgs

    def _died(self, why: str) -> None:
        """The server is gone: nobody can report its trainers' exits any more. Kill them and report them as
        killed, so the launcher's next attempt (started cold) does not race a half-watched group."""
        if self.dead_reason:
            return
        self.dead_reason = why
        if self.children:
            log.warning("the fork server is gone (%s); SIGKILLing its %d running trainer(s)%s", why,
                        len(self.children), "" if why == "closed" else ", the next attempt starts cold")
        for pid, child in list(self.children.items()):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            child.returncode = -signal.SIGKILL
        self.children.clear()


def _split_argv(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """``python`` arguments -> (unbuffered, [SCRIPT, ...] or ['-m', MODULE, ...]); ValueError if not forkable."""
    argv = list(argv)
    unbuffered = False
    while argv and argv[0] == "-u":
        unbuffered, argv = True, argv[1:]
    if not argv:
        raise ConfigError("no script or module to run")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise ConfigError("'-m' without a module")
    elif argv[0].startswith("-"):
        raise ConfigError(f"interpreter option {argv[0]!r} (only 'python [-u] SCRIPT ...' and "
                         "'python [-u] -m MODULE ...' are forked)")
    return unbuffered, argv


_PER_RANK_PREFIXES = ("SHARDSAFE_", "TORCHELASTIC_")
_PER_RANK = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE", "ROLE_NAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


def _per_rank(key: str) -> bool:
    return key in _PER_RANK or key.startswith(_PER_RANK_PREFIXES)


# ---------------------------------------------------------------------------------------------------------
# server side


def _send(sock: socket.socket, msg: dict) -> None:
    sock.send(json.dumps(msg).encode())


def _preload(modules: Sequence[str]) -> list[str]:
    """Import ``modules``; a submodule this version of its package does not have (e.g. a DeepSpeed module
    added in a later release) is skipped with a line in the server's log, anything else that fails to
    import fails the server (the trainers, started cold, would fail on it too and say why).

    An entry ``module:function`` imports the module and calls ``function()``: work a trainer does at start
    that the server can do once for all of them (``shardsafe.adapters.deepspeed.prewarm``). It returns a line for
    the server's log; if it raises, the line says so and the server goes on without it (the trainers then
    do that work themselves, as a cold start would)."""
    done = []
    for entry in modules:
        if entry in PRELOADED:
            done.append(entry)
            continue
        m, _, fn = entry.partition(":")
        try:
            mod = importlib.import_module(m)
        except ModuleNotFoundError as e:
            if "." not in m or e.name != m:
                raise
            print(f"fork server: {m} does not exist in this version of {m.split('.')[0]}; not preloaded",
                  file=sys.stderr, flush=True)
            continue
        if fn:
            try:
                said = getattr(mod, fn)()
            except Exception as e:   # noqa: BLE001 - an optimization; the trainers do the work themselves
                print(f"fork server: {entry} failed ({type(e).__name__}: {e}); the trainers do that work themselves",
                      file=sys.stderr, flush=True)
                continue
            print(f"fork server: {entry}: {said}", file=sys.stderr, flush=True)
        done.append(entry)
        PRELOADED.add(entry)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise PrewarmError(f"importing {', '.join(done)} initialized CUDA; a forked trainer could not use it. "
                           f"Drop the module that does from the preload list")
    return done


def _child(req: dict, sock: socket.socket, fds: dict[str, int]) -> dict:
    """In the forked child: become a freshly started trainer (see the module docstring)."""
    gc.enable()
    sock.close()
    os.setsid()
    for sig, how in _AT_START.items():   # as a cold interpreter would find them (_AT_START)
        signal.signal(sig, how if how is not None else signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)   # as the interpreter sets it at start
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for name, target in (("stdout", 1), ("stderr", 2)):
        if name in fds:
            os.dup2(fds[name], target)
    for fd in set(fds.values()):
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    npr = sys.modules.get("numpy.random")
    if npr is not None:
        npr.seed()   # numpy seeds its global generator at import: a cold start would get fresh entropy
    # python's random module reseeds itself at fork (os.register_at_fork)
    return req


def serve(preload: Sequence[str], sock: socket.socket) -> Optional[dict]:
    """The server loop. Returns in a forked child (with its request); returns None when the launcher hangs up."""
    os.dup2(2, 1)   # anything a preloaded module prints goes to the server's log, once
    t0 = time.monotonic()
    # Copy-on-write friendly (the recipe of the gc module's docs for fork without exec): no collection
    # punches holes into the imported heap, and after freeze() the trainers' collections never write to
    # the preloaded objects' GC headers, so those pages stay shared instead of being copied per trainer.
    gc.disable()
    try:
        done = _preload(preload)
    except BaseException as e:   # noqa: BLE001 - any failed import is reported, then the launcher goes cold
        _send(sock, {"op": "ready", "error": f"{type(e).__name__}: {e}"})
        return None
    n_threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1
    print(f"fork server pid {os.getpid()}: preloaded {done} in {time.monotonic() - t0:.2f} s, "
          f"{n_threads} OS thread(s)", file=sys.stderr, flush=True)
    gc.freeze()
    # Preloaded weakref finalizers (one per torch op library) only undo in-process registrations: run at each
    # trainer's exit they took 34 ms and 8k page copies. The trainer's own still run (_exit_without_teardown).
    for info in getattr(weakref.finalize, "_registry", {}).values():
        info.atexit = False
    _send(sock, {"op": "ready", "preloaded": done, "seconds": round(time.monotonic() - t0, 3),
                 "threads": n_threads})
    open_ = True
    live: set[int] = set()
    while open_ or live:
        if open_:
            if select.select([sock], [], [], 0.02)[0]:
                data, got, _, _ = socket.recv_fds(sock, ForkServer.MAX_MESSAGE, 2)
                if not data:
                    open_ = False   # the launcher is gone or done; report the remaining exits, then leave
                else:
                    req = json.loads(data)
                    fds = dict(zip(req.get("fds", []), got))
                    try:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        pid = os.fork()
                    except OSError as e:
                        pid = -1
                        _send(sock, {"op": "error", "id": req.get("id"), "error": str(e)})
                    if pid == 0:
                        return _child(req, sock, fds)
                    for fd in got:
                        os.close(fd)
                    if pid > 0:
                        live.add(pid)
                        _send(sock, {"op": "spawned", "id": req.get("id"), "pid": pid})
        else:
            time.sleep(0.02)
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                live.clear()
                break
            if pid == 0:
                break
            live.discard(pid)
            if open_:
                try:
                    _send(sock, {"op": "exit", "pid": pid, "rc": os.waitstatus_to_exitcode(status)})
                except OSError:
                    open_ = False   # the launcher is gone; keep reaping
    return None


def _run_child(req: dict) -> None:
    """Run the trainer as ``python ARGV...`` would, in this (forked) interpreter."""
    import runpy
    from ..holder import early_open
    # A restarted trainer maps and verifies its newest snapshot while it sets up, instead of inside its restore.
    early_open.start()
    # Forked trainers start within milliseconds of each other, before rank 0 has its store up: without this
    # each of them loses torch's ~0.5 s connect back-off (discovery.wait_before_store_connect).
    wait_before_store_connect()
    unbuffered, argv = _split_argv(req["argv"])
    if unbuffered:   # python -u: write-through text layer over unbuffered stdout/stderr
        import io
        for fd, name in ((1, "stdout"), (2, "stderr")):
            old = getattr(sys, name)
            setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,
                                                errors=old.errors, write_through=True))
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]   # runpy puts the module's file in argv[0], as `python -m` does
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    else:
        code = None
    # Any other exception propagates: the interpreter prints it and ends as a cold one would.
    _exit_without_teardown(code)


def _exit_without_teardown(code) -> None:
    """End a forked trainer whose script returned (or raised SystemExit with ``code``) as the interpreter's
    shutdown would, less the teardown of its modules: non-daemon threads joined, atexit handlers run, every
    open file flushed, the exit status as ``sys.exit(code)`` gives it.

    Why: the teardown frees every object the server imported, and each free writes to a page the trainer
    still shares with the server, so the kernel copies the preloaded heap page by page on the way out. That
    took 0.33 s of a forked DeepSpeed trainer that ran for 0.35 s on this 2-core machine (it is the same work
    at every job's end on every rank, and the largest part of a short trainer's system time)."""
    import atexit
    import io
    import threading
    if code is None:
        rc = 0
    elif isinstance(code, int):
        rc = code
    else:   # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        rc = 1
    shutdown = getattr(threading, "_shutdown", None)   # what the interpreter's shutdown calls first
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    # Files the script opened and left open would be flushed when the teardown freed them. The preloaded
    # objects are frozen (gc.freeze) and not listed here: only what this trainer created.
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            try:
                obj.flush()
            except Exception:   # noqa: BLE001 - closed, read-only or broken: the teardown would not flush it
                pass
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:   # noqa: BLE001 - as the interpreter does when stdout cannot be flushed at exit
            rc = rc or 120
    os._exit(rc & 0xFF)


def main(argv: Optional[Sequence[str]] = None) -> None:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m shardsafe.launch.prewarm",
                                 description="fork server for pre-warmed trainer starts (started by the launcher)")
    ap.add_argument("--preload", default="", help="comma-separated modules to import before forking "
                                                   "(module:function also calls function())")
    ap.add_argument("--fd", type=int, required=True, help="this end of the launcher's socket pair")
    a = ap.parse_args(argv)
    run_server([m.strip() for m in a.preload.split(",") if m.strip()], socket.socket(fileno=a.fd))


def run_server(preload: Sequence[str], sock: socket.socket) -> None:
    """Serve on ``sock`` until the launcher hangs up, then end this process; in a forked child, run the trainer."""
    ignore_until_run()   # in the trainers it forks
    req = serve(preload, sock)
    if req is None:
        # Nothing of the server needs an orderly shutdown (no files, no device, children reaped); the teardown of
        # torch's and DeepSpeed's modules would delay every job's end (the launchers wait for the server's exit).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    _run_child(req)   # from here on this process is the trainer: exceptions and SystemExit end it as a cold one


if __name__ == "__main__":
    # Run as the module shardsafe.launch.prewarm, not as __main__'s copy of it: a process forked from this server
    # finds PRELOADED filled in where it imports it (agentforks).
    from shardsafe.launch.prewarm import main as _main
    _main()
