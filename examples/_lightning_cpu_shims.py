"""A GPU stand-in for Lightning's DeepSpeed strategy on a machine without one (this project's CPU CI).

``lightning.pytorch.strategies.DeepSpeedStrategy.setup_environment`` accepts only a ``CUDAAccelerator`` and
raises otherwise ("The DeepSpeed strategy is only supported on CUDA GPUs"), although DeepSpeed itself runs on its
CPU accelerator (``DS_ACCELERATOR=cpu``). :class:`CPUStandInForCUDA` is a ``CUDAAccelerator`` whose devices are
the CPU: it is the test double for the GPU, nothing else. On a GPU machine use ``accelerator="gpu"``.
"""
from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators.cuda import CUDAAccelerator


class CPUStandInForCUDA(CUDAAccelerator):
    """Lightning's CUDA accelerator with the CPU as its devices (no ``torch.cuda`` call anywhere)."""

    def setup_device(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"CPUStandInForCUDA runs on the CPU; got device {device}")

    def setup(self, trainer: Any) -> None:
        pass   # CUDAAccelerator.setup sets NVIDIA flags and clears the CUDA cache

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return {}

    def teardown(self) -> None:
        pass

    @staticmethod
    def parse_devices(devices: Any) -> int:
        return int(devices)

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        # indexed like CUDA devices: the strategy checks that device i belongs to local rank i
        return [torch.device("cpu", i) for i in range(int(devices))]

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True
