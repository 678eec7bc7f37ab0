"""The persistent tier: committed snapshot versions on disk, written by holders off the training path.

Layout (one directory per run; a version is complete when every rank's manifest is there)::

    PERSIST_DIR/RUN_NAME/v000000000120/rank000003.bin    payload bytes (as in holder memory)
    PERSIST_DIR/RUN_NAME/v000000000120/rank000003.json   the rank's manifest (checksums, layout, meta)

RUN_NAME is ``shardsafe.run_name`` (SHARDSAFE_RUN_NAME; the sbatch scripts' SS_RUN_NAME), else the job id; a
program with several protected engines adds one directory per engine (``RUN_NAME/engine1``). The directory
is keyed by the run, not the job id, because the job id changes with every SLURM requeue
(``SLURM_RESTART_COUNT``) and resubmission (``SLURM_JOB_ID``) while the disk tier must outlive both: a
requeued or resubmitted job starts with empty holders and restores from here (docs/slurm.md).

Each file is written under a temporary name, fsynced and renamed, the manifest last, then the
directory is fsynced: a rank's files are either complete or absent. Restore verifies every xxh3
segment again before anything is loaded.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import time
from dataclasses import dataclass
from typing import Callable

from .errors import ShardsafeError

log = logging.getLogger(__name__)
CHUNK = 8 << 20


class PersistError(OSError, ShardsafeError):
    """A flush or a read of the persistent tier failed; the message names the path and what to do."""


@dataclass(frozen=True)
class PersistentStore:
    """Args:
        root: the persistent directory (``shardsafe.persist_dir``).
        job_id: the run's directory under it: the run name (``ShardsafeConfig.persist_name``), with ``/SCOPE`` for
            a program's second and later engines.
    """
    root: str
    job_id: str

    @property
    def dir(self) -> str:
        return os.path.join(self.root, self.job_id)

    def version_dir(self, version: int) -> str:
        return os.path.join(self.dir, f"v{version:012d}")

    def paths(self, version: int, rank: int) -> tuple[str, str]:
        base = os.path.join(self.version_dir(version), f"rank{rank:06d}")
        return base + ".bin", base + ".json"

    def versions(self) -> list[int]:
        try:
            names = os.listdir(self.dir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(int(n[1:]) for n in names if n.startswith("v") and n[1:].isdigit())

    def rank_versions(self, rank: int) -> list[int]:
        """Versions whose files for ``rank`` are complete (the manifest lands last)."""
        return [v for v in self.versions() if all(os.path.exists(p) for p in self.paths(v, rank))]

    # ---- write (holder side) ------------------------------------------------------------------------
    def write(self, *, version: int, rank: int, payload: memoryview, manifest: dict, mbps: float = 0.0,
              on_progress: Callable[[float], None] | None = None) -> float:
        """Write one rank's payload and manifest durably; return the seconds it took. ``on_progress`` is told
        the payload's written fraction after each chunk (fault injection: a flush torn halfway)."""
        t0 = time.perf_counter()
        vdir = self.version_dir(version)
        try:
            bin_path, json_path = self.paths(version, rank)
            for attempt in range(3):
                os.makedirs(vdir, mode=0o700, exist_ok=True)
                try:
                    _write_file(bin_path, payload, mbps, on_progress=on_progress)
                    break
                except FileNotFoundError:
                    # Another rank's holder pruned this (older) version and removed its directory, empty
                    # between our makedirs and our first file: make it again. Our own files never vanish
                    # (prune removes only its own rank's), so a second miss is something else.
                    if attempt == 2 or os.path.isdir(vdir):
                        raise
            _write_file(json_path, memoryview(json.dumps(manifest).encode()), 0.0)
            fd = os.open(vdir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise PersistError(e.errno, f"flush of version {version} rank {rank} to {vdir} failed: {e.strerror or e}. "
                                        "Check that shardsafe.persist_dir exists, is writable and has space; "
                                        "training and the memory tiers are unaffected") from None
        return time.perf_counter() - t0

    def complete_versions(self, world_size: int) -> list[int]:
        """Versions whose files are complete for every one of ``world_size`` ranks."""
        return [v for v in self.versions() if all(os.path.exists(self.paths(v, r)[1]) for r in range(world_size))]

    def prune(self, rank: int, keep: int, world_size: int | None = None) -> list[int]:
        """Remove this rank's files of all but its newest ``keep`` versions, and its leftovers of a torn flush
        (a holder killed mid-write: a ``.tmp``, or a payload without its manifest) below its newest complete
        version; drop empty dirs. With ``world_size`` nothing at or above the newest version complete on every rank
        is removed: ranks flush on their own, and a rank whose holder died mid-flush lags behind, so its peers
        pruning by their own count alone could delete the only version all ranks have. Returns the complete
        versions removed."""
        mine = self.rank_versions(rank)
        floor = None
        if world_size:
            common = self.complete_versions(world_size)
            floor = max(common) if common else -1
        gone = [v for v in (mine[:-keep] if keep > 0 else []) if floor is None or v < floor]
        # a flush is never resumed (flushes of a rank go in version order): a torn one below this rank's newest
        # complete version stays torn
        torn = [v for v in self.versions() if v not in mine and mine and v < max(mine)
                and (floor is None or v < floor)]
        for v in gone + torn:
            for p in self.paths(v, rank):
                for q in (p, p + ".tmp"):
                    try:
                        os.unlink(q)
                    except FileNotFoundError:
                        pass
            try:
                os.rmdir(self.version_dir(v))
            except OSError:
                pass   # other ranks' files are still there
        return gone

    def drop_rank(self, rank: int) -> int:
        """Remove every file of this rank (``resume: never``: the run starts fresh and its old versions must never
        be restored); returns the versions removed."""
        n = 0
        for v in self.versions():
            found = False
            for p in self.paths(v, rank):
                for q in (p, p + ".tmp"):
                    try:
                        os.unlink(q)
                        found = True
                    except FileNotFoundError:
                        pass
            n += found
            try:
                os.rmdir(self.version_dir(v))
            except OSError:
                pass   # other ranks' files are still there
        return n

    # ---- read (restore side) ------------------------------------------------------------------------
    def open(self, version: int, rank: int) -> tuple[dict, mmap.mmap]:
        bin_path, json_path = self.paths(version, rank)
        with open(json_path) as f:
            manifest = json.load(f)
        with open(bin_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mm = mmap.mmap(f.fileno(), max(size, 1), mmap.MAP_PRIVATE, mmap.PROT_READ) if size else mmap.mmap(-1, 1)
        return manifest, mm


def _write_file(path: str, data: memoryview, mbps: float, on_progress: Callable[[float], None] | None = None) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    # A progress hook sees at least two steps, so a payload below one chunk can still be torn halfway.
    step = CHUNK if on_progress is None else max(1, min(CHUNK, (len(data) + 1) // 2))
    try:
        t0, done = time.perf_counter(), 0
        while done < len(data):
            done += os.write(fd, data[done: done + step])
            if on_progress is not None:
                on_progress(done / len(data))
            if mbps > 0:   # bandwidth cap: never let a flush starve the job's own I/O
                ahead = done / (mbps * 1e6) - (time.perf_counter() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)   # a half-written file would only hold on to the space that ran out
        except OSError:
            pass
        raise
    os.close(fd)
    os.replace(tmp, path)
