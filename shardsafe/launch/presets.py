"""What a fork server preloads: the presets behind ``--preload deepspeed|megatron|hf`` and their parser.

A fork server (:mod:`.prewarm`) imports these modules once; every trainer of every attempt is forked from it
instead of importing them again. ``shardsafe launch``, ``shardsafe agent`` (and with it the sbatch scripts'
``SS_PRELOAD``) and ``shardsafe demo`` take a preset name or an explicit comma-separated list
(:func:`preload_modules`). Standard library only: the launch commands parse ``--preload`` without importing
the launchers.
"""
from __future__ import annotations

import re

from ..errors import ConfigError

PRELOAD_DEEPSPEED = ("torch", "deepspeed", "torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer",
                     "deepspeed.module_inject.auto_ep_layer", "torch.utils.cpp_extension",
                     "shardsafe.adapters.deepspeed.prewarm:remember_cpu_info",
                     "shardsafe.adapters.deepspeed.prewarm:probe_compatible_ops", "shardsafe.runtime",
                     "shardsafe.adapters.deepspeed.engine")
"""The heavy imports of a DeepSpeed ZeRO trainer before its first step (``python -X importtime`` shows them as most
of its start): torch._dynamo comes with torch.optim's first step (torch >= 2.1); DeepSpeed >= 0.18's ZeRO and
bf16 optimizers import the Muon optimizer, which compiles its kernels with torch.compile at import
(a submodule an older DeepSpeed lacks is skipped); DeepSpeed 0.19.8's engine imports its AutoEP layer (and
with it its Triton ops and MoE modules) in every ``initialize``. Then what loading one of DeepSpeed's
JIT-built CPU ops costs every trainer (FusedAdam's CPU build is DeepSpeed's default optimizer;
CPUAdam/Lion/Adagrad under offload): torch's cpp_extension module (it imports setuptools) and
py-cpuinfo's answer, asked once for every trainer instead of twice per op each trainer loads (a Python subprocess
each time: adapters/deepspeed/prewarm.py), and DeepSpeed's op-compatibility probe (a C compiler run, on the CPU
accelerator only: on a GPU it queries the device). shardsafe's own runtime last: the few dozen modules that
``initialize`` would otherwise import on every restart (they start no thread and open nothing at import)."""

PRELOAD_MEGATRON = ("torch", "torch._dynamo", "megatron.core", "shardsafe.adapters.megatron.prewarm:import_tokenizers",
                    "shardsafe.runtime", "shardsafe.adapters.megatron.core_api", "shardsafe.adapters.megatron.hooks")
"""The heavy imports of a megatron-core trainer (megatron.core alone is seconds of CPU), Megatron-LM's tokenizers
where its loop is installed (its ``initialize_megatron`` builds one on every start; that module imports
transformers), then shardsafe's runtime."""

PRELOAD_HF = (*PRELOAD_DEEPSPEED, "transformers", "transformers.trainer", "accelerate", "shardsafe.adapters.hf")
"""A Hugging Face ``Trainer`` (or Accelerate) program on DeepSpeed: the DeepSpeed preset, then transformers'
Trainer module (its import pulls in the model registry: after torch and DeepSpeed the largest import of such a
trainer), Accelerate, and the Trainer glue that the automatic activation installs when ``transformers.trainer``
is imported (a protected engine imports :mod:`shardsafe.adapters.hf` anyway)."""

PRESETS: dict[str, tuple[str, ...]] = {"deepspeed": PRELOAD_DEEPSPEED, "megatron": PRELOAD_MEGATRON,
                                       "hf": PRELOAD_HF, "none": ()}
"""``--preload NAME``: the preset for the framework the trainers run; ``none`` starts every trainer cold."""

RUNTIME_MODULES = ("shardsafe.runtime", "shardsafe.adapters.deepspeed.engine", "shardsafe.adapters.megatron.core_api",
                   "shardsafe.adapters.megatron.hooks", "shardsafe.adapters.hf")
"""shardsafe's runtime and framework adapters in the presets: what an unprotected run's server leaves out."""


def without_runtime(modules: tuple[str, ...]) -> tuple[str, ...]:
    """``modules`` without shardsafe's runtime and adapters: a server for unprotected runs (a reference, an
    oracle), which import the frameworks as the protected ones do and nothing of shardsafe's runtime. Function
    entries stay (py-cpuinfo's answer is remembered as for the protected runs)."""
    return tuple(m for m in modules if m not in RUNTIME_MODULES)


_ENTRY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(:[A-Za-z_][A-Za-z0-9_]*)?")


def preload_modules(text: str) -> tuple[str, ...]:
    """The modules ``--preload TEXT`` names: a preset (:data:`PRESETS`) when TEXT is exactly its name, else a
    comma-separated list of modules (``module:function`` calls the function once in the server; see
    :mod:`.prewarm`). '' and ``none``: nothing (trainers start cold).

    Raises:
        ConfigError: an entry that is no module name (a path, a space inside a name, ``-``).
    """
    t = (text or "").strip()
    if t in PRESETS:
        return PRESETS[t]
    mods = tuple(m.strip() for m in t.split(",") if m.strip())
    bad = [m for m in mods if not _ENTRY.fullmatch(m)]
    if bad:
        raise ConfigError(f"preload {text!r}: {', '.join(map(repr, bad))} is no module name; expected a preset "
                          f"({', '.join(PRESETS)}) or modules separated by commas, e.g. torch,deepspeed "
                          "(module:function calls that function once in the fork server)")
    return mods
