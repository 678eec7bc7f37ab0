"""Restart in place, the pieces: the mode's setting, the agent's notice, the holder-memory fence, the guards of
shardsafe.inplace.run, and the agent's signal aimed at a process's main thread (tests/fault/test_inplace.py runs the
whole of it)."""
import mmap
import os
import signal
import threading
import time

import pytest
import torch

from shardsafe import env, inplace
from shardsafe.errors import ConfigError
from shardsafe.holder.client import HolderClient
from shardsafe.holder.paths import HolderPaths
from shardsafe.launch.elastic import ElasticConfig
from shardsafe.launch.errors import LaunchError
from shardsafe.launch.replace import signal_main_thread


def test_the_mode_is_full_unless_set_and_a_bad_value_says_what_is_expected(tmp_path):
    assert env.restart_mode({}) == "full"
    assert env.restart_mode({env.RESTART: "In-Place"}) == "in-place"
    with pytest.raises(ConfigError, match="expected one of full, in-place"):
        env.restart_mode({env.RESTART: "partial"})
    with pytest.raises(LaunchError, match="--restart 'partial'"):
        ElasticConfig(run_dir=str(tmp_path), restart="partial")


def test_a_notice_round_trips_and_a_missing_or_torn_one_reads_as_none(tmp_path):
    assert inplace.read_notice(str(tmp_path), "node1") is None
    inplace.write_notice(str(tmp_path), "node1", 3, [7])
    got = inplace.read_notice(str(tmp_path), "node1")
    assert (got.attempt, got.lost) == (3, [7])
    assert oct(os.stat(tmp_path / inplace.NOTICE_DIR).st_mode & 0o777) == "0o700"
    (tmp_path / inplace.NOTICE_DIR / "node2.json").write_text('{"attempt": ')
    assert inplace.read_notice(str(tmp_path), "node2") is None


def test_a_fenced_mapping_no_longer_reaches_the_holders_memory(tmp_path):
    """What a snapshot thread left behind by a restart in place writes after the fence lands in private memory: the
    memfd (the holder's segment) keeps what it had, and the writer does not fault."""
    fd = os.memfd_create("slot")
    os.ftruncate(fd, 1 << 20)
    client = HolderClient(HolderPaths(str(tmp_path), "job", "node0"))
    m = mmap.mmap(fd, 1 << 20, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    client._maps[1] = m
    view = torch.frombuffer(m, dtype=torch.uint8)   # a thread's view, as the pipeline's copy holds one
    view[:4] = 7
    assert client.fence() == 1 << 20 and client.mapped_slots() == {}
    view[:4] = 9                                    # the left-behind writer, after the fence
    assert view[:4].tolist() == [9, 9, 9, 9]
    assert os.pread(fd, 4, 0) == b"\x07" * 4        # the holder's memory is untouched
    client.close()
    os.close(fd)


def test_run_refuses_an_initialised_process_group_and_other_threads(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with pytest.raises(inplace.InPlaceError, match="before init_process_group"):
            inplace.run(lambda: None)
    finally:
        dist.destroy_process_group()
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(inplace.InPlaceError, inplace.run, lambda: None)))
    t.start()
    t.join()
    assert "main thread" in str(errors[0].value)


def test_the_agents_signal_cuts_the_main_threads_sleep_short():
    """Aimed at the main thread (whose thread id is the pid), not at the process: a process-directed signal may land
    on another thread, and the main thread's handler then waits for its sleep to end."""
    class Stop(BaseException):
        pass

    def on_signal(signum, frame):
        raise Stop

    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        threading.Timer(0.2, signal_main_thread, (os.getpid(), signal.SIGUSR1)).start()
        t0 = time.monotonic()
        with pytest.raises(Stop):
            time.sleep(10)
        assert time.monotonic() - t0 < 5
    finally:
        signal.signal(signal.SIGUSR1, previous)
    with pytest.raises(ProcessLookupError):
        signal_main_thread(2 ** 22 + 12345, 0)


_BLOCKED_CHILD = r"""
import ctypes, os, signal, sys
from shardsafe import inplace
if sys.argv[2] == "own":   # the program's own wakeup fd (as asyncio sets one): the watchdog polls instead
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
trigger = inplace._Trigger(sys.argv[1], "n0")
dog = inplace._watchdog(trigger, rank=3, stuck_s=0.05)
assert sys.argv[2] != "own" or signal.set_wakeup_fd(-1) == w   # the program's wakeup fd is still its own
if sys.argv[2] == "own":
    signal.set_wakeup_fd(w)
print("ready", "polls" if dog.polls else "wakes", flush=True)
# the main thread blocked in native code that no signal ends (a gloo wait stands in here): a mutex locked twice
libc = ctypes.CDLL(None)
m = ctypes.create_string_buffer(64)
libc.pthread_mutex_init(m, None)
libc.pthread_mutex_lock(m)
libc.pthread_mutex_lock(m)
"""


@pytest.mark.parametrize("announced, wakeup", [(1, "ours"), (0, "ours"), (1, "own")])
def test_a_main_thread_no_signal_can_stop_exits_75_once_a_newer_attempt_is_announced(tmp_path, announced, wakeup):
    """shardsafe.inplace._Watchdog: with attempt 1 announced, a rank whose main thread is stuck exits with 75 (the
    agent then restarts every worker) after 30 x stuck_s outside torch.distributed, woken by the agent's signal
    through the signal wakeup fd, or reading the notice each second where the program owns that fd; a notice of
    the attempt it already runs changes nothing."""
    import subprocess
    import sys
    child_env = {**os.environ, env.ATTEMPT: "0"}
    p = subprocess.Popen([sys.executable, "-c", _BLOCKED_CHILD, str(tmp_path), wakeup], env=child_env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().split() == ["ready", "wakes" if wakeup == "ours" else "polls"]
        inplace.write_notice(str(tmp_path), "n0", announced, [1])
        os.kill(p.pid, inplace.SIGNAL)   # as the agent does: the watchdog wakes on it, not on the file
        if announced:
            assert p.wait(timeout=30) == inplace.EXIT_NOT_IN_PLACE
            err = p.stderr.read()
            assert "[rank 3] the job restarts in place at attempt 1" in err and "which no signal ends" in err, err
        else:
            with pytest.raises(subprocess.TimeoutExpired):
                p.wait(timeout=3)
    finally:
        p.kill()
        p.wait()
