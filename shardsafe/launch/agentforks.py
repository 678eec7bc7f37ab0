"""Agents forked from a warm image: the local launcher's torch elastic agents and their fork servers without imports.

Every agent of ``shardsafe launch`` (:mod:`.elastic`) is a Python process that imports torch and torch elastic
(about a second of CPU), and with ``--preload`` it starts its node's fork server (:mod:`.prewarm`), which imports
the framework (seconds more). The local launcher starts an agent per simulated node at the job's start and again
on every re-forming (a shrink, a grow): on one host those imports compete with the trainers for the cores.

So the launcher starts one fork server of its own that imports the agent's modules and the trainers' preload, and
forks every agent from it (:func:`launch_agent_server`, :func:`agent_server_ready`); an agent found to be such a
fork, still single-threaded, with every preload entry in its image, forks its node's fork server from itself
(:func:`fork_worker_server`) instead of starting a new interpreter. What each process runs is unchanged: the agent
is ``python -m shardsafe.launch agent ...`` as :mod:`.prewarm` forks a command, and its fork server serves the
trainers as one started cold would (it imported the same modules, in an environment that differs only in per-rank
variables). Either step falls back to the cold start, with a log line saying why.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Mapping, Optional, Sequence

from .prewarm import PRELOADED, ForkServer, PrewarmError, _exit_without_teardown, run_server

log = logging.getLogger(__name__)

AGENT_MODULES = ("torch", "torch.distributed.run", "torch.distributed.elastic.agent.server.local_elastic_agent",
                 "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler",
                 "shardsafe.launch.agent", "shardsafe.launch.cli")
"""What an agent imports before it starts torchrun (``python -X importtime -m shardsafe.launch agent``)."""


def launch_agent_server(preload: Sequence[str], *, env: Mapping[str, str], log_path: str) -> ForkServer:
    """The launcher's fork server for its agents, starting: AGENT_MODULES and the trainers' ``preload``, imported
    with the agents' environment. :func:`agent_server_ready` waits for its imports (overlap them with the holders'
    start)."""
    return ForkServer([*AGENT_MODULES, *preload], env=env, log_path=log_path).launch()


def agent_server_ready(server: ForkServer) -> Optional[ForkServer]:
    """``server`` once its imports are done; None (the agents start cold) if it failed, with the reason logged."""
    try:
        return server.wait_ready()
    except PrewarmError as e:
        log.warning("agents start cold: %s", e)
        return None


class _Child:
    """The part of :class:`subprocess.Popen` that :class:`ForkServer` uses, for a server forked from this process."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"fork server pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _end_as_uncaught(e: BaseException) -> None:
    """End this process as the interpreter ends one whose ``__main__`` raised ``e``: the traceback printed, status 1
    (killed by SIGINT for a KeyboardInterrupt). A trainer forked from a server started by ``python -m`` gets that
    from the interpreter; here the frames below it are the agent's, which must never run on in a trainer."""
    if isinstance(e, KeyboardInterrupt):
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    try:
        tb = e.__traceback__.tb_next or e.__traceback__   # from run_server down, as under `python -m` (main)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
    finally:
        _exit_without_teardown(1)


def why_not_here(preload: Sequence[str]) -> str:
    """'' if this process can fork its fork server from itself, else why not: it must have every entry of
    ``preload`` in its image (it was forked from a server that preloaded them) and run one thread (forking a
    process with other threads copies their locks in whatever state they are)."""
    missing = [e for e in preload if e not in PRELOADED]
    if missing:
        return f"this process did not preload {', '.join(missing[:3])}"
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1
    if threads != 1:
        return f"this process runs {threads} threads"
    return ""


def fork_worker_server(preload: Sequence[str], *, env: Mapping[str, str]) -> ForkServer:
    """A :class:`ForkServer` for ``preload`` that is a fork of this process (see :func:`why_not_here`), ready.

    Raises:
        PrewarmError: :func:`why_not_here` says why not, or the fork failed.
    """
    why = why_not_here(preload)
    if why:
        raise PrewarmError(why)
    server = ForkServer(preload, env=env)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    server._t0 = time.monotonic()
    try:
        pid = os.fork()
    except OSError as e:
        ours.close()
        theirs.close()
        raise PrewarmError(f"fork failed: {e}") from None
    if pid == 0:   # the server: its own session, as one started by ForkServer.launch
        try:
            ours.close()
            os.setsid()
            run_server(preload, theirs)   # ends the process itself (the server, or a trainer forked from it)
        except BaseException as e:   # noqa: BLE001 - a trainer's uncaught exception must not unwind into the agent
            _end_as_uncaught(e)
    theirs.close()
    server.proc, server.sock = _Child(pid), ours
    return server.wait_ready()
