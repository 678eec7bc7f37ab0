"""The holder's work off the request path: flushes of committed versions to the persistent tier, and scrubs
that re-verify sealed slots. Both read slots pinned under the holder's lock, so a slot being read is never
handed out for writing; a mixin of :class:`shardsafe.holder.server.Holder`, whose state (``ranks``, ``lock``,
``_unpin``, the stats and queues) it uses.
"""
from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from .protocol import HolderError, req_int, req_scope

if TYPE_CHECKING:
    from .slots import Slot

log = logging.getLogger(__name__)


class BackgroundWork:
    # ---- persistent tier --------------------------------------------------------------------------
    def flush(self, req: dict) -> dict:
        """Queue a committed version for the disk (returns at once; the flush thread writes it)."""
        rank, version, scope = req_int(req, "rank", minimum=0), req_int(req, "version"), req_scope(req)
        for key in ("dir", "job_id"):
            if not isinstance(req.get(key), str) or not req[key]:
                raise HolderError("bad_request", f"flush needs a non-empty string {key!r}, got {str(req.get(key))[:60]!r}")
        keep = req_int(req, "keep", minimum=0) if "keep" in req else 0
        mbps = req.get("mbps") or 0
        if not isinstance(mbps, (int, float)) or isinstance(mbps, bool) or not math.isfinite(mbps) or mbps < 0:
            raise HolderError("bad_request", f"flush: 'mbps' must be a number >= 0 (0 = uncapped), got {str(mbps)[:60]!r}")
        with self.lock:
            s = self._find((scope, rank), "data", version, ("sealed",))
            if not s.committed:
                raise HolderError("state", f"version {version} of rank {rank} is not committed: only committed "
                                           "versions are flushed")
            s.pins += 1
            self._flush_pending += 1
            man, nbytes = s.manifest, s.nbytes   # as sealed: a drop while flushing clears the slot's fields
        self._flush_q.put({**req, "rank": rank, "scope": scope, "version": version, "keep": keep, "mbps": float(mbps), "_slot": s,
                           "_manifest": man, "_nbytes": nbytes})
        return {"queued": True}

    def _flush_loop(self) -> None:
        from shardsafe.persist import PersistentStore, PersistError
        while True:
            job = self._flush_q.get()
            if job is None:
                return
            s: Slot = job["_slot"]
            store = PersistentStore(job["dir"], job["job_id"])
            try:
                mv = memoryview(s.seg.map)[: job["_nbytes"]]
                try:
                    secs = store.write(version=job["version"], rank=job["rank"], payload=mv, manifest=job["_manifest"],
                                       mbps=float(job.get("mbps") or 0), on_progress=self._flush_progress(job["version"]))
                finally:
                    mv.release()
                ws = job["_manifest"].get("world_size") if isinstance(job["_manifest"], dict) else None
                store.prune(job["rank"], int(job.get("keep") or 0),
                            world_size=ws if isinstance(ws, int) and ws > 0 else None)
                self.flush_stats["done"] += 1
                self.flush_stats["bytes"] += job["_nbytes"]
                self._emit("flush", version=job["version"], seconds=secs, bytes=job["_nbytes"], rank=job["rank"], ok=True)
            except Exception as e:   # PersistError, OSError, or a bug: the flush thread must not die
                if not isinstance(e, (PersistError, OSError)):
                    log.exception("flush of version %s rank %s failed", job["version"], job["rank"])
                self.flush_stats["failed"] += 1
                self.flush_stats["last_error"] = str(e)
                log.error("%s", e)
                self._emit("flush", version=job["version"], seconds=0.0, bytes=0, rank=job["rank"], ok=False,
                           error=str(e)[:500])
            finally:
                with self.lock:
                    self._unpin((job["scope"], job["rank"]), "data", s)
                    self._flush_pending -= 1
                    self._last_activity = time.monotonic()   # the idle exit counts from the last flush's end

    def _flush_progress(self, version: int):
        """The kill-flush fault's hook for writing ``version`` (None: no fault there)."""
        f = self._flush_fault
        if f is None or f.step != version:
            return None

        def progress(fraction: float) -> None:
            if fraction >= 0.5:
                from shardsafe.faults import kill_self_in_flush
                kill_self_in_flush(f, self._run_dir, version)
        return progress

    # ---- scrubbing --------------------------------------------------------------------------------
    def scrub(self, req: dict | None = None) -> dict:
        """Re-verify every sealed slot's checksums; a bad one becomes ``corrupt`` (never listed or
        opened again, so restore rebuilds that rank from parity or falls back a tier)."""
        from shardsafe.payload import manifest as mf
        with self.lock:
            todo = [(key, k, s, s.version) for key, e in self.ranks.items() for k, lst in e.slots.items() for s in lst
                    if s.state == "sealed" and s.manifest is not None]
        bad, checked = [], 0
        try:
            for key, kind, s, version in todo:
                # One slot pinned at a time, for as long as its hash takes: pinning them all for the whole
                # scrub made every snapshot in that window need an extra slot (or be skipped).
                with self.lock:
                    if s.state != "sealed" or s.version != version or s.manifest is None or s.doomed:
                        continue     # rewritten or dropped since the list was taken
                    s.pins += 1
                    man = s.manifest      # a drop or rewrite meanwhile clears the slot's, not this one
                try:
                    mv = memoryview(s.seg.map)
                    try:
                        problems = mf.verify_any(man, mv)
                    finally:
                        mv.release()
                    checked += 1
                    with self.lock:
                        s.scrubbed_at = time.time()
                        if problems and s.state == "sealed":
                            s.state, s.committed = "corrupt", False
                            ent = self.ranks[key]
                            scope, rank = key
                            ent.last_committed[kind] = max([x.version for x in ent.slots[kind] if x.committed],
                                                           default=-1)
                            bad.append({"rank": rank, "kind": kind, "version": s.version, "problems": problems[:5],
                                        **({"scope": scope} if scope else {})})
                            log.error("scrub: rank %d %s version %d is corrupt (%s): marked unusable; restore will "
                                      "rebuild it from parity or use another tier", rank, kind, s.version,
                                      "; ".join(problems[:3]))
                            self._emit("scrub_failed", rank=rank, slot_kind=kind, version=s.version,
                                       problems=problems[:5])
                finally:
                    with self.lock:
                        self._unpin(key, kind, s)
        finally:
            self.scrub_stats["runs"] += 1
            self.scrub_stats["slots"] += checked
            self.scrub_stats["corrupt"] += len(bad)
            self.scrub_stats["last"] = time.time()
        return {"checked": checked, "corrupt": bad}

    def _scrub_loop(self) -> None:
        while not self._stop.wait(self.scrub_interval_s):
            try:
                self.scrub()
            except Exception:   # a scrub problem must never take the holder down
                log.exception("scrub failed")
