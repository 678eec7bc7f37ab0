"""The holder against clients that do not follow its protocol: raw AF_UNIX sockets against a real holder process.

Every malformed input gets an error reply or a closed connection; no connection thread dies with a
traceback; no file descriptor sent along with a bad frame stays open in the holder; a client that says
nothing, stops mid-frame or trickles bytes is dropped after the read timeout; connections beyond the cap
are refused with a reason; the first request must be `hello` with the holder's job id.
"""
import array
import json
import os
import socket
import struct
import time

import pytest

from shardsafe.holder.client import HolderClient, HolderUnavailable
from shardsafe.holder.paths import HolderPaths
from shardsafe.holder.protocol import MAX_BODY, MAX_FDS, HolderError

HDR = struct.Struct("<II")
READ_TIMEOUT_S = 0.5
MAX_CLIENTS = 4


class Holder:
    """One holder of tests/conftest.py's holder_factory (stderr to a file), with raw-socket helpers."""

    def __init__(self, running):
        self._running = running
        self.paths, self.proc = running.paths, running.proc

    def stderr(self) -> str:
        return self._running.stderr()

    def fds(self) -> set[str]:
        d = f"/proc/{self.proc.pid}/fd"
        return {os.readlink(os.path.join(d, f)) for f in os.listdir(d)}

    def nfds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def threads(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(next(ln for ln in f if ln.startswith("Threads:")).split()[1])

    def raw(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(self.paths.socket)
        return s

    def hello(self, busy_wait_s: float = 0.0) -> socket.socket:
        """A connection past its hello. With ``busy_wait_s``, a hello the connection cap turns away ("busy": the
        holder has not yet dropped connections the test closed, as on a loaded machine) is tried again for that
        long; any other refusal fails at once."""
        deadline = time.monotonic() + busy_wait_s
        while True:
            s = self.raw()
            send_frame(s, json.dumps({"op": "hello", "job_id": self.paths.job_id}).encode())
            r = read_reply(s)
            if r["ok"]:
                return s
            s.close()
            assert r.get("code") == "busy" and time.monotonic() < deadline, r
            time.sleep(0.05)

    def client(self) -> HolderClient:
        return HolderClient(self.paths, timeout_s=5).connect()


@pytest.fixture
def holder(holder_factory, tmp_path):
    (h,) = holder_factory(["n0"], job="pjob", budget_gb=0.05, root=tmp_path / "h", stderr_file=True, idle_exit_s=0,
                          read_timeout_s=READ_TIMEOUT_S, max_clients=MAX_CLIENTS)
    return Holder(h)


def send_frame(s, body: bytes, fds=(), announce=None, header_only=False):
    hdr = HDR.pack(len(body), len(fds) if announce is None else announce)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    s.sendmsg([hdr], anc)
    if not header_only:
        try:
            s.sendall(body)
        except BrokenPipeError:
            pass   # refused on the header alone: the reply is waiting


def read_reply(s) -> dict:
    hdr = recv_exact(s, HDR.size)
    n, nfds = HDR.unpack(hdr)
    assert nfds == 0
    return json.loads(recv_exact(s, n))


def recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, f"connection closed after {len(buf)} of {n} bytes"
        buf += chunk
    return buf


def closed_within(s, seconds: float) -> float | None:
    """Seconds until the holder closes ``s`` (EOF), or None if it stays open that long."""
    t0 = time.monotonic()
    s.settimeout(seconds)
    try:
        while True:
            if s.recv(4096) == b"":
                return time.monotonic() - t0
    except (socket.timeout, TimeoutError):
        return None
    except ConnectionResetError:
        return time.monotonic() - t0


def assert_serving(h: Holder):
    c = h.client()
    try:
        assert c.status()["job_id"] == h.paths.job_id
    finally:
        c.close()


def _status(h: Holder) -> dict:
    c = h.client()
    try:
        return c.status()
    finally:
        c.close()


def assert_no_traceback(h: Holder):
    err = h.stderr()
    assert "Traceback" not in err and "Exception in thread" not in err, err


def settled(h: Holder) -> tuple[int, int]:
    """(threads, fds) of the holder once they stop changing (a closed client's thread is still ending)."""
    last, since = None, time.monotonic()
    t_last = since
    while time.monotonic() - since < 5:
        now = (h.threads(), h.nfds())
        if now == last and time.monotonic() - t_last > 0.3:
            return now
        if now != last:
            last, t_last = now, time.monotonic()
        time.sleep(0.05)
    return last


def wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


@pytest.mark.parametrize("body, why", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),                 # not UTF-8
    (b"[" * 100_000, "not valid JSON"),                # RecursionError inside json.loads
    (b'{"op": ' * 100_000, "not valid JSON"),
    (b"[1, 2, 3]", "expected a JSON object"),
    (b'"hello"', "expected a JSON object"),
])
@pytest.mark.parametrize("after_hello", [False, True])
def test_malformed_body_gets_an_error_and_a_closed_connection(holder, body, why, after_hello):
    s = holder.hello() if after_hello else holder.raw()
    send_frame(s, body)
    r = read_reply(s)
    assert r["ok"] is False and r["code"] == "protocol" and why in r["error"], r
    assert closed_within(s, 2) is not None
    assert_serving(holder)
    assert_no_traceback(holder)


def test_oversized_frame_is_refused_without_reading_it(holder):
    s = holder.hello()
    s.sendmsg([HDR.pack(MAX_BODY + 1, 0)])
    r = read_reply(s)
    assert r["ok"] is False and r["code"] == "protocol" and str(MAX_BODY) in r["error"], r
    assert closed_within(s, 2) is not None
    assert_serving(holder)
    assert_no_traceback(holder)


def _pipes(n):
    ps = [os.pipe() for _ in range(n)]
    return [r for r, _ in ps], [w for _, w in ps]


@pytest.mark.parametrize("case", ["non-object", "invalid-json", "count-mismatch", "valid-request", "too-many-fds",
                                  "fds-with-the-body"])
def test_file_descriptors_sent_along_are_closed(holder, case):
    """The holder never keeps an fd a client sends: after the connection, the holder's fd table is as before,
    and the write ends it received are closed (their pipes read EOF once we close ours)."""
    holder.client().close()   # the first connection may open lazily-created fds (logging): count after it
    _, before = settled(holder)
    for _ in range(5):
        n = MAX_FDS + 4 if case == "too-many-fds" else 3
        reads, writes = _pipes(n)
        s = holder.hello()
        if case == "non-object":
            send_frame(s, b"[1, 2]", fds=writes)
        elif case == "invalid-json":
            send_frame(s, b"{oops", fds=writes)
        elif case == "count-mismatch":
            send_frame(s, b"{}", fds=writes, announce=1)
        elif case == "valid-request":
            send_frame(s, json.dumps({"op": "status"}).encode(), fds=writes)
        elif case == "too-many-fds":
            send_frame(s, b"{}", fds=writes)
        else:   # the fds ride on the body's bytes, not the header's
            s.sendmsg([HDR.pack(2, 0)])
            s.sendmsg([b"{}"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", writes).tobytes())])
        r = read_reply(s)
        if case in ("valid-request", "fds-with-the-body"):
            assert r["ok"] is (case == "valid-request"), r
        else:
            assert r["ok"] is False and r["code"] == "protocol", r
        s.close()
        for w in writes:
            os.close(w)
        for rd in reads:   # EOF only once every write end (ours and the holder's copy) is closed
            os.set_blocking(rd, False)
            assert wait_for(lambda: _eof(rd)), f"{case}: the holder still holds a write end it was sent"
            os.close(rd)
    assert wait_for(lambda: holder.nfds() == before), (case, before, holder.fds())
    assert_serving(holder)
    assert_no_traceback(holder)


def _eof(fd):
    try:
        return os.read(fd, 1) == b""
    except BlockingIOError:
        return False


BAD_REQUESTS = [
    ({"op": "frobnicate"}, "bad_request", "unknown op 'frobnicate'"),
    ({"op": 5}, "bad_request", "unknown op"),
    ({"nop": 1}, "bad_request", "unknown op 'None'"),
    ({"op": "acquire"}, "bad_request", "'rank'"),
    ({"op": "acquire", "rank": 0, "version": 1}, "bad_request", "'nbytes'"),
    ({"op": "acquire", "rank": 0, "version": "1", "nbytes": 10}, "bad_request", "'version' must be an integer"),
    ({"op": "acquire", "rank": True, "version": 1, "nbytes": 10}, "bad_request", "'rank' must be an integer"),
    ({"op": "acquire", "rank": -1, "version": 1, "nbytes": 10}, "bad_request", "'rank' must be >= 0"),
    ({"op": "acquire", "rank": 0, "version": 1, "nbytes": -5}, "bad_request", "'nbytes' must be >= 0"),
    ({"op": "acquire", "rank": 0, "version": 1.5, "nbytes": 10}, "bad_request", "'version' must be an integer"),
    ({"op": "acquire", "rank": 0, "version": 1, "nbytes": 10, "kind": {}}, "bad_request", "kind must be one of"),
    ({"op": "acquire", "rank": 0, "version": 1, "nbytes": 10 ** 30}, "budget", "Raise memory_budget_gb"),
    ({"op": "seal", "rank": 0, "version": 1, "manifest": [1]}, "bad_request", "manifest"),
    ({"op": "commit", "version": 1, "ranks": "abc"}, "bad_request", "'ranks' must be a list"),
    ({"op": "commit", "version": 1, "ranks": [{}]}, "bad_request", "'ranks' must be a list"),
    ({"op": "commit", "version": 1, "ranks": [0]}, "not_found", "holds no sealed"),
    ({"op": "drop", "ranks": [0], "version": "x"}, "bad_request", "'version' must be an integer"),
    ({"op": "drop"}, "bad_request", "'rank'"),
    ({"op": "list", "rank": [1]}, "bad_request", "'rank' must be an integer"),
    ({"op": "open", "rank": 0, "version": None}, "bad_request", "'version' must be an integer"),
    ({"op": "flush", "rank": 0, "version": 1, "dir": 5, "job_id": "j"}, "bad_request", "'dir'"),
    ({"op": "flush", "rank": 0, "version": 1, "dir": "/tmp", "job_id": "j", "mbps": "fast"}, "bad_request", "'mbps'"),
    ({"op": "hello", "job_id": "pjob"}, None, ""),   # a second hello is harmless
]


def test_bad_requests_get_error_replies_and_the_connection_goes_on(holder):
    s = holder.hello()
    threads = holder.threads()
    for req, code, words in BAD_REQUESTS:
        send_frame(s, json.dumps(req).encode())
        r = read_reply(s)
        if code is None:
            assert r["ok"], (req, r)
            continue
        assert r["ok"] is False and r["code"] == code and words in r["error"], (req, r)
    # the same connection still works, and nothing was allocated by the refused requests
    send_frame(s, json.dumps({"op": "status"}).encode())
    st = read_reply(s)
    assert st["ok"] and st["used"] == 0 and st["ranks"] == {}, st
    assert holder.threads() == threads
    s.close()
    assert_no_traceback(holder)


def test_hello_is_required_first(holder):
    for first in ({"op": "list"}, {"op": "acquire", "rank": 0, "version": 1, "nbytes": 4096}, {"op": "shutdown"}):
        s = holder.raw()
        send_frame(s, json.dumps(first).encode())
        r = read_reply(s)
        assert r["ok"] is False and r["code"] == "hello_required", r
        assert "'op': 'hello'" in r["error"] and repr(first["op"]) in r["error"] and "HolderClient" in r["error"]
        assert closed_within(s, 2) is not None
    st = _status(holder)
    assert st["used"] == 0 and st["ranks"] == {}         # the acquire before hello allocated nothing
    assert holder.proc.poll() is None                      # the shutdown before hello stopped nothing


def test_hello_of_another_job_is_refused_and_closed(holder):
    s = holder.raw()
    send_frame(s, json.dumps({"op": "hello", "job_id": "someone-else"}).encode())
    r = read_reply(s)
    assert r["ok"] is False and r["code"] == "job" and "pjob" in r["error"] and "someone-else" in r["error"], r
    assert closed_within(s, 2) is not None
    other = HolderClient(HolderPaths(holder.paths.root, "someone-else", "n0"))
    other._sock = holder.raw()
    with pytest.raises(HolderError) as e:
        other._hello()
    assert e.value.code == "job"


def test_client_says_hello_first(holder, monkeypatch):
    """HolderClient.connect's first frame is the hello with its job id (what the holder now requires)."""
    from shardsafe.holder import client as cl
    sent = []
    real = cl.send_msg
    monkeypatch.setattr(cl, "send_msg", lambda sock, obj, fds=(): (sent.append(obj), real(sock, obj, fds))[1])
    c = holder.client()
    c.list()
    c.close()
    assert sent[0] == {"op": "hello", "job_id": "pjob"} and sent[1]["op"] == "list"


@pytest.mark.parametrize("phase", ["before hello", "mid-header", "mid-body", "trickle"])
def test_silent_or_slow_client_is_dropped_after_the_read_timeout(holder, phase):
    s = holder.raw() if phase == "before hello" else holder.hello()
    t0 = time.monotonic()
    if phase == "mid-header":
        s.sendall(HDR.pack(10, 0)[:3])
    elif phase == "mid-body":
        s.sendall(HDR.pack(100, 0) + b'{"op": "st')
    elif phase == "trickle":   # one byte every 0.2 s: each recv is quick, the frame never completes in time
        s.sendall(HDR.pack(100, 0))
        try:
            for _ in range(20):
                time.sleep(0.2)
                s.sendall(b" ")
        except (BrokenPipeError, ConnectionResetError):
            pass
    dt = closed_within(s, 5)
    assert dt is not None, f"{phase}: the holder kept the connection open"
    assert time.monotonic() - t0 < READ_TIMEOUT_S + 2.0, f"{phase}: closed only after {time.monotonic() - t0:.1f} s"
    assert wait_for(lambda: _status(holder)["clients"] == 1)   # only the status client itself
    assert_no_traceback(holder)


def test_an_idle_client_after_hello_is_kept(holder):
    """Between requests a trainer may be silent for a long time: only started frames are timed."""
    s = holder.hello()
    time.sleep(READ_TIMEOUT_S * 3)
    send_frame(s, json.dumps({"op": "list"}).encode())
    assert read_reply(s)["ok"]


def test_connection_cap_refuses_with_a_reason_and_recovers(holder):
    clients = [holder.client() for _ in range(MAX_CLIENTS)]
    with pytest.raises(HolderUnavailable) as e:
        holder.client()
    assert "max_clients" in str(e.value) and str(MAX_CLIENTS) in str(e.value) and "--max-clients" in str(e.value)
    # a raw socket over the cap is told so too, before it says anything
    s = holder.raw()
    r = read_reply(s)
    assert r["ok"] is False and r["code"] == "busy", r
    assert closed_within(s, 2) is not None
    clients.pop().close()
    assert wait_for(lambda: _connects(holder))
    for c in clients:
        c.close()
    # every slot free again (the status request's own connection is the one left), as on a loaded machine it may
    # not be at once: else a "silent" connection below would be turned away busy instead of timing out
    assert wait_for(lambda: _clients(holder) == 1, timeout=20)
    # silent clients do not hold the slots: they are dropped after the read timeout (the wait is generous: the
    # holder's threads may be slow to run on a loaded machine, the counts below say what happened)
    silent = [holder.raw() for _ in range(MAX_CLIENTS)]
    assert wait_for(lambda: _connects(holder), timeout=READ_TIMEOUT_S + 20)
    for s in silent:
        s.close()
    st = _status(holder)
    assert st["refused"]["busy"] >= 2 and st["refused"]["timeout"] >= MAX_CLIENTS, st
    assert_no_traceback(holder)


def _clients(h: Holder) -> int:
    """The holder's connected clients, this request's own included; -1 while it turns connections away."""
    try:
        return _status(h)["clients"]
    except HolderUnavailable:
        return -1


def _connects(h: Holder) -> bool:
    try:
        h.client().close()
        return True
    except HolderUnavailable:
        return False


def test_threads_and_fds_return_to_baseline_after_abuse(holder):
    """Many misbehaving connections later the holder has the threads and fds it had before."""
    holder.client().close()
    threads, nfds = settled(holder)
    for i in range(30):
        s = holder.raw() if i % 2 else holder.hello(busy_wait_s=20)
        send_frame(s, [b"[" * 5000, b"{bad", b"[]", b"{}"][i % 4])
        s.close()
    assert wait_for(lambda: holder.threads() == threads and holder.nfds() == nfds, timeout=20), \
        (threads, holder.threads(), nfds, holder.nfds())
    assert_serving(holder)
    assert_no_traceback(holder)
