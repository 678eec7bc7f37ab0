"""Other ranks' payloads of the version being restored, read from this node's holder (:class:`PeerPayloads`), and
the digest that says two copies of a rank's snapshot hold the same bytes (:func:`manifest_digest`)."""
from __future__ import annotations

import json
import logging
from typing import Any, Optional

import torch
import xxhash

from ..holder.client import HolderClient
from ..holder.protocol import HolderFailure
from ..payload import manifest as mf
from .pinning import unmap_later

log = logging.getLogger(__name__)


def manifest_digest(manifest: dict) -> int:
    """63-bit digest of a payload's identity (version, rank, every segment checksum): two copies of a
    rank's snapshot with equal digests hold the same bytes."""
    key = json.dumps([manifest.get("version"), manifest.get("rank"), [e.get("xxh3") for e in manifest["entries"]]])
    return xxhash.xxh3_64_intdigest(key.encode()) & ((1 << 63) - 1)


class PeerPayloads:
    """Other ranks' payloads of the version being restored, read from this node's holder.

    An adapter whose re-derivation step is a collective over data-parallel peers (DeepSpeed's
    ``update_lp_params``: fp32 shard -> low-precision partition -> all-gather) can instead read the
    peers' shards straight from the node's shared memory when the node holds all of them. A peer's
    copy is used only if its digest equals the one its owner verified and voted on (``digests``,
    all-gathered before apply): a copy left on this node by an earlier placement of that rank, from
    an earlier timeline of the same version, is never mixed in. Nothing writes to a holder during a
    restore. ``available`` is collective: every rank takes the same path.
    """

    def __init__(self, client: Optional[HolderClient], version: int, coll: Any, digests: list[int]):
        self.client, self.version, self.coll, self.digests = client, version, coll, digests
        self._open: dict[int, tuple] = {}

    @staticmethod
    def pays_off(targets) -> bool:
        """Whether reading the peers' shards from the node's memory beats the framework's collective for the
        tensors it would fill: only when they live in host memory, where that collective is gloo (on CPU the
        all-gather of the bf16 params is most of a restore, the local casts a small part of it). On a GPU every
        peer's fp32 shard (4 bytes per parameter) would cross PCIe from pageable memory, where the framework's
        all-gather moves the bf16 params (2 bytes per parameter) over NVLink or the network with NCCL."""
        return all(t.device.type == "cpu" for t in targets)

    def available(self, ranks: list[int], *, usable: bool = True) -> bool:
        """True on every rank iff every rank's holder has the verified copy of all of its ``ranks``
        and every rank found the path ``usable``. Every rank calls it at most once per apply, and
        either all ranks or none (it is a collective)."""
        ok = False
        if usable and self.client is not None:
            try:
                held = self.client.list()
                ok = all(any(s["version"] == self.version and s["state"] == "sealed"
                             for s in held.get(str(r), {}).get("data", [])) for r in ranks)
                ok = ok and all(manifest_digest(self._get(r)[0]) == self.digests[r] for r in ranks)
            except (HolderFailure, OSError, KeyError) as e:
                log.info("peer payloads not available from the holder: %s", e)
                ok = False
        return self.coll.all_true(ok)

    def tensors(self, rank: int) -> dict[str, torch.Tensor]:
        """Views of ``rank``'s payload (valid until ``close``)."""
        return self._get(rank)[2]

    def meta(self, rank: int) -> dict:
        """``rank``'s snapshot metadata (decoded)."""
        return self._get(rank)[3]

    def _get(self, rank: int) -> tuple:
        if rank not in self._open:
            man, mm = self.client.open(rank=rank, version=self.version, populate=False)
            self._open[rank] = (man, mm, mf.views(man, mm), mf.from_jsonable(man["meta"]))
        return self._open[rank]

    def close(self) -> None:
        for man, mm, views, _ in self._open.values():
            views.clear()
            unmap_later(mm)   # the pages the casts touched have page tables to tear down: not on the restore's path
        self._open.clear()
