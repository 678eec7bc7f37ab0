"""CPU SHIMS FOR megatron-core — test and example use only, never imported by shardsafe itself.

megatron-core assumes CUDA in a handful of places (RNG tracker, `torch.cuda.current_device()` as the
allocation device, `device='cuda'` literals, `Tensor.type()` strings such as 'torch.cuda.FloatTensor',
streams/events). These monkeypatches make its local (non-TE) GPT, DDP, DistributedOptimizer and the
pipeline schedules run on CPU over gloo, so that the shardsafe Megatron adapter can be tested on a
machine without a GPU (each shim's comment names the failure it removes).

They pretend CUDA exists, so they are process-global and irreversible: install them only in a process
that does nothing but CPU Megatron work (a forked test rank, the example script). ``install()`` refuses
to run where a real GPU is present, because there the shims would silently move work to the CPU.
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_MODE = None


class _NullStream:
    """Stands in for torch.cuda.Stream / current_stream(): everything is synchronous on CPU."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _is_cuda_device(d) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrite device='cuda' / 'cuda:N' / N in factory calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if getattr(func, "__name__", "") == "to" and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def install() -> None:
    """Install every shim (idempotent). Call before building any Megatron object."""
    global _INSTALLED, _MODE
    if _INSTALLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("examples/_megatron_cpu_shims.install(): a CUDA device is present; run Megatron on it "
                           "instead of installing the CPU shims (unset CUDA_VISIBLE_DEVICES only for CPU tests).")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    # Tensor.type() with no argument: Megatron switches on the CUDA type names.
    orig_type = torch.Tensor.type

    def fake_type(self, *args, **kwargs):
        if args or kwargs:
            return orig_type(self, *args, **kwargs)
        name = orig_type(self)
        return _TYPE_NAMES.get(name, name)

    torch.Tensor.type = fake_type

    # RNG: the CUDA RNG tracker swaps the CPU generator instead of a CUDA one.
    import megatron.core.tensor_parallel.random as R

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda s, device="cuda": torch.set_rng_state(s)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed only the CPU generator here.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    R._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    R._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # With one generator behind both, the tracker's "CPU RNG state changed within GPU RNG context"
    # warning fires on every fork and means nothing here.
    logging.getLogger(R.__name__).setLevel(logging.ERROR)

    # Allocation device and stream/sync APIs.
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.device_count = lambda: 1
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.empty_cache = lambda: None
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.memory_reserved = lambda *a, **k: 0
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_reserved = lambda *a, **k: 0
    torch.Tensor.cuda = lambda self, *a, **k: self

    # megatron-core 0.16's MoE router reads a module global that only exists when Transformer Engine
    # imported (moe_utils.te_general_gemm: NameError without TE); its torch.mm fallback is what runs here.
    try:
        import megatron.core.transformer.moe.moe_utils as moe_utils
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    except ImportError:
        pass

    _MODE = _CudaToCpu()
    _MODE.__enter__()  # kept referenced in _MODE: the mode stays active for the process lifetime
    _INSTALLED = True


class _FakeDeviceProps:
    major, minor, name, total_memory, multi_processor_count = 8, 0, "cpu-shim", 1 << 34, 1


def install_training_shims() -> None:
    """Extra patches for Megatron-LM's ``megatron.training`` loop on CPU (megatron-core >= 0.17 wheels).

    On top of ``install()``: ``initialize_megatron(allow_no_cuda=True)`` (it asserts a GPU otherwise),
    no dataset-helper compilation or JIT warm-up (both need CUDA/make; the examples use their own
    mock dataset), device properties for validate_args, and memory statistics.
    """
    install()
    import megatron.training.initialize as I
    import megatron.training.training as T

    torch.cuda.get_device_properties = lambda *a, **k: _FakeDeviceProps()
    torch.cuda.get_device_capability = lambda *a, **k: (8, 0)
    torch.cuda.memory_stats = lambda *a, **k: {}
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None

    orig_init = I.initialize_megatron

    def initialize_megatron(*a, **k):
        k["allow_no_cuda"] = True
        return orig_init(*a, **k)

    T.initialize_megatron = initialize_megatron
    I._compile_dependencies = lambda: None
    T.set_jit_fusion_options = lambda *a, **k: None
