"""The rank state of the parity-group tests (exchange, scrub, timelines, placement): WORLD ranks, one per 'node'."""
import torch

from shardsafe.snapshot.state import RankState, StateAdapter

WORLD = 3
"""Ranks (and holders, one per 'node') of the parity-group tests: one RS(2, 1) group over 3 nodes."""


class Shard(StateAdapter):
    """A DP shard: equal-sized tensors whose content depends on (rank, version)."""

    def __init__(self, rank: int, version: int, n: int = 300_007):
        g = torch.Generator().manual_seed(1000 * rank + version)
        self.t = {"master": torch.randn(n, generator=g),
                  "exp_avg": torch.randn(n, generator=g).to(torch.bfloat16),
                  "step": torch.tensor(float(version))}
        self.meta = {"version": version}

    def capture(self):
        return RankState(dict(self.t), dict(self.meta))

    def apply(self, tensors, meta):
        for k, v in self.t.items():
            v.copy_(tensors[k])
        self.meta = dict(meta)

    def equals(self, other) -> bool:
        return all(torch.equal(self.t[k], other.t[k]) for k in self.t) and self.meta == other.meta


def flip(client, rank, version, kind, offset):
    slot = next(s["slot"] for s in client.list(rank)[str(rank)][kind] if s["version"] == version)
    mm = client._maps[slot]   # the writable mapping the pipeline used
    mm[offset] ^= 0x5A
