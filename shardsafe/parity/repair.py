"""Rebuild of lost members by partial-parallel repair: partial products reduced along the survivors.

A lost fragment is a linear combination of the k source fragments of its codeword over GF(2^8):
``t = sum_j c_j * s_j`` (:meth:`shardsafe.parity.codec.Codec.coefficients`). Sending the k sources to the
rebuilder makes it receive k bytes per byte it rebuilds; its link (and on one host its receiving thread) is the
bottleneck of every node-loss restore. Here the sum is formed on the way instead: the survivor holding ``s_0``
sends ``c_0 * s_0`` to the one holding ``s_1``, which adds ``c_1 * s_1`` and passes it on, and the last survivor
sends the finished fragment to the rebuilder. Every link carries one byte per byte rebuilt, so the rebuilder
receives what it rebuilds and nothing more, and the multiplications run on the k survivors side by side. Each
slice of a fragment (SLICE bytes) is its own chain and the chains of successive slices overlap, so the chain's k
hops cost about one slice's transfer more than a single hop.

Every rank walks the same chains in the same order (:func:`run_chains`, which the restore at another
data-parallel size drives too: :meth:`shardsafe.parity.recovery.MemberRecovery.chain_decode`). A rank posts the
receives of the chains it ends all at once; on the others it posts WINDOW ahead and waits only on a receive from
an earlier position of the same chain, or on its own oldest send, whose receiver has posted it or will before
waiting on anything of a later chain: no cycle, so no deadlock.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from .topology import CodewordRecovery, FragmentRef

_CHAIN_TAG = 3 << 20   # + the chain's place in the plan's enumeration
SLICE = 4 << 20        # bytes of a fragment one message of a chain carries
WINDOW = 8             # slices a survivor has posted to receive ahead, and has in flight to send


class Link(NamedTuple):
    """This rank's part in one chain. ``prev``: the rank it receives the partial sums from (None: it starts the
    chain); ``next``: the rank it sends them on to (None: it ends the chain, the rebuilder); ``nbytes``: one
    message's bytes; ``what``: the caller's, for its ``step``, ``land`` and ``finish``."""
    tag: int
    prev: Optional[int]
    next: Optional[int]
    nbytes: int
    what: Any


class Failed(NamedTuple):
    """A ``step`` or ``finish`` that raised: its link and the exception."""
    link: Link
    error: Exception


def accumulate(codec: Any, coeffs: np.ndarray, mine: Sequence[Any], received: Optional[torch.Tensor],
               n: int) -> torch.Tensor:
    """One hop's partial sums: ``received`` (len(coeffs) sums of ``n`` bytes back to back; None on the chain's first
    rank) plus ``coeffs`` (one row per sum, one column per fragment of ``mine``) times this rank's fragments, into a
    new buffer (``received`` may be where the finished fragment lands)."""
    out = torch.empty(len(coeffs) * n, dtype=torch.uint8)
    outs = [out[j * n:(j + 1) * n].numpy() for j in range(len(coeffs))]
    if received is None:
        codec.combine(coeffs, list(mine), outs)
        return out
    for j, o in enumerate(outs):   # coefficient 1 on what came: GF(2^8) addition is the sum so far plus ours
        row = np.concatenate(([1], coeffs[j])).astype(np.uint8).reshape(1, -1)
        codec.combine(row, [received[j * n:(j + 1) * n].numpy(), *mine], [o])
    return out


def run_chains(pg: Any, links: Sequence[Link], *, step: Callable[[Link, Optional[torch.Tensor]], torch.Tensor],
               land: Callable[[Link], Optional[torch.Tensor]] = lambda link: None,
               finish: Callable[[Link, torch.Tensor], None] = lambda link, got: None) -> list[Failed]:
    """Pass partial sums along chains; every rank of ``pg`` calls it, with its links in the order in which every
    rank enumerates the chains (a link's tag is unique to its chain).

    Args:
        pg: isend/irecv of uint8 CPU tensors by global rank (:class:`shardsafe.hierarchy.MemberGroup`'s signature).
        links: this rank's links.
        step: on a link that sends, the bytes it sends on (``nbytes``), from what it received (None at the first).
        land: on a link that ends its chain, where the finished bytes land (``nbytes`` writable bytes), or None for
            a buffer of their own.
        finish: on a link that ends its chain, once every message to this rank has arrived: what to do with them.
    Returns:
        The steps and finishes that raised. A step that raises sends zeros in its place: its chain runs to its end
        all the same, so no other rank waits for ever on this one (the rebuilder's checksums then fail).
    """
    # A rank's receives of the chains it ends land where the finished bytes go: posted all at once, they cost no
    # memory. Those it passes on are posted WINDOW ahead of the chain it works on, and WINDOW sends stay in flight,
    # so its extra memory is 2 x WINDOW messages whatever the payload: waiting on its oldest send is safe, as the
    # next rank of that chain has posted the receive or will before it waits on anything of a later chain.
    window = WINDOW
    failed: list[Failed] = []
    ends = [ln for ln in links if ln.next is None]
    hops = [ln for ln in links if ln.next is not None]
    rx = [ln for ln in hops if ln.prev is not None]
    recvs: dict[int, tuple[torch.Tensor, Any]] = {}
    ahead = 0

    def receive(ln: Link, into: Optional[torch.Tensor]) -> None:
        buf = into if into is not None else torch.empty(ln.nbytes, dtype=torch.uint8)
        recvs[ln.tag] = (buf, pg.irecv(buf, ln.prev, ln.tag))

    def post(upto: int) -> None:
        nonlocal ahead
        while ahead < min(upto, len(rx)):
            receive(rx[ahead], None)
            ahead += 1

    for ln in ends:
        try:
            into = land(ln)
        except Exception as e:   # noqa: BLE001 -- received all the same, into a buffer of its own
            failed.append(Failed(ln, e))
            into = None
        receive(ln, into)
    post(window)
    sends: list[tuple[torch.Tensor, Any]] = []
    done = 0
    for ln in hops:
        got = None
        if ln.prev is not None:
            done += 1
            post(done + window)
            got, work = recvs.pop(ln.tag)
            work.wait()
        try:
            out = step(ln, got)
        except Exception as e:   # noqa: BLE001 -- whatever it was, the chain must still reach its end
            failed.append(Failed(ln, e))
            out = torch.zeros(ln.nbytes, dtype=torch.uint8)
        sends.append((out, pg.isend(out, ln.next, ln.tag)))
        if len(sends) > window:
            sends.pop(0)[1].wait()
    post(len(rx))
    for _, work in recvs.values():
        work.wait()
    for _, work in sends:
        work.wait()
    for ln in ends:
        try:
            finish(ln, recvs[ln.tag][0])
        except Exception as e:   # noqa: BLE001 -- said by the caller; the other chains' bytes still count
            failed.append(Failed(ln, e))
    return failed


def chain_rebuild(pg: Any, codec: Any, plan: Sequence[CodewordRecovery], rank: int, cs: int, *,
                  source: Callable[[FragmentRef], torch.Tensor],
                  dest: Callable[[FragmentRef], Optional[torch.Tensor]]) -> None:
    """Rebuild the targets of ``plan`` on their ranks, every member of the group calling it.

    Args:
        pg: the group's process group (isend/irecv of uint8 CPU tensors).
        codec: the group's codec (``coefficients``, ``combine``).
        plan: the group's recovery plan (:meth:`ParityGroup.recovery_plan`).
        rank: this rank.
        cs: chunk size, the bytes of one fragment.
        source: on a survivor, the bytes of one of its source fragments (``cs`` bytes).
        dest: on a rebuilder, where one of its target fragments goes (``cs`` writable bytes), or None to drop it
            (a slot that could not be had: the rebuilder still takes part, so no survivor waits on it).

    Raises:
        Exception: the first ``source``, ``dest`` or codec failure on this rank, once every message went through.
    """
    # One chain per (codeword, rebuilder, slice of SLICE bytes): small enough that the hops of successive slices
    # overlap, as in a pipeline. Every rank enumerates every chain in the same order (the tag is the place in it)
    # and keeps those it is on, with its targets, their coefficients (this survivor's column), its fragment and
    # the byte range. A chain carries all of its rebuilder's targets in the codeword, back to back.
    links, tag = [], _CHAIN_TAG
    for cw in plan:
        srcs = [f.rank for f in cw.sources]
        for lost in sorted({t.rank for t in cw.targets}):
            targets = [t for t in cw.targets if t.rank == lost]
            on = rank in srcs or rank == lost
            coeffs = codec.coefficients([f.fragment for f in cw.sources], [t.fragment for t in targets]) if on else None
            for lo in range(0, cs, SLICE):
                hi = min(cs, lo + SLICE)
                if rank == lost:   # it holds no source: it only receives
                    links.append(Link(tag, srcs[-1], None, len(targets) * (hi - lo), (targets, None, None, lo, hi)))
                elif on:
                    pos = srcs.index(rank)
                    links.append(Link(tag, srcs[pos - 1] if pos else None, srcs[pos + 1] if pos + 1 < len(srcs)
                                      else lost, len(targets) * (hi - lo),
                                      (targets, coeffs[:, pos:pos + 1], cw.sources[pos], lo, hi)))
                tag += 1

    def step(ln: Link, got: Optional[torch.Tensor]) -> torch.Tensor:
        _, col, frag, lo, hi = ln.what
        return accumulate(codec, col, [source(frag)[lo:hi].numpy()], got, hi - lo)

    def land(ln: Link) -> Optional[torch.Tensor]:
        targets, _, _, lo, hi = ln.what
        into = dest(targets[0]) if len(targets) == 1 else None
        return None if into is None else into[lo:hi]   # the finished fragment lands where it belongs

    def finish(ln: Link, got: torch.Tensor) -> None:
        targets, _, _, lo, hi = ln.what
        if len(targets) == 1:
            return   # landed, or dropped
        n = hi - lo
        for j, t in enumerate(targets):
            d = dest(t)
            if d is not None:
                d[lo:hi].copy_(got[j * n:(j + 1) * n])

    failed = run_chains(pg, links, step=step, land=land, finish=finish)
    if failed:
        raise failed[0].error
