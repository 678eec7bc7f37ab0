"""The agent's side of a restart in place (``--restart in-place``; the workers' side is shardsafe.inplace).

torch elastic stops every worker of the node when one dies, and every other agent restarts its workers for the
membership change. Here the agent looks at its workers before torch does, on every monitor tick:

* **A worker of this node died** (:meth:`InPlace.replace_dead`): the agent claims the attempt in the control store
  (one agent per attempt), draws the job's next attempt number from the counter the rendezvous rounds draw from,
  reports the failure to the controller, starts the dead rank again in torch's own worker context (same rank, same
  environment and store, the new attempt) and announces the attempt to the other agents (:meth:`Keys.inplace`).
* **Any agent announced it** (:meth:`InPlace.follow`): the agent writes the new attempt for its workers
  (shardsafe.inplace.write_notice), signals the survivors, and reports the attempt's start.

torch then sees every worker running and restarts nobody. Where in place cannot work, the agent leaves the failure
to torch (a full restart) and says why: rank 0 died (its process hosts the workers' store), another node's worker
failed in the same attempt, a rank could not abandon its runtime (shardsafe.inplace.EXIT_NOT_IN_PLACE), a
worker died of an error no restart fixes, or no restarts are left.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from typing import Any, Optional

from .. import env as names
from ..fatal import read_fatal
from ..inplace import EXIT_NOT_IN_PLACE, SIGNAL, write_notice

log = logging.getLogger(__name__)

LISTEN_S = 86400.0
"""The longest server-side wait for an announcement. A wait that times out makes torch log two warnings, so the
listener waits for the key to be set instead: by the announcement, or by :meth:`InPlace.supersede`."""
SUPERSEDED = json.dumps({"attempt": -1})


def signal_main_thread(pid: int, sig: int) -> None:
    """Send ``sig`` to the main thread of process ``pid`` (its thread id is the pid). A process-directed signal goes
    to any thread that does not block it (gloo's, the snapshot thread), and the main thread's handler then runs only
    once its sleep or wait ends by itself; aimed at the main thread, it cuts the sleep short.

    Raises:
        ProcessLookupError: no such process.
    """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_TGKILL, pid, pid, sig) == 0:
        return
    if ctypes.get_errno() == errno.ESRCH:
        raise ProcessLookupError(pid)
    os.kill(pid, sig)   # tgkill unknown on this machine: signal the process


_SYS_TGKILL = {"x86_64": 234, "aarch64": 131, "ppc64le": 250}.get(os.uname().machine, -1)


class InPlace:
    """One agent's in-place restarts. ``hooks``: the agent's :class:`~.agent._AgentHooks` (store, keys, attempt)."""

    def __init__(self, hooks: Any):
        self.hooks = hooks
        self.opts = hooks.opts
        self._asked = 0.0   # when follow() last read the store
        # One announcement is acted on once: by the agent that made it, by the listener, or by follow()
        self._going = threading.Lock()
        self._stop = threading.Event()
        self._listener = threading.Thread(target=self._listen, name="shardsafe-inplace-listener", daemon=True)
        self._listener.start()

    def close(self) -> None:
        """Stop the listener while the interpreter is fully alive (as _AgentHooks.close, for its store wait)."""
        self._stop.set()
        if self.hooks.attempt is not None:
            self.supersede(self.hooks.attempt)
        self._listener.join(timeout=5)

    def supersede(self, a: int) -> None:
        """``a`` is over without a restart in place (a new rendezvous round, the job's end): its key gets a value
        every reader ignores, unless an announcement is there already, which ends the listener's wait for it."""
        with self.hooks._lock:
            try:
                self.hooks.store.compare_set(self.hooks.keys.inplace(a), "", SUPERSEDED)
            except Exception as e:  # noqa: BLE001 - the store gone at the job's end: the listener's wait ends too
                log.debug("[agent %s] superseding attempt %d: %s", self.opts.node, a, e)

    def _listen(self) -> None:
        """Wait in the control store for the current attempt's announcement (a server-side wait: no polling), so
        this node's survivors hear of a restart in place within milliseconds instead of the next monitor tick."""
        from datetime import timedelta

        from .controller import _store_client
        store = None
        while not self._stop.is_set():
            a = self.hooks.attempt
            if a is None:
                self._stop.wait(0.05)
                continue
            try:
                store = store or _store_client(self.opts.control)
                store.wait([self.hooks.keys.inplace(a)], timedelta(seconds=LISTEN_S))
                got = json.loads(store.get(self.hooks.keys.inplace(a)))
            except Exception:  # noqa: BLE001 - the store gone at the job's end, or a day's wait: a new connection
                store = None
                self._stop.wait(0.25)
                continue
            wg = self.hooks.worker_group
            if wg is not None:
                self._follow(wg, a, got)
            # Superseded by an agent whose next round began before this one's, or acted on: the key stays set, so
            # the next wait is for the next attempt's key, once this agent is in it
            while self.hooks.attempt == a and not self._stop.wait(0.05):
                pass
        store = None

    # ---- this node's worker died ----------------------------------------------------------------------------
    def replace_dead(self, agent: Any, wg: Any) -> bool:
        """Start this node's dead workers again in place; False when there are none or the failure is torch's to
        handle (the module docstring lists when)."""
        ctx, a = getattr(agent, "_pcontext", None), self.hooks.attempt
        handlers = getattr(ctx, "subprocess_handlers", None)
        running = getattr(ctx, "_running_local_ranks", None)
        if not handlers or running is None or a is None:
            return False
        dead = {lr: rc for lr, h in handlers.items() if lr in running
                for rc in [h.proc.poll()] if rc is not None and rc != 0}
        if not dead:
            return False
        ranks = {lr: wg.workers[lr].global_rank for lr in dead}
        why = self._why_not(agent, a, dead, ranks)
        if why:
            log.warning("[agent %s] rank(s) %s of attempt %d failed; not restarting in place (%s): every worker "
                        "restarts", self.opts.node, sorted(ranks.values()), a, why)
            return False
        mine = json.dumps({"node": self.opts.node, "ranks": sorted(ranks.values()), "t": time.time()})
        with self._going:
            return self._replace(agent, wg, a, dead, ranks, mine, ctx)

    def _replace(self, agent: Any, wg: Any, a: int, dead: dict[int, int], ranks: dict[int, int], mine: str,
                 ctx: Any) -> bool:
        with self.hooks._lock:
            got = self.hooks.store.compare_set(self.hooks.keys.inplace_claim(a), "", mine)
            if (got.decode() if isinstance(got, bytes) else str(got)) != mine:
                log.warning("[agent %s] another node restarts attempt %d in place; rank(s) %s failed too: every "
                            "worker restarts", self.opts.node, a, sorted(ranks.values()))
                return False
            nxt = self.hooks.draw_attempt()
        self.hooks.reported.add((a, "fail"))
        self.hooks._publish({"type": "fail", "attempt": a, "exits": {str(ranks[lr]): rc for lr, rc in dead.items()}})
        agent._remaining_restarts -= 1
        lost = sorted(ranks.values())
        log.warning("[agent %s] rank(s) %s of attempt %d died (exit %s); restarting them in place as attempt %d, "
                    "%d restart(s) left", self.opts.node, lost, a, sorted(dead.values()), nxt,
                    agent._remaining_restarts)
        for lr in dead:
            self._start_again(ctx, wg, lr, nxt)
        with self.hooks._lock:
            self.hooks.store.set(self.hooks.keys.inplace(a), json.dumps({"attempt": nxt, "ranks": lost}))
        self._go_on(wg, a, nxt, lost, skip=set(dead))
        return True

    def _why_not(self, agent: Any, a: int, dead: dict[int, int], ranks: dict[int, int]) -> str:
        if not self.opts.run_dir:
            return "the job has no run directory to tell its workers the new attempt"
        if 0 in ranks.values():
            return "rank 0 hosts the workers' store"
        if EXIT_NOT_IN_PLACE in dead.values():
            return f"a rank exited with {EXIT_NOT_IN_PLACE}: it could not abandon its runtime"
        if agent._remaining_restarts <= 0:
            return "no restarts left"
        if read_fatal(self.opts.run_dir, a):
            return "a worker died of an error no restart fixes"
        return ""

    @staticmethod
    def _start_again(ctx: Any, wg: Any, lr: int, attempt: int) -> None:
        """Replace local rank ``lr``'s handle in torch's worker context by a new process with the same command and
        environment, in ``attempt``; its output goes to new files beside the dead worker's."""
        from torch.distributed.elastic.multiprocessing import api as mp_api
        old = ctx.subprocess_handlers[lr]
        for f in (getattr(old, "_stdout", None), getattr(old, "_stderr", None)):
            if f is not None:
                f.close()
        env = {**ctx.envs[lr], names.ATTEMPT: str(attempt)}
        kw = {"entrypoint": ctx.entrypoint, "args": ctx.args[lr], "env": env,
              "stdout": f"{ctx.stdouts[lr]}.attempt{attempt}" if ctx.stdouts.get(lr) else "",
              "stderr": f"{ctx.stderrs[lr]}.attempt{attempt}" if ctx.stderrs.get(lr) else "", "local_rank_id": lr}
        if hasattr(ctx, "_numa_options"):
            kw["numa_options"] = ctx._numa_options
        new = mp_api.get_subprocess_handler(**kw)
        ctx.subprocess_handlers[lr] = new
        wg.workers[lr].id = new.proc.pid

    # ---- any node's worker died ----------------------------------------------------------------------------
    def follow(self, wg: Any) -> None:
        """Follow another agent's restart in place of the current attempt, if one was announced."""
        a, now = self.hooks.attempt, time.monotonic()
        # At most one store read per peer_check_s, as for a peer's failure (the rendezvous poll: by job size)
        if a is None or now - self._asked < self.hooks.peer_check_s:
            return
        self._asked = now
        got = self._announced(a)
        if got is not None:
            self._follow(wg, a, got)

    def _follow(self, wg: Any, a: int, got: dict) -> None:
        with self._going:
            if self.hooks.attempt == a and int(got.get("attempt", -1)) > a:   # an announcement not yet acted on
                self._go_on(wg, a, int(got["attempt"]), [int(r) for r in got.get("ranks", [])], skip=set())

    def _announced(self, a: int) -> Optional[dict]:
        key = self.hooks.keys.inplace(a)
        with self.hooks._lock:
            try:
                if not self.hooks.store.check([key]):
                    return None
                return json.loads(self.hooks.store.get(key))
            except Exception as e:  # noqa: BLE001 - a store hiccup: the next tick asks again
                log.debug("[agent %s] reading %s: %s", self.opts.node, key, e)
                return None

    def _go_on(self, wg: Any, a: int, nxt: int, lost: list[int], *, skip: set[int]) -> None:
        """Tell this node's surviving workers that the job goes on at ``nxt``, and the controller that it started."""
        write_notice(self.opts.run_dir, self.opts.node, nxt, lost)
        for w in wg.workers:
            if w.local_rank in skip or w.id is None:
                continue
            try:
                signal_main_thread(int(w.id), SIGNAL)
            except ProcessLookupError:
                pass   # it died meanwhile: the next tick sees it
        self.hooks.attempt = nxt
        os.environ[names.ATTEMPT] = str(nxt)
        self.hooks._publish({"type": "start", "attempt": nxt, "group_rank": wg.group_rank,
                             "ranks": [w.global_rank for w in wg.workers], "in_place": True})
        log.info("[agent %s] attempt %d goes on in place as attempt %d (ranks %s started again)", self.opts.node, a,
                 nxt, lost)
