"""Early open: a restarted trainer maps and verifies its newest held snapshot while it starts up.

Why. A restore verifies every byte of the slot it maps, and the mapping is new: the trainer that made the
snapshot died with its page tables. Filling them is a page fault per 4 KiB page (262,144 per GiB, which can
cost more than hashing the same bytes; seconds for a shard of many GB), and the checksums read every byte once
more before the copy reads them again: with one core per rank verify-then-copy costs at least a hash plus a
memcpy of every byte (bench/RESULTS.md "Snapshot and restore at real shard sizes"), on the critical path of every
recovery. The restarted trainer reaches its restore only after seconds of other work (the process group, the
model, the engine, its optimizer), and none of that needs the mapping: this module maps and verifies it then,
beside that work, so the restore only copies.

How. :func:`start`, called as the trainer starts (in the fork server's child before it runs the script, and
by the automatic activation when DeepSpeed or Megatron-LM loads in a trainer torchrun started itself), opens
in a daemon thread the newest version this rank's holder has sealed and checks every segment against its
manifest's checksums (the process's hash threads fill the page tables of their segments as they go).
:func:`take` hands it to the restore of the process's first protected engine, which uses the mapping only when
the holder still serves the version it chose from the same shared memory (:class:`OpenedSlot` ``ident``), and
the early verification only when, in addition, the manifest is the same and no writer was handed the slot
since (the holder's ``sealing`` count of the restore's open equals the early open's): then the bytes are the
ones verified, and the restore skips its own pass over them. A restore that asks while the early open still
works waits for it (what is left costs it the same either way). In every other case (another version, a
rebuilt or re-written slot, a problem found early) the restore verifies the bytes itself. Verification is as
complete as the restore's own, only earlier: what it cannot see is memory that changes without any writer
between the early open and the restore (a hardware fault ECC did not correct); ``SHARDSAFE_EARLY_OPEN=map``
keeps the verification in the restore for who wants that window closed too. A mapping nobody claims is closed
after :data:`CLAIM_WAIT_S` (it must not keep memory alive that the holder frees), and a process forked from the
trainer (a data-loader worker) closes its inherited copy at once.

Only the trainer process opens early, not a process it started (a spawn-mode DataLoader worker imports DeepSpeed
again): :func:`trainer_process`. Only the environment is read: ``SHARDSAFE_JOB_ID`` and ``RANK`` (set by
``shardsafe launch``, the local launcher, the sbatch scripts, torchrun), the node and holder directory as the
config's defaults derive them (:mod:`.paths`). A trainer whose job id or node comes from its config alone opens
its slot in the restore. ``SHARDSAFE_EARLY_OPEN``: unset or ``1`` maps and verifies, ``map`` only maps (with
``MAP_POPULATE``), ``0`` (or ``false``/``off``/``no``) turns it off.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from typing import Mapping, MutableMapping, NamedTuple, Optional

from .. import env
from ..errors import ConfigError
from .client import HolderClient, OpenedSlot
from .paths import ForeignHolder, HolderPaths, HolderSecurityError, default_holder_dir, default_node_name
from .protocol import HolderFailure

log = logging.getLogger(__name__)

ENV_EARLY_OPEN = env.EARLY_OPEN
"""Unset or ``1``: map and verify; ``map``: map only; ``0`` (or ``false``/``off``/``no``): off."""
CLAIM_WAIT_S = 600.0
"""How long an opened mapping waits for the restore to claim it before it is closed."""
CONNECT_TIMEOUT_S = 10.0
ENV_TRAINER = env.TRAINER
"""``PID:RANK:LOCAL_RANK`` of the trainer process (:func:`trainer_process`); the processes it starts inherit it."""
_MAP_ONLY = "not verified early (SHARDSAFE_EARLY_OPEN=map)"


class Claimed(NamedTuple):
    """What the restore takes from the early open: the mapping, page tables filled, and whether its bytes
    verified against the manifest the restore opened, with no writer handed the slot since."""
    mm: mmap.mmap
    verified: bool


class EarlyOpen:
    """One process's early open of one rank's newest sealed version (a daemon thread; :func:`start`).

    Args:
        paths: the node's holder for the job.
        rank: the global rank whose slot is opened (``RANK``).
        verify: check the slot's checksums too (else only map it, with ``MAP_POPULATE``).
    """

    def __init__(self, paths: HolderPaths, rank: int, *, verify: bool = True):
        self.paths, self.rank, self.verify = paths, rank, verify
        self.version = -1          # the version opened (-1: none)
        self.seconds = 0.0         # connect, list, open, populate (and verify), in the thread
        self.verify_seconds = 0.0  # the verification's part of it
        self.why = ""              # why nothing was opened
        self.problems: Optional[list[str]] = None   # what the verification found ([]: every segment good; None: not run)
        self.verify_why = ""       # why the restore did not take the verification
        self._slot: Optional[OpenedSlot] = None
        self._used = False         # claimed by the restore, for the version it opened
        self._verified_used = False
        self._spent = False        # claimed or discarded: a slot the thread opens afterwards is closed at once
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._claimed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardsafe-early-open", daemon=True)
        # Imported here, on the caller's thread (the trainer's main thread, as it starts), not in the daemon
        # thread: a module import racing the main thread's imports of the same packages is best avoided.
        self._mf = None
        if verify:
            from ..payload import manifest as mf
            self._mf = mf

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
                    # Verifying: the hash threads fill the page tables of their own segments (in parallel);
                    # mapping only: MAP_POPULATE fills them in one call.
                    slot = c.open_slot(rank=self.rank, version=max(versions), populate=not self.verify)
                else:
                    self.why = f"the holder has no sealed version of rank {self.rank}"
            finally:
                c.close()
        except HolderSecurityError as e:   # never used; the client logged a foreign holder, the directory is said here
            self.why = f"{type(e).__name__}: {e}"
            if not isinstance(e, ForeignHolder):
                log.error("[rank %d] early open: %s", self.rank, e)
        except (HolderFailure, OSError, ValueError, KeyError) as e:
            self.why = f"{type(e).__name__}: {e}"
        if slot is not None and self._mf is not None:
            t1 = time.perf_counter()
            buf = memoryview(slot.mm)
            try:
                self.problems = self._mf.verify(slot.manifest, buf, populate=True)
            except Exception as e:   # a malformed manifest, say: the restore verifies (and says so) itself
                self.problems = [f"{type(e).__name__}: {e}"]
            finally:
                buf.release()
            self.verify_seconds = time.perf_counter() - t1
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
        """Until the open (and verification) is done (or failed); False on timeout."""
        return self._done.wait(timeout)

    def claim(self, rank: int, version: int, held: OpenedSlot, *, wait_s: float = CONNECT_TIMEOUT_S + 60.0
              ) -> Optional[Claimed]:
        """The mapping if it is ``rank``'s ``version`` in the shared memory the restore's own open of it (``held``)
        maps, with whether its early verification holds for ``held`` (same manifest, same sealing); None
        otherwise. Waits for an open in progress. The mapping belongs to the caller from here; a second claim
        gets None."""
        self._claimed.set()
        self._done.wait(wait_s)
        with self._lock:
            slot, self._slot, self._spent = self._slot, None, True
        if slot is None:
            return None
        if rank != self.rank or version != self.version or held.ident != slot.ident:
            _close(slot.mm)
            self.why = (f"opened version {self.version} of rank {self.rank}, the restore wanted version {version} of "
                        f"rank {rank}" + ("" if version != self.version or rank != self.rank else
                                          " from other shared memory (the holder moved it)"))
            return None
        self._used = True
        if self.problems is None:
            self.verify_why = _MAP_ONLY
        elif self.problems:
            self.verify_why = f"the early verification found {len(self.problems)} problem(s); verified again"
        elif held.sealing <= 0 or held.sealing != slot.sealing:
            self.verify_why = (f"the slot was sealed again since (sealing {slot.sealing} -> {held.sealing}); verified "
                               "again")
        elif held.manifest != slot.manifest:
            self.verify_why = "the holder's manifest changed since the early open; verified again"
        else:
            self._verified_used = True
        return Claimed(slot.mm, self._verified_used)

    def discard(self) -> None:
        """Close the mapping unless claimed (idempotent)."""
        with self._lock:
            slot, self._slot, self._spent = self._slot, None, True
        self._claimed.set()
        if slot is not None:
            _close(slot.mm)

    def notes(self, restored: int) -> dict:
        """For the notes of a restore of version ``restored``: whether the early open (and its verification) served
        it and what it cost."""
        if self._used and restored == self.version:
            how = "used"
        elif self._used:
            how = (f"missed: opened version {self.version}, which was not restorable on every rank; version "
                   f"{restored} was restored")
        else:
            how = "missed: " + (self.why or f"opened version {self.version}, the restore chose version {restored}")
        verified = ("used" if self._verified_used and restored == self.version else
                    "missed: " + (self.verify_why or (_MAP_ONLY if not self.verify else how.removeprefix("missed: "))))
        return {"early_open": how, "early_open_version": self.version, "early_open_s": round(self.seconds, 6),
                "early_verify": verified, "early_verify_s": round(self.verify_seconds, 6)}


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:   # views of it still alive: closed when they go
        pass


_current: Optional[EarlyOpen] = None
_current_lock = threading.Lock()


def mode(environ: Mapping[str, str] = os.environ) -> str:
    """``verify`` (the default), ``map`` or ``off``, from ``SHARDSAFE_EARLY_OPEN``.

    Raises:
        ConfigError: another value (said with the ones accepted)."""
    v = env.get(ENV_EARLY_OPEN, environ).strip().lower()
    if v in ("0", "false", "off", "no"):
        return "off"
    if v == "map":
        return "map"
    if v in ("", "1", "true", "on", "yes", "verify"):
        return "verify"
    raise ConfigError(f"{ENV_EARLY_OPEN}={env.get(ENV_EARLY_OPEN, environ)!r}: expected 1 (map and verify, the default), "
                     "map (map only; the restore verifies) or 0 (off)")


def trainer_process(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether this process is a trainer and not a process one started with its environment: a DataLoader worker
    (spawn and forkserver re-import the main script, and DeepSpeed with it) or any subprocess that inherits its
    ``RANK``. Such a process must not open the rank's snapshot early (it would map the shard and keep its memory
    alive) nor protect an engine of the trainer's rank (its snapshots would overwrite the trainer's).

    The trainer says so in ``environ`` as it starts using shardsafe (:data:`ENV_TRAINER`: its pid, ``RANK`` and
    ``LOCAL_RANK``), and the processes it starts inherit that. A process that finds another pid there with its own
    ``RANK`` and ``LOCAL_RANK`` is one of them. One with other rank variables was started by a launcher for
    another rank (torch's ``mp.spawn``, Lightning's launcher) and is a trainer itself, as is the process that
    set it (an ``exec`` keeps the pid). shardsafe's launchers start trainers without the variable. A process
    without ``RANK`` (a single-process program) is not judged: True, and nothing is set."""
    if not environ.get("RANK"):
        return True
    ranks = f"{environ['RANK']}:{environ.get('LOCAL_RANK', '')}"
    pid, _, theirs = env.get(ENV_TRAINER, environ).partition(":")
    if pid and pid != str(os.getpid()) and theirs == ranks:
        return False
    environ[ENV_TRAINER] = f"{os.getpid()}:{ranks}"
    return True


def start(environ: MutableMapping[str, str] = os.environ) -> Optional[EarlyOpen]:
    """Start this process's early open, once, if the environment names a shardsafe job and a rank and this is the
    trainer process (:func:`trainer_process`); returns it (or the one already started, or None). A holder
    directory that is not private to this user is logged at ERROR and not used (the trainer's claim of its job id
    then fails with the same error)."""
    global _current
    job, rank = env.get(env.JOB_ID, environ), environ.get("RANK", "")
    try:
        how = mode(environ)
    except ConfigError as e:
        # A trainer's start is no place to fail over a speed setting: the strictest mode that still helps.
        log.error("%s; mapping only (the restore verifies)", e)
        how = "map"
    if not job or not rank.isdigit() or how == "off" or not trainer_process(environ):
        return None
    with _current_lock:
        if _current is None:
            try:
                paths = HolderPaths(default_holder_dir(environ), job, default_node_name(environ))
                if not paths.check_dir() or not os.path.exists(paths.socket):
                    return None   # no holder for this job on this node (a first start): nothing to open
            except (HolderSecurityError, ConfigError) as e:
                log.error("[rank %s] early open: %s", rank, e)
                return None
            _current = EarlyOpen(paths, int(rank), verify=how == "verify").start()
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
