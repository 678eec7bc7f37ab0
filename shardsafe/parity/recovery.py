"""Rebuilding a lost member of a parity group whose ranks no longer run: a restore at another data-parallel size.

:class:`~shardsafe.parity.exchange.ParityExchange` rebuilds a lost member among the members of its group, each
running as the rank it was. When the job continues at another data-parallel size, the ranks that took the
snapshots are gone: their snapshots and parity shares lie in the holders of the nodes that survived, read by
whichever current rank runs there, and the current ranks that need the lost member's payload decode it in their
own memory, each the byte ranges it needs: by partial-parallel repair along the ranks that read the survivors
(:meth:`MemberRecovery.chain_decode`, shardsafe.parity.repair), or from the k fragments gathered on the decoding
rank (:meth:`MemberRecovery.decode_range`).

The code and the chunk layout are the exchange's, read back from a survivor's parity manifest (``group``,
``chunk_size``, ``code``): member i's payload padded to k chunks of ``chunk_size`` bytes
(:func:`~shardsafe.parity.exchange.data_chunks`), the rotated codewords of :class:`~.topology.ParityGroup`, and the
rebuild rule of :meth:`~.topology.ParityGroup.recovery_plan`. Gathered, the caller sends the ranges of the
fragments :meth:`MemberRecovery.chunks_of` names from the rank that reads them to the rank that decodes, and
:meth:`MemberRecovery.decode_range` rebuilds that range from them; by chain, :meth:`MemberRecovery.chain_decode`
moves the partial sums itself, over the caller's process group. It never re-encodes the lost member's parity
shares: the layout they protected is being left (the next snapshot at the new size is protected by its own).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from ..errors import ParityError
from . import repair
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

    def chain_decode(self, pg: Any, rank: int, wanted: Sequence[tuple[int, int, int, int, int]], *,
                     server: Callable[[Fragment], int], read: Callable[[Fragment, int, int], torch.Tensor],
                     out: Callable[[int, int, int, int], torch.Tensor],
                     tag: int) -> tuple[dict[int, Exception], int, int]:
        """Decode byte ranges of the lost members on the ranks that want them by partial-parallel repair
        (:mod:`shardsafe.parity.repair`): each range's linear combination of its k fragments is formed along the
        ranks that read them, each adding all the fragments it reads, and the decoding rank receives each byte it
        decodes once. Every rank of ``pg`` calls it with the same ``wanted``.

        Args:
            pg: isend/irecv of uint8 CPU tensors by global rank (:class:`shardsafe.hierarchy.MemberGroup`'s).
            rank: this rank.
            wanted: (lost member, the rank that decodes, its data chunk slot, lo, hi): bytes ``lo:hi`` of that
                chunk, in the order every rank lists them.
            server: the rank that reads fragment ``f`` (on ``f``'s node), the same on every rank.
            read: on ``f``'s server, bytes ``lo:hi`` of ``f`` (:meth:`fragment_range` of its mapping).
            out: on the decoding rank, where bytes ``lo:hi`` of chunk ``slot`` of lost member ``member`` go
                (``out(member, slot, lo, hi)``, writable).
            tag: the first of the tags of the chains (one per chain, consecutive).
        Returns:
            (the first failure on this rank by lost member: a fragment it could not read, a decode; the bytes of
            partial sums it received; the bytes it decoded). A failure never stops the chains: a rank that cannot
            add its fragments passes zeros on, and the decoding rank's checksums fail.
        """
        # One chain per (range, slice of repair.SLICE bytes) through the distinct ranks that read its fragments, each
        # adding the products of all the fragments it reads: one hop per server, not per fragment. The decoding rank
        # ends the chain, and adds the fragments it reads itself last, to what it received: it never sends to
        # itself; where it reads all k, it decodes alone. The servers go in rank order rotated by the chain's place
        # in the enumeration (the same on every rank): every server but the first receives what it passes on, so
        # successive slices share that among them instead of loading the same rank with every chain's relay.
        links, local, first = [], [], tag
        for member, r, slot, lo, hi in wanted:
            _, target, sources = self.chunks_of(member)[slot]
            by: dict[int, list[int]] = {}
            for i, f in enumerate(sources):
                by.setdefault(server(f), []).append(i)
            hops = sorted(s for s in by if s != r)
            on = rank == r or rank in hops
            if on:
                coeffs = self.codec.coefficients([f.fragment for f in sources], [target])
                cols = by.get(rank, [])
                mine = ([sources[i] for i in cols], np.ascontiguousarray(coeffs[:, cols]))
            for a in range(lo, hi, repair.SLICE):
                b = min(hi, a + repair.SLICE)
                if rank == r and not hops:
                    local.append((member, slot, a, b, mine))
                elif on:
                    turn = (tag - first) % len(hops)
                    order = hops[turn:] + hops[:turn] + [r]
                    pos = order.index(rank)
                    links.append(repair.Link(tag, order[pos - 1] if pos else None,
                                             order[pos + 1] if pos + 1 < len(order) else None, b - a,
                                             (member, slot, a, b, mine)))
                tag += 1

        def products(ln_what: tuple, got: Optional[torch.Tensor]) -> torch.Tensor:
            _, _, a, b, (frags, coeffs) = ln_what
            return repair.accumulate(self.codec, coeffs, [read(f, a, b).numpy() for f in frags], got, b - a)

        def finish(ln: repair.Link, got: torch.Tensor) -> None:
            member, slot, a, b, (frags, _) = ln.what
            if frags:   # landed where it goes: this rank's own fragments on top
                out(member, slot, a, b).copy_(products(ln.what, got))

        failed = repair.run_chains(pg, links, step=lambda ln, got: products(ln.what, got),
                                   land=lambda ln: out(*ln.what[:4]), finish=finish)
        errors: dict[int, Exception] = {}
        for f in failed:
            errors.setdefault(f.link.what[0], f.error)
        unfinished = {f.link.tag for f in failed if f.link.next is None}
        decoded = sum(ln.nbytes for ln in links if ln.next is None and ln.tag not in unfinished)
        for what in local:
            try:
                out(*what[:4]).copy_(products(what, None))
                decoded += what[3] - what[2]
            except Exception as e:   # noqa: BLE001 -- said by the caller, as a decode that failed
                errors.setdefault(what[0], e)
        return errors, sum(ln.nbytes for ln in links if ln.prev is not None), decoded
