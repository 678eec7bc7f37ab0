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

Every rank walks the same chains in the same order. The rebuilder posts all its receives at once; a survivor
posts WINDOW ahead and waits only on a receive from an earlier position of the same chain, or on its own oldest
send, whose receiver has posted it or will before waiting on anything of this rank's: no cycle, so no deadlock.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from .topology import CodewordRecovery, FragmentRef

_CHAIN_TAG = 3 << 20   # + the chain's place in the plan's enumeration
SLICE = 4 << 20        # bytes of a fragment one message of a chain carries
WINDOW = 8             # slices a survivor has posted to receive ahead, and has in flight to send


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
    """
    # One chain per (codeword, rebuilder, slice of SLICE bytes): small enough that the hops of successive slices
    # overlap, as in a pipeline. Every rank enumerates every chain in the same order (the tag is the place in it)
    # and keeps those it is on: the tag, the source ranks in order, the rebuilder, its targets, their
    # coefficients (targets x k), this rank's place (len(srcs): the rebuilder), its fragment, the byte range.
    items, tag = [], _CHAIN_TAG
    for cw in plan:
        srcs = [f.rank for f in cw.sources]
        for lost in sorted({t.rank for t in cw.targets}):
            targets = [t for t in cw.targets if t.rank == lost]
            on = rank in srcs or rank == lost
            coeffs = codec.coefficients([f.fragment for f in cw.sources], [t.fragment for t in targets]) if on else None
            for lo in range(0, cs, SLICE):
                if on:
                    pos = srcs.index(rank) if rank in srcs else len(srcs)
                    items.append((tag, srcs, lost, targets, coeffs, pos, cw.sources[pos] if pos < len(srcs) else None,
                                  lo, min(cs, lo + SLICE)))
                tag += 1
    # The rebuilder posts every receive at once, straight into its slots. A survivor keeps WINDOW receives posted
    # ahead of the chain it works on and WINDOW sends in flight, so its extra memory is 2 x WINDOW slices whatever
    # the payload: waiting on its oldest send is safe, as the next rank of that chain has posted the receive or
    # will before it waits on anything of this rank's.
    recvs, copies, ahead = {}, [], 0
    rx = [it for it in items if it[5] > 0]

    def post(upto: int) -> None:
        nonlocal ahead
        while ahead < min(upto, len(rx)):
            tag, srcs, lost, targets, _, pos, _, lo, hi = rx[ahead]
            ahead += 1
            n = hi - lo
            into = [dest(t) for t in targets] if rank == lost else None
            if into is not None and len(into) == 1 and into[0] is not None:
                buf = into[0][lo:hi]   # the finished fragment lands where it belongs
            else:
                buf = torch.empty(len(targets) * n, dtype=torch.uint8)
                if into is not None:
                    copies.append((buf, into, lo, hi))
            recvs[tag] = (buf, pg.irecv(buf, srcs[pos - 1], tag))

    # A lost member is a rebuilder on every chain it is on (it holds no source): every receive now.
    post(len(rx) if any(it[6] is None for it in items) else WINDOW)
    sends, done = [], 0
    for tag, srcs, lost, targets, coeffs, pos, frag, lo, hi in items:
        if frag is None:   # the rebuilder: it only receives
            continue
        if pos > 0:
            done += 1
            post(done + WINDOW)
        n = hi - lo
        mine = source(frag)[lo:hi].numpy()
        out = torch.empty(len(targets) * n, dtype=torch.uint8)
        outs = [out[j * n:(j + 1) * n].numpy() for j in range(len(targets))]
        if pos == 0:
            codec.combine(coeffs[:, :1], [mine], outs)
        else:
            buf, work = recvs.pop(tag)
            work.wait()
            for j in range(len(targets)):
                codec.combine(np.array([[1, coeffs[j, pos]]], dtype=np.uint8),
                              [buf[j * n:(j + 1) * n].numpy(), mine], [outs[j]])
        sends.append((out, pg.isend(out, srcs[pos + 1] if pos + 1 < len(srcs) else lost, tag)))
        if len(sends) > WINDOW:
            sends.pop(0)[1].wait()
    post(len(rx))
    for _, work in recvs.values():
        work.wait()
    for _, work in sends:
        work.wait()
    for buf, into, lo, hi in copies:
        n = hi - lo
        for j, d in enumerate(into):
            if d is not None:
                d[lo:hi].copy_(buf[j * n:(j + 1) * n])
