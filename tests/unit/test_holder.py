"""The holder daemon over its real socket: slots, budget, torn writes, isolation, crash survival."""
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardsafe.holder.client import HolderClient, HolderUnavailable, connect_or_start, holder_command
from shardsafe.holder.paths import HolderPaths
from shardsafe.holder.protocol import HolderError


@pytest.fixture
def holder(holder_factory, tmp_path):
    """start(job, node, budget_gb) -> (paths, process, connected client) of a new holder in tmp_path/h."""
    def start(job="job1", node="n0", budget_gb=0.1):
        (h,) = holder_factory([node], job=job, budget_gb=budget_gb, root=tmp_path / "h")
        return h.paths, h.proc, HolderClient(h.paths, timeout_s=5).connect()

    return start


def test_slots_never_overwrite_last_committed(holder):
    _, _, c = holder()
    _, m = c.acquire(rank=0, version=1, nbytes=1000)
    m[:4] = b"v001"
    c.seal(rank=0, version=1, manifest={"v": 1})
    c.commit(ranks=[0], version=1)
    for v in (2, 3, 4):   # versions never committed keep cycling through the other slot
        _, m = c.acquire(rank=0, version=v, nbytes=1000)
        m[:4] = b"v%03d" % v
    man, rm = c.open(rank=0, version=1)
    assert man == {"v": 1} and rm[:4] == b"v001"
    rm.close()
    assert c.sealed_versions(0) == [1]          # v4 is being written: invisible to readers
    info = c.list(0)["0"]["data"]
    assert len(info) == 2 and {s["version"] for s in info} == {1, 4}


def test_torn_write_is_never_listed_or_opened(holder):
    _, _, c = holder()
    c.acquire(rank=3, version=7, nbytes=4096)
    assert c.sealed_versions(3) == []
    with pytest.raises(HolderError) as e:
        c.open(rank=3, version=7)
    assert e.value.code == "not_found"


def test_budget_error_names_bytes(holder):
    _, _, c = holder(budget_gb=0.01)   # 10.7 MB
    with pytest.raises(HolderError) as e:
        c.acquire(rank=0, version=1, nbytes=20_000_000)
    msg = str(e.value)
    assert e.value.code == "budget"
    assert "20000000 bytes" in msg and "memory_budget_gb" in msg
    # the refusal lost nothing: a request that fits still works
    c.acquire(rank=0, version=1, nbytes=1_000_000)


def test_isolation_and_permissions(holder):
    pa, proc_a, a = holder(job="jobA")
    pb, _, b = holder(job="jobB")
    _, m = a.acquire(rank=0, version=1, nbytes=100)
    a.seal(rank=0, version=1, manifest={})
    assert b.list() == {} and b.sealed_versions(0) == []
    for p in (pa, pb):
        assert stat.S_IMODE(os.stat(p.socket).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(p.dir).st_mode) == 0o700
    # every memfd the holder owns is 0600
    fds = [os.path.join(f"/proc/{proc_a.pid}/fd", f) for f in os.listdir(f"/proc/{proc_a.pid}/fd")]
    memfds = [f for f in fds if "memfd:shardsafe.jobA" in os.readlink(f)]
    assert memfds and all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in memfds)
    # a client of job B that finds job A's socket is refused: the holder answers only its own job id
    s = HolderClient(pa)
    s._sock = __import__("socket").socket(__import__("socket").AF_UNIX)
    s._sock.connect(pa.socket)
    with pytest.raises(HolderError) as e:
        s.request("hello", job_id="jobB")
    assert e.value.code == "job"


CLIENT = r"""
import os, signal, sys
from shardsafe.holder.client import HolderClient
from shardsafe.holder.paths import HolderPaths
c = HolderClient(HolderPaths(sys.argv[1], "job1", "n0")).connect()
_, m = c.acquire(rank=0, version=5, nbytes=1 << 20)
m[:5] = b"alive"
c.seal(rank=0, version=5, manifest={"ok": True})
c.commit(ranks=[0], version=5)
_, m = c.acquire(rank=0, version=6, nbytes=1 << 20)
m[:5] = b"torn!"
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_survives_sigkill_of_trainer_and_shuts_down_cleanly(holder):
    p, proc, c = holder()
    r = subprocess.run([sys.executable, "-c", CLIENT, p.root])
    assert r.returncode == -signal.SIGKILL
    assert c.sealed_versions(0) == [5]
    man, m = c.open(rank=0, version=5)
    assert man == {"ok": True} and m[:5] == b"alive"
    m.close()
    st = c.status()
    assert st["used"] > 0 and st["ranks"]["0"]["data"][0]["committed"]
    c.shutdown()
    assert proc.wait(timeout=10) == 0
    assert not os.path.exists(p.socket)
    with pytest.raises(HolderUnavailable):
        HolderClient(p).connect()


def test_connect_or_start_detaches_one_holder(tmp_path):
    p = HolderPaths(str(tmp_path / "h"), "jobD", "n0")
    with pytest.raises(HolderUnavailable):
        connect_or_start(p, budget_gb=0.01, start=False)
    c1 = connect_or_start(p, budget_gb=0.01, start=True)
    c2 = connect_or_start(p, budget_gb=0.01, start=True)   # finds the running one
    pid = c1.status()["pid"]
    assert c2.status()["pid"] == pid
    assert os.getsid(pid) != os.getsid(0)   # its own session: a launcher's group kill misses it
    c1.shutdown()
    for _ in range(100):
        if not os.path.exists(p.socket):
            break
        time.sleep(0.05)
    assert not os.path.exists(p.socket)


def test_status_cli(holder):
    p, _, c = holder()
    c.acquire(rank=2, version=3, nbytes=5 << 20)
    c.seal(rank=2, version=3, manifest={})
    c1 = HolderClient(p, timeout_s=5, scope="engine1").connect()   # a second engine of the process
    c1.acquire(rank=2, version=1, nbytes=2 << 20)
    c1.seal(rank=2, version=1, manifest={})
    out = subprocess.run([sys.executable, "-m", "shardsafe.cli", "status", "--holder-dir", p.root, "--job-id",
                          p.job_id, "--json"], capture_output=True, text=True, check=True).stdout
    st = json.loads(out)["holders"][0]
    assert st["node"] == "n0" and st["ranks"]["2"]["data"][0]["version"] == 3
    txt = subprocess.run([sys.executable, "-m", "shardsafe.cli", "status", "--holder-dir", p.root, "--job-id",
                          p.job_id], capture_output=True, text=True, check=True).stdout
    assert "  rank 2 data: v3 sealed" in txt and "  engine1 rank 2 data: v1 sealed" in txt, txt
    # without --job-id: every job with a holder under the root; a file there (py-cpuinfo's answer for the boot,
    # adapters/deepspeed/prewarm.py) is no job
    (Path(p.root) / "cpuinfo-boot.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDSAFE_JOB_ID", "SLURM_JOB_ID")}
    out = subprocess.run([sys.executable, "-m", "shardsafe.cli", "status", "--holder-dir", p.root, "--json"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["job_id"] == p.job_id, out.stdout


def test_shutdown_is_answered_before_the_holder_stops(tmp_path, monkeypatch):
    """The holder requests its own stop only once the reply to `shutdown` is out: a stop wakes the accept loop
    at once and the process may exit before a reply still to be sent (a CI run saw the client's 'holder went
    away during shutdown'). In process, so the order can be observed: serve() runs here, the client in a thread."""
    import threading

    from shardsafe.holder import server as srv
    from shardsafe.holder import serving
    h = srv.Holder(HolderPaths(str(tmp_path / "h"), "job", "n0"), budget_bytes=1 << 20)
    stopped_at_reply = []
    real_send = serving.send_msg

    def send(conn, msg, fds=()):
        if "pending_flushes" in msg:
            stopped_at_reply.append(h._stop.is_set())
        return real_send(conn, msg, fds)

    monkeypatch.setattr(serving, "send_msg", send)
    got = []
    t = threading.Thread(target=lambda: got.append(HolderClient(h.paths, timeout_s=5).connect().shutdown()))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}   # serve() installs its own
    try:
        h.serve(ready=t.start)
    finally:
        for s, fn in handlers.items():
            signal.signal(s, fn)
    t.join(5)
    assert got == [0] and stopped_at_reply == [False]


def _named_budget_gb(msg: str) -> float:
    import re
    m = re.search(r"Raise memory_budget_gb \(--memory-budget-gb\) to at least ([0-9.]+) GiB", msg)
    assert m, msg
    return float(m.group(1))


def _keep_two_versions(c, rank: int, nbytes: int, first: int) -> None:
    """Write, seal and commit two successive versions of ``rank``: what a holder keeps per rank."""
    for v in (first, first + 1):
        c.acquire(rank=rank, version=v, nbytes=nbytes)
        c.seal(rank=rank, version=v, manifest={"v": v})
        c.commit(ranks=[rank], version=v)


@pytest.mark.parametrize("others", [[], [(0, 4 << 20)]], ids=["one rank", "after another rank"])
def test_budget_message_names_a_budget_that_holds_the_versions_kept(holder, others):
    """The refused request's message says two versions per rank are kept; a holder started with the budget it
    names must hold two versions of every rank it had seen (the message once asked for one version only, and
    rounded that to the nearest MB, below what it needed)."""
    _, _, c = holder(budget_gb=0.01)   # 10.7 MB: room for the other rank's two 4 MiB slots, not for 20 MB
    for rank, n in others:
        _keep_two_versions(c, rank, n, first=1)
    with pytest.raises(HolderError) as e:
        c.acquire(rank=1, version=1, nbytes=20_000_000)
    msg = str(e.value)
    assert e.value.code == "budget" and "2 versions per rank are kept" in msg, msg
    gb = _named_budget_gb(msg)
    need = 2 * (20 << 20) + sum(2 * n for _, n in others)       # 20_000_000 rounds up to 20 MiB slots
    assert need <= gb * (1 << 30) < need + (2 << 20), (gb, need)   # enough, and not wildly more
    _, _, big = holder(job="job2", budget_gb=gb)
    for rank, n in others:
        _keep_two_versions(big, rank, n, first=1)
    _keep_two_versions(big, 1, 20_000_000, first=1)
    _keep_two_versions(big, 1, 20_000_000, first=3)   # and go on: each new version reuses the older slot
    assert big.status()["used"] <= big.status()["budget"]


def _wait_exit(proc, timeout):
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def test_idle_exit_counts_from_the_last_client_and_waits_for_flushes(holder_factory, tmp_path):
    """An automatically started holder exits once no client is connected and no flush is pending for
    idle_exit_s: not while a silent trainer stays connected, not at once when a long-connected client leaves,
    not while a flush still writes to disk."""
    from shardsafe.persist import PersistentStore
    from shardsafe.runcheck import read_jsonl
    idle = 1.0
    (h,) = holder_factory(["n0"], job="jobI", budget_gb=0.1, root=tmp_path / "h", idle_exit_s=idle,
                          run_dir=str(tmp_path))
    p, proc = h.paths, h.proc
    c = HolderClient(p, timeout_s=5).connect()
    time.sleep(3 * idle)                    # connected but silent (a trainer between snapshots): stays
    assert proc.poll() is None
    _, m = c.acquire(rank=0, version=1, nbytes=6 << 20)
    m[:] = b"\x01" * len(m)
    c.seal(rank=0, version=1, manifest={"entries": []})
    c.commit(ranks=[0], version=1)
    # 6 MiB at 2 MB/s: the flush takes ~3 s, longer than the idle time, after the client has gone
    c.flush(rank=0, version=1, dir=str(tmp_path / "persist"), job_id="jobI", keep=1, mbps=2.0)
    c.close()
    t_left = time.monotonic()
    time.sleep(idle + 1.0)
    assert proc.poll() is None, "exited while a flush was still being written"
    s = HolderClient(p, timeout_s=5).connect()   # and still serving meanwhile
    s.close()
    assert _wait_exit(proc, 15) == 0, "did not exit once idle"
    waited = time.monotonic() - t_left
    assert waited >= 3.0 + idle * 0.9, f"exited {waited:.1f} s after the client left, before its flush could end"
    assert PersistentStore(str(tmp_path / "persist"), "jobI").versions() == [1]
    assert not os.path.exists(p.socket)
    stops = [e for e in read_jsonl(os.path.join(str(tmp_path), "events.jsonl")) if e.get("kind") == "holder_stop"]
    assert [e.get("reason") for e in stops] == ["idle_exit"]


def test_idle_exit_starts_when_the_last_client_leaves(holder_factory, tmp_path):
    """A client connected longer than idle_exit_s leaves: the holder still waits idle_exit_s (it once
    counted from the client's last request and exited at once)."""
    idle = 1.5
    (h,) = holder_factory(["n0"], job="jobJ", budget_gb=0.05, root=tmp_path / "h", idle_exit_s=idle)
    p, proc = h.paths, h.proc
    c = HolderClient(p, timeout_s=5).connect()
    time.sleep(2 * idle)
    c.close()
    t0 = time.monotonic()
    assert _wait_exit(proc, 10) == 0
    assert time.monotonic() - t0 >= idle * 0.9


def test_auto_started_holders_get_an_idle_exit_by_default(tmp_path):
    """connect_or_start (a rank's detached holder) and holder_command (launchers) pass the idle exit; the
    config's knob defaults to the same value; 0 means never."""
    from shardsafe.config import ConfigError, ShardsafeConfig
    from shardsafe.holder.protocol import DEFAULT_IDLE_EXIT_S
    assert DEFAULT_IDLE_EXIT_S > 0
    assert ShardsafeConfig(job_id="j").holder_idle_exit_s == DEFAULT_IDLE_EXIT_S
    assert ShardsafeConfig(job_id="j", holder_idle_exit_s=0).holder_idle_exit_s == 0
    with pytest.raises(ConfigError, match="holder_idle_exit_s"):
        ShardsafeConfig(job_id="j", holder_idle_exit_s=-1)
    cmd = holder_command(HolderPaths("/x", "j", "n"), budget_gb=1)
    assert cmd[cmd.index("--idle-exit-s") + 1] == repr(DEFAULT_IDLE_EXIT_S)
    p = HolderPaths(str(tmp_path / "h"), "jobK", "n0")
    c = connect_or_start(p, budget_gb=0.01, start=True)
    try:
        assert c.started_holder
        with open(f"/proc/{c.holder_pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert argv[argv.index(b"--idle-exit-s") + 1] == repr(DEFAULT_IDLE_EXIT_S).encode()
        again = connect_or_start(p, budget_gb=0.01, start=True)
        assert not again.started_holder and again.holder_pid == c.holder_pid
        again.close()
    finally:
        c.shutdown()


def test_engine_scopes_keep_their_versions_apart(holder):
    """Two engines of one process (HF's Trainer builds one per train() call; RLHF runs several) write the same
    rank and version numbers into one holder: each scope lists, opens, commits and drops only its own, and the
    holder's one budget counts them all."""
    paths, _, first = holder(budget_gb=0.009)   # 9.66 MB: four 2 MiB slots, not five
    second = HolderClient(paths, timeout_s=5, scope="engine1").connect()
    for c, tag in ((first, b"e0"), (second, b"e1")):
        for v in (4, 5):
            _, m = c.acquire(rank=0, version=v, nbytes=2 << 20)
            m[:3] = tag + bytes([v])
            c.seal(rank=0, version=v, manifest={"tag": tag.decode(), "v": v})
            c.commit(ranks=[0], version=v)
    for c, tag in ((first, "e0"), (second, "e1")):
        assert c.sealed_versions(0) == [4, 5]
        man, rm = c.open(rank=0, version=5)
        assert man == {"tag": tag, "v": 5} and rm[:3] == tag.encode() + b"\x05"
        rm.close()
    st = first.status()
    assert set(st["ranks"]) == {"0"} and set(st["scopes"]) == {"engine1"}
    assert st["used"] == 4 * (2 << 20)
    # the budget is the holder's: a fifth slot does not fit, and the refusal names both scopes' slots
    third = HolderClient(paths, timeout_s=5, scope="engine2").connect()
    with pytest.raises(HolderError) as e:
        third.acquire(rank=0, version=1, nbytes=2 << 20)
    assert e.value.code == "budget" and "engine scope 'engine2'" in str(e.value) and "3 rank(s)" in str(e.value), \
        str(e.value)
    second.drop(rank=0, version=4)
    assert second.sealed_versions(0) == [5] and first.sealed_versions(0) == [4, 5]
    with pytest.raises(HolderError) as e:
        second.open(rank=0, version=4)
    assert e.value.code == "not_found" and "engine scope 'engine1'" in str(e.value)
    third.acquire(rank=0, version=1, nbytes=2 << 20)   # the freed slot is the holder's again
    with pytest.raises(ValueError, match="holder scope"):
        HolderClient(paths, scope="../x")
    # a malformed scope on the wire is refused by the holder itself
    with pytest.raises(HolderError) as e:
        first.request("list", scope="a/b")
    assert e.value.code == "bad_request" and "'scope'" in str(e.value)


def test_a_slot_being_allocated_does_not_hold_up_the_other_ranks(tmp_path, monkeypatch):
    """Allocating a new slot (seconds for a multi-GB one, more on 2 MiB pages) runs outside the holder's lock:
    another rank's request is served meanwhile, the bytes being allocated count against the budget, and the
    same rank's next request waits for its previous one instead of allocating beside it."""
    import threading

    from shardsafe.holder import server
    from shardsafe.holder.server import Holder
    entered, release = threading.Event(), threading.Event()
    real = server.Segment

    def slow_for_rank0(name, size):
        if ".r0." in name and not release.is_set():
            entered.set()
            assert release.wait(10)
        return real(name, size)
    monkeypatch.setattr(server, "Segment", slow_for_rank0)
    mib = 1 << 20
    h = Holder(HolderPaths(str(tmp_path / "h"), "job", "n0"), budget_bytes=8 * mib)
    got = {}
    a = threading.Thread(target=lambda: got.setdefault("r0", h.acquire({"rank": 0, "version": 1, "nbytes": 4 * mib})))
    a.start()
    try:
        assert entered.wait(10)
        assert h.used_bytes() == 4 * mib                          # reserved while it allocates
        reply, _ = h.acquire({"rank": 1, "version": 1, "nbytes": 2 * mib})   # not queued behind rank 0
        assert reply["capacity"] == 2 * mib and "r0" not in got
        with pytest.raises(HolderError) as e:                     # 4 + 2 + 4 MiB > the 8 MiB budget
            h.acquire({"rank": 2, "version": 1, "nbytes": 4 * mib})
        assert e.value.code == "budget"
        b = threading.Thread(target=lambda: got.setdefault("r0v2", h.acquire({"rank": 0, "version": 2, "nbytes": mib})))
        b.start()
        b.join(0.5)
        assert b.is_alive() and "r0v2" not in got                 # the same rank waits for its first slot
    finally:
        release.set()
        a.join(10)
    b.join(10)
    assert got["r0"][0]["capacity"] == 4 * mib
    # rank 0's second version took the slot its first one had just got (version 1 was never committed, so it
    # may be overwritten), not a second slot allocated beside it while the first was still being allocated
    assert got["r0v2"][0]["slot"] == got["r0"][0]["slot"]
    assert [s.version for s in h.ranks[("", 0)].slots["data"]] == [2]
    assert h.used_bytes() == 6 * mib and h._allocating == 0
    for ent in h.ranks.values():
        for lst in ent.slots.values():
            for s in lst:
                s.seg.close()


def test_status_shows_every_ranks_protection_state_and_reserve_checks_two_versions(holder):
    """What ranks report (shardsafe.protection.Protection.state) is what `shardsafe status` prints; and a holder
    whose budget cannot keep two versions of every rank that reserved refuses the reservation with the number."""
    from shardsafe.protection import Protection, Cause
    p, _, c = holder()
    ok = Protection(rank=0, interval=1)
    ok.started(7)
    ok.observe(8, 7)
    c.report(rank=0, state=ok.state())
    bad = Protection(rank=1, interval=1)
    bad.stand(Cause.BUDGET, "rank 1: holder budget")
    c.report(rank=1, state=bad.state())
    txt = subprocess.run([sys.executable, "-m", "shardsafe.cli", "status", "--holder-dir", p.root, "--job-id",
                          p.job_id], capture_output=True, text=True, check=True).stdout
    assert "  rank 0: protected (step 8, newest committed version 7, 1 step(s) old" in txt, txt
    assert "  rank 1: NOT protected: budget: rank 1: holder budget" in txt, txt
    budget = c.status()["budget"]
    assert c.reserve(rank=0, nbytes=budget // 5)["reserved"] == 2 * (budget // 5)
    with pytest.raises(HolderError, match=r"cannot keep 2 versions of its 2 rank\(s\).*Raise memory_budget_gb") as e:
        c.reserve(rank=1, nbytes=budget // 3)
    assert e.value.code == "budget"
