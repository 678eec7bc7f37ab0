"""Early open: a restarted trainer maps its newest held snapshot, page tables filled, while it starts up.

Why. A restore verifies every byte of the slot it maps, and the mapping is new: the trainer that made the
snapshot died with its page tables. Filling them costs ~270 ns per 4 KiB page on this project's VM
(0.070 s/GiB, more than hashing the same bytes; bench/RESULTS.md), 2-3 s for a 13 GB shard, on the
critical path of every recovery. The restarted trainer reaches its restore only after seconds of other
work (the process group, the model, the engine, its optimizer), and none of that needs the mapping: this
module makes it then, beside that work, so the restore finds the pages mapped.

How. :func:`start`, called as the trainer starts (in the fork server's child before it runs the script, and
by the automatic activation when DeepSpeed or Megatron-LM loads in a trainer torchrun started itself), opens
in a daemon thread the newest version this rank's holder has sealed, with ``MAP_POPULATE``. :func:`take` hands
it to the restore of the process's first protected engine, which uses it only when the holder still serves the
version it chose from the same shared memory (:class:`~shardsafe.holder.client.OpenedSlot` ``ident``); the
restore verifies every byte as always, so nothing is taken from the early open but the page tables. A
mapping nobody claims is closed after :data:`CLAIM_WAIT_S` (it must not keep memory alive that the holder
frees), and a process forked from the trainer (a data-loader worker) closes its inherited copy at once.

Only the environment is read: ``SHARDSAFE_JOB_ID`` and ``RANK`` (set by ``shardsafe launch``, the local
launcher, the sbatch scripts, torchrun), the node and holder directory as the config's defaults derive them
(:mod:`.paths`). A trainer whose job id or node comes from its config alone opens its slot in the restore, as
before. ``SHARDSAFE_EARLY_OPEN=0`` turns it off.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from typing import Mapping, Optional

from .client import HolderClient, OpenedSlot
from .paths import HolderPaths, default_holder_dir, default_node_name
from .protocol import HolderFailure

log = logging.getLogger("shardsafe.holder.early_open")

ENV_EARLY_OPEN = "SHARDSAFE_EARLY_OPEN"
"""``0`` (or ``false``/``off``/``no``) turns the early open off."""
CLAIM_WAIT_S = 600.0
"""How long an opened mapping waits for the restore to claim it before it is closed."""
CONNECT_TIMEOUT_S = 10.0


class EarlyOpen:
    """One process's early open of one rank's newest sealed version (a daemon thread; :func:`start`).

    Args:
        paths: the node's holder for the job.
        rank: the global rank whose slot is opened (``RANK``).
    """

    def __init__(self, paths: HolderPaths, rank: int):
        self.paths, self.rank = paths, rank
        self.version = -1          # the version opened (-1: none)
        self.seconds = 0.0         # connect, list, open and populate, in the thread
        self.why = ""              # why nothing was opened
        self._slot: Optional[OpenedSlot] = None
        self._used = False         # claimed by the restore, for the version it opened
        self._spent = False        # claimed or discarded: a slot the thread opens afterwards is closed at once
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._claimed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardsafe-early-open", daemon=True)

    def start(self) -> "EarlyOpen":
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        slot = None
        try:
            c = HolderClient(self.paths, timeout_s=CONNECT_TIMEOUT_S).connect()
            try:
                versions = c.sealed_versions(self.rank)
                if versions:
                    slot = c.open_slot(rank=self.rank, version=max(versions), populate=True)
                else:
                    self.why = f"the holder has no sealed version of rank {self.rank}"
            finally:
                c.close()
        except (HolderFailure, OSError, ValueError, KeyError) as e:
            self.why = f"{type(e).__name__}: {e}"
        self.seconds = time.perf_counter() - t0
        with self._lock:
            if slot is not None and not self._spent:
                self._slot, self.version = slot, int(slot.manifest.get("version", -1))
                slot = None
        if slot is not None:
            _close(slot.mm)   # discarded while it opened
        self._done.set()
        if self.version >= 0 and not self._claimed.wait(CLAIM_WAIT_S):
            log.info("[rank %d] early-opened snapshot version %d unclaimed after %.0f s: closed", self.rank,
                     self.version, CLAIM_WAIT_S)
            self.discard()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Until the open is done (or failed); False on timeout."""
        return self._done.wait(timeout)

    def claim(self, rank: int, version: int, ident: tuple[int, int, int], *, wait_s: float = CONNECT_TIMEOUT_S + 60.0
              ) -> Optional[mmap.mmap]:
        """The populated mapping if it is ``rank``'s ``version`` in the shared memory ``ident`` names (the restore's
        own open of it); None otherwise. Waits for an open in progress: populating the rest of the pages costs the
        restore the same either way. The mapping belongs to the caller from here; a second claim gets None."""
        self._claimed.set()
        self._done.wait(wait_s)
        with self._lock:
            slot, self._slot, self._spent = self._slot, None, True
        if slot is None:
            return None
        if rank != self.rank or version != self.version or ident != slot.ident:
            _close(slot.mm)
            self.why = (f"opened version {self.version} of rank {self.rank}, the restore wanted version {version} of "
                        f"rank {rank}" + ("" if version != self.version or rank != self.rank else
                                          " from other shared memory (the holder moved it)"))
            return None
        self._used = True
        return slot.mm

    def discard(self) -> None:
        """Close the mapping unless claimed (idempotent)."""
        with self._lock:
            slot, self._slot, self._spent = self._slot, None, True
        self._claimed.set()
        if slot is not None:
            _close(slot.mm)

    def notes(self, restored: int) -> dict:
        """For the notes of a restore of version ``restored``: whether the early open served it and what it cost."""
        if self._used and restored == self.version:
            how = "used"
        elif self._used:
            how = (f"missed: opened version {self.version}, which was not restorable on every rank; version "
                   f"{restored} was restored")
        else:
            how = "missed: " + (self.why or f"opened version {self.version}, the restore chose version {restored}")
        return {"early_open": how, "early_open_version": self.version, "early_open_s": round(self.seconds, 6)}


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:   # views of it still alive: closed when they go
        pass


_current: Optional[EarlyOpen] = None
_current_lock = threading.Lock()


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENV_EARLY_OPEN, "").strip().lower() not in ("0", "false", "off", "no")


def start(environ: Mapping[str, str] = os.environ) -> Optional[EarlyOpen]:
    """Start this process's early open, once, if the environment names a shardsafe job and a rank; returns it
    (or the one already started, or None)."""
    global _current
    job, rank = environ.get("SHARDSAFE_JOB_ID", ""), environ.get("RANK", "")
    if not job or not rank.isdigit() or not enabled(environ):
        return None
    with _current_lock:
        if _current is None:
            paths = HolderPaths(default_holder_dir(environ), job, default_node_name(environ))
            if not os.path.exists(paths.socket):
                return None   # no holder for this job on this node (a first start): nothing to open
            _current = EarlyOpen(paths, int(rank)).start()
        return _current


def take() -> Optional[EarlyOpen]:
    """This process's early open, handed over once (to the restore of its first protected engine)."""
    global _current
    with _current_lock:
        got, _current = _current, None
    return got


def _after_fork_in_child() -> None:
    # A process forked from the trainer inherits the mapping (shared memory, kept across fork) but not the thread:
    # it never restores, so its copy goes now, before it could keep memory the holder frees alive.
    global _current, _current_lock
    got, _current, _current_lock = _current, None, threading.Lock()
    if got is not None:
        slot, got._slot = got._slot, None
        if slot is not None:
            _close(slot.mm)


os.register_at_fork(after_in_child=_after_fork_in_child)
