"""The "device" parity transport: stripes staged into GPU memory, moved over NCCL, encoded by the CUDA kernels
(:class:`DevicePath`, used by :class:`shardsafe.parity.exchange.ParityExchange` when ``parity_transport`` is
"device"). Imported lazily by nothing CUDA: the class touches torch.cuda only when built."""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch
import xxhash

from .codec import get_codec
from .topology import ParityGroup
from .transport import _BLOCK, ExchangeError, ParityTransport, _blocks

_NO_CUDA = "parity_transport 'device' needs a CUDA device, and torch sees none here; use parity_transport 'host'"


class DevicePath(ParityTransport):
    """The "device" parity transport of :meth:`ParityExchange.encode`: each block of a member's data chunks is
    copied from its data slot into GPU memory, moved to the group's parity holders over NCCL (one batched
    group call per block, so no pair of ranks waits on the other's order), encoded there by the CUDA
    kernels, and the parity is copied back into the holder's parity slot, all on a side stream. Two blocks
    are in flight: block b+1 moves while block b is encoded. Parity is byte for byte that of the host
    transport (same code, same padding, same blocks); only the path of the bytes differs.

    Device memory: two sets of block buffers, 2 * (k + m*k + m) * block bytes (120 MiB for k=7, m=1 and
    4 MiB blocks), plus 2 * m * block bytes of pinned host memory; allocated at the first snapshot, reused.

    Args:
        device: ``torch.device("cuda", i)``. ``torch.device("cpu")`` runs the same pipeline on CPU tensors over
            gloo with the CPU codec: the test double that tests/dist runs where there is no GPU.
        pg: the process group of the parity group's members for the transfers (NCCL for a CUDA device).
        k, m: the group's code.
        block: bytes per block.
    """

    def __init__(self, device: "torch.device", pg: Any, *, k: int, m: int, block: int = 0):
        self.device, self.pg, self.k, self.m = device, pg, k, m
        self.block = block or _BLOCK
        self.cuda = device.type == "cuda"
        self.codec = get_codec(k=k, m=m, backend="cuda" if self.cuda else "auto")
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._bufs: list[dict[str, torch.Tensor]] = []

    @staticmethod
    def default_device() -> "torch.device":
        if not torch.cuda.is_available():
            raise ExchangeError(_NO_CUDA)
        return torch.device("cuda", torch.cuda.current_device())

    @staticmethod
    def check(device: "torch.device", k: int, m: int) -> None:
        """Raise ExchangeError naming what is missing for the device transport on ``device``."""
        import torch.distributed as dist
        if device.type != "cuda":
            return   # the CPU test double: gloo and the CPU codec
        if not torch.cuda.is_available():
            raise ExchangeError(_NO_CUDA)
        if not dist.is_nccl_available():
            raise ExchangeError("parity_transport 'device' moves stripes over NCCL, and this torch has no NCCL; "
                                "use parity_transport 'host'")
        try:
            get_codec(k=k, m=m, backend="cuda")
        except Exception as e:   # any reason the kernels cannot load becomes one ExchangeError naming the fix
            raise ExchangeError(f"parity_transport 'device' encodes with the CUDA kernels, which cannot be used "
                                f"here ({e}); build them (pip install without SHARDSAFE_SKIP_CUDA_BUILD, nvcc on "
                                "PATH) or use parity_transport 'host'") from None

    def _buffers(self, nj: int) -> list[dict[str, torch.Tensor]]:
        if not self._bufs or self._bufs[0]["recv"].shape[0] != nj or self._bufs[0]["send"].shape[1] != self.block:
            B = self.block
            self._bufs = [{"send": torch.empty(self.k, B, dtype=torch.uint8, device=self.device),
                           "recv": torch.empty(nj, self.k, B, dtype=torch.uint8, device=self.device),
                           "par": torch.empty(nj, B, dtype=torch.uint8, device=self.device),
                           "host": torch.empty(nj, B, dtype=torch.uint8, pin_memory=self.cuda)}
                          for _ in range(2)]
        return self._bufs

    def _encode(self, frags: dict[int, torch.Tensor], j: int, out: torch.Tensor) -> None:
        if self.cuda:   # enqueued on the current (side) stream
            self.codec.reconstruct(frags, [self.k + j], out=[out])
        else:
            self.codec.reconstruct({p: t.numpy() for p, t in frags.items()}, [self.k + j], out=[out.numpy()])

    def move_and_encode(self, g: ParityGroup, me: int, data: list[torch.Tensor], pview: np.ndarray, cs: int,
                        first_block: Callable[[], None] = lambda: None) -> tuple[list[str], float]:
        """Move this member's k data chunks (host tensors in its data slot) to their parity holders and encode
        the m shares it holds into ``pview`` (its parity slot). Returns (xxh3 of each share, seconds spent
        waiting for blocks)."""
        import contextlib

        import torch.distributed as dist
        # One entry per (codeword, peer): ordered by codeword on both sides, so the sends from A to B and
        # B's receives from A pair up in the same order (NCCL matches point-to-point traffic by order).
        outs = sorted((stripe.codeword, c, pref.rank) for c, stripe in enumerate(g.data_stripes(me))
                      for pref in stripe.parity)
        ins = sorted((stripe.codeword, j, p, dref.rank) for j, stripe in enumerate(g.parity_stripes(me))
                     for p, dref in enumerate(stripe.data))
        nj = len(g.parity_stripes(me))
        blocks = _blocks(cs, self.block)
        bufs = self._buffers(nj)
        hashers = [xxhash.xxh3_64() for _ in range(nj)]

        def post(b: int) -> list:
            a, z = blocks[b]
            w, buf = z - a, bufs[b % 2]
            for c in range(len(data)):   # H2D (async from the registered data slot) on the side stream
                buf["send"][c, :w].copy_(data[c][a:z], non_blocking=self.cuda)
            ops = [dist.P2POp(dist.isend, buf["send"][c, :w], peer, group=self.pg) for _, c, peer in outs]
            ops += [dist.P2POp(dist.irecv, buf["recv"][j, p, :w], peer, group=self.pg) for _, j, p, peer in ins]
            return dist.batch_isend_irecv(ops) if ops else []

        t_wait = 0.0
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            works = post(0)
            for b, (a, z) in enumerate(blocks):
                w, buf = z - a, bufs[b % 2]
                tw = time.perf_counter()
                for work in works:   # NCCL: the side stream waits; gloo: the host waits
                    work.wait()
                t_wait += time.perf_counter() - tw
                if b == 0:
                    first_block()
                # Block b+1 goes on the wire while b is encoded; its buffers were block b-1's, which is done.
                works = post(b + 1) if b + 1 < len(blocks) else []
                for j in range(nj):
                    self._encode({p: buf["recv"][j, p, :w] for p in range(self.k)}, j, buf["par"][j, :w])
                    buf["host"][j, :w].copy_(buf["par"][j, :w], non_blocking=self.cuda)
                if self.cuda:
                    self.stream.synchronize()
                for j in range(nj):
                    out = pview[j * cs + a: j * cs + z]
                    np.copyto(out, buf["host"][j, :w].numpy())
                    hashers[j].update(out)
        return [format(h.intdigest(), "016x") for h in hashers], t_wait
