"""One node's torchrun agent, in this process, with shardsafe's hooks (``shardsafe agent``).

Torch elastic restarts workers and admits new nodes; shardsafe does not re-implement that. The agent adds:

* **One attempt number for the whole job.** ``TORCHELASTIC_RESTART_COUNT`` is per agent: the agent whose
  worker failed counts a restart, the others restart for the "membership change" and do not. Fault
  injection, restore and TOR need one number per worker-group generation, so each torchrun agent runs in
  ``ShardsafeAgent``, which numbers every completed rendezvous round once (the round's group-rank-0 agent
  draws it from a counter in the control store, the others read it from the round's store) and exports it
  to its workers as ``SHARDSAFE_ATTEMPT``.
* **Facts for the controller.** Round started, workers failed/succeeded, hung workers are published into
  the control store (:mod:`.controller`), and the agent SIGKILLs its workers when the controller says an
  attempt is hung. A worker that died of an error no restart fixes (shardsafe.fatal) ends the restarts.
* **Forked workers.** With ``--preload``, workers are forked from this node's fork server
  (:mod:`.prewarm`) plugged into torch elastic's worker start.

torch is imported when the agent runs, not at import.
"""
from __future__ import annotations

import logging
import os
import shlex
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import env as names
from ..collectives import lazy_gloo_env
from ..fatal import describe as describe_fatal, read_fatal
from .controller import Keys, _store_client, publish
from .markers import done_ranks, mark_rank_done
from .shrink import RENDEZVOUS_TIMEOUT_S

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class AgentOptions:
    node: str
    """This node's name: SHARDSAFE_NODE of its workers, the key of its holder."""
    control: str
    """HOST:PORT of the job's control store; also the c10d rendezvous endpoint."""
    nnodes: str
    """torchrun --nnodes (N or MIN:MAX)."""
    nproc_per_node: int = 1
    job_id: str = ""
    run_dir: str = ""
    holder_dir: str = ""
    inject: str = ""
    max_restarts: int = 3
    local_addr: str = ""
    monitor_interval_s: float = 0.1
    rendezvous_poll_s: float = -1.0
    """How often a waiting agent re-reads the rendezvous state (torch's own: 1 s); < 0 = by job size
    (:func:`rendezvous_poll_s`)."""
    keep_alive_s: int = 2
    keep_alive_misses: int = 3
    join_timeout_s: float = 600.0
    job_start_t: float | None = None
    torchrun_args: list[str] = field(default_factory=list)
    preload: list[str] = field(default_factory=list)
    """Modules this node's fork server imports once; workers are forked from it (shardsafe.launch.prewarm)."""
    rdzv_id: str = ""
    """torchrun --rdzv-id (default: the job id). A launcher that re-forms the job at another size starts its agents
    on a new one: the old rendezvous still lists the agents it stopped."""
    full_world_size: int = 0
    """The job's full world size, exported to the workers as SHARDSAFE_FULL_WORLD_SIZE (0: not exported); below
    the world of the rounds, the job runs at a smaller data-parallel size (shardsafe.launch.resize)."""

    def torchrun_argv(self, script: list[str]) -> list[str]:
        conf = (f"is_host=false,join_timeout={int(self.join_timeout_s)},keep_alive_interval={int(self.keep_alive_s)},"
                f"keep_alive_max_attempt={int(self.keep_alive_misses)},read_timeout={int(RENDEZVOUS_TIMEOUT_S)}")
        argv = ["--nnodes", str(self.nnodes), "--nproc-per-node", str(self.nproc_per_node),
                "--max-restarts", str(self.max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", self.control,
                "--rdzv-id", self.rdzv_id or self.job_id, "--rdzv-conf", conf, "--monitor-interval", str(self.monitor_interval_s)]
        if self.local_addr:
            argv += ["--local-addr", self.local_addr]
        return argv + list(self.torchrun_args) + list(script)

    def worker_env(self) -> dict[str, str]:
        env = {names.NODE: self.node, names.JOB_ID: self.job_id,
               # Each round's rank-0 *worker* hosts the workers' store: an agent-hosted store would stay
               # cached in the other agents after that agent's node is lost (torch 2.x).
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               # gloo groups connect pairs on first use, not as a full mesh at every restart (collectives.py)
               **lazy_gloo_env(os.environ)}
        if self.run_dir:
            env[names.RUN_DIR] = self.run_dir
        if self.holder_dir:
            env[names.HOLDER_DIR] = self.holder_dir
        if self.inject:
            env[names.INJECT] = self.inject
        if self.job_start_t is not None:
            env[names.JOB_START_T] = repr(self.job_start_t)
        if self.full_world_size:
            env[names.FULL_WORLD_SIZE] = str(self.full_world_size)
        return env


class _AgentHooks:
    """What the agent adds to torch elastic: job-wide attempt numbers, facts, kill commands."""

    def __init__(self, opts: AgentOptions):
        self.opts = opts
        self.keys = Keys(opts.job_id)
        self.store = _store_client(opts.control)
        self.attempt: int | None = None
        self.reported: set[tuple[int, str]] = set()
        self.spare_pids: set[int] = set()   # descendants that are not workers (the fork server): never killed
        self.worker_group = None
        self.fatal = ""          # set when a worker of this job died of an error no restart fixes
        self.peer_check_s = 0.05  # how often peer_failed asks the store (run_agent: the rendezvous poll)
        self._peer_checked = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watch = threading.Thread(target=self._kill_loop, name="shardsafe-kill-watch", daemon=True)
        self._watch.start()

    def close(self) -> None:
        """Stop the kill watcher and drop the store clients while the interpreter is fully alive: a
        daemon thread still inside a TCPStore call at interpreter teardown aborts the process
        ("terminate called without an active exception"), which would turn a finished job's agent
        exit code into a failure."""
        self._stop.set()
        self._watch.join(timeout=5)
        self.store = None

    def _publish(self, fact: dict) -> None:
        with self._lock:
            try:
                publish(self.store, self.keys, {"node": self.opts.node, "t": time.time(), **fact})
            except Exception as e:  # noqa: BLE001 - accounting never stops training
                log.warning("[agent %s] cannot publish %s to the controller: %s", self.opts.node, fact.get("type"), e)

    def draw_attempt(self) -> int:
        """The job's next attempt number (each rendezvous round draws one, and each restart in place); the caller
        holds ``_lock``."""
        n = self.store.add(self.keys.rounds, 1) - 1
        return n + (int(self.store.get(self.keys.base)) if self.store.check([self.keys.base]) else 0)

    def on_rendezvous(self, worker_group) -> None:
        st = worker_group.store
        with self._lock:
            if worker_group.group_rank == 0:
                st.set(Keys.ROUND_ATTEMPT, str(self.draw_attempt()))
            attempt = int(st.get(Keys.ROUND_ATTEMPT))
        self.attempt = attempt
        self.worker_group = worker_group
        os.environ[names.ATTEMPT] = str(attempt)   # workers inherit the agent's environment
        ranks = [w.global_rank for w in worker_group.workers]
        log.info("[agent %s] attempt %d: group rank %d, ranks %s", self.opts.node, attempt, worker_group.group_rank, ranks)
        self._publish({"type": "start", "attempt": attempt, "group_rank": worker_group.group_rank, "ranks": ranks})

    def on_monitor(self, worker_group, result) -> None:
        from torch.distributed.elastic.agent.server.api import WorkerState
        a = self.attempt
        if a is None:
            return
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and (a, "fail") not in self.reported:
            self.reported.add((a, "fail"))
            exits = {str(r): f.exitcode for r, f in (result.failures or {}).items()}
            self._mark_failed(a)
            self._publish({"type": "fail", "attempt": a, "exits": exits})
            records = read_fatal(self.opts.run_dir, a) if self.opts.run_dir else []
            if records:
                self.fatal = describe_fatal(records)
        elif result.state == WorkerState.SUCCEEDED and (a, "done") not in self.reported:
            self.reported.add((a, "done"))
            ranks = [w.global_rank for w in worker_group.workers]
            if self.opts.run_dir:   # every local worker exited 0: their completion markers (scripts may write richer ones)
                have = done_ranks(self.opts.run_dir)
                for r in ranks:
                    if r not in have:
                        mark_rank_done(self.opts.run_dir, r, by="agent", node=self.opts.node)
            self._publish({"type": "done", "attempt": a, "ranks": ranks})

    def _mark_failed(self, attempt: int) -> None:
        with self._lock:
            try:
                self.store.set(self.keys.failed(attempt), self.opts.node)
            except Exception as e:  # noqa: BLE001 - the other agents then notice at the next rendezvous, as torch does
                log.warning("[agent %s] cannot tell the other agents that attempt %d failed: %s", self.opts.node,
                            attempt, e)

    def peer_failed(self) -> bool:
        """Whether another node's workers of the current attempt failed (at most one store read per
        ``peer_check_s``)."""
        a, now = self.attempt, time.monotonic()
        if a is None or now - self._peer_checked < self.peer_check_s:
            return False
        self._peer_checked = now
        with self._lock:
            try:
                return bool(self.store.check([self.keys.failed(a)]))
            except Exception:  # noqa: BLE001 - a store hiccup: torch's own detection still works
                return False

    def _kill_loop(self) -> None:
        store = None
        try:
            self._watch_kills(store)
        finally:
            store = None

    def _watch_kills(self, store: Any) -> None:
        while not self._stop.wait(0.25):
            a = self.attempt
            if a is None or (a, "kill") in self.reported:
                continue
            try:
                store = store or _store_client(self.opts.control)
                if not store.check([self.keys.kill(a)]):
                    continue
            except Exception:  # noqa: BLE001 - the controller may be gone at the very end
                store = None
                continue
            self.reported.add((a, "kill"))
            self._kill_workers(a)

    def _kill_workers(self, attempt: int) -> None:
        import psutil
        procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in self.spare_pids]
        # A forked worker's /proc/PID/environ is the fork server's (it never exec'd): ranks come from the
        # worker group (worker.id is the pid torch elastic started), the environment is the fallback.
        by_pid = {w.id: w.global_rank for w in getattr(self.worker_group, "workers", []) or [] if w.id is not None}
        hung = []
        for p in procs:
            try:
                if p.status() == psutil.STATUS_STOPPED:
                    r = by_pid[p.pid] if p.pid in by_pid else p.environ().get("RANK")
                    if r is not None and str(r).isdigit():
                        hung.append(int(r))
            except (psutil.Error, OSError):
                pass
        # Published even when empty: the controller names the stopped rank once every node's scan is in.
        self._publish({"type": "hung", "attempt": attempt, "ranks": sorted(hung)})
        log.warning("[agent %s] controller: attempt %d is hung%s; SIGKILLing %d worker process(es)", self.opts.node,
                    attempt, f" (stopped ranks {sorted(hung)})" if hung else "", len(procs))
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass


def rendezvous_poll_s(nnodes: str, requested: float = -1.0) -> float:
    """The rendezvous poll interval: ``requested`` when >= 0, else 1 ms per node of the job's maximum
    (``--nnodes N`` or ``MIN:MAX``), between 10 ms and torch's own 1 s. Every waiting agent reads the round's
    state from the store once per poll, so the store sees about nodes / poll reads per second while a round
    forms: 200/s for 2 nodes, 1000/s from 10 nodes on (1,000 nodes at torch's 1 s: the load torch's default
    puts on it there)."""
    if requested >= 0:
        return float(requested)
    n = int(str(nnodes).split(":")[-1])
    return min(1.0, max(0.01, 0.001 * n))


BACKOFF_AFTER_S = 1.0
"""A rendezvous wait polls at the tuned rate for this long, then backs off to torch's 1 s
(:func:`tune_rendezvous_poll`)."""


def tune_rendezvous_poll(poll_s: float) -> bool:
    """Make torch's c10d rendezvous re-read the store every ``poll_s`` instead of every second while it waits.

    torch.distributed.elastic's DynamicRendezvousHandler, in its op executor's SYNC action, sleeps a fixed
    ``_delay(seconds=1)`` between reads of the round's state while it waits for the other nodes, and its state
    holder (``_BackendRendezvousStateHolder``, ``cache_duration=1``) serves a cached state for a second before it
    reads the store again. After a failure every agent joins the next round; the round's completion is seen
    only at a read, so each restart pays up to a second or two of these (bench/RESULTS.md "Kill to the next
    iteration, per launcher"). Both become ``poll_s``: only the sleep whose argument is exactly 1 and the cache of
    state holders created from now on. A wait longer than BACKOFF_AFTER_S backs off to torch's 1 s (1.5x per
    read). The random skew torch adds before a node's first join (``_delay(seconds=(0, 0.3))`` while the state
    holder still shows round 0) spreads the first writes of many nodes; it also hits
    the first restart (the first completed round is round 0), where it adds up to 0.3 s. It is
    scaled by ``poll_s`` (seconds): 3 ms for 2 nodes at 10 ms, torch's 0.3 s from 1,000 nodes on. In this
    agent process only; workers are not touched. Returns False (and torch keeps its own polling) if this
    torch's rendezvous has neither hook."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    except ImportError:
        return False
    import inspect
    orig = getattr(dr, "_delay", None)
    holder = getattr(dr, "_BackendRendezvousStateHolder", None)
    init = getattr(holder, "__init__", None)
    if not callable(orig) or init is None or "cache_duration" not in inspect.signature(init).parameters:
        log.warning("torch's dynamic rendezvous has no _delay / state cache to tune (torch changed them); it polls at "
                    "its own rate")
        return False
    orig = getattr(orig, "__wrapped__", orig)
    init = getattr(init, "__wrapped__", init)

    wait = {"since": -1e9, "last": -1e9, "delay": poll_s}

    def _delay(seconds):
        if isinstance(seconds, tuple):
            orig(tuple(x * min(1.0, poll_s) for x in seconds))
        elif seconds != 1:
            orig(seconds)
        else:
            # A round that forms at a restart forms within its first second, which polls at poll_s. A longer wait
            # (a node still booting, a spare awaited) backs off by 1.5x per read to torch's 1 s: agents that poll a
            # store 100 times a second for minutes take the CPU their own node's trainers and the store need.
            now = time.monotonic()
            if now - wait["last"] > BACKOFF_AFTER_S:   # reads of one wait follow each other within milliseconds
                wait["since"], wait["delay"] = now, poll_s
            elif now - wait["since"] > BACKOFF_AFTER_S:
                wait["delay"] = min(1.0, max(poll_s, wait["delay"] * 1.5))
            orig(wait["delay"])
            wait["last"] = time.monotonic()

    def __init__(self, backend, settings, cache_duration=1):
        init(self, backend, settings, cache_duration=min(cache_duration, poll_s))

    _delay.__wrapped__, __init__.__wrapped__ = orig, init
    dr._delay = _delay
    holder.__init__ = __init__
    return True


def cheap_rendezvous_event_names() -> bool:
    """Let torch's rendezvous name its events without walking the stack.

    torch's DynamicRendezvousHandler records an event at every step of a round (a join, a heartbeat, each write to
    the store) named after the calling method, and computes that name before it checks whether anything records
    events (by default nothing does): ``get_method_name()`` calls ``inspect.stack()`` twice, which looks up every
    frame's source file and, for a frame of no module's file (runpy's and importlib's frozen frames, which every
    agent forked from a warm image has), scans all of ``sys.modules``: milliseconds of CPU per event. On a node
    whose CPUs are busy that stretched each step of a round to 0.4-1 s; the agents' compare-and-set writes then
    kept meeting each other's heartbeats (every 2 s), heartbeats lapsed, live nodes were dropped as dead and joined
    again, and a round of 4 agents took 12 s to minutes instead of 2 s. ``sys._getframe`` gives the same name
    (the caller of ``_record``) in a microsecond. In this agent process only. Returns False if this torch has no
    ``get_method_name``."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    except ImportError:
        return False
    if not callable(getattr(dr, "get_method_name", None)):
        return False

    def get_method_name(depth: int = 2) -> str:
        # inspect.stack()[depth] inside torch's function is this frame's sys._getframe(depth)
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    dr.get_method_name = get_method_name
    return True


def run_agent(opts: AgentOptions, script: list[str]) -> int:
    """Run torchrun's agent in this process with shardsafe's hooks; returns its exit code."""
    os.environ.update(opts.worker_env())
    cheap_rendezvous_event_names()
    poll = rendezvous_poll_s(opts.nnodes, opts.rendezvous_poll_s)
    if poll != 1.0 and tune_rendezvous_poll(poll):
        log.info("[agent %s] rendezvous polls every %.2f s (torch's own: 1 s)", opts.node, poll)
    import torch.distributed.launcher.api as launcher_api
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    forks = _start_fork_server(opts) if opts.preload else None   # first: it may fork this process (one thread)
    hooks = _AgentHooks(opts)
    if forks is not None:
        hooks.spare_pids.add(forks.proc.pid)

    hooks.peer_check_s = max(poll, opts.monitor_interval_s)
    in_place = None
    if names.restart_mode() == "in-place":
        from .replace import InPlace
        in_place = InPlace(hooks)

    class ShardsafeAgent(LocalElasticAgent):
        """LocalElasticAgent + job-wide attempt numbers and facts for the controller."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _restart_on_peer_failure(self._worker_group.spec.rdzv_handler, hooks)

        def _rendezvous(self, worker_group) -> None:
            super()._rendezvous(worker_group)
            before = hooks.attempt
            hooks.on_rendezvous(worker_group)
            if in_place is not None and before is not None:
                in_place.supersede(before)   # restarted in full: the listener's wait for it ends

        def _monitor_workers(self, worker_group):
            if in_place is not None:   # before torch's poll, which stops every worker when one died
                in_place.follow(worker_group)
                in_place.replace_dead(self, worker_group)
            result = super()._monitor_workers(worker_group)
            hooks.on_monitor(worker_group, result)
            if hooks.fatal and self._remaining_restarts > 0:
                # A ConfigError / RestoreError (shardsafe.fatal) comes back on every restart: stop now.
                log.error("[agent %s] %s", opts.node, hooks.fatal)
                self._remaining_restarts = 0
            return result

    launcher_api.LocalElasticAgent = ShardsafeAgent   # what torchrun's launch_agent instantiates
    argv = opts.torchrun_argv(script)
    log.info("[agent %s] torchrun %s", opts.node, shlex.join(argv))
    try:
        torchrun.main(argv)
        return 0
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    except Exception as e:  # noqa: BLE001 - ChildFailedError & co.: torchrun already logged the details
        log.error("[agent %s] torchrun ended with %s: %s", opts.node, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return 1
    finally:
        if in_place is not None:
            in_place.close()
        hooks.close()
        if forks is not None:
            forks.close()


def _restart_on_peer_failure(handler: Any, hooks: _AgentHooks) -> None:
    """Let a healthy agent restart its workers as soon as another node's workers of the attempt failed.

    torch elastic's agent loop restarts healthy workers, without counting a restart, when the rendezvous
    reports nodes waiting (``num_nodes_waiting() > 0``). The failed node's agent waits first: it stops its
    own workers, then joins the next round, and only then do the healthy agents see it: their workers' stop
    waits for the failed agent's whole stop and join instead of running beside it. The
    failed agent also sets ``Keys.failed(attempt)``; counting that as a waiting node starts the healthy
    agents' stop at once, in parallel with the failed agent's, along the path torch already takes."""
    orig = handler.num_nodes_waiting

    def num_nodes_waiting() -> int:
        n = orig()
        return n if n > 0 else int(hooks.peer_failed())

    handler.num_nodes_waiting = num_nodes_waiting


def forked_handler_class(base: type, forks: Any, who: str) -> type:
    """torch elastic's worker handle (``base``: its SubprocessHandler) for workers forked by ``forks``, this
    node's fork server, or started by torch's own Popen when the server cannot fork them (``who`` names them in
    the one line that says why)."""

    class ForkedHandler(base):
        def _popen(self, args, env):
            proc = forks.fork_or_cold(args, env=env, stdout=self._stdout.fileno() if self._stdout else None,
                                      stderr=self._stderr.fileno() if self._stderr else None, who=who)
            return proc if proc is not None else super()._popen(args, env)

        def close(self, death_sig=None) -> None:
            # torch signals the worker's process group (os.killpg) when poll() still said it runs. A forked
            # worker is the fork server's child, not the agent's: when the server has reaped it (SIGKILLed by
            # the hang watchdog a moment before, its exit message not read yet) its group is gone and killpg
            # raises ProcessLookupError, which torch does not catch. The agent died of it and closed the
            # rendezvous, ending a job that should have restarted. A Popen child is a zombie until the agent
            # reaps it, so torch never meets this with its own workers.
            try:
                super().close(death_sig=death_sig)
            except ProcessLookupError:
                for f in (self._stdout, self._stderr):
                    if f is not None:
                        f.close()

    return ForkedHandler


def _start_fork_server(opts: AgentOptions):
    """This node's fork server (shardsafe.launch.prewarm), plugged into torch elastic's worker start: its
    ``get_subprocess_handler`` hands out handlers whose ``_popen`` forks from the server when it can and
    falls back to torch's own Popen when it cannot (the reason is logged once). None if it cannot start.
    An agent forked from the local launcher's server forks it from itself (shardsafe.launch.agentforks)."""
    from .agentforks import fork_worker_server, why_not_here
    from .prewarm import ForkServer, PrewarmError
    try:
        from torch.distributed.elastic.multiprocessing import api as mp_api
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler
    except ImportError as e:
        log.warning("[agent %s] this torch has no elastic subprocess handler to fork from (%s); workers start cold",
                    opts.node, e)
        return None
    if not callable(getattr(mp_api, "get_subprocess_handler", None)) or not hasattr(SubprocessHandler, "_popen"):
        log.warning("[agent %s] torch %s starts workers differently than shardsafe.launch.prewarm knows; "
                    "workers start cold", opts.node, getattr(sys.modules.get("torch"), "__version__", "?"))
        return None
    if opts.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")   # torchrun sets it for its workers; import with it
    cold_why = why_not_here(opts.preload)
    try:
        if cold_why:
            forks = ForkServer(opts.preload, env=dict(os.environ)).start()
        else:
            forks = fork_worker_server(opts.preload, env=dict(os.environ))
    except PrewarmError as e:
        log.warning("[agent %s] %s; workers start cold", opts.node, e)
        return None

    handler_class = forked_handler_class(SubprocessHandler, forks, f"[agent {opts.node}] workers")
    mp_api.get_subprocess_handler = lambda **kw: handler_class(**kw)
    log.info("[agent %s] workers are forked from the fork server (pid %d, preloaded %s in %.2f s; %s)", opts.node,
             forks.proc.pid, ",".join(opts.preload), forks.ready_s,
             f"a new interpreter: {cold_why}" if cold_why else "forked from this agent's image")
    return forks
