"""Page-locking the restore's mapping (shardsafe/snapshot/pinning.py) without a GPU.

The CUDA runtime cannot exist on this machine, so these tests replace ``torch.cuda.cudart()``,
``set_device`` and ``synchronize`` with a recording double and give PinnedMapping live "tensors" that
say they are on a GPU: what they pin down is the contract around the driver (which bytes are registered
with which flags, the fallback to pageable memory, unregister-before-close), not CUDA itself.
tests/gpu/test_snapshot_cuda.py runs the real thing (scripts/gpu_check.sh).
"""
from __future__ import annotations

import logging
import mmap
import threading
import time

import numpy as np
import pytest
import torch

from shardsafe.config import ConfigError, ShardsafeConfig
from shardsafe.snapshot import pinning
from shardsafe.snapshot.pinning import PinnedMapping


class FakeCudart:
    """Records cudaHostRegister/Unregister; ``rc`` is what register returns (0 = success)."""

    def __init__(self, rc: int = 0, gate: threading.Event | None = None):
        self.rc, self.gate, self.calls = rc, gate, []

    def cudaHostRegister(self, ptr, size, flags):
        if self.gate is not None:
            self.gate.wait(5)
        self.calls.append(("register", ptr, size, flags))
        return self.rc

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


class OnGpu:
    is_cuda = True
    device = torch.device("cuda", 0)


@pytest.fixture
def fake_cuda(monkeypatch):
    rt = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: rt.calls.append(("set_device", str(d))))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: rt.calls.append(("synchronize", str(d))))
    monkeypatch.setattr(pinning, "_warned", set())
    return rt


def _mapping(n: int = 1 << 16) -> mmap.mmap:
    rw = mmap.mmap(-1, n)
    rw.write(b"\x07" * n)
    return rw


def _closed_soon(mm, timeout_s: float = 10.0) -> bool:
    """The mapping is unmapped by a thread of close()'s (pinning._unmap_later)."""
    end = time.monotonic() + timeout_s
    while not mm.closed and time.monotonic() < end:
        time.sleep(0.005)
    return mm.closed


def test_the_unmap_runs_off_the_callers_thread():
    """Tearing down a populated mapping's page tables is ~0.75x a memcpy of its bytes on 4 KiB pages: the restore
    returns without waiting for it."""
    done, names = threading.Event(), []

    class Mapping:
        def __len__(self):
            return 4096

        def close(self):
            names.append(threading.current_thread().name)
            done.set()

    pin = PinnedMapping(Mapping(), {"w": torch.zeros(4)})
    pin.close()
    assert pin.mm is None and done.wait(10) and names == ["shardsafe-unmap"]


def test_registers_the_whole_mapping_read_only_and_unregisters_before_closing(fake_cuda):
    mm = _mapping()
    addr = int(np.frombuffer(mm, dtype=np.uint8).ctypes.data)
    pin = PinnedMapping(mm, {"w": OnGpu()})
    assert pin.wait() == "pinned"
    assert ("register", addr, len(mm), 0x01 | 0x08) in fake_cuda.calls   # portable | read-only
    assert pin.notes()["h2d"] == "pinned" and pin.notes()["pin_s"] >= 0
    pin.close()
    kinds = [c[0] for c in fake_cuda.calls]
    assert kinds[-2:] == ["synchronize", "unregister"] and fake_cuda.calls[-1][1] == addr
    assert _closed_soon(mm) and pin.mm is None
    pin.close()   # idempotent: the restore's error paths may close twice
    assert [c[0] for c in fake_cuda.calls].count("unregister") == 1


def test_a_refused_registration_falls_back_to_pageable_and_warns_once(fake_cuda, caplog):
    fake_cuda.rc = 801   # cudaErrorNotSupported: no read-only registration on this device
    for _ in range(2):
        pin = PinnedMapping(_mapping(), {"w": OnGpu()})
        with caplog.at_level(logging.WARNING, logger="shardsafe.snapshot.pinning"):
            assert pin.wait() == "pageable"
        assert pin.notes()["h2d"] == "pageable" and "801" in pin.notes()["h2d_why"]
        pin.close()
    assert "unregister" not in [c[0] for c in fake_cuda.calls]
    assert sum("pageable memory" in r.getMessage() for r in caplog.records) == 1


def test_pinning_runs_beside_the_caller_and_close_waits_for_it(fake_cuda):
    fake_cuda.gate = gate = threading.Event()
    mm = _mapping()
    pin = PinnedMapping(mm, {"w": OnGpu()})
    assert pin.state == "pinning" and not fake_cuda.calls[1:]   # the caller goes on (verifies) meanwhile
    gate.set()
    pin.close()   # never closes a mapping the driver is still pinning
    assert [c[0] for c in fake_cuda.calls][-3:] == ["register", "synchronize", "unregister"] and _closed_soon(mm)


def test_nothing_is_pinned_for_cpu_tensors_or_when_pageable_is_asked(fake_cuda):
    cpu = PinnedMapping(_mapping(), {"w": torch.zeros(4)})
    assert cpu.wait() == "cpu" and cpu.notes() == {}
    cpu.close()
    pageable = PinnedMapping(_mapping(), {"w": OnGpu()}, mode="pageable")
    assert pageable.wait() == "pageable" and pageable.notes()["h2d_why"] == "restore_h2d='pageable'"
    pageable.close()
    assert fake_cuda.calls == []


def test_restore_h2d_is_checked():
    assert ShardsafeConfig(restore_h2d="pageable").restore_h2d == "pageable"
    with pytest.raises(ConfigError, match="restore_h2d must be one of 'pinned', 'pageable'; got 'dma'"):
        ShardsafeConfig(restore_h2d="dma")
