"""Asynchronous snapshot pipeline: rank state -> holder slot, checksummed, sealed, agreed, committed.

One background worker per rank processes snapshot jobs in order:
  acquire slot -> copy tensors (CPU: in this thread, each segment hashed as it is copied, from the cache,
  where the fused kernel is built; GPU: D2H on a side stream into cudaHostRegister'ed shared memory) ->
  xxh3 per segment on the hash threads, each batch of segments as soon as it has landed (beside the rest
  of the copy; the CPU copy too when it is not fused) -> [copied] -> seal with manifest
  -> agreement (all ranks sealed?) -> commit.
The training loop only waits for [copied] before the next optimizer step mutates the state;
that wait (and waiting for a previous job still in flight) is the *stall*, recorded per version.
Every due version goes through agreement on every rank, even when this rank's copy failed
(it votes "not ok"): the background collectives stay aligned across ranks, and a failed
snapshot never takes training down.
"""
from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from ..collectives import min_reduce
from ..errors import DeviceError
from ..faults import PHASE_COMMIT, PHASE_VOTE
from ..holder.client import HolderClient, HolderUnavailable
from ..holder.protocol import HolderError, HolderFailure
from ..payload import checksum
from ..payload import manifest as mf
from ..protection import Cause, bits_to_causes, causes_to_bits
from .state import RankState

log = logging.getLogger(__name__)


class Agreement(Protocol):
    def vote(self, version: int, ok: bool, causes: int = 0, standing: int = 0) -> tuple[bool, int, int]:
        """(every rank voted ok for the same version, the union of every rank's ``causes`` bits, the union of every
        rank's ``standing`` bits). Causes say why a rank could not complete this version, standing causes why it
        cannot be protected at all for now (shardsafe.protection.CAUSE_BITS). A collective: all ranks call it in
        order."""


def _union_bits(values: list[int]) -> int:
    """The bits set anywhere, from a min-reduce of "not set" flags (0 where any rank has the bit)."""
    return sum(1 << i for i, b in enumerate(values) if b == 0)


def _not_set(bits: int) -> list[int]:
    return [0 if bits & (1 << i) else 1 for i in range(len(Cause))]


class GlooAgreement:
    """Votes over shardsafe's own gloo groups (a :class:`shardsafe.hierarchy.Hierarchy` in a job: node-local, then
    the node leaders), used only by snapshot workers (off the training path)."""

    def __init__(self, group=None):
        self.group = group

    def rebuild(self, generation: int) -> None:
        """A failed vote left the groups unusable: build them again under ``generation`` (lazily, at the next vote).
        A plain torch process group cannot be rebuilt (tests' one-group setups): it is kept."""
        if hasattr(self.group, "rebuild"):
            self.group.rebuild(generation)

    def vote(self, version: int, ok: bool, causes: int = 0, standing: int = 0) -> tuple[bool, int, int]:
        # One min-reduce: the flag, the version both ways (every rank voted on the same one), and per cause bit a
        # 0 where any rank has it (the minimum of "not set"), for this version's causes and for standing ones.
        n = len(Cause)
        got = min_reduce([1 if ok else 0, version, -version, *_not_set(causes), *_not_set(standing)], self.group)
        flag, lo, neg_hi = got[:3]
        return (flag == 1 and lo == version and -neg_hi == version, _union_bits(got[3:3 + n]),
                _union_bits(got[3 + n:]))


class LocalAgreement:
    """Single-rank jobs: my vote is the decision."""

    def rebuild(self, generation: int) -> None:
        pass

    def vote(self, version: int, ok: bool, causes: int = 0, standing: int = 0) -> tuple[bool, int, int]:
        return ok, causes, standing


@dataclass
class SnapshotStats:
    version: int
    nbytes: int = 0
    stall_s: float = 0.0
    copy_s: float = 0.0
    hash_s: float = 0.0
    parity_s: float = 0.0
    vote_s: float = 0.0      # the commit vote (a collective over every rank)
    parity_phases: dict = field(default_factory=dict)
    committed: bool = False
    error: str = ""
    causes: dict = field(default_factory=dict)   # Cause -> detail: why this version did not commit (this rank's view)


@dataclass
class _Job:
    version: int
    state: RankState
    entries: list
    nbytes: int
    copied: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    cuda_ready: Any = None      # torch.cuda.Event recorded on the compute stream at submit
    cuda_done: Any = None       # torch.cuda.Event recorded on the side stream after the copies
    stats: SnapshotStats = None  # type: ignore[assignment]


@dataclass
class PipelineHooks:
    """What the pipeline calls back into, all optional: the TOR event log, the fault injector, the runtime's holder
    reconnect and its flush to the persistent tier."""

    on_event: Callable[..., None] = lambda kind, **f: None
    """``on_event(kind, **fields)`` for the TOR log."""
    on_phase: Callable[[str, int], None] = lambda name, version: None
    """``on_phase(name, version)`` at :data:`PHASE_VOTE` and :data:`PHASE_COMMIT` (shardsafe.faults)."""
    on_progress: Optional[Callable[[int, float], None]] = None
    """``on_progress(version, fraction_copied)`` while a copy runs (shardsafe.faults' kill-copy)."""
    reconnect: Optional[Callable[[], HolderClient]] = None
    """A new connection once the old one broke (the runtime's: the node's first rank starts a new holder)."""
    flush: Optional[Callable[[int], None]] = None
    """Called with each committed version; the runtime decides which go to disk."""


class SnapshotPipeline:
    """Args:
        client: connection to this node's holder (or None: every snapshot is skipped with a reason).
        rank, world_size, node: identity written into manifests.
        agreement: how ranks agree that a version is complete everywhere.
        parity: the parity exchange (shardsafe.parity.exchange.ParityExchange) or None.
        hasher: the checksum threads (default: the process's shared ones).
        interval: the snapshot interval (steps): a failed vote's backoff counts in it.
        hooks: what the pipeline calls back into (:class:`PipelineHooks`).
    """

    def __init__(self, client: Optional[HolderClient], *, rank: int, world_size: int, node: str,
                 agreement: Agreement, parity: Any = None, hasher: Any = None, interval: int = 1,
                 hooks: Optional[PipelineHooks] = None):
        self.client = client
        # Checksums are computed on these threads (off the GIL) while the copy goes on: shardsafe/payload/checksum.py.
        self.hasher = hasher if hasher is not None else checksum.shared()
        self.rank, self.world_size, self.node = rank, world_size, node
        self.agreement = agreement
        self.hooks = hooks or PipelineHooks()
        self.parity = parity
        self.history: list[SnapshotStats] = []
        # Every second the training loop spent blocked here (submit + wait_copied), for loops that time their
        # iterations: an iteration's `seconds` excludes the stall (docs/tor.md), which is reported apart.
        self.stall_total_s = 0.0
        self.last_committed = -1
        # The timeline (branch) id written into every manifest; set by the runtime after its restore vote.
        self.timeline = 0
        # The run's fingerprint (shardsafe/fingerprint.py), set by the runtime before its restore, and the command
        # that took the snapshots: both in every manifest (a restore names when and by what a version was taken).
        self.fingerprint: Optional[dict] = None
        # This rank's parallel coordinates ({"dp", "tp", "pp"}), set by the runtime: a restore at another
        # data-parallel size finds which model-parallel slice, and which place in it, each held snapshot is.
        self.coords: Optional[dict] = None
        self._command = " ".join(sys.argv)[:300]
        self._q: "queue.Queue[_Job | None]" = queue.Queue()
        self._inflight: Optional[_Job] = None
        # After a failed vote: its groups are rebuilt, and the next versions (fewer than `interval` * 2^(k-1) steps
        # after the k-th failure in a row) skip the vote on every rank alike, so a rank that keeps failing does not
        # stall the others one timeout per snapshot. Every rank derives the same numbers from the failed version.
        self.interval = interval
        self._vote_failures = 0
        self._vote_retry_at = -1
        self._warned: set[str] = set()
        # Why recent versions did not commit, for the runtime's protection state (shardsafe.protection): this rank's
        # own failures and the other ranks' causes the vote carried. Taken (and cleared) by take_causes().
        self._causes: dict[Cause, str] = {}
        self._causes_lock = threading.Lock()
        # Causes that keep this rank unprotected until they change (its holder cannot keep two versions of the node's
        # ranks), and every rank's standing causes as the newest vote said (Cause -> detail; replaced each vote).
        self.standing: dict[Cause, str] = {}
        self.standing_everywhere: dict[Cause, str] = {}
        self._reserved = 0   # bytes per version this rank told its holder it takes
        self._side_stream = None
        self._registered: set[int] = set()
        self.abandoned = False   # set by abandon(): nothing more is exchanged, voted on or committed
        self._abandoned_job: Optional[_Job] = None
        self._worker = threading.Thread(target=self._run, name=f"shardsafe-snapshot-r{rank}", daemon=True)
        self._worker.start()

    # ---- training-loop side -----------------------------------------------------------------------
    def submit(self, version: int, state: RankState) -> None:
        """Queue a snapshot of ``state`` (live tensors) for ``version``. Waits for a previous job still in flight."""
        t0 = time.perf_counter()
        prev = self._inflight
        if prev is not None:
            # A previous snapshot still in flight blocks this one: that wait is its stall too.
            prev.done.wait()
            dt = time.perf_counter() - t0
            prev.stats.stall_s += dt
            self.stall_total_s += dt
            self._report(prev)
        t0 = time.perf_counter()
        tensors = {n: (t.detach() if t.is_contiguous() else t.detach().contiguous()) for n, t in state.tensors.items()}
        entries, nbytes = mf.layout(tensors)
        job = _Job(version, RankState(tensors, state.meta), entries, nbytes, stats=SnapshotStats(version, nbytes))
        if any(t.is_cuda for t in tensors.values()):
            job.cuda_ready = torch.cuda.Event()
            job.cuda_ready.record()
        dt = time.perf_counter() - t0
        job.stats.stall_s += dt
        self.stall_total_s += dt
        self._inflight = job
        self._q.put(job)

    def wait_copied(self) -> float:
        """Block until the in-flight copy no longer needs the live tensors; return the seconds blocked."""
        job = self._inflight
        if job is None or job.copied.is_set() and job.cuda_done is None:
            return 0.0
        t0 = time.perf_counter()
        job.copied.wait()
        if job.cuda_done is not None:
            # GPU: the next optimizer step's kernels wait for the D2H copy on the device, not the CPU.
            torch.cuda.current_stream().wait_event(job.cuda_done)
            job.cuda_done = None
        dt = time.perf_counter() - t0
        job.stats.stall_s += dt
        self.stall_total_s += dt
        return dt

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued snapshot is sealed/agreed; True if the last one committed."""
        job = self._inflight
        if job is None:
            return True
        job.done.wait(timeout)
        return job.stats.committed

    def close(self) -> None:
        self.flush()
        if self._inflight is not None:
            self._report(self._inflight)
            self._inflight = None
        self._q.put(None)
        self._worker.join(timeout=10)

    def abandon(self) -> None:
        """A restart in place: the snapshot in flight goes no further than its copy (no parity, vote or commit) and
        the worker stops after it. :meth:`join` waits for that."""
        self.abandoned = True
        self._abandoned_job, self._inflight = self._inflight, None
        # Dropped at once: a group nobody refers to any more is destroyed, and its closed sockets fail the peers
        # still waiting on it (a worker stuck in a collective keeps its own reference until that fails). No more
        # events, and no reconnect: the process goes on with another runtime.
        self.agreement, self.parity, self.hooks = None, None, PipelineHooks()
        self._q.put(None)

    def wait_abandoned_copy(self, timeout: float) -> bool:
        """After :meth:`abandon`: wait until the abandoned snapshot's copy into holder memory is over (it is local
        and bounded); True if it is (or there was none)."""
        job, deadline = self._abandoned_job, time.monotonic() + timeout
        # A job the restart signal caught inside submit() may never have reached the worker: once the worker is gone,
        # nothing copies.
        while job is not None and not job.copied.wait(0.05) and self._worker.is_alive():
            if time.monotonic() > deadline:
                return False
        if self._side_stream is not None or self._registered:
            # GPU: the D2H copy may still run on the side stream, and DMA lands in the pinned pages whatever the
            # mapping says; then CUDA must forget the registrations of mappings that are about to change.
            torch.cuda.synchronize()
            if self._registered and self.client is not None:
                cudart = torch.cuda.cudart()
                for slot, m in self.client.mapped_slots().items():
                    if slot in self._registered:
                        cudart.cudaHostUnregister(torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr())
                self._registered.clear()
        return True

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the worker to stop; True if it did."""
        self._worker.join(timeout)
        return not self._worker.is_alive()

    def take_causes(self) -> dict:
        """Causes reported since the last call (Cause -> detail)."""
        with self._causes_lock:
            out, self._causes = self._causes, {}
        return out

    def _note(self, job: _Job, cause: Cause, detail: str) -> None:
        job.stats.causes[cause] = detail
        with self._causes_lock:
            self._causes[cause] = detail

    def _report(self, job: _Job) -> None:
        st = job.stats
        self.hooks.on_event("snapshot", version=st.version, stall_s=st.stall_s, copy_s=st.copy_s, hash_s=st.hash_s,
                      parity_s=st.parity_s, vote_s=st.vote_s, parity_phases=st.parity_phases, bytes=st.nbytes, committed=st.committed,
                      **({"error": st.error[:500]} if st.error else {}))

    # ---- worker side ------------------------------------------------------------------------------
    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("[rank %d] %s", self.rank, msg)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                self._process(job)
            except BaseException as e:  # never let the worker die silently: training must go on
                job.stats.error = job.stats.error or f"{type(e).__name__}: {e}"
                log.exception("[rank %d] snapshot %d failed", self.rank, job.version)
            finally:
                job.copied.set()
                job.done.set()
                self.history.append(job.stats)

    def _process(self, job: _Job) -> None:
        ok, man, mm = False, None, None
        if self.abandoned:
            job.copied.set()
            return
        if job.version < self._vote_retry_at:
            job.stats.error = f"the commit vote failed; its group is rebuilt and voting resumes at version {self._vote_retry_at}"
            self._note(job, Cause.VOTE, f"rank {self.rank}: {job.stats.error}")
            job.copied.set()
            return
        try:
            man, mm = self._write(job)
            ok = True
        except (HolderFailure, OSError, RuntimeError) as e:
            job.stats.error = str(e)
            budget = isinstance(e, HolderError) and e.code == "budget"
            key = "budget" if budget else type(e).__name__
            self._note(job, Cause.BUDGET if budget else Cause.NO_HOLDER if isinstance(e, HolderUnavailable)
                       else Cause.SNAPSHOT, f"rank {self.rank}: {e}"[:500])
            self._warn_once(key, f"snapshot {job.version} skipped, training continues: {e}")
            self.hooks.on_event("snapshot_skipped", version=job.version, reason=str(e)[:500])
        finally:
            job.copied.set()
        if self.abandoned:
            return
        try:
            if self.parity is not None:
                # Every member of the parity group takes part, also after a failed write (it votes no).
                t0 = time.perf_counter()
                pok = self.parity.encode(version=job.version, client=self.client, data_mm=mm, data_manifest=man, ok=ok)
                job.stats.parity_s = time.perf_counter() - t0
                job.stats.parity_phases = dict(getattr(self.parity, "timings", {}) or {})
                if ok and not pok:
                    job.stats.error = f"parity not stored: {self.parity.last_error}"
                    self._note(job, Cause.PARITY, f"rank {self.rank}: {self.parity.last_error}"[:500])
                    self._warn_once("parity", f"snapshot {job.version} not protected by parity, not committed: "
                                              f"{self.parity.last_error}")
                ok = ok and pok
            if self.abandoned:
                return
            self.hooks.on_phase(PHASE_VOTE, job.version)
            t0 = time.perf_counter()
            agreed, union, standing = self.agreement.vote(job.version, ok, causes_to_bits(job.stats.causes),
                                                          causes_to_bits(self.standing))
            job.stats.vote_s = time.perf_counter() - t0
            self.standing_everywhere = {c: self.standing.get(c, f"another rank: {c.value}")
                                        for c in bits_to_causes(standing)}
        except Exception as e:   # a failed vote (peer gone, gloo timeout) never ends training, nor protection
            self._vote_failed(job, e)
            return
        self._vote_failures = 0
        if not agreed:
            if ok:
                job.stats.error = "another rank could not complete this version"
            for c in bits_to_causes(union) - set(job.stats.causes):
                self._note(job, c, f"another rank reported {c.value} for version {job.version}")
            if not union:
                self._note(job, Cause.STALE, f"version {job.version} did not commit on every rank")
            return
        if self.abandoned:
            return
        self.hooks.on_phase(PHASE_COMMIT, job.version)
        try:
            self.client.commit(ranks=[self.rank], version=job.version)
            if self.parity is not None:
                self.client.commit(ranks=[self.rank], version=job.version, kind="parity")
            job.stats.committed = True
            self.last_committed = job.version
        except HolderFailure as e:
            job.stats.error = f"commit failed: {e}"
            self._warn_once("commit", f"commit of snapshot {job.version} failed: {e}")
            return
        if self.hooks.flush is not None:
            try:
                self.hooks.flush(job.version)
            except HolderFailure as e:
                self._warn_once("flush", f"flush of snapshot {job.version} to disk not queued: {e}")

    MAX_VOTE_BACKOFF = 64   # snapshots skipped at most after repeated failed votes

    def _vote_failed(self, job: _Job, e: BaseException) -> None:
        """Rebuild the vote's and the parity exchange's groups under the failed version (the same on every rank),
        and skip the vote for a while that doubles with each failure in a row."""
        if self.abandoned:   # its groups are gone for good: nothing to rebuild
            job.stats.error = f"abandoned for a restart in place: {e}"
            return
        self._vote_failures += 1
        backoff = min(1 << (self._vote_failures - 1), self.MAX_VOTE_BACKOFF)
        self._vote_retry_at = job.version + backoff * self.interval
        job.stats.error = f"agreement failed: {e}"
        self._note(job, Cause.VOTE, f"rank {self.rank}: the commit vote of version {job.version} failed ({e}); "
                                    f"retried at version {self._vote_retry_at}"[:500])
        log.warning("[rank %d] the commit vote of snapshot %d failed (%s); its group is rebuilt and the vote retried at "
                    "version %d (failure %d in a row)", self.rank, job.version, str(e)[:300], self._vote_retry_at,
                    self._vote_failures)
        try:
            self.agreement.rebuild(job.version)
            if self.parity is not None and hasattr(self.parity, "rebuild_groups"):
                self.parity.rebuild_groups(job.version)
        except Exception as err:  # noqa: BLE001 - the next vote fails again and backs off further
            log.warning("[rank %d] rebuilding the vote's groups failed: %s", self.rank, err)

    def _ensure_client(self) -> HolderClient:
        if self.client is not None and self.client.connected:
            return self.client
        if self.hooks.reconnect is not None:
            try:
                fresh = self.hooks.reconnect()   # the runtime's: the node's first rank starts a new holder if none runs
            except HolderUnavailable as e:
                raise HolderUnavailable(f"holder for node {self.node!r} is gone: snapshots skipped, training continues "
                                        f"({e})") from None
            self._forget_client(self.client)
            self.client = fresh
            return fresh
        raise HolderUnavailable(f"no holder for node {self.node!r}: snapshots skipped, training continues")

    def _forget_client(self, old: Optional[HolderClient]) -> None:
        """Let go of a broken connection's mappings: they keep a killed holder's memory alive, and a new
        holder numbers its slots from 1 again, so CUDA registrations by slot id would point at old memory."""
        if old is None:
            return
        if self._registered:
            cudart = torch.cuda.cudart()
            for slot, m in old.mapped_slots().items():
                if slot in self._registered:
                    cudart.cudaHostUnregister(torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr())
            self._registered.clear()
        old.close()

    def _reserve(self, client: HolderClient, want: int) -> None:
        """Tell the holder what one version of this rank takes, when that grows (the first snapshot): a holder that
        cannot keep two versions of every rank of its node makes this rank unprotected (standing, said by the vote
        to every rank) although the first version may still fit."""
        from ..holder.segments import round_size
        share = 0 if self.parity is None else self.parity.group.m * self.parity.group.chunk_size(want)
        per_version = round_size(want) + (round_size(share) if share else 0)
        if per_version <= self._reserved:
            return
        try:
            client.reserve(rank=self.rank, nbytes=per_version)
            self._reserved = per_version
            self.standing.pop(Cause.BUDGET, None)
        except HolderError as e:
            if e.code != "budget":
                raise
            self.standing[Cause.BUDGET] = f"rank {self.rank}: {e}"[:500]
            self._warn_once("reserve", f"NOT protected: {e}")

    def _write(self, job: _Job) -> tuple[dict, Any]:
        client = self._ensure_client()
        want = job.nbytes if self.parity is None else max(job.nbytes, self.parity.padded_nbytes(job.nbytes))
        self._reserve(client, want)
        slot, mm = client.acquire(rank=self.rank, version=job.version, nbytes=want)
        t0 = time.perf_counter()
        dst_all = torch.frombuffer(mm, dtype=torch.uint8, count=job.nbytes) if job.nbytes else torch.empty(0, dtype=torch.uint8)
        buf, pending = memoryview(mm), []
        try:
            if job.cuda_ready is not None:
                self._copy_cuda(job, slot, mm, dst_all, buf, pending)
            else:
                self._copy_cpu(job, dst_all, buf, pending)
            job.stats.copy_s = time.perf_counter() - t0
            job.copied.set()
            t1 = time.perf_counter()
            for e in job.entries:
                e["xxh3"] = []
            for i, fut in pending:   # in copy order: an entry's batches come in sequence
                job.entries[i]["xxh3"].extend(fut.result())
            # what hashing added after the last byte landed (it runs beside the copy)
            job.stats.hash_s = time.perf_counter() - t1
        finally:
            for _, fut in pending:   # a failed copy: the hash threads must let go of the slot before it is released
                fut.exception()
            buf.release()
        man = mf.build(version=job.version, rank=self.rank, world_size=self.world_size, node=self.node,
                       entries=job.entries, payload_nbytes=job.nbytes, meta=mf.to_jsonable(job.state.meta),
                       extra={"timeline": self.timeline, "command": self._command,
                              **({"fingerprint": self.fingerprint} if self.fingerprint else {}),
                              **({"coords": self.coords} if self.coords else {})})
        if not self.abandoned:   # a version abandoned for a restart in place is never sealed
            client.seal(rank=self.rank, version=job.version, manifest=man)
        return man, mm

    HASH_BATCH = 8   # segments (of CHUNK_BYTES) per hand-over to the hash threads: 32 MiB

    def _copy_cpu(self, job: _Job, dst_all: torch.Tensor, buf: memoryview, pending: list) -> None:
        """Copy segment by segment: ``pending`` gets (entry index, future of the digests of its segments).

        Where the fused kernel is built (checksum.fused_available), each segment is copied and hashed in one
        pass on this thread, every piece hashed from the cache right after it landed, so the hash adds no DRAM
        traffic and needs no core of its own. Otherwise the segments that have landed go to the hash threads
        in batches of ``HASH_BATCH`` while the copy goes on."""
        total, done, fused = max(job.nbytes, 1), 0, checksum.fused_available()
        base = dst_all.data_ptr()
        for i, (e, t) in enumerate(zip(job.entries, job.state.tensors.values())):
            src = t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)
            n, off, landed, digests = e["nbytes"], e["offset"], [], []
            for a in range(0, n, mf.CHUNK_BYTES):
                b = min(a + mf.CHUNK_BYTES, n)
                if fused:
                    digests += checksum.copy_and_hash(base + off + a, src.data_ptr() + a, b - a, mf.CHUNK_BYTES)
                else:
                    dst_all[off + a: off + b].copy_(src[a:b])
                    landed.append((off + a, off + b))
                    if len(landed) == self.HASH_BATCH:
                        pending.append((i, self.hasher.submit(buf, landed)))
                        landed = []
                done += b - a
                if self.hooks.on_progress is not None:
                    self.hooks.on_progress(job.version, done / total)
            if landed:
                pending.append((i, self.hasher.submit(buf, landed)))
            if digests:
                ready: Future = Future()
                ready.set_result(digests)
                pending.append((i, ready))

    def _copy_cuda(self, job: _Job, slot: int, mm, dst_all: torch.Tensor, buf: memoryview, pending: list) -> None:
        """Queue every entry's D2H copy on the side stream in batches of ``HASH_BATCH`` segments, an event
        after each batch; then hand each batch to the hash threads as soon as its event says it landed, so
        the checksums run beside the rest of the DMA instead of after it (``pending`` as in ``_copy_cpu``)."""
        # Pinning makes the D2H copy a true async DMA; register each reused slot mapping once.
        if slot not in self._registered:
            cudart = torch.cuda.cudart()
            rc = cudart.cudaHostRegister(dst_all.data_ptr(), len(mm), 0)
            code = int(getattr(rc, "value", rc))
            if code != 0:
                raise DeviceError(f"cudaHostRegister of the {len(mm)}-byte holder slot failed (cudaError {code})")
            self._registered.add(slot)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        batches = []   # (entry index, segments, event recorded after their copy)
        with torch.cuda.stream(self._side_stream):
            self._side_stream.wait_event(job.cuda_ready)
            for i, (e, t) in enumerate(zip(job.entries, job.state.tensors.values())):
                src = t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)
                segs = list(mf.chunk_ranges(e))
                for k in range(0, len(segs), self.HASH_BATCH):
                    group = segs[k:k + self.HASH_BATCH]
                    a, b = group[0][0] - e["offset"], group[-1][1] - e["offset"]
                    dst_all[e["offset"] + a: e["offset"] + b].copy_(src[a:b], non_blocking=src.is_cuda)
                    landed = torch.cuda.Event()
                    landed.record(self._side_stream)
                    batches.append((i, group, landed))
            done = torch.cuda.Event()
            done.record(self._side_stream)
        job.cuda_done = done
        job.copied.set()        # the main thread can now make its stream wait on cuda_done
        for i, group, landed in batches:   # the worker needs a batch's bytes before hashing them
            landed.synchronize()
            pending.append((i, self.hasher.submit(buf, group)))
        done.synchronize()
        if self.hooks.on_progress is not None:
            self.hooks.on_progress(job.version, 1.0)
