"""Rebuilding a lost member of a parity group whose ranks no longer run: a restore at another data-parallel size.

:class:`~shardsafe.parity.exchange.ParityExchange` rebuilds a lost member among the members of its group, each
running as the rank it was. When the job continues at another data-parallel size, the ranks that took the
snapshots are gone: their snapshots and parity shares lie in the holders of the nodes that survived, read by
whichever current rank runs there, and one current rank decodes the lost member's payload in its own memory.

The code and the chunk layout are the exchange's, read back from a survivor's parity manifest (``group``,
``chunk_size``, ``code``): member i's payload padded to k chunks of ``chunk_size`` bytes
(:func:`~shardsafe.parity.exchange.data_chunks`), the rotated codewords of :class:`~.topology.ParityGroup`, and the
rebuild rule of :meth:`~.topology.ParityGroup.recovery_plan`. This module moves nothing: the caller sends each
fragment :meth:`MemberRecovery.fragments` names from the rank that reads it to the rank that decodes, and
:meth:`MemberRecovery.decode` rebuilds the payload from them. It never re-encodes the lost member's parity
shares: the layout they protected is being left (the next snapshot at the new size is protected by its own).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..errors import ParityError
from .codec import CODE_ID, get_codec
from .exchange import data_chunks
from .topology import CodewordRecovery, ParityGroup


@dataclass(frozen=True)
class Fragment:
    """One fragment a rebuild reads: fragment ``fragment`` of codeword ``codeword``, held by member ``rank`` (its
    data chunk ``slot``, or its parity slot ``slot`` when ``parity``), needed by the lost members ``takers``."""
    codeword: int
    fragment: int
    rank: int
    parity: bool
    slot: int
    takers: tuple[int, ...]


class MemberRecovery:
    """Rebuild the ``lost`` members of one parity group of an earlier layout.

    Args:
        group: the group as its parity manifests record it (``{"members", "nodes", "k", "m", "index"}``).
        chunk_size: the group's chunk size (``chunk_size`` of the parity manifests of that version).
        code: the code the parity was made with (``code`` of the parity manifests).
        lost: the members to rebuild (at most m).
        backend: codec backend ("auto": ISA-L, else the numpy reference; every backend gives the same bytes).

    Raises:
        ParityError: another code than this shardsafe's, or more lost members than the group's parity covers.
    """

    def __init__(self, *, group: Mapping[str, Any], chunk_size: int, code: Mapping[str, Any], lost: Sequence[int],
                 backend: str = "auto"):
        members = tuple(int(r) for r in group["members"])
        k, m = int(group["k"]), int(group["m"])
        if code.get("code") != CODE_ID or (int(code.get("k", k)), int(code.get("m", m))) != (k, m):
            raise ParityError(f"the parity was made with the code {dict(code)}, this shardsafe decodes {CODE_ID} with "
                              f"k={k}, m={m}: rebuild with the shardsafe version that took the snapshot")
        self.group = ParityGroup(index=int(group.get("index", 0)), members=members, nodes=tuple(group["nodes"]),
                                 k=k, m=m, key=(), dp=tuple(range(len(members))))
        self.lost = tuple(sorted(int(r) for r in lost))
        self.chunk_size = int(chunk_size)
        # Only codewords with a lost *data* chunk: the lost parity shares protected the layout being left.
        self._plan: list[CodewordRecovery] = [cw for cw in self.group.recovery_plan(self.lost)
                                              if any(not t.is_parity for t in cw.targets)]
        self.codec = get_codec(k=k, m=m, backend=backend)

    @property
    def k(self) -> int:
        return self.group.k

    def fragments(self) -> list[Fragment]:
        """Every fragment the rebuild reads, in one order on every rank (by codeword, then fragment)."""
        out = []
        for cw in self._plan:
            takers = tuple(sorted({t.rank for t in cw.targets if not t.is_parity}))
            out += [Fragment(cw.codeword, f.fragment, f.rank, f.is_parity, f.slot, takers) for f in cw.sources]
        return out

    def fragment_of(self, f: Fragment, mapping: Any) -> torch.Tensor:
        """The ``chunk_size`` bytes of ``f`` in ``mapping``: the member's data slot (the exchange's padding rule: bytes
        past the slot count as zeros) or its parity slot."""
        cs = self.chunk_size
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")   # read, then sent
            if f.parity:
                return torch.frombuffer(mapping, dtype=torch.uint8, count=cs, offset=f.slot * cs)
            return data_chunks(mapping, self.k, cs)[f.slot]

    def decode(self, rank: int, received: Mapping[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        """Lost member ``rank``'s padded payload (k x chunk_size bytes) from the fragments it took
        (``received[(codeword, fragment)]``, as :meth:`fragments` names them). The caller verifies it against the
        member's manifest (its checksums survive it in the parity manifests) before anything uses it."""
        if rank not in self.lost:
            raise ParityError(f"rank {rank} is not among the lost members {list(self.lost)} of parity group "
                              f"{self.group.index}")
        cs = self.chunk_size
        # not zeroed first: the decode writes every chunk it rebuilds, and only a chunk no codeword rebuilds is zeroed
        out = torch.empty(self.k * cs, dtype=torch.uint8)
        written = set()
        for cw in self._plan:
            mine = [t for t in cw.targets if t.rank == rank and not t.is_parity]
            if not mine:
                continue
            avail = {f.fragment: np.asarray(received[(cw.codeword, f.fragment)].numpy()) for f in cw.sources}
            outs = [out[t.slot * cs:(t.slot + 1) * cs].numpy() for t in mine]
            self.codec.reconstruct(avail, [t.fragment for t in mine], out=outs)
            written.update(t.slot for t in mine)
        for slot in set(range(self.k)) - written:
            out[slot * cs:(slot + 1) * cs].zero_()
        return out
