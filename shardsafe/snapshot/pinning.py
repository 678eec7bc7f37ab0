"""Page-locking the holder mapping a restore reads, so its host-to-device copies are DMA.

A restore into CUDA tensors copies out of the holder's shared memory. From pageable memory the
driver copies through its own pinned bounce buffers (a CPU memcpy per chunk, then the DMA), so the
copy runs at the speed of one CPU thread, not of the link. Registered memory is read by the copy
engine directly. The trainer that registered the slot for its snapshots is the one that died; the
restarted one maps the slot anew, so the mapping is registered here:

- in a background thread started as soon as the mapping is open, so that pinning (the driver walks
  and locks every page) runs beside the verification and the vote instead of after them;
- read-only (``cudaHostRegisterReadOnly``): the mapping is ``PROT_READ``, and without the flag the
  driver asks for write access to the pages and the call fails;
- portable (``cudaHostRegisterPortable``): pinned for every CUDA context, whichever device the
  thread would otherwise have selected;
- unregistered before the mapping closes, after the device has finished reading it.

If registration fails (a driver or device without read-only registration, a locked-memory limit), the restore copies
from pageable memory (the driver's bounce buffers, above), and says so once in the log and in the restore's notes:
the bytes are the same, only slower. Nothing here runs when no live tensor is on a GPU.
"""
from __future__ import annotations

import logging
import mmap
import threading
import time
from typing import Mapping, Optional

import numpy as np
import torch

log = logging.getLogger(__name__)

H2D_MODES = ("pinned", "pageable")
# cudaHostRegisterPortable | cudaHostRegisterReadOnly (driver_types.h)
_FLAGS = 0x01 | 0x08
_warned: set[str] = set()


class PinnedMapping:
    """One restore's registration of one holder mapping. ``close`` always runs (it also closes the mapping).

    Args:
        mm: the read-only mapping of the verified slot (closed by ``close``), or None (nothing opened).
        live: the live tensors the payload will be copied into; pinning is skipped unless one is on a GPU.
        mode: "pinned" (register) or "pageable" (copy from pageable memory, the driver's staging path).
    """

    def __init__(self, mm: Optional[mmap.mmap], live: Mapping[str, torch.Tensor], mode: str = "pinned"):
        self.mm, self.mode = mm, mode
        self.state = "cpu"          # cpu (no GPU tensor) | pageable | pinning | pinned | failed
        self.why = ""
        self.pin_s = 0.0            # the registration's own time (in its thread)
        self.wait_s = 0.0           # how long the apply waited for it
        self._ptr: Optional[int] = None
        self._device: Optional[torch.device] = None
        self._thread: Optional[threading.Thread] = None
        device = next((t.device for t in live.values() if t.is_cuda), None)
        if mm is None or device is None or len(mm) == 0:
            return
        if mode != "pinned":
            self.state, self.why = "pageable", f"restore_h2d={mode!r}"
            return
        self.state, self._device = "pinning", device
        self._thread = threading.Thread(target=self._register, args=(device,), name="shardsafe-pin", daemon=True)
        self._thread.start()

    def _register(self, device: torch.device) -> None:
        t0 = time.perf_counter()
        try:
            torch.cuda.set_device(device)
            ptr = int(np.frombuffer(self.mm, dtype=np.uint8).ctypes.data)
            rc = torch.cuda.cudart().cudaHostRegister(ptr, len(self.mm), _FLAGS)
            code = int(getattr(rc, "value", rc))
            if code == 0:
                self._ptr, self.state = ptr, "pinned"
            else:
                self.state, self.why = "failed", f"cudaHostRegister(read-only) returned cudaError {code}"
        except Exception as e:   # the restore must go on from pageable memory, whatever the driver said
            self.state, self.why = "failed", f"{type(e).__name__}: {e}"
        self.pin_s = time.perf_counter() - t0

    def wait(self) -> str:
        """Before the first copy: wait for the registration; returns how the copies will read
        ("pinned", "pageable", or "cpu" when nothing is copied to a GPU)."""
        if self._thread is not None:
            t0 = time.perf_counter()
            self._thread.join()
            self._thread = None
            self.wait_s = time.perf_counter() - t0
            if self.state == "failed":
                if self.why not in _warned:
                    _warned.add(self.why)
                    log.warning("restore copies to the GPU from pageable memory (slower, same bytes): %s", self.why)
                self.state = "pageable"
        return self.state

    def notes(self) -> dict:
        """For the restore's notes (the TOR event): how the H2D copies read and what pinning cost."""
        if self.state == "cpu":
            return {}
        out = {"h2d": self.state, "pin_s": round(self.pin_s, 6), "pin_wait_s": round(self.wait_s, 6)}
        if self.why:
            out["h2d_why"] = self.why
        return out

    def close(self) -> None:
        """Unregister (after the device read the bytes) and close the mapping."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._ptr is not None:
            torch.cuda.synchronize(self._device)   # copies queued on any stream must have read the pages
            torch.cuda.cudart().cudaHostUnregister(self._ptr)
            self._ptr = None
        if self.mm is not None:
            unmap_later(self.mm)
            self.mm = None


def unmap_later(mm: mmap.mmap) -> None:
    """Close a restore's mapping in a short-lived thread. Unmapping tears its page tables down, and on 4 KiB
    pages that is not free (262,144 entries per GiB, of the order of a memcpy of the same bytes; 2 MiB
    pages: 512 entries per GiB): nothing after the restore needs the address space back, so training goes
    on meanwhile instead of waiting for it."""
    def run() -> None:
        try:
            mm.close()
        except BufferError:   # views of it still alive: the mapping goes with the last of them
            pass
    threading.Thread(target=run, name="shardsafe-unmap", daemon=True).start()
