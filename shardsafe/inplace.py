"""Restart in place: after a worker dies, the others stay alive and only the dead rank starts again.

A full restart stops every worker of the job, forms a new rendezvous and starts all N processes again: each one pays
its start, ``init_process_group``, shardsafe's set-up and the restore, all at once on the same hosts. With
``shardsafe launch --restart in-place`` (``SHARDSAFE_RESTART=in-place``), the agent whose worker died starts only
that rank again (the same rank and store), draws the job's next attempt number, and every agent signals its
surviving workers (:data:`SIGNAL`) after writing the new attempt where they read it (:func:`write_notice`). A
program that runs its training inside :func:`run` then, on every surviving rank:

1. stops where it is: the signal raises :class:`RestartInPlace` in the main thread. It is a BaseException, so an
   ``except Exception`` in the program does not swallow it. A collective that broke first, because the peer died,
   raises in ``train`` before the signal comes: the rank then waits for the notice (``notice_wait_s``);
2. abandons its shardsafe runtimes. The snapshot in flight is neither sealed nor committed, the runtime's gloo
   groups are dropped, and its holder connection closes as if the process had died. Then it lets go of its
   process groups (``destroy_process_group``, their destructors on a thread of their own). Dropped gloo groups
   close their sockets, so a peer still waiting on one of them fails at once. A snapshot thread still waiting after
   ``abandon_grace_s`` (its peer's end of the group is held open by that peer's own wait) is left to end at its
   timeout, its holder memory fenced off first (shardsafe.holder.client.HolderClient.fence): it can no longer write
   into the holder;
3. calls ``train`` again under the new attempt, on a new default group over the same store (its keys prefixed by
   the attempt). The runtime's restore then agrees on the newest version every rank holds and applies it, as after
   a full restart.

The launcher falls back to a full restart when rank 0 died (its process hosts the workers' store), when workers of
two nodes fail in one attempt, when a node is lost, or when a rank cannot fence an abandoned snapshot off (it then
exits with :data:`EXIT_NOT_IN_PLACE`, and the agent restarts every worker).

``train`` must build everything that holds a process group (the engine, the model's groups, shardsafe's runtime)
itself, on every call: after an in-place restart the old groups are gone. What a framework caches at module level
(DeepSpeed's world and expert groups, for one) its adapter forgets through :func:`on_let_go`.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

from . import env
from .ordinals import new_process_group
from .errors import ShardsafeError

log = logging.getLogger(__name__)

__all__ = ["run", "RestartInPlace", "SIGNAL", "EXIT_NOT_IN_PLACE", "write_notice", "read_notice", "notice_path",
           "InPlaceError", "on_let_go", "ignore_until_run"]

T = TypeVar("T")

SIGNAL = signal.SIGUSR1
"""What an agent sends its surviving workers when the job restarts in place."""
EXIT_NOT_IN_PLACE = 75
"""The exit code of a rank that could not restart in place (an abandoned snapshot could not be fenced off from
holder memory): the agent then restarts every worker, as without ``--restart in-place``."""
NOTICE_DIR = "inplace"


class InPlaceError(RuntimeError, ShardsafeError):
    """The program cannot restart in place (not under a launcher that does it, or called twice)."""


class RestartInPlace(BaseException):
    """Raised in the main thread of a surviving rank: the job restarts in place at ``attempt``; ``lost`` are the
    ranks started again."""

    def __init__(self, attempt: int, lost: list[int]):
        super().__init__(f"the job restarts in place at attempt {attempt} (ranks {lost} started again)")
        self.attempt, self.lost = attempt, lost
        self.t = time.time()   # when this process learnt of it


timings: dict[str, float] = {}
"""This process's last restart in place: ``noticed`` (wall clock), ``let_go_s`` (abandoning the runtimes and
groups; of it ``abandon_s``, ``destroy_s``, ``forget_s`` and ``collect_s``), ``init_s`` (the new default group).
Empty before the first."""


_FORGET: dict[str, Callable[[], None]] = {}


def on_let_go(name: str, forget: Callable[[], None]) -> None:
    """Have ``forget()`` called on a surviving rank after its process groups are destroyed and before ``train`` runs
    again: a framework adapter drops the groups its framework cached at module level, which the next attempt's
    ``train`` would otherwise find and use, destroyed. One per ``name`` (registering again replaces it)."""
    _FORGET[name] = forget


def ignore_until_run() -> None:
    """In a job that restarts in place, ignore :data:`SIGNAL` in this process (a fork server: in the trainers it
    forks) until :func:`run` installs its handler. A rank its agent started again is signalled with the survivors
    when the next restart in place is announced, possibly before it got that far; by default the signal would kill
    it. Nothing is lost: the handler reads the announcement from the notice file."""
    if env.restart_mode() == "in-place":
        signal.signal(SIGNAL, signal.SIG_IGN)


def notice_path(run_dir: str, node: str) -> str:
    return os.path.join(run_dir, NOTICE_DIR, f"{node}.json")


def write_notice(run_dir: str, node: str, attempt: int, lost: list[int]) -> None:
    """The agent's side: say which attempt the node's surviving workers continue in (atomically: a worker never
    reads half a file)."""
    path = notice_path(run_dir, node)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"attempt": int(attempt), "lost": [int(r) for r in lost]}, f)
    os.replace(tmp, path)


def read_notice(run_dir: str, node: str) -> Optional[RestartInPlace]:
    """The newest in-place restart the node's agent announced, or None."""
    try:
        with open(notice_path(run_dir, node)) as f:
            got = json.load(f)
        return RestartInPlace(int(got["attempt"]), [int(r) for r in got.get("lost", [])])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class _Trigger:
    """The signal handler: raises :class:`RestartInPlace` in the main thread while armed, for a notice newer than
    the attempt this process runs; a signal that comes while disarmed is found by :meth:`arm` from the notice."""

    def __init__(self, run_dir: str, node: str):
        self.run_dir, self.node = run_dir, node
        self.attempt = env.attempt()
        self.armed = False
        self._previous = signal.signal(SIGNAL, self._on_signal)

    def newer(self) -> Optional[RestartInPlace]:
        got = read_notice(self.run_dir, self.node)
        return got if got is not None and got.attempt > self.attempt else None

    def wait_newer(self, timeout_s: float) -> Optional[RestartInPlace]:
        """A notice newer than this attempt, waited for up to ``timeout_s`` (the file, read every 20 ms)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.newer()
            if got is not None or time.monotonic() >= deadline:
                return got
            time.sleep(0.02)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.armed:
            self.arm()

    def arm(self) -> None:
        self.armed = True
        got = self.newer()
        if got is not None:
            self.armed = False
            raise got

    def close(self) -> None:
        self.armed = False
        signal.signal(SIGNAL, self._previous)


def run(train: Callable[[], T], *, backend: str = "gloo", timeout_s: float = 600.0,
        abandon_grace_s: float = 0.1, notice_wait_s: float = 10.0, stuck_s: float = 1.0) -> T:
    """Run ``train()`` with torch.distributed initialised, again after every in-place restart; return its result.

    Args:
        train: the training, from building the model and engine to the end. It runs with the default process
            group initialised (``backend``, ``timeout_s``) and builds its shardsafe runtime (or engine) itself.
        backend: the default group's backend ("gloo" on CPU, "nccl" on GPU).
        timeout_s: the default group's timeout.
        abandon_grace_s: how long a surviving rank waits for its snapshot thread to stop before fencing it off
            from holder memory and going on without it.
        notice_wait_s: when ``train`` raises, how long to wait for the agent's word that the job restarts in place
            (a collective fails as soon as a peer dies, before the peer's agent has started it again) before the
            error ends this rank. Its agent stops it sooner where the job restarts in full.
        stuck_s: how long the main thread may stay in a collective of the abandoned attempt after the signal
            before this rank gives up restarting in place (:class:`_Watchdog`); 30 times that outside one.

    Raises:
        InPlaceError: called from a thread other than the main one, or with torch.distributed already
            initialised.
    """
    import torch.distributed as dist
    if threading.current_thread() is not threading.main_thread():
        raise InPlaceError("shardsafe.inplace.run must be called from the main thread (the restart signal is "
                           "delivered there)")
    if dist.is_initialized():
        raise InPlaceError("shardsafe.inplace.run initialises torch.distributed itself (once per attempt); call it "
                           "before init_process_group, and do not call init_process_group inside train")
    run_dir, node, mode = env.get(env.RUN_DIR), env.node_name(), env.restart_mode()
    in_place = mode == "in-place" and bool(run_dir)
    if mode == "in-place" and not run_dir:
        log.warning("%s=in-place needs %s (the launcher's run directory): restarts are full", env.RESTART,
                    env.RUN_DIR)
    # The workers' store, as init_process_group's env:// makes it (rank 0 hosts it); kept across attempts so a
    # survivor never connects again, and only the restarted ranks join it.
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    # On rank 0 this object hosts the store: it must outlive every attempt, whichever client the next one uses.
    host = store
    trigger = _Trigger(run_dir, node) if in_place else None
    watchdog = _watchdog(trigger, rank, stuck_s) if trigger is not None else None
    try:
        while True:
            attempt, t0 = env.attempt(), time.perf_counter()
            dist.init_process_group(backend, store=dist.PrefixStore(f"shardsafe/inplace/a{attempt}", store),
                                    rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
            new_process_group()
            if timings:
                timings["init_s"] = time.perf_counter() - t0
            again = _attempt(train, trigger, rank, notice_wait_s)
            if isinstance(again, RestartInPlace):
                trigger.attempt = again.attempt   # taken: the watchdog stands down
                # Out of the except block, the attempt's frames (the program's engine, runtime and groups among
                # their locals) are gone: only now can dropping the groups close their sockets.
                t0 = time.perf_counter()
                if _let_go(rank, again, abandon_grace_s):
                    # A snapshot thread left behind may hold the store client's one connection (a wait for a peer's
                    # address in the store): the next attempt talks to the store over a connection of its own.
                    store = dist.TCPStore(host.host, host.port, is_master=False,
                                          timeout=timedelta(seconds=timeout_s))
                timings.update(noticed=again.t, let_go_s=time.perf_counter() - t0)
                os.environ[env.ATTEMPT] = str(again.attempt)
                continue
            if dist.is_initialized():
                dist.destroy_process_group()
            return again.value
    finally:
        if watchdog is not None:
            watchdog.stop()
        if trigger is not None:
            trigger.close()


class _Watchdog:
    """A surviving rank whose main thread cannot stop: it exits with :data:`EXIT_NOT_IN_PLACE`, and the job restarts
    in full instead of waiting.

    The signal's handler runs only when the main thread runs Python. A main thread blocked in a gloo collective of
    the abandoned attempt does not: that collective waits for a peer's part that never comes (the dead rank's, or
    one from a pair that was never connected, as with lazily connected gloo groups), up to the group's timeout, 30
    minutes for a group a framework made without one. Once a newer attempt is announced, this thread gives the main
    thread ``stuck_s`` inside ``torch.distributed`` (a collective that fails by itself ends sooner: the rank then
    restarts in place) and ``30 * stuck_s`` anywhere else (one long native call, a backward pass).

    The thread sleeps until a signal comes: the interpreter's C-level handler writes to a pipe
    (``signal.set_wakeup_fd``) even while the main thread is blocked. It reads the notice then, and every 50 ms
    until the main thread has taken the restart or the limit passed; it never polls the notice file otherwise, which
    lies in the run directory, on a shared file system. A program that set a wakeup fd of its own (asyncio) keeps
    it, and the thread reads the notice once a second instead."""

    def __init__(self, trigger: _Trigger, rank: int, stuck_s: float, pipe: Optional[tuple[int, int]]):
        """``pipe``: (read end, write end), the write end already the signal wakeup fd; None: the notice is read
        once a second (:func:`_watchdog`)."""
        self.trigger, self.rank, self.stuck_s = trigger, rank, stuck_s
        self.polls = pipe is None
        self._main = threading.main_thread().ident
        self._stopped = threading.Event()
        self._pipe = pipe
        self._thread = threading.Thread(target=self._watch, name="shardsafe-inplace-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """From the main thread, at the end of :func:`run`."""
        self._stopped.set()
        if self._pipe is None:
            return
        signal.set_wakeup_fd(-1)
        os.write(self._pipe[1], b"\0")   # wake the thread
        self._thread.join(timeout=1.0)
        for fd in self._pipe:
            os.close(fd)

    def _where(self) -> str:
        """The main thread's innermost Python frame, as ``file:function``."""
        frame = sys._current_frames().get(self._main)
        return f"{frame.f_code.co_filename}:{frame.f_code.co_name}" if frame is not None else "?"

    def _wait(self, timeout: Optional[float]) -> None:
        """Until a signal comes (or ``timeout``); polling: ``timeout``, else a second."""
        if self._pipe is None:
            self._stopped.wait(1.0 if timeout is None else timeout)
            return
        import select
        if select.select([self._pipe[0]], [], [], timeout)[0]:
            try:
                os.read(self._pipe[0], 512)
            except BlockingIOError:
                pass

    def _watch(self) -> None:
        since = None
        while not self._stopped.is_set():
            self._wait(None if since is None else 0.05)
            if not self._stopped.is_set():
                since = self._check(since)

    def _check(self, since: Optional[float]) -> Optional[float]:
        """The time the newest announcement was first seen untaken (None: nothing to wait for); exits when the
        main thread stayed past the limit."""
        got = self.trigger.newer()
        if got is None:
            return None
        since = since or time.monotonic()
        where = self._where()
        limit = self.stuck_s * (1 if f"torch{os.sep}distributed{os.sep}" in where else 30)
        if time.monotonic() - since >= limit:
            log.error("[rank %d] the job restarts in place at attempt %d, but this rank's main thread has not "
                      "stopped in %.1f s: it waits in %s, which no signal ends. Exiting with %d so the job "
                      "restarts in full", self.rank, got.attempt, time.monotonic() - since, where, EXIT_NOT_IN_PLACE)
            logging.shutdown()
            os._exit(EXIT_NOT_IN_PLACE)
        return since


def _watchdog(trigger: _Trigger, rank: int, stuck_s: float) -> _Watchdog:
    """A :class:`_Watchdog` woken through the signal wakeup fd, or one that polls where the program owns that fd."""
    r, w = os.pipe()
    os.set_blocking(w, False)   # the C handler must never block on a full pipe
    theirs = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    if theirs == -1:
        return _Watchdog(trigger, rank, stuck_s, (r, w))
    signal.set_wakeup_fd(theirs)   # not ours to replace: the program's is put back
    os.close(r)
    os.close(w)
    log.info("[rank %d] the program owns the signal wakeup fd: the in-place watchdog reads the notice once a "
             "second", rank)
    return _Watchdog(trigger, rank, stuck_s, None)


class _Done:
    def __init__(self, value: Any):
        self.value = value


def _attempt(train: Callable[[], Any], trigger: Optional[_Trigger], rank: int,
             notice_wait_s: float) -> "_Done | RestartInPlace":
    """One call of ``train``: its result, or the in-place restart that ended it (its traceback dropped)."""
    try:
        if trigger is not None:
            trigger.arm()
        out = train()
    except RestartInPlace as r:
        r.__context__ = r.__cause__ = None
        return r.with_traceback(None)
    except Exception as e:
        if trigger is None:
            raise
        # A collective breaks as soon as a peer dies, before that peer's agent has started it again and told this
        # node's agent: wait for the notice. Exiting now would make this rank the next one to restart, and its
        # peers would fail in turn.
        try:
            trigger.armed = False
            late = trigger.wait_newer(notice_wait_s)
        except RestartInPlace as r:   # the signal, between the error and the line above
            late = r
        if late is None:
            raise
        log.warning("[rank %d] training failed (%s: %s) as the job restarts in place; restarting", rank,
                    type(e).__name__, str(e)[:200])
        late.__context__ = late.__cause__ = None
        return late.with_traceback(None)
    finally:
        if trigger is not None:
            trigger.armed = False
    return _Done(out)


def _let_go(rank: int, why: RestartInPlace, grace_s: float) -> bool:
    """Abandon this process's shardsafe runtimes and process groups (module docstring, step 2); True when a snapshot
    thread was left behind."""
    import torch.distributed as dist
    from .hierarchy import let_go_of
    from .teardown import live_runtimes
    log.warning("[rank %d] %s: abandoning this attempt", rank, why)
    t0 = time.perf_counter()
    runtimes = live_runtimes()
    fenced = all([rt.abandon(grace_s) for rt in runtimes])
    timings["abandon_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    if not fenced:
        log.error("[rank %d] an abandoned snapshot could not be fenced off from holder memory: this rank cannot "
                  "restart in place; exiting with %d so the job restarts in full", rank, EXIT_NOT_IN_PLACE)
        os._exit(EXIT_NOT_IN_PLACE)
    if dist.is_initialized():
        # destroy_process_group unregisters and shuts down every group torch knows, and returns at once while a
        # reference remains: the groups' destructors, which close their pairs one by one (up to 0.45 s at 64 ranks
        # here, and a wait up to the timeout where a pair's loop is inside an abandoned collective), run on
        # let_go_of's thread, as shardsafe's own groups' do.
        held = list(getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None) or ())
        dist.destroy_process_group()
        let_go_of(held, abort=False)
        del held
    timings["destroy_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    for name, forget in _FORGET.items():
        try:
            forget()
        except Exception as e:  # noqa: BLE001 - a stale group would break the next attempt: restart in full
            log.error("[rank %d] cannot forget %s's cached process groups (%s: %s): this rank cannot restart in "
                      "place; exiting with %d so the job restarts in full", rank, name, type(e).__name__, e,
                      EXIT_NOT_IN_PLACE)
            os._exit(EXIT_NOT_IN_PLACE)
    timings["forget_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    # The attempt's engine and model hold their groups and tensors in reference cycles (module hooks, closures):
    # only a collection frees them. Freed groups close their sockets, so a peer blocked in one of their
    # collectives fails at once and restarts in place too; freed tensors give the next attempt's engine the memory
    # (device memory on a GPU) it is about to allocate again.
    gc.collect()
    timings["collect_s"] = time.perf_counter() - t0
    return any(rt.left_behind for rt in runtimes)
