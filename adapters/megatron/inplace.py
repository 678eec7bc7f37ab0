"""megatron-core's module-level state, forgotten on a rank that restarts in place (shardsafe.inplace).

``megatron.core.parallel_state`` keeps every group it made (tensor, pipeline, data, context, expert, and their gloo
copies) and its global memory buffer at module level, and ``initialize_model_parallel`` refuses to run while they
are set; ``num_microbatches_calculator`` keeps the calculator Megatron-LM's initialize sets. After an in-place
restart the groups are destroyed and the next attempt's ``train`` initialises them again: megatron-core's own
``destroy_model_parallel`` and ``destroy_num_microbatches_calculator`` clear them first. Megatron-LM's global
arguments, timers and tokenizer (``megatron.training.global_vars``) are not cleared: its ``pretrain`` does not run
twice in one process.
"""
from __future__ import annotations

import sys


def forget_parallel_state() -> None:
    """Clear megatron-core's parallel state and microbatch calculator (nothing when megatron-core was never
    imported)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None:
        ps.destroy_model_parallel()
    calc = sys.modules.get("megatron.core.num_microbatches_calculator")
    if calc is not None and hasattr(calc, "destroy_num_microbatches_calculator"):
        calc.destroy_num_microbatches_calculator()
