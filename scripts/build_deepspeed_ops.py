"""Build the DeepSpeed CPU ops that the examples' optimizers load, once per venv (`make venv` runs this).

DeepSpeed JIT-compiles its CPU optimizers with torch's cpp_extension the first time a process loads them:
FusedAdam's CPU build (``"AdamW"`` without ``torch_adam``, DeepSpeed's default), DeepSpeedCPUAdam and
DeepSpeedCPULion (``offload_optimizer``). On the 2-core development machine each build takes 30-40 s, and
the first test or demo trainer that loads the op pays it while the node's other ranks wait for its lock. Built
here, into ``TORCH_EXTENSIONS_DIR`` (the Makefile points it into the venv), every later load finds the build
up to date and only dlopens it.

Run with the venv's python and the environment the trainers get (``DS_ACCELERATOR=cpu`` here): the builders
derive their compiler flags from the accelerator and the CPU, and a build made with other flags is rebuilt.
"""
from __future__ import annotations

import os
import sys
import time

OPS = ("FusedAdamBuilder", "CPUAdamBuilder", "CPULionBuilder")


def main() -> int:
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        print("build_deepspeed_ops: TORCH_EXTENSIONS_DIR is not set; the builds would go to ~/.cache/torch_extensions, "
              "shared by every venv on the machine. Set it (the Makefile does) and run again.", file=sys.stderr)
        return 2
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    failed = []
    for name in OPS:
        builder = acc.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"build_deepspeed_ops: {name} does not apply to accelerator {acc.device_name()}; skipped")
            continue
        t = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as e:   # a compiler problem: say which op, keep building the others
            failed.append(f"{name}: {type(e).__name__}: {e}")
            continue
        print(f"build_deepspeed_ops: {builder.name} ready in {time.perf_counter() - t:.1f} s "
              f"({os.environ['TORCH_EXTENSIONS_DIR']})")
    for f in failed:
        print(f"build_deepspeed_ops: could not build {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
