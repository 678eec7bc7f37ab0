"""What the parity transports share: their error, and how a chunk is cut into the blocks that move while
earlier ones are encoded (:mod:`.exchange` moves them over gloo from the holders' memory, :mod:`.device` over
NCCL through GPU memory)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import numpy as np
import torch

from ..errors import ShardsafeError
from .topology import ParityGroup


class ExchangeError(RuntimeError, ShardsafeError):
    """Parity could not be computed or a payload could not be rebuilt; the message says why."""


_BLOCK = 4 << 20   # bytes per transfer block: large enough for gloo's throughput, small enough to overlap


def _blocks(cs: int, block: int = _BLOCK) -> list[tuple[int, int]]:
    """[start, end) ranges covering a chunk of ``cs`` bytes (64-byte aligned starts: ISA-L's vector loads)."""
    return [(a, min(cs, a + block)) for a in range(0, cs, block)] or [(0, 0)]


class ParityTransport(ABC):
    """How one member's data chunks reach its group's parity holders and become parity, after a snapshot
    (:meth:`shardsafe.parity.exchange.ParityExchange.encode` chooses one at construction: :class:`HostTransport`
    for ``parity_transport: host``, :class:`~shardsafe.parity.device.DevicePath` for ``device``). Votes, manifests
    and the rebuild after a node loss stay on the group's gloo group whichever moves the stripes."""

    @abstractmethod
    def move_and_encode(self, g: ParityGroup, me: int, data: list[torch.Tensor], pview: np.ndarray, cs: int,
                        first_block: Callable[[], None]) -> tuple[list[str], float]:
        """Every member calls it for the same version. Move member ``me``'s k data chunks (``data``, host tensors of
        ``cs`` bytes in its data slot) to their parity holders, and encode the parity shares ``me`` holds into
        ``pview`` (its parity slot, m x cs bytes); ``first_block()`` runs once the first block has arrived (a fault
        injection point).

        Returns:
            (the xxh3 of each parity share, as the manifest records it; seconds spent waiting for blocks)."""

    def rebuild_groups(self, generation: int) -> None:
        """A failed exchange left the transport's own group unusable: build it again under ``generation``."""

