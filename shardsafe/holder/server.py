"""The holder daemon: one per (job, node); owns snapshot memory and outlives crashed trainers.

State per (scope, rank, kind): at most two slots. A scope is one engine's namespace (a process that builds
several protected DeepSpeed engines, e.g. HF's Trainer once per ``train()`` or hyperparameter trial, keeps each
engine's snapshots apart; the first engine's scope is ""); the budget is the holder's, shared by all. A slot is ``writing`` (acquired, maybe torn),
``sealed`` (complete, with its manifest) and possibly ``committed`` (all ranks agreed). The slot
holding a rank's newest committed version is never handed out for writing, so a crash at any
moment leaves that version intact. Memory stays inside the budget; an over-budget request gets
an error naming the bytes needed.
"""
from __future__ import annotations

import logging
import os
import queue
import select
import signal
import socket
import threading
import json
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConfigError
from .paths import HolderPaths
from .protocol import FLUSH_DRAIN_S, HolderError, gib_up, req_int, req_ranks, req_scope
from .background import BackgroundWork
from .serving import Serving
from .segments import Segment, huge_pages_possible, round_size, shmem_huge_setting
from .slots import KINDS, MAX_SLOTS, RankEntry, Slot

log = logging.getLogger(__name__)


Key = tuple[str, int]
"""(scope, rank): whose slots these are."""


@dataclass(frozen=True)
class _NewSlot:
    """A slot ``acquire`` allocates outside the lock: its id, bytes (counted against the budget meanwhile), name."""
    slot_id: int
    size: int
    name: str


def who(key: Key) -> str:
    """A key as error messages name it."""
    scope, rank = key
    return f"rank {rank}" + (f" (engine scope {scope!r})" if scope else "")

# A client has this long to say hello after connecting, and to send the rest of a frame once it began one;
# a client that does not take its reply within it is dropped too. Trainers send each frame in one go: only
# a stuck or hostile peer hits it. Idle *between* requests is normal (a trainer connects for its whole run).
DEFAULT_READ_TIMEOUT_S = 30.0
# Connections served at once (one thread each). A node's trainers hold one or two each, the launcher and
# `shardsafe status` one briefly; beyond the cap a connection is answered with a `busy` error and closed.
DEFAULT_MAX_CLIENTS = 128


class Holder(Serving, BackgroundWork):
    def __init__(self, paths: HolderPaths, *, budget_bytes: int, idle_exit_s: float = 0.0,
                 run_dir: str = "", scrub_interval_s: float = 0.0, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                 max_clients: int = DEFAULT_MAX_CLIENTS):
        if read_timeout_s <= 0 or max_clients < 1:
            raise ConfigError(f"holder read_timeout_s must be > 0 and max_clients >= 1; got {read_timeout_s} and "
                             f"{max_clients}")
        self.paths = paths
        self.budget = int(budget_bytes)
        # (scope, rank) -> bytes of one version of it (data + parity), as each rank said at its first snapshot
        self.reserved: dict[Key, int] = {}
        self.reports: dict[Key, dict] = {}   # (scope, rank) -> its newest protection state
        self.idle_exit_s = idle_exit_s
        self.read_timeout_s = float(read_timeout_s)
        self.max_clients = int(max_clients)
        self.refused = {"busy": 0, "protocol": 0, "timeout": 0, "hello": 0, "uid": 0}   # connections closed, by reason
        self.ranks: dict[Key, RankEntry] = {}   # (scope, rank) -> its slots
        self.lock = threading.RLock()
        # Slots being allocated outside the lock (their bytes count against the budget meanwhile), and the
        # (key, kind) each is for: a second request for the same rank waits for the first (``acquire``).
        self._allocating = 0
        self._alloc_keys: set[tuple[Key, str]] = set()
        self._allocated = threading.Condition(self.lock)
        self._next_slot = 1
        self._sealings = 0    # seals so far: Slot.sealing
        self._stop = threading.Event()
        # Wakes the accept loop at once when a stop is requested (it otherwise polls every 0.5 s for the
        # idle exit): the launchers wait for the holder's exit at the end of every job.
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._clients = 0
        self._last_activity = time.monotonic()
        self.started = time.time()
        self.scrub_interval_s = scrub_interval_s
        self.scrub_stats = {"runs": 0, "slots": 0, "corrupt": 0, "last": 0.0}
        self.flush_stats = {"done": 0, "failed": 0, "bytes": 0, "last_error": ""}
        self._flush_q: "queue.Queue[dict | None]" = queue.Queue()
        self._flush_pending = 0    # queued or being written; a shutdown reports it so launchers wait for them
        self._events = None
        self._run_dir = run_dir
        from shardsafe.faults import flush_fault
        try:
            self._flush_fault = flush_fault(paths.node)   # kill-flush: fault injection (tests, demos)
        except ValueError as e:
            log.warning("SHARDSAFE_INJECT ignored by the holder: %s", e)
            self._flush_fault = None
        if run_dir:
            try:
                from shardsafe.tor.events import EventLog
                self._events = EventLog(run_dir, source="holder", node=paths.node)
            except Exception as e:  # accounting never takes the holder down
                log.warning("TOR event log unavailable: %s", e)

    # ---- accounting -------------------------------------------------------------------------------
    def used_bytes(self) -> int:
        return self._allocating + sum(s.seg.size for r in self.ranks.values() for lst in r.slots.values() for s in lst)

    def _emit(self, kind: str, **f: Any) -> None:
        if self._events is not None:
            self._events.emit(kind, **f)

    # ---- requests ---------------------------------------------------------------------------------
    def _entry(self, key: Key) -> RankEntry:
        rank = key[1]
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise HolderError("bad_request", f"rank must be a non-negative integer, got {rank!r}")
        return self.ranks.setdefault(key, RankEntry())

    @staticmethod
    def _key(req: dict) -> Key:
        return req_scope(req), req_int(req, "rank", minimum=0)

    @staticmethod
    def _kind(req: dict) -> str:
        kind = req.get("kind", "data")
        if kind not in KINDS:
            raise HolderError("bad_request", f"kind must be one of {KINDS}, got {kind!r}")
        return kind

    def acquire(self, req: dict) -> tuple[dict, list[int]]:
        """A slot for (rank, kind, version). A new slot's memory is allocated outside the lock: allocating
        (and with 2 MiB pages zeroing) a multi-GB slot takes seconds, and the node's other ranks, taking
        their first snapshots at the same moment, must not queue behind it (nor flushes, status, ...)."""
        key, kind, version = self._key(req), self._kind(req), req_int(req, "version")
        nbytes = req_int(req, "nbytes", minimum=0)
        with self.lock:
            while (key, kind) in self._alloc_keys:   # the same rank's previous request is still allocating
                self._allocated.wait()
            try:
                plan = self._acquire(key, kind, version, nbytes)
                if isinstance(plan, tuple):
                    return plan
                self._allocating += plan.size
                self._alloc_keys.add((key, kind))
            finally:
                ent = self.ranks.get(key)
                if ent is not None and not any(ent.slots.values()) and (key, kind) not in self._alloc_keys:
                    del self.ranks[key]   # a refused first request leaves no empty entry behind
        seg = None
        try:
            seg = Segment(plan.name, plan.size)
        finally:
            with self.lock:
                self._allocating -= plan.size
                self._alloc_keys.discard((key, kind))
                self._allocated.notify_all()
                if seg is None:
                    ent = self.ranks.get(key)
                    if ent is not None and not any(ent.slots.values()):
                        del self.ranks[key]
        with self.lock:
            slot = Slot(plan.slot_id, seg)
            self._entry(key).slots[kind].append(slot)
            return self._hand_out(slot, version, nbytes)

    def _acquire(self, key: Key, kind: str, version: int, nbytes: int) -> "tuple[dict, list[int]] | _NewSlot":
        """The reply for a slot that exists, or what to allocate for a new one (``acquire`` does, unlocked)."""
        scope, rank = key
        with self.lock:
            ent = self._entry(key)
            slots = ent.slots[kind]
            protected = ent.last_committed[kind]
            # Candidates: never the slot of the newest committed version; prefer the oldest other one.
            # Rewriting a version (a restarted job replays it) invalidates the old copy of it, committed or not.
            # Slots pinned by a flush or scrub are never handed out: their bytes are being read.
            for s in slots:
                if s.version == version and s.pins:
                    self._invalidate(s)   # its reader (flush, scrub) keeps the bytes; nobody else sees them
                    ent.last_committed[kind] = max([x.version for x in slots if x.committed], default=-1)
                    protected = ent.last_committed[kind]
            same = [s for s in slots if s.version == version and s.pins == 0]
            cands = [s for s in slots if not (s.committed and s.version == protected) and s.pins == 0 and not s.doomed]
            slot = same[0] if same else self._pick(cands, held=sum(1 for s in slots if s.state != "free"))
            if same and same[0].committed:
                same[0].committed = False
                ent.last_committed[kind] = max([s.version for s in slots if s.committed], default=-1)
            need = round_size(nbytes)
            busy = [s for s in slots if s.pins]
            if slot is None and len(slots) >= MAX_SLOTS + len(busy):
                raise HolderError("state", f"{who(key)} already has {len(slots)} {kind} slots and none may be overwritten"
                                           + (f" (version(s) {[s.version for s in busy]} still being flushed to disk or "
                                              "scrubbed)" if busy else ""))
            if slot is None and len(slots) >= MAX_SLOTS:
                # A flush or scrub is reading an older version: one more slot, inside the budget, keeps the
                # snapshots going meanwhile (otherwise every snapshot during a long flush is skipped and the
                # memory tier falls behind). It stays as a free, pre-faulted slot for the next flush.
                used = self.used_bytes()
                if used + need > self.budget:
                    used -= self._reclaim_free()
                if used + need > self.budget:
                    raise HolderError(
                        "budget",
                        f"holder on node {self.paths.node} (job {self.paths.job_id}) cannot give {who(key)} a slot for "
                        f"version {version} while version(s) {[s.version for s in busy]} are being flushed to disk or "
                        f"scrubbed: one more slot needs {need} bytes, {used} in use, budget {self.budget} bytes. Raise "
                        f"memory_budget_gb (--memory-budget-gb) to at least {gib_up(used + need):.3f} GiB to keep "
                        "snapshotting during flushes, or flush less often (persist_every) or faster (persist_mbps).")
            if slot is not None and slot.seg.size < need:
                self._check_budget(need - slot.seg.size, key, nbytes, kind, keep=slot)
                slots.remove(slot)
                slot.seg.close()
                slot = None
            if slot is None:
                self._check_budget(need, key, nbytes, kind)
                where = f"{scope}.r{rank}" if scope else f"r{rank}"
                plan = _NewSlot(self._next_slot, need,
                                f"shardsafe.{self.paths.job_id}.{self.paths.node}.{where}.{kind}.{self._next_slot}")
                self._next_slot += 1
                return plan
            return self._hand_out(slot, version, nbytes)

    def _hand_out(self, slot: Slot, version: int, nbytes: int) -> tuple[dict, list[int]]:
        """Mark ``slot`` as being written with ``version`` and answer with its fd (call with the lock held)."""
        slot.version, slot.state, slot.committed, slot.manifest, slot.nbytes = version, "writing", False, None, nbytes
        # Every slot id that still exists: a client unmaps the ones it cached that are gone (grown,
        # dropped, reclaimed), or their memory would outlive the holder's accounting of it.
        live = sorted(x.slot_id for e in self.ranks.values() for lst in e.slots.values() for x in lst)
        return {"slot": slot.slot_id, "capacity": slot.seg.size, "live": live}, [slot.seg.fd]

    @staticmethod
    def _pick(cands: list[Slot], *, held: int) -> Slot | None:
        """The slot a new version goes to: a free one while the rank holds fewer than MAX_SLOTS versions
        (or nothing else is allowed), else the oldest version that may be overwritten, so a rank never
        holds more than MAX_SLOTS versions because a flush once needed an extra slot."""
        free = [s for s in cands if s.state == "free"]
        used = [s for s in cands if s.state != "free"]
        if free and (held < MAX_SLOTS or not used):
            return free[0]
        return min(used, key=lambda s: (s.state != "corrupt", s.version)) if used else None

    @staticmethod
    def _invalidate(s: Slot) -> None:
        s.version, s.state, s.committed, s.manifest, s.nbytes = -1, "free", False, None, 0

    def _unpin(self, key: Key, kind: str, s: Slot) -> None:
        """A flush or scrub is done with ``s`` (call with the lock held). A slot dropped meanwhile is
        closed now; if an extra slot was taken during the read, the rank goes back to MAX_SLOTS
        versions: the oldest one that may go becomes a free slot again."""
        s.pins -= 1
        if s.pins:
            return
        ent = self.ranks.get(key)
        if ent is None:
            return
        slots = ent.slots[kind]
        if s.doomed:
            if s in slots:
                slots.remove(s)
            s.seg.close()
            return
        held = [x for x in slots if x.state != "free"]
        while len(held) > MAX_SLOTS:
            gone = [x for x in held if x.pins == 0 and x.state in ("sealed", "corrupt")
                    and not (x.committed and x.version == ent.last_committed[kind])]
            if not gone:
                break
            victim = min(gone, key=lambda x: (x.state != "corrupt", x.version))
            self._invalidate(victim)
            held.remove(victim)
        ent.last_committed[kind] = max([x.version for x in slots if x.committed], default=-1)

    def _reclaim_free(self, keep: Slot | None = None) -> int:
        """Close every idle free slot (kept after a flush needed one more) except ``keep``; returns the
        bytes given back. Free slots are a cache, never a reason to refuse a request."""
        freed = 0
        for ent in self.ranks.values():
            for kind, lst in ent.slots.items():
                idle = [x for x in lst if x.state == "free" and x.pins == 0 and x is not keep]
                for x in idle:
                    lst.remove(x)
                    freed += x.seg.size
                    x.seg.close()
        return freed

    def _check_budget(self, extra: int, key: Key, nbytes: int, kind: str = "data", keep: Slot | None = None) -> None:
        used = self.used_bytes()
        if used + extra > self.budget:
            used -= self._reclaim_free(keep)
        if used + extra > self.budget:
            steady = self.steady_bytes(key, kind, round_size(nbytes))
            raise HolderError(
                "budget",
                f"holder on node {self.paths.node} (job {self.paths.job_id}) cannot hold {nbytes} bytes for {who(key)}: "
                f"{used} bytes in use + {extra} needed > budget {self.budget} bytes. "
                f"Raise memory_budget_gb (--memory-budget-gb) to at least {gib_up(steady):.3f} GiB "
                f"({MAX_SLOTS} versions per rank are kept: {steady} bytes for the {self._ranks_seen(key)} "
                f"rank(s) this holder has seen so far{self._scopes_said()}, more for ranks still to come), or snapshot "
                "less often.")

    def steady_bytes(self, key: Key, kind: str, need: int) -> int:
        """Bytes the holder needs once every (scope, rank, kind) it knows keeps MAX_SLOTS versions of its largest
        slot, with ``need`` bytes per slot for (``key``, ``kind``): what a budget must hold, not just the
        next request (call with the lock held)."""
        total = MAX_SLOTS * need
        for r, ent in self.ranks.items():
            for k, lst in ent.slots.items():
                if (r, k) != (key, kind) and lst:
                    total += MAX_SLOTS * max(s.seg.size for s in lst)
        return total

    def _ranks_seen(self, key: Key) -> int:
        return len({key, *(r for r, e in self.ranks.items() if any(e.slots.values()))})

    def _scopes_said(self) -> str:
        """", in N engine scopes" when more than one engine of the job keeps snapshots here."""
        scopes = {sc for (sc, _), e in self.ranks.items() if any(e.slots.values())}
        return f" in {len(scopes)} engine scopes (every protected engine of a process keeps its own)" \
            if len(scopes) > 1 else ""

    def _find(self, key: Key, kind: str, version: int, states: tuple[str, ...]) -> Slot:
        ent = self.ranks.get(key)
        for s in (ent.slots[kind] if ent else []):
            if s.version == version and s.state in states:
                return s
        raise HolderError("not_found", f"node {self.paths.node} holds no {'/'.join(states)} {kind} version {version} "
                                       f"for {who(key)}")

    def seal(self, req: dict) -> dict:
        key, kind, version = self._key(req), self._kind(req), req_int(req, "version")
        manifest = req.get("manifest")
        if not isinstance(manifest, dict):
            raise HolderError("bad_request", "seal needs a JSON object manifest")
        with self.lock:
            s = self._find(key, kind, version, ("writing",))
            s.state, s.manifest, s.sealed_at = "sealed", manifest, time.time()
            self._sealings += 1
            s.sealing = self._sealings
        return {}

    def commit(self, req: dict) -> dict:
        """Mark ``version`` committed for the given ranks; older versions become overwritable."""
        kind, version, ranks, scope = self._kind(req), req_int(req, "version"), req_ranks(req), req_scope(req)
        with self.lock:
            for rank in ranks:
                s = self._find((scope, rank), kind, version, ("sealed",))
                s.committed = True
                ent = self.ranks[(scope, rank)]
                ent.last_committed[kind] = max(ent.last_committed[kind], version)
        return {}

    def list(self, req: dict) -> dict:
        """The slots of the request's scope ("" by default), of one rank or of all."""
        want, scope = req.get("rank"), req_scope(req)
        if want is not None:
            want = req_int(req, "rank", minimum=0)
        with self.lock:
            out = {}
            for (sc, rank), ent in sorted(self.ranks.items()):
                if sc != scope or (want is not None and rank != want):
                    continue
                out[str(rank)] = {k: [s.info() for s in sorted(lst, key=lambda s: s.version)] for k, lst in ent.slots.items() if lst}
            return {"ranks": out}

    def scopes(self) -> list[str]:
        """The engine scopes that hold slots, "" (the first engine) first."""
        with self.lock:
            return sorted({sc for (sc, _), e in self.ranks.items() if any(e.slots.values())})

    def open(self, req: dict) -> tuple[dict, list[int]]:
        key, kind, version = self._key(req), self._kind(req), req_int(req, "version")
        with self.lock:
            s = self._find(key, kind, version, ("sealed",))
            return {"slot": s.slot_id, "manifest": s.manifest, "nbytes": s.nbytes, "committed": s.committed,
                    "sealing": s.sealing}, [s.seg.readonly_fd()]

    def drop(self, req: dict) -> dict:
        kind, ranks, scope = self._kind(req), req_ranks(req), req_scope(req)
        version = req_int(req, "version") if req.get("version") is not None else None
        freed = 0
        with self.lock:
            for rank in ranks:
                ent = self.ranks.get((scope, rank))
                if not ent:
                    continue
                keep = []
                for s in ent.slots[kind]:
                    if version is None or s.version == version:
                        if s.pins:           # a flush or scrub still reads it: closed (freed) when it is done
                            self._invalidate(s)
                            s.doomed = True
                            keep.append(s)
                        else:
                            freed += s.seg.size
                            s.seg.close()
                    else:
                        keep.append(s)
                ent.slots[kind] = keep
                if version is None or ent.last_committed[kind] == version:
                    ent.last_committed[kind] = max([s.version for s in keep if s.committed], default=-1)
        return {"freed": freed}

    def status(self, req: dict) -> dict:
        with self.lock:
            return {"job_id": self.paths.job_id, "node": self.paths.node, "pid": os.getpid(),
                    "budget": self.budget, "used": self.used_bytes(), "started": self.started,
                    "used_by_scope": self._used_by_scope(),
                    "protection": {(f"{sc}/{r}" if sc else str(r)): st for (sc, r), st in sorted(self.reports.items())},
                    "clients": self._clients, "refused": dict(self.refused), "health": "ok" if not self._corrupt() else "corrupt",
                    "corrupt": self._corrupt(), "scrub": dict(self.scrub_stats), "flush": dict(self.flush_stats),
                    "shmem_enabled": shmem_huge_setting(),   # the slots' page size: docs/operations.md
                    **self.list({}),
                    "scopes": {sc: self.list({"scope": sc})["ranks"] for sc in self.scopes() if sc}}

    def reserve(self, req: dict) -> dict:
        """A rank says how many bytes one version of it takes here (data and parity slots, rounded as allocated):
        the holder must be able to keep MAX_SLOTS of them for every rank that said so, or the second version never
        commits and a crash much later restores the first. Refused with code "budget" (the number to raise the
        budget to in the message) when the node's ranks together need more than the budget."""
        key = self._key(req)
        per_version = req_int(req, "nbytes", minimum=0)
        with self.lock:
            self.reserved[key] = per_version
            need = MAX_SLOTS * sum(self.reserved.values())
            others = sum(s.seg.size for k, e in self.ranks.items() if k not in self.reserved
                         for lst in e.slots.values() for s in lst)
            if need + others > self.budget:
                raise HolderError(
                    "budget",
                    f"the holder of node {self.paths.node} (job {self.paths.job_id}) cannot keep {MAX_SLOTS} versions "
                    f"of its {len(self.reserved)} rank(s) (their data and parity): {need + others} bytes needed, budget "
                    f"{self.budget} bytes; the second version would never commit, and a crash later would restore the "
                    f"first one. Raise memory_budget_gb (--memory-budget-gb) to at least {gib_up(need + others):.3f} "
                    "GiB")
            return {"reserved": need, "budget": self.budget}

    def report(self, req: dict) -> dict:
        """A rank's protection state (shardsafe.protection.Protection.state), kept for ``shardsafe status``."""
        key = self._key(req)
        state = req.get("state")
        if not isinstance(state, dict) or len(json.dumps(state)) > 8192:
            raise HolderError("bad_request", "report needs a JSON object 'state' of at most 8 KiB")
        with self.lock:
            self.reports[key] = {**state, "reported": time.time()}
        return {}

    def _used_by_scope(self) -> dict[str, int]:
        """Bytes of slots per engine scope (a starting engine checks what the others keep against the budget)."""
        out: dict[str, int] = {}
        for (sc, _), e in self.ranks.items():
            out[sc] = out.get(sc, 0) + sum(s.seg.size for lst in e.slots.values() for s in lst)
        return out

    def _corrupt(self) -> list[dict]:
        return [{"rank": r, "kind": k, "version": s.version, **({"scope": sc} if sc else {})}
                for (sc, r), e in self.ranks.items() for k, lst in e.slots.items() for s in lst if s.state == "corrupt"]

    def handle(self, req: dict) -> tuple[dict, list[int]]:
        op = req.get("op")
        if op in ("acquire", "open"):
            return getattr(self, op)(req)
        if op in ("seal", "commit", "list", "drop", "status", "flush", "scrub", "reserve", "report"):
            return getattr(self, op)(req), []
        if op == "hello":
            if req.get("job_id") != self.paths.job_id:
                raise HolderError("job", f"this holder serves job {self.paths.job_id!r}, not {str(req.get('job_id'))[:80]!r}: "
                                         "connect to the holder of your own job (its socket is "
                                         "HOLDER_DIR/JOB_ID/NODE.sock)")
            return {"node": self.paths.node, "pid": os.getpid(), "started": self.started}, []
        if op == "shutdown":
            # The stop itself is requested by _serve_conn once this reply is sent: the accept loop wakes at
            # once and the process may exit before a reply still to be sent. Queued flushes are written before
            # the holder exits (the newest committed version is usually among them): the caller must give it
            # that long instead of killing it.
            with self.lock:
                return {"pending_flushes": self._flush_pending}, []
        raise HolderError("bad_request", f"unknown op {str(op)[:60]!r}; expected one of acquire, seal, commit, list, "
                                         "open, drop, flush, scrub, status, reserve, report, hello, shutdown")

    def serve(self, ready: Callable[[], None] | None = None) -> None:
        self.paths.ensure_dir()
        try:
            os.unlink(self.paths.socket)
        except FileNotFoundError:
            pass
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is created 0600: only this user may connect
        try:
            srv.bind(self.paths.socket)
        finally:
            os.umask(old)
        os.chmod(self.paths.socket, 0o600)
        srv.listen(256)
        srv.settimeout(0.5)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.request_stop())
        self._emit("holder_start", budget=self.budget, pid=os.getpid())
        flusher = threading.Thread(target=self._flush_loop, name="shardsafe-flush", daemon=True)
        flusher.start()
        if self.scrub_interval_s > 0:
            threading.Thread(target=self._scrub_loop, name="shardsafe-scrub", daemon=True).start()
        log.info("holder for job %s node %s serving on %s (budget %d bytes, slots on %s pages: shmem_enabled=%s)",
                 self.paths.job_id, self.paths.node, self.paths.socket, self.budget,
                 "2 MiB" if huge_pages_possible() else "4 KiB", shmem_huge_setting() or "unknown")
        if ready:
            ready()
        stop_reason = "requested"   # shutdown request or SIGTERM/SIGINT
        try:
            while not self._stop.is_set():
                readable, _, _ = select.select([srv, self._wake_r], [], [], 0.5)
                if srv not in readable:
                    if self._idle_expired():
                        log.info("no client and no flush for %.0f s (idle exit): exiting", self.idle_exit_s)
                        stop_reason = "idle_exit"
                        break
                    continue
                try:
                    conn, _ = srv.accept()
                except (socket.timeout, BlockingIOError):
                    continue   # the client gave up between select and accept
                with self.lock:
                    busy = self._clients >= self.max_clients
                    if not busy:
                        self._clients += 1
                if busy:
                    self._turn_away(conn)
                    continue
                try:
                    threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()
                except RuntimeError:   # no thread to be had (process limits): this client only is dropped
                    log.exception("no thread for a new connection; closed it")
                    with self.lock:
                        self._clients -= 1
                    conn.close()
        finally:
            srv.close()
            try:
                os.unlink(self.paths.socket)
            except FileNotFoundError:
                pass
            self._stop.set()
            self._flush_q.put(None)      # finish queued flushes (bounded) before the memory goes
            flusher.join(timeout=FLUSH_DRAIN_S)
            with self.lock:
                for ent in self.ranks.values():
                    for lst in ent.slots.values():
                        for s in lst:
                            s.seg.close()
                self.ranks.clear()
            self._emit("holder_stop", reason=stop_reason)
            log.info("holder stopped; memory freed")
