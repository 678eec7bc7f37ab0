"""The "host" parity transport: data chunks move from the holders' shared memory over the parity group's gloo
group, and the CPU codec (ISA-L) encodes each block into the parity slot as soon as its k pieces are in."""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch
import xxhash

from .topology import ParityGroup
from .transport import ParityTransport, _blocks


class HostTransport(ParityTransport):
    """Args:
        group: returns the parity group's current :class:`shardsafe.hierarchy.MemberGroup` (rebuilt after a failure).
        codec: the group's CPU codec.
    """

    def __init__(self, group: Callable[[], Any], codec: Any):
        self._group, self.codec = group, codec
        self._staging: torch.Tensor | None = None

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8).fill_(0)   # pre-faulted, reused
        return self._staging[:nbytes]

    def move_and_encode(self, g: ParityGroup, me: int, data: list[torch.Tensor], pview: np.ndarray, cs: int,
                        first_block: Callable[[], None]) -> tuple[list[str], float]:
        pg = self._group()
        stage = self._staging_for(g.m * g.k * cs).view(g.m, g.k, cs)
        # Chunks move in blocks, and each block is encoded (and hashed) as soon as its k pieces are in,
        # while later blocks are still on the wire: RS works column by column, so block-wise parity
        # is byte for byte the parity of the whole chunk.
        blocks = _blocks(cs)
        nb = len(blocks)
        sends, recvs = [], []
        for b, (a, z) in enumerate(blocks):
            for c, stripe in enumerate(g.data_stripes(me)):
                for pref in stripe.parity:
                    sends.append(pg.isend(data[c][a:z], pref.rank, stripe.codeword * nb + b))
            recvs.append([pg.irecv(stage[j, p, a:z], dref.rank, stripe.codeword * nb + b)
                          for j, stripe in enumerate(g.parity_stripes(me)) for p, dref in enumerate(stripe.data)])
        stripes = g.parity_stripes(me)
        hashers = [xxhash.xxh3_64() for _ in stripes]
        t_wait = 0.0
        for b, (a, z) in enumerate(blocks):
            tw = time.perf_counter()
            for r in recvs[b]:
                r.wait()
            if b == 0:
                first_block()
            t_wait += time.perf_counter() - tw
            for j in range(len(stripes)):
                out = pview[j * cs + a: j * cs + z]
                self.codec.reconstruct({p: stage[j, p, a:z].numpy() for p in range(g.k)}, [g.k + j], out=[out])
                hashers[j].update(out)
        for r in sends:
            r.wait()
        return [format(h.intdigest(), "016x") for h in hashers], t_wait   # == manifest.hash_bytes of each share
