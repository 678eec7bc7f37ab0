"""The hidden optimizer state of DeepSpeed's CPU Adam kernels: the running products beta1^t and beta2^t.

DeepSpeed's CPU Adam kernel (``csrc/includes/cpu_adam.h``, ``Adam_Optimizer::IncrementStep``) keeps
the bias-correction powers in a C++ object, not in ``optimizer.state``: when called with
``step == _step + 1`` and unchanged betas it multiplies ``_betta1_t *= beta1`` in float32; otherwise it
recomputes ``_betta1_t = pow(beta1, step)``. The two differ in the last bits after a few steps. A process
restarted at step v therefore computes step v+1 with ``pow(beta, v+1)`` where the uninterrupted run used
the float32 product chain, and every later loss differs (relative 1e-5 .. 1e-4). Two optimizers of
DeepSpeed's config path run this kernel:

- ``FusedAdam`` (``"optimizer": {"type": "Adam"|"AdamW"}`` without ``torch_adam``) on the CPU
  accelerator: the CPU build of ``multi_tensor_adam`` keeps one static C++ optimizer per Adam mode
  (AdamW / L2), created with placeholder betas 0.0. (The CUDA build computes ``1 - beta^step`` on every
  call and has no such state.)
- ``DeepSpeedCPUAdam`` (ZeRO-Offload, ``offload_optimizer.device: cpu``) on any accelerator: one C++
  optimizer per instance, created with the configured betas and step 0.

A product chain is fully described by where it (re)started, ``s0`` (the step of the last ``pow``), the
step it reached, and the betas; :class:`AdamPowersTracker` observes every kernel call to keep that
description (it mirrors ``IncrementStep`` exactly), it goes into the snapshot's metadata, and on restore
the fresh C++ object is brought to the same chain by calling the kernel on a one-element dummy
parameter: one ``pow`` call at the newest step where the chain still equals ``pow`` (found in numpy with
the same float32 rounding), then one multiplying call per step after it. That costs one kernel call per
step since the chain last equalled ``pow``, each on one element: microseconds per step.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np
import torch

from shardsafe.errors import InternalError

# kernel call signature used for the replay: (step, lr, beta1, beta2, eps, weight_decay, bias_correction)
_Replay = Callable[[int, float, float, float], None]


def _f32(x: float) -> np.float32:
    return np.float32(x)


class AdamChain:
    """A mirror of one C++ ``Adam_Optimizer``'s (``_step``, ``_betta1``, ``_betta2``) and the start ``s0`` of
    its product chain (``_betta*_t == f32(pow(beta, s0))`` then multiplied by beta once per step since)."""

    def __init__(self, beta1: float, beta2: float, step: int = 0):
        self.b1, self.b2 = float(_f32(beta1)), float(_f32(beta2))
        self.step = self.s0 = int(step)

    def observe(self, step: int, beta1: float, beta2: float) -> None:
        """What ``IncrementStep(step, beta1, beta2)`` does to the C++ object, in the same order of tests."""
        b1, b2, step = float(_f32(beta1)), float(_f32(beta2)), int(step)
        if b1 != self.b1 or b2 != self.b2:
            self.b1, self.b2, self.step, self.s0 = b1, b2, step, step
        elif step == self.step + 1:
            self.step = step
        elif step != self.step:
            self.step = self.s0 = step

    def state(self) -> dict[str, Any]:
        return {"s0": self.s0, "step": self.step, "beta1": self.b1, "beta2": self.b2}

    def replay_start(self) -> int:
        """The newest step j in [s0, step] at which the float32 product chain equals ``f32(pow(beta, j))`` for
        both betas: replaying from j (one pow call, then step - j multiplications) gives the same bits."""
        if self.step <= self.s0:
            return self.s0
        chains = []
        for b in (self.b1, self.b2):
            factors = np.full(self.step - self.s0 + 1, np.float32(b), dtype=np.float32)
            factors[0] = _f32(math.pow(b, self.s0))   # C++: float _betta_t = pow(double, double) (libm, as here)
            # sequential float32 products, as `_betta_t *= _betta` (accumulate does not reassociate)
            chains.append(np.multiply.accumulate(factors, dtype=np.float32))
        for j in range(self.step, self.s0, -1):       # newest first: usually the chain left pow long ago
            i = j - self.s0
            if all(c[i] == _f32(math.pow(b, j)) for c, b in zip(chains, (self.b1, self.b2))):
                return j
        return self.s0


class AdamPowersTracker:
    """Observe and restore the hidden beta powers of the CPU Adam kernel an optimizer uses.

    ``for_optimizer`` returns None for optimizers without such state (torch optimizers, CUDA FusedAdam,
    Lion, Adagrad: their kernels read the step from ``optimizer.state`` on every call).
    """

    def __init__(self, kind: str, chain: AdamChain, call: _Replay, key: str):
        self.kind, self.chain, self._call, self.key = kind, chain, call, key
        self.replayed_calls = 0

    @classmethod
    def for_optimizer(cls, opt: Any) -> Optional["AdamPowersTracker"]:
        name = type(opt).__name__
        if name == "DeepSpeedCPUAdam" and hasattr(opt, "ds_opt_adam"):
            return cls._wrap_cpu_adam(opt)
        if name == "FusedAdam" and hasattr(opt, "multi_tensor_adam") and _cpu_accelerator():
            return cls._wrap_fused_cpu(opt)
        return None

    # ---- the two kernels ----------------------------------------------------------------------------
    @classmethod
    def _wrap_cpu_adam(cls, opt: Any) -> "AdamPowersTracker":
        betas = opt.param_groups[0]["betas"] if opt.param_groups else opt.defaults["betas"]
        chain = AdamChain(betas[0], betas[1])   # create_adam(opt_id, lr, beta1, beta2, ...): _step 0, _betta_t 1
        op = opt.ds_opt_adam

        class _Observed:
            """The op module with adam_update observed (everything else passes through)."""

            def __getattr__(self, name: str) -> Any:
                return getattr(op, name)

            def adam_update(self, opt_id, step, lr, beta1, beta2, *rest):
                chain.observe(step, beta1, beta2)
                return op.adam_update(opt_id, step, lr, beta1, beta2, *rest)

        opt.ds_opt_adam = _Observed()
        p, g, m, v = _dummy(4)

        def call(step: int, lr: float, beta1: float, beta2: float) -> None:
            opt.ds_opt_adam.adam_update(opt.opt_id, step, lr, beta1, beta2, 1e-8, 0.0, True, p, g, m, v)

        return cls("DeepSpeedCPUAdam", chain, call, f"cpu_adam/{opt.opt_id}")

    @classmethod
    def _wrap_fused_cpu(cls, opt: Any) -> "AdamPowersTracker":
        mode = int(getattr(opt, "adam_w_mode", 1))
        # One static C++ optimizer per mode and process, created on the first call with placeholder betas 0.0.
        chain = _FUSED_CHAINS.setdefault(mode, AdamChain(0.0, 0.0))
        op = opt.multi_tensor_adam

        def observed(chunk, noop, lists, lr, beta1, beta2, eps, step, mode_, *rest):
            if lists and len(lists[0]) > 0:   # the C++ loop calls IncrementStep once per tensor, none if empty
                chain.observe(step, beta1, beta2)
            return op(chunk, noop, lists, lr, beta1, beta2, eps, step, mode_, *rest)

        opt.multi_tensor_adam = observed
        p, g, m, v = _dummy(4)
        noop = torch.zeros(1, dtype=torch.int)

        def call(step: int, lr: float, beta1: float, beta2: float) -> None:
            observed(2048 * 32, noop, [[g], [p], [m], [v]], lr, beta1, beta2, 1e-8, step, mode, 1, 0.0)

        return cls("FusedAdam(cpu)", chain, call, f"fused_adam_cpu/{mode}")

    # ---- snapshot / restore -------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key, **self.chain.state()}

    def restore(self, saved: dict[str, Any]) -> int:
        """Bring the C++ object to ``saved``'s chain. Returns the number of kernel calls it took."""
        target = AdamChain(saved["beta1"], saved["beta2"])
        target.s0, target.step = int(saved["s0"]), int(saved["step"])
        if target.step == self.chain.step and target.s0 == self.chain.s0 and \
                (target.b1, target.b2) == (self.chain.b1, self.chain.b2):
            return 0
        if target.step == 0:
            # Never stepped: a fresh object is in that state (placeholder or constructor betas, step 0).
            if self.chain.step != 0:
                raise InternalError(f"{self.kind}: cannot rewind the kernel's beta powers to step 0 "
                                 f"(it is at step {self.chain.step})")
            return 0
        start = max(target.replay_start(), 1)
        calls = 0
        # A pow call needs the object to take IncrementStep's pow branch: a step other than _step + 1 or
        # other betas. Detour through a step that forces it if the object would multiply instead.
        if start == self.chain.step + 1 and (target.b1, target.b2) == (self.chain.b1, self.chain.b2) \
                and self.chain.step != 0:
            self._call(start + 1, 0.0, target.b1, target.b2)
            calls += 1
        for s in range(start, target.step + 1):
            self._call(s, 0.0, target.b1, target.b2)   # lr 0: the dummy parameter does not matter anyway
            calls += 1
        if (self.chain.step, self.chain.b1, self.chain.b2) != (target.step, target.b1, target.b2):
            raise InternalError(f"{self.kind}: replaying the beta powers reached {self.chain.state()}, "
                               f"expected {target.state()}")
        self.replayed_calls = calls
        return calls


_FUSED_CHAINS: dict[int, AdamChain] = {}


def _cpu_accelerator() -> bool:
    try:
        from deepspeed.accelerator import get_accelerator
        return get_accelerator().device_name() == "cpu"
    except Exception:   # no DeepSpeed accelerator: not DeepSpeed's CPU FusedAdam
        return False


def _dummy(n: int) -> list[torch.Tensor]:
    # fp32 parameter, gradient and moments of one element: the replay's kernel calls update them, not the model
    return [torch.zeros(1, dtype=torch.float32) for _ in range(n)]
