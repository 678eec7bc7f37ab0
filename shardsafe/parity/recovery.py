"""Rebuilding a lost member of a parity group whose ranks no longer run: a restore at another data-parallel size.

:class:`~shardsafe.parity.exchange.ParityExchange` rebuilds a lost member among the members of its group, each
running as the rank it was. When the job continues at another data-parallel size, the ranks that took the
snapshots are gone: their snapshots and parity shares lie in the holders of the nodes that survived, read by
whichever current rank runs there, and the current ranks that need the lost member's payload decode it in their
own memory, each the byte ranges it needs (:meth:`MemberRecovery.decode_range`).

The code and the chunk layout are the exchange's, read back from a survivor's parity manifest (``group``,
``chunk_size``, ``code``): member i's payload padded to k chunks of ``chunk_size`` bytes
(:func:`~shardsafe.parity.exchange.data_chunks`), the rotated codewords of :class:`~.topology.ParityGroup`, and the
rebuild rule of :meth:`~.topology.ParityGroup.recovery_plan`. This module moves nothing: the caller sends the
ranges of the fragments :meth:`MemberRecovery.chunks_of` names from the rank that reads them to the rank that decodes,
and :meth:`MemberRecovery.decode_range` rebuilds that range from them. It never re-encodes the lost member's parity
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
from .topology import CodewordRecovery, ParityGroup


@dataclass(frozen=True)
class Fragment:
    """One fragment a rebuild reads: fragment ``fragment`` of codeword ``codeword``, held by member ``rank`` (its
    data chunk ``slot``, or its parity slot ``slot`` when ``parity``)."""
    codeword: int
    fragment: int
    rank: int
    parity: bool
    slot: int


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

    def chunks_of(self, rank: int) -> dict[int, tuple[int, int, tuple[Fragment, ...]]]:
        """For each data chunk (slot) of lost member ``rank`` a codeword rebuilds: (the codeword, the chunk's fragment
        index in it, the k fragments it is decoded from). The code works byte by byte, so any byte range of a
        chunk is decoded from the same range of those fragments (:meth:`fragment_range`, :meth:`decode_range`).

        Raises:
            ParityError: ``rank`` is not among the lost members.
        """
        if rank not in self.lost:
            raise ParityError(f"rank {rank} is not among the lost members {list(self.lost)} of parity group "
                              f"{self.group.index}")
        out = {}
        for cw in self._plan:
            for t in cw.targets:
                if t.rank == rank and not t.is_parity:
                    out[t.slot] = (cw.codeword, t.fragment, tuple(
                        Fragment(cw.codeword, f.fragment, f.rank, f.is_parity, f.slot) for f in cw.sources))
        return out

    def fragment_range(self, f: Fragment, mapping: Any, lo: int, hi: int) -> torch.Tensor:
        """Bytes ``lo:hi`` of fragment ``f`` in ``mapping`` (a view; bytes past a data slot count as zeros, in a copy:
        the rule of :func:`~shardsafe.parity.exchange.data_chunks`)."""
        a, n = f.slot * self.chunk_size + lo, hi - lo
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")   # read, then sent
            if f.parity or a + n <= len(mapping):
                return torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=a)
            out = torch.zeros(n, dtype=torch.uint8)
            have = max(0, len(mapping) - a)
            if have:
                out[:have] = torch.frombuffer(mapping, dtype=torch.uint8, count=have, offset=a)
            return out

    def decode_range(self, rank: int, slot: int, received: Mapping[int, torch.Tensor], out: torch.Tensor) -> None:
        """Decode one byte range of lost member ``rank``'s data chunk ``slot`` into ``out`` from the same range of
        the fragments :meth:`chunks_of` names (``received[fragment index]``)."""
        _, target, sources = self.chunks_of(rank)[slot]
        avail = {f.fragment: np.asarray(received[f.fragment].numpy()) for f in sources}
        self.codec.reconstruct(avail, [target], out=[out.numpy()])
