"""Megatron's module-level state, forgotten on a rank that restarts in place (shardsafe.inplace).

``megatron.core.parallel_state`` keeps every group it made (tensor, pipeline, data, context, expert, and their gloo
copies) and its global memory buffer at module level, and ``initialize_model_parallel`` refuses to run while they
are set; ``num_microbatches_calculator`` keeps the calculator Megatron-LM's initialize sets. Megatron-LM keeps its
arguments, timers, tokenizer, writers and signal handler in ``megatron.training.global_vars`` (each refuses to be
set twice) and the rerun state machine in ``megatron.core.rerun_state_machine``. After an in-place restart the
groups are destroyed and the next attempt initialises all of them again: they are cleared first, with Megatron's
own ``destroy_global_state`` where Megatron-LM is loaded (what its in-process restart,
``megatron.training.inprocess_restart``, calls between attempts), and megatron-core's destroy functions otherwise.
"""
from __future__ import annotations

import sys


def forget_parallel_state() -> None:
    """Clear Megatron's parallel state, microbatch calculator and, where Megatron-LM's loop was imported, its global
    variables, rerun state machine and persistent asynchronous checkpoint worker (nothing for what was never
    imported)."""
    training = sys.modules.get("megatron.training.training")
    if training is not None and hasattr(training, "destroy_global_state"):
        _reset_async_worker()   # needs the arguments, which destroy_global_state clears
        training.destroy_global_state()
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None:
        ps.destroy_model_parallel()
    calc = sys.modules.get("megatron.core.num_microbatches_calculator")
    if calc is not None and hasattr(calc, "destroy_num_microbatches_calculator"):
        calc.destroy_num_microbatches_calculator()
    rerun = sys.modules.get("megatron.core.rerun_state_machine")
    if rerun is not None and hasattr(rerun, "destroy_rerun_state_machine"):
        rerun.destroy_rerun_state_machine()


def _reset_async_worker() -> None:
    """``--async-save`` with a persistent worker: its queue belongs to the abandoned attempt (Megatron-LM's own
    in-process restart resets it on abort)."""
    utils = sys.modules.get("megatron.training.async_utils")
    gv = sys.modules.get("megatron.training.global_vars")
    if utils is None or gv is None or getattr(utils, "_async_calls_queue", None) is None:
        return
    args = getattr(gv, "_GLOBAL_ARGS", None)
    if args is not None and hasattr(utils, "reset_persistent_async_worker"):
        utils.reset_persistent_async_worker(getattr(args, "async_strategy", None))
