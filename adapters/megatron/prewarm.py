"""Start-up work of a Megatron-LM trainer that a fork server does once for every trainer it forks.

Listed in ``PRELOAD_MEGATRON`` as ``shardsafe.adapters.megatron.prewarm:import_tokenizers`` (shardsafe/launch/prewarm.py
calls it after the imports, before it forks anything; if it raises, the trainers import the module themselves).
"""
from __future__ import annotations

import importlib
import importlib.util

# Where Megatron-LM keeps the tokenizer classes its ``initialize_megatron`` builds, newest layout first.
TOKENIZER_MODULES = ("megatron.core.tokenizers.text", "megatron.training.tokenizer.tokenizer")


def import_tokenizers() -> str:
    """Import Megatron-LM's tokenizer module, where Megatron-LM's loop (``megatron.training``) is installed.

    ``initialize_megatron`` builds the tokenizer on every start, and its module imports transformers (whose import
    scans its model registry): measured as the largest import left in a forked Megatron-LM trainer, more than
    megatron.training itself. A program on megatron-core alone builds no tokenizer, so its server does not import
    it for nothing. Returns a line for the server's log."""
    if importlib.util.find_spec("megatron.training") is None:
        return "megatron.training is not installed (a megatron-core program): tokenizers not preloaded"
    for name in TOKENIZER_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):   # this Megatron version keeps them elsewhere
                continue
            raise
        return f"preloaded {name}"
    return f"none of {', '.join(TOKENIZER_MODULES)} exists in this Megatron version: tokenizers not preloaded"
