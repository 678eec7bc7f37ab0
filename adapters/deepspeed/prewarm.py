"""Start-up work of a DeepSpeed trainer that a fork server does once for every trainer it forks, and py-cpuinfo's
answer remembered for every process of this host's boot.

Listed in ``PRELOAD_DEEPSPEED`` as ``shardsafe.adapters.deepspeed.prewarm:remember_cpu_info`` and
``...:probe_compatible_ops`` (shardsafe/launch/prewarm.py calls them after the imports, before it forks anything).

DeepSpeed's op builders ask py-cpuinfo for the CPU's vendor and SIMD flags (``OpBuilder.cpu_arch`` and
``simd_width``, each a call of ``cpuinfo.get_cpu_info()``) every time a process loads one of its CPU ops:
FusedAdam's CPU build (``"AdamW"`` without ``torch_adam``, DeepSpeed's default optimizer), and DeepSpeedCPUAdam /
CPULion / CPUAdagrad (``offload_optimizer``, on GPU nodes too); DeepSpeedCPUAdam's constructor asks once more.
``get_cpu_info()`` starts a Python subprocess each time (an interpreter start and py-cpuinfo's probing), and a
trainer loading FusedAdam asks twice: without a remembered answer, that is most of a forked trainer's restart
(bench/RESULTS.md "Restart: trainers forked from a fork server vs cold starts", ``--optimizer fused-adamw``). The
answer cannot change while the host runs (the kernel fixes the CPU flags at boot), so:

- a fork server asks once (``remember_cpu_info``) and its trainers get a copy of that answer;
- the answer is also kept on disk for this boot of this host (``cpuinfo-<boot id>.json`` in the user's holder
  directory: private, node-local, JSON), so the next fork server (every agent of ``shardsafe launch`` starts
  one) and a protected trainer started cold (plain ``torchrun``, whose restart would otherwise ask twice per
  op: ``memo_cpu_info``, installed by the DeepSpeed adapter before DeepSpeed builds its optimizer) read it
  instead of asking. A file that is not this user's, is writable by others, or does not hold an answer of
  this boot and py-cpuinfo version is ignored; py-cpuinfo is then asked, as DeepSpeed would.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import stat
from typing import Callable, Optional

log = logging.getLogger(__name__)
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def remember_cpu_info(cache_dir: Optional[str] = None) -> str:
    """Ask py-cpuinfo once (or read this boot's answer from ``cache_dir``, default the holder directory) and make
    ``cpuinfo.get_cpu_info()`` return a copy of that answer in this process and every process forked from it
    (DeepSpeed imports the function at call time: ``from cpuinfo import get_cpu_info``). Returns a line for the
    fork server's log."""
    import cpuinfo
    memo_cpu_info(cache_dir)
    info, source = _MEMO.answer()
    if not info.get("flags"):
        # py-cpuinfo returns {} when its subprocess fails: leave the function alone, DeepSpeed then falls back to
        # lscpu itself (OpBuilder._backup_cpuinfo), as in a cold start.
        cpuinfo.get_cpu_info = _MEMO.original
        return "py-cpuinfo found no CPU flags; not remembered"
    return f"py-cpuinfo {source} ({info.get('brand_raw', 'unknown CPU')}, {len(info['flags'])} flags)"


def memo_cpu_info(cache_dir: Optional[str] = None) -> None:
    """Make ``cpuinfo.get_cpu_info()`` answer from memory: on its first call this boot's answer is read from
    ``cache_dir`` (default the holder directory) or asked of py-cpuinfo and written there. Costs nothing until
    something asks (DeepSpeed on a GPU with its CUDA ops never does). Idempotent; nothing to do without
    py-cpuinfo (DeepSpeed then falls back to lscpu)."""
    try:
        import cpuinfo
    except ImportError:
        return
    if _MEMO.installed(cpuinfo.get_cpu_info):
        return
    _MEMO.install(cpuinfo, cache_path(cache_dir))


def cache_path(cache_dir: Optional[str] = None) -> Optional[str]:
    """This boot's cache file, or None where the host has no boot id (then nothing is written)."""
    try:
        with open(BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        return None
    if not boot or not all(c.isalnum() or c == "-" for c in boot):
        return None
    from shardsafe.holder.paths import default_holder_dir, private_dir
    cache_dir = default_holder_dir() if cache_dir is None else private_dir(cache_dir)   # never the user's own
    return os.path.join(cache_dir, f"cpuinfo-{boot}.json")


class _Memo:
    """The one answer of this process (a fork inherits it)."""

    def __init__(self) -> None:
        self.original: Optional[Callable[[], dict]] = None
        self.path: Optional[str] = None
        self.version = ""    # py-cpuinfo's version: an answer kept by another version is not used
        self.info: dict = {}
        self.source = ""
        self._fn: Optional[Callable[[], dict]] = None

    def installed(self, fn) -> bool:
        return fn is self._fn and fn is not None

    def install(self, cpuinfo, path: Optional[str]) -> None:
        self.original, self.path, self.info, self.source = cpuinfo.get_cpu_info, path, {}, ""
        self.version = ".".join(str(x) for x in getattr(cpuinfo, "CPUINFO_VERSION", ()))

        def get_cpu_info() -> dict:
            return copy.deepcopy(self.answer()[0])

        get_cpu_info.__doc__ = ("py-cpuinfo's answer, remembered by shardsafe for this boot of this host "
                                "(shardsafe.adapters.deepspeed.prewarm).")
        self._fn = get_cpu_info
        cpuinfo.get_cpu_info = get_cpu_info

    def answer(self) -> tuple[dict, str]:
        """(the answer, where it came from); asks py-cpuinfo (and keeps its answer) only while none is kept."""
        if not self.info:
            cached = _read(self.path, self.version) if self.path else None
            if cached is not None:
                self.info, self.source = cached, "answer of this boot read from " + self.path
            else:
                info = self.original()
                if not info.get("flags"):
                    return info, "found no CPU flags"   # not remembered: the next call asks again
                self.info, self.source = info, "asked once"
                if self.path:
                    _write(self.path, self.version, info)
        return self.info, self.source


_MEMO = _Memo()


def _read(path: str, version: str) -> Optional[dict]:
    """This boot's answer from ``path``, or None (absent, not private to this user, or not an answer)."""
    from shardsafe.holder.paths import UnsafeHolderDir, check_private_dir, open_private
    try:
        if not check_private_dir(os.path.dirname(path)):
            return None
        fd = open_private(path, os.O_RDONLY)
    except UnsafeHolderDir as e:
        log.warning("py-cpuinfo's answer not read: %s", e)
        return None
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or not stat.S_ISREG(st.st_mode):
            log.warning("ignoring %s: not a private file of this user (uid %d, mode %o)", path, st.st_uid,
                        st.st_mode & 0o777)
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            doc = json.loads(f.read(1 << 20))
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: %s", path, e)
        return None
    finally:
        os.close(fd)
    info = doc.get("info") if isinstance(doc, dict) else None
    ok = (isinstance(info, dict) and doc.get("cpuinfo") == version and isinstance(info.get("arch"), str)
          and isinstance(info.get("flags"), list) and info["flags"] and all(isinstance(x, str) for x in info["flags"]))
    if not ok:
        log.warning("ignoring %s: not py-cpuinfo %s's answer", path, version)
        return None
    return info


def _write(path: str, version: str, info: dict) -> None:
    """Write the answer next to the holders' sockets (a private directory), atomically; failing is harmless."""
    from shardsafe.holder.paths import UnsafeHolderDir, check_private_dir, open_private
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        check_private_dir(os.path.dirname(path), create=True)
    except UnsafeHolderDir as e:
        log.info("py-cpuinfo's answer kept in memory only: %s", e)
        return
    except OSError as e:
        log.info("py-cpuinfo's answer not written to %s: %s", path, e)
        return
    try:
        fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "w") as f:
            json.dump({"cpuinfo": version, "info": info}, f)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as e:
        log.info("py-cpuinfo's answer not written to %s: %s", path, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass


def probe_compatible_ops() -> str:
    """Run DeepSpeed's op-compatibility probe once, on the CPU accelerator, so that every forked trainer finds its
    answer (``deepspeed.ops.__compatible_ops__``, computed on first access and kept in the module) instead of
    running it: ``deepspeed.comm`` asks for it when the process group comes up, and the probe compiles a test
    program for async_io with the system's C compiler, a compiler run in every trainer's start. On a GPU the probe
    queries the device, which the fork server must not touch (a forked child cannot use a CUDA context made
    before the fork): not probed there, the trainers probe as a cold start does. Returns a line for the fork
    server's log."""
    from deepspeed.accelerator import get_accelerator
    name = get_accelerator().device_name()
    if name != "cpu":
        return f"not probed on the {name} accelerator (the probe queries the device); each trainer probes"
    import deepspeed.ops
    ops = deepspeed.ops.__compatible_ops__
    return f"DeepSpeed's op compatibility probed once ({sum(1 for v in ops.values() if v)} of {len(ops)} compatible)"
