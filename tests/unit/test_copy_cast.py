"""``copy_and_cast``: the restore's master copy fused with the owner's fp32 -> bf16/fp16 cast, block by block.

The fused result must be what the two whole-tensor copies give, bit for bit: the master equal to the source, the
low-precision params equal to ``lp.copy_(master)``, for every kind of value (rounding ties, subnormals, infinities,
NaNs with payloads and either sign), with a ragged last block and blocks that start off any vector alignment.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from shardsafe.snapshot import state


def _nasty_fp32(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 1e3
    bits = x.view(torch.int32)
    special = np.array([0x7FC00000, 0xFFC00000, 0x7FA00001, 0xFFC00123, 0x7F800001,   # NaNs: quiet, signalling, payloads
                        0x7F800000, 0xFF800000,                                        # +-inf
                        0x00000001, 0x807FFFFF, 0x00400000,                            # subnormals
                        0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x80000000],   # bf16 ties, max, -0
                       dtype=np.uint32).view(np.int32)
    idx = torch.randperm(n, generator=g)[: 40 * len(special)]
    bits[idx] = torch.from_numpy(np.tile(special, 40))
    bits[-len(special):] = torch.from_numpy(special)   # in the ragged last block too
    return x


@pytest.mark.parametrize("lp_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [1000, 4096, 1 << 16])
def test_fused_copy_and_cast_equals_the_two_copies(monkeypatch, lp_dtype, block):
    monkeypatch.setattr(state, "FUSE_BLOCK", block)
    n = 3 * block + 777 if block < (1 << 16) else 150_001
    src = _nasty_fp32(n)
    want_lp = torch.empty(n, dtype=lp_dtype).copy_(src.clone())
    master, lp = torch.full((n,), 7.0), torch.zeros(n, dtype=lp_dtype)
    state.copy_and_cast(master, lp, src)
    assert torch.equal(master.view(torch.int32), src.view(torch.int32))
    assert torch.equal(lp.view(torch.int16), want_lp.view(torch.int16))


def test_shapes_and_layouts_it_cannot_block_fall_back_to_the_two_copies(monkeypatch):
    monkeypatch.setattr(state, "FUSE_BLOCK", 1000)
    src = _nasty_fp32(6000).view(60, 100)
    master = torch.zeros(60, 100)
    lp = torch.zeros(100, 60, dtype=torch.bfloat16).t()   # not contiguous
    want = torch.zeros(100, 60, dtype=torch.bfloat16).t()
    want.copy_(src.clone())   # torch's strided conversion writes NaNs as 0x7fc0, its contiguous one as 0xffff
    state.copy_and_cast(master, lp, src)
    assert torch.equal(master.view(torch.int32), src.view(torch.int32))
    assert torch.equal(lp.contiguous().view(torch.int16), want.contiguous().view(torch.int16))
