"""The sources of an export: one committed version of every rank, verified, from the persistent tier or the holders."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from shardsafe.errors import ShardsafeError
from shardsafe.payload import manifest as mf

log = logging.getLogger(__name__)


class ExportError(RuntimeError, ShardsafeError):
    """The snapshot cannot be exported; the message says what was expected, what was found and what to do."""


@dataclass
class RankSnapshot:
    """One rank's verified snapshot: its manifest, decoded meta and tensors viewing the payload."""
    rank: int
    manifest: dict
    meta: dict
    tensors: dict[str, torch.Tensor]
    _keep: list = field(default_factory=list, repr=False)   # the mappings the views point into


# ---- sources -----------------------------------------------------------------------------------------

def _verified(rank: int, manifest: dict, buf, where: str) -> RankSnapshot:
    bad = mf.verify(manifest, memoryview(buf))
    if bad:
        raise ExportError(f"rank {rank} of version {manifest.get('version')} in {where} fails its checksums "
                          f"({'; '.join(bad[:3])}); nothing was written. Export an older version (--version), "
                          "or restore the job once so parity repairs it and export again.")
    return RankSnapshot(rank, manifest, mf.from_jsonable(manifest["meta"]), mf.views(manifest, buf), [buf])


def open_persistent(job_dir: str, version: int | None = None) -> tuple[int, list[RankSnapshot]]:
    """Every rank of ``version`` (default: the newest complete one) from a persistent job directory
    (``PERSIST_DIR/RUN_NAME``)."""
    from shardsafe.persist import PersistentStore
    job_dir = os.path.abspath(job_dir)
    store = PersistentStore(os.path.dirname(job_dir), os.path.basename(job_dir))
    versions = store.versions()
    if not versions:
        raise ExportError(f"no snapshot versions under {job_dir} (expected v<iteration>/rank<R>.bin|.json, written "
                          "by the holders' flush); pass the persistent run directory PERSIST_DIR/RUN_NAME.")

    complete = [v for v in versions if _complete_on_disk(store, v)]
    if version is None:
        if not complete:
            raise ExportError(f"no version under {job_dir} has the files of every rank (found {versions}); "
                              "wait for the next flush, or pass --version of a complete one.")
        version = complete[-1]
    elif version not in complete:
        raise ExportError(f"version {version} under {job_dir} is missing or incomplete; complete versions: {complete}")
    out = []
    for r in _ranks_on_disk(store, version):
        man, mm = store.open(version, r)
        out.append(_verified(r, man, mm, store.version_dir(version)))
    return version, out


def _ranks_on_disk(store: Any, version: int) -> list[int]:
    """Ranks whose manifest of ``version`` is on disk (the manifest is written after the payload)."""
    return sorted(int(n[len("rank"):-len(".json")]) for n in os.listdir(store.version_dir(version))
                  if n.startswith("rank") and n.endswith(".json"))


def _complete_on_disk(store: Any, version: int) -> bool:
    """Every rank of the job (the manifests' world size) has its files of ``version``."""
    ranks = _ranks_on_disk(store, version)
    if not ranks:
        return False
    with open(store.paths(version, ranks[0])[1]) as f:
        world = int(json.load(f)["world_size"])
    return ranks == list(range(world)) and all(os.path.exists(store.paths(version, r)[0]) for r in ranks)


def open_holders(holder_dir: str, job_id: str, version: int | None = None) -> tuple[int, list[RankSnapshot]]:
    """Every rank of ``version`` (default: the newest committed on every rank) from the job's holders."""
    from shardsafe.holder.client import HolderClient, HolderUnavailable
    from shardsafe.holder.paths import HolderPaths
    nodes = HolderPaths.list_nodes(holder_dir, job_id)
    if not nodes:
        raise ExportError(f"no holder of job {job_id!r} under {holder_dir}; check --holder-dir and the job id "
                          "(`shardsafe status`), or export from the persistent directory instead.")
    clients, where, committed = [], {}, {}
    try:
        for node in nodes:
            try:
                c = HolderClient(HolderPaths(holder_dir, job_id, node), timeout_s=10).connect()
            except HolderUnavailable as e:
                log.warning("holder of node %s not reachable (%s); its ranks must come from another holder", node, e)
                continue
            clients.append(c)
            for rank, kinds in c.list().items():
                vs = {s["version"] for s in kinds.get("data", []) if s["state"] == "sealed" and s["committed"]}
                if vs:
                    where[int(rank)] = c
                    committed[int(rank)] = vs
        if not committed:
            raise ExportError(f"the holders of job {job_id!r} ({', '.join(nodes)}) hold no committed snapshot")
        common = set.intersection(*committed.values())
        if version is None:
            if not common:
                raise ExportError(f"no version is committed on every rank ({ {r: sorted(v) for r, v in committed.items()} }); "
                                  "restore the job once (parity rebuilds lost ranks), or export from the persistent tier.")
            version = max(common)
        elif version not in common:
            raise ExportError(f"version {version} is not committed on every rank; committed everywhere: {sorted(common)}")
        out = []
        for r in sorted(where):
            man, mm = where[r].open(rank=r, version=version)
            out.append(_verified(r, man, mm, f"the holder of node {man.get('node')}"))
        return version, out
    finally:
        for c in clients:
            c.close()


def open_source(src: str, *, holder_dir: str = "", version: int | None = None) -> tuple[int, list[RankSnapshot]]:
    """``holder://JOB_ID`` reads the live holders; anything else is a persistent job directory."""
    if src.startswith("holder://"):
        from shardsafe.config import ShardsafeConfig
        return open_holders(holder_dir or ShardsafeConfig().holder_dir, src[len("holder://"):], version)
    if not os.path.isdir(src):
        raise ExportError(f"{src} is not a directory; SRC is a persistent run directory (PERSIST_DIR/RUN_NAME) "
                          "or holder://JOB_ID")
    return open_persistent(src, version)
