"""The restore's peer-shard cast (``shardsafe.snapshot.state.cast_like_owner``) on a GPU: a CPU fp32 shard cast
into a GPU bf16/fp16 buffer must equal the owner's GPU-side cast bit for bit, edge values included.

Skipped (with the reason) without a GPU; ``scripts/gpu_check.sh`` runs tests/gpu with ``-rs``.
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip(f"no CUDA device visible to torch {torch.__version__}: the GPU cast runs in scripts/gpu_check.sh",
                allow_module_level=True)

from shardsafe.snapshot import state  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_like_owner_equals_the_device_cast(dtype, monkeypatch):
    monkeypatch.setattr(state, "CAST_CHUNK", 1000)   # several staged chunks, a ragged last one
    g = torch.Generator().manual_seed(7)
    src = torch.randn(12345, generator=g) * torch.logspace(-45, 38, 12345)
    edge = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45, 3.3895e38, 1.0009765625,
                         1.00390625, 65504.0, 65520.0, 2.0 ** -24, 2.0 ** -25])
    src = torch.cat([src, edge])
    owner = src.cuda().to(dtype)                 # what the owner's copy_ computes on its device
    dst = torch.empty(src.numel(), dtype=dtype, device="cuda")
    state.cast_like_owner(dst, src)
    torch.cuda.synchronize()
    assert torch.equal(dst.view(torch.int16), owner.view(torch.int16))
