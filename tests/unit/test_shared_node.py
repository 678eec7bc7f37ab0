"""Shared nodes (docs/operations.md "Security model"): another user of the node cannot reach a job's holder
directory, its sockets or its files, and a user-named directory is never changed.

Real processes, real sockets, real holders. The other user is ``nobody`` (uid 65534): files and directories are
chowned to it, or a forked child ``setuid``s to it, so these tests need root (as the project's test machines run)
and are skipped otherwise. Also the small pieces of the claim and the activation: JobConflict waits for the
previous instance to exit, only the trainer process opens its snapshot early or protects an engine, and the
``.pth`` line never prints at interpreter start.
"""
from __future__ import annotations

import json
import logging
import os
import runpy
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from shardsafe import jobid
from shardsafe.holder import early_open
from shardsafe.holder.client import HolderClient, connect_or_start
from shardsafe.holder.paths import (ForeignHolder, HolderPaths, UnsafeHolderDir, default_holder_dir, private_dir,
                                    safe_name)

from .test_snapshot_restore import ToyAdapter, snap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOBODY = 65534
MINE = f"shardsafe-{os.getuid()}"
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as a second user (chown, setuid)")


@pytest.fixture(autouse=True)
def _no_claims_left():
    yield
    jobid.release_all()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardsafe.cli", *args], capture_output=True, text=True, timeout=60)


def _mkdir(path, mode: int, uid: int | None = None):
    path.mkdir()
    if uid is not None:
        os.chown(path, uid, uid)
    os.chmod(path, mode)
    return path


# ---- 1. a directory of another user ------------------------------------------------------------------------

@as_root
def test_a_holder_directory_another_user_made_first_is_refused_and_nothing_in_it_deleted(tmp_path, caplog):
    """The attack of issue 40: another user creates this user's predictable /tmp/shardsafe-<uid> first (mode 0777)
    and puts an owner record in it whose token walks out of the directory. The trainer's claim deleted the file the
    token named; now every reader of the directory refuses it before touching anything in it, naming it."""
    base = _mkdir(tmp_path / "tmp", 0o1777)                 # a /tmp
    root = _mkdir(base / MINE, 0o777, NOBODY)               # made by the other user before this user's first job
    job = _mkdir(root / "job1", 0o777, NOBODY)
    _mkdir(job / "n0.instance.x", 0o777, NOBODY)
    (job / "n0.owner").write_text(json.dumps({"token": "x/../../../victim", "pid": 1, "argv": [], "cwd": "/"}))
    os.chown(job / "n0.owner", NOBODY, NOBODY)
    victim = base / "victim"                                 # root/job1/n0.instance.x/../../../victim
    victim.write_text("this user's file")

    try:
        jobid.claim(str(root), "job1", "n0", token="mine")
        err = None
    except UnsafeHolderDir as e:
        err = e
    assert victim.read_text() == "this user's file"                    # (before: deleted by the claim)
    assert sorted(os.listdir(job)) == ["n0.instance.x", "n0.owner"]   # nothing created or removed in it
    for w in (str(root), "uid 65534", "not to you", "SHARDSAFE_HOLDER_DIR"):
        assert w in str(err), str(err)

    paths = HolderPaths(str(root), "job1", "n0")
    with pytest.raises(UnsafeHolderDir):
        paths.ensure_dir()
    with pytest.raises(UnsafeHolderDir):
        HolderClient(paths, timeout_s=2).connect()
    with pytest.raises(UnsafeHolderDir):
        connect_or_start(paths, budget_gb=0.01, start=True, timeout_s=5)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o777 and os.stat(root).st_uid == NOBODY   # left as it is
    env = {"SHARDSAFE_JOB_ID": "job1", "RANK": "0", "SHARDSAFE_NODE": "n0", "SHARDSAFE_HOLDER_DIR": str(root)}
    with caplog.at_level(logging.ERROR, logger="shardsafe.holder.early_open"):
        assert early_open.start(env) is None
    assert any(str(root) in r.getMessage() for r in caplog.records), caplog.text
    for args in (("status", "--holder-dir", str(base)), ("status", "--holder-dir", str(base), "--job-id", "job1"),
                 ("holder", "--holder-dir", str(base), "--job-id", "job1", "--node", "n0")):
        out = _cli(*args)
        assert out.returncode == 2 and str(root) in out.stderr and "uid 65534" in out.stderr, (args, out)
    from shardsafe.fatal import is_fatal
    assert is_fatal(err)   # the launchers stop instead of restarting into the same error
    from shardsafe.launch.errors import LaunchError
    from shardsafe.launch.local import LaunchConfig, LocalLauncher
    launcher = LocalLauncher(LaunchConfig(job_id="job1", run_dir=str(tmp_path / "run"), holder_dir=str(base)))
    with pytest.raises(LaunchError, match="uid 65534"):
        launcher.start_holder("node0")
    assert launcher.holders == {}


@as_root
@pytest.mark.parametrize("bad", ["link", "group", "job-dir-of-another-user"])
def test_a_linked_or_open_or_foreign_directory_is_refused(tmp_path, bad):
    real = _mkdir(tmp_path / "real", 0o700)
    if bad == "link":
        (tmp_path / MINE).symlink_to(real)
    else:
        _mkdir(tmp_path / MINE, 0o750 if bad == "group" else 0o700)
        if bad == "job-dir-of-another-user":
            _mkdir(tmp_path / MINE / "job1", 0o700, NOBODY)
    with pytest.raises(UnsafeHolderDir) as e:
        jobid.claim(str(tmp_path), "job1", "n0", token="mine")
    want = {"link": "symbolic link", "group": "mode 0750", "job-dir-of-another-user": "uid 65534"}[bad]
    assert want in str(e.value), str(e.value)
    assert os.listdir(real) == []


# ---- 2. a directory the user names is never chmodded ----------------------------------------------------------

def test_a_named_directory_keeps_its_mode_and_gets_a_private_subdirectory(tmp_path, holder_factory):
    named = _mkdir(tmp_path / "group-dir", 0o2770)       # a group's setgid directory (or $HOME)
    assert private_dir(str(named)) == str(named / MINE) == private_dir(str(named / MINE))   # idempotent
    assert default_holder_dir({"SHARDSAFE_HOLDER_DIR": str(named)}) == str(named / MINE)
    jobid.claim(str(named), "job1", "n0", token="mine")
    (h,) = holder_factory(1, job="job1", root=named)
    assert stat.S_IMODE(named.stat().st_mode) == 0o2770    # untouched
    private = named / MINE
    assert stat.S_IMODE(private.stat().st_mode) & 0o777 == 0o700 and private.stat().st_uid == os.getuid()
    assert h.paths.root == str(private) and h.paths.socket == str(private / "job1" / "n0.sock")
    assert os.path.exists(h.paths.socket) and sorted(os.listdir(named)) == [MINE]
    out = _cli("status", "--holder-dir", str(named), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["job_id"] == "job1", out


def test_the_default_directory_is_shardsafes_own_and_used_as_it_is(tmp_path):
    """/tmp/shardsafe-<uid> (or under XDG_RUNTIME_DIR) already is shardsafe's private directory: no second level."""
    run = _mkdir(tmp_path / "run", 0o700)
    assert default_holder_dir({"XDG_RUNTIME_DIR": str(run)}) == str(run / MINE)
    assert default_holder_dir({}) == f"/tmp/{MINE}"
    paths = HolderPaths(str(run / MINE), "job1", "n0")
    paths.ensure_dir()
    assert paths.root == str(run / MINE) and os.listdir(run) == [MINE]


# ---- 3. names read from files --------------------------------------------------------------------------------

def test_an_owner_token_that_walks_out_of_the_directory_never_becomes_a_path(tmp_path, caplog):
    """Even in this user's own private directory, a token from a file is one plain name or ignored: before, the
    claim unlinked whatever ``{"token": "x/../../../victim"}`` named once no process held it."""
    root = _mkdir(tmp_path / MINE, 0o700)
    job = _mkdir(root / "job1", 0o700)
    _mkdir(job / "n0.instance.x", 0o700)
    (job / "n0.owner").write_text(json.dumps({"token": "x/../../../victim", "pid": 1}))
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    with caplog.at_level(logging.WARNING, logger="shardsafe.jobid"):
        assert jobid.claim(str(root), "job1", "n0", token="mine") == "mine"
    assert victim.read_text() == "keep me"
    assert json.loads((job / "n0.owner").read_text())["token"] == "mine"
    assert "is not a plain name" in caplog.text
    for bad in ("", ".", "..", "a/b", "a\0b", "x" * 129, "é", None, 7):
        assert not safe_name(bad), bad
    assert safe_name("12345.678") and safe_name("launch-1_a.b")
    with pytest.raises(ValueError, match="instance token"):
        jobid.claim(str(root), "job1", "n0", token="../up")


# ---- 4. no file is opened through a link ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["owner.tmp", "owner.lock", "lock"])
def test_no_file_in_the_directory_is_opened_through_a_link(tmp_path, holder_root, name):
    """A link in the directory, wherever it points, is never followed: the claim's temporary owner file (whose
    name is predictable) is replaced, the locks are refused by name."""
    paths = HolderPaths(holder_root, f"link-{name}", "n0")
    paths.ensure_dir()
    target = tmp_path / "target"
    if name == "owner.tmp":
        target.write_text("keep me")
    link = {"owner.tmp": os.path.join(paths.dir, f"n0.owner.tmp{os.getpid()}"),
            "owner.lock": os.path.join(paths.dir, "n0.owner.lock"), "lock": paths.lock}[name]
    os.symlink(target, link)
    if name == "owner.tmp":
        jobid.claim(holder_root, paths.job_id, "n0", token="mine")
        assert target.read_text() == "keep me" and not os.path.lexists(link)
        return
    with pytest.raises(UnsafeHolderDir, match="symbolic link"):
        if name == "lock":
            connect_or_start(paths, budget_gb=0.01, start=True, timeout_s=10)
        else:
            jobid.claim(holder_root, paths.job_id, "n0", token="mine")
    assert not target.exists()   # O_CREAT through the link would have made it


# ---- 5. SO_PEERCRED on both ends -------------------------------------------------------------------------------

def _as_nobody_serving(path: str, conns: int) -> tuple[int, int]:
    """A process that binds ``path`` (as root: the directory is this user's), becomes nobody and listens: the
    uid the kernel records for the socket's server. It accepts ``conns`` connections and writes to the returned pipe
    how many bytes the clients sent it. Returns (pid, read end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # pragma: no cover - the child
        got = 0
        try:
            os.close(r)
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            srv.bind(path)
            os.chmod(path, 0o666)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            srv.listen(4)
            os.write(w, b"+")
            srv.settimeout(30)
            for _ in range(conns):
                conn, _ = srv.accept()
                conn.settimeout(10)
                while True:   # until the client closes (or the timeout: a client waiting for a reply)
                    try:
                        data = conn.recv(65536)
                    except socket.timeout:
                        break
                    if not data:
                        break
                    got += len(data)
                conn.close()
        finally:
            os.write(w, str(got).encode())
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"+"
    return pid, r


@as_root
def test_a_socket_served_by_another_user_is_never_used(tmp_path, caplog):
    paths = HolderPaths(str(tmp_path), "fjob", "n0")
    paths.ensure_dir()
    pid, r = _as_nobody_serving(paths.socket, conns=2)
    try:
        with caplog.at_level(logging.ERROR, logger="shardsafe.holder"):
            with pytest.raises(ForeignHolder) as e:
                HolderClient(paths, timeout_s=3).connect()
        for w in (paths.socket, "uid 65534", "not as you", "sent it nothing"):
            assert w in str(e.value), str(e.value)
        assert "uid 65534" in caplog.text                # loud, whoever catches it
        env = {"SHARDSAFE_JOB_ID": "fjob", "RANK": "0", "SHARDSAFE_NODE": "n0", "SHARDSAFE_HOLDER_DIR": str(tmp_path)}
        eo = early_open.start(env)
        assert eo is not None and eo.wait(30)
        assert eo.version == -1 and "ForeignHolder" in eo.why, eo.why
        assert early_open.take() is eo
        os.waitpid(pid, 0)
        pid = 0
        assert os.read(r, 32) == b"0"                     # neither client sent it a byte (no hello, no job id)
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(r)


@as_root
def test_the_holder_answers_no_client_of_another_user(tmp_path):
    """The holder's side: a connection from another uid (a socket pair made by nobody, handed to the holder's
    connection handler) is closed unanswered and counted."""
    from shardsafe.holder.server import Holder
    holder = Holder(HolderPaths(str(tmp_path), "sjob", "n0"), budget_bytes=1 << 20)
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:   # pragma: no cover - the child
        rc = 1
        try:
            parent.close()
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            mine, theirs = socket.socketpair()       # the kernel records nobody as the peer of both ends
            socket.send_fds(child, [b"s"], [theirs.fileno()])
            theirs.close()
            from shardsafe.holder.protocol import send_msg
            try:
                send_msg(mine, {"op": "hello", "job_id": "sjob"})
            except OSError:
                pass   # the holder may have closed it already
            mine.settimeout(20)
            try:
                rc = 0 if mine.recv(100) == b"" else 3   # closed without a reply
            except ConnectionResetError:
                rc = 0                                    # closed with the hello unread
        finally:
            os._exit(rc)
    child.close()
    _, fds, _, _ = socket.recv_fds(parent, 1, 1)
    conn = socket.socket(fileno=fds[0])
    holder._clients += 1
    holder._serve_conn(conn)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert holder.refused["uid"] == 1 and holder._clients == 0


# ---- 6. XDG_RUNTIME_DIR of the submitting host -------------------------------------------------------------------

def test_an_xdg_runtime_dir_missing_on_the_node_falls_back_to_tmp_said_once(tmp_path, caplog, monkeypatch):
    from shardsafe import env as hp
    monkeypatch.setattr(hp, "_xdg_said", set())
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "run-user-1000"), "SLURM_JOB_ID": "4711"}
    with caplog.at_level(logging.INFO, logger="shardsafe.holder"):
        assert default_holder_dir(env) == default_holder_dir(env) == f"/tmp/{MINE}"
    said = [r for r in caplog.records if "XDG_RUNTIME_DIR" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert env["XDG_RUNTIME_DIR"] in said[0].getMessage() and f"/tmp/{MINE}" in said[0].getMessage()
    assert "SLURM" in said[0].getMessage()


# ---- 7. JobConflict waits for the previous instance ---------------------------------------------------------------

_HOLD = textwrap.dedent("""
    import sys, time
    from shardsafe import jobid
    jobid.claim(sys.argv[1], "job1", "n0", token="previous", wait_s=0)
    print("CLAIMED", flush=True)
    time.sleep(60)
""")


def test_a_relaunch_waits_for_the_previous_instance_to_exit(tmp_path, caplog):
    old = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert old.stdout.readline().strip() == "CLAIMED"
        t0 = time.monotonic()
        with pytest.raises(jobid.JobConflict, match="still running after"):
            jobid.claim(str(tmp_path), "job1", "n0", token="next", wait_s=0.6)
        assert time.monotonic() - t0 >= 0.6
        threading.Timer(1.0, old.kill).start()          # the hung trainer of the previous attempt goes
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="shardsafe.jobid"):
            assert jobid.claim(str(tmp_path), "job1", "n0", token="next", wait_s=30) == "next"
        assert 0.9 <= time.monotonic() - t0 < 20
        said = [r.getMessage() for r in caplog.records if "waiting up to 30 s" in r.getMessage()]
        assert len(said) == 1 and "'job1'" in said[0] and "previous" in said[0], caplog.text
    finally:
        old.kill()
        old.wait()
    assert jobid.CLAIM_WAIT_S >= 30   # longer than SLURM's default KillWait


# ---- 8. only the trainer process opens its snapshot early or protects an engine -----------------------------------

_TRAINER = textwrap.dedent("""
    import json, multiprocessing, os, subprocess, sys, types
    from shardsafe.adapters import autoload
    from shardsafe.holder import early_open

    # What `import deepspeed` does where shardsafe's finder is installed (the main script's top level: a spawn-mode
    # DataLoader worker runs it again as __mp_main__).
    ds = types.SimpleNamespace(initialize=lambda *a, **k: "deepspeed's own engine")
    autoload._patch_deepspeed(ds)

    def report():
        e = early_open.take()
        return {"early_open": e is not None and e.wait(30) and e.version, "pid": os.getpid()}

    def worker(q):
        q.put(report())

    if sys.argv[1:] == ["--subprocess"]:
        out = report()
        try:
            out["initialize"] = ds.initialize(config={"train_batch_size": 1, "shardsafe": {"enabled": True}})
        except Exception as e:   # protect() in this process (what must not happen): said in the report
            out["initialize"] = f"protected, and failed: {type(e).__name__}: {e}"[:300]
        print(json.dumps(out))
    elif __name__ == "__main__":
        out = {"trainer": report()}
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=worker, args=(q,))
        p.start()
        out["spawn worker"] = q.get(timeout=60)
        p.join()
        r = subprocess.run([sys.executable, __file__, "--subprocess"], capture_output=True, text=True, timeout=60)
        out["subprocess"] = json.loads(r.stdout)
        out["subprocess stderr"] = r.stderr
        print(json.dumps(out))
""")


def test_only_the_trainer_process_opens_early_or_protects(holder_factory, tmp_path):
    (h,) = holder_factory(1, job="tjob", budget_gb=0.2)
    c = HolderClient(h.paths, timeout_s=10).connect()
    try:
        snap(c, ToyAdapter(1), 8)
        script = tmp_path / "train.py"
        script.write_text(_TRAINER)
        env = {k: v for k, v in os.environ.items() if k != early_open.ENV_TRAINER}
        env.update(SHARDSAFE_JOB_ID="tjob", RANK="0", SHARDSAFE_NODE="n0", SHARDSAFE_HOLDER_DIR=h.paths.root)
        r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
    finally:
        c.close()
    assert out["trainer"]["early_open"] == 8, out          # the trainer maps its snapshot as DeepSpeed loads
    assert out["spawn worker"]["early_open"] is False, out  # its DataLoader worker re-imports DeepSpeed: nothing
    assert out["subprocess"]["early_open"] is False, out
    assert out["subprocess"]["initialize"] == "deepspeed's own engine", out
    assert "not protected here" in out["subprocess stderr"], out
    assert len({out[k]["pid"] for k in ("trainer", "spawn worker", "subprocess")}) == 3


def test_the_trainer_marker(monkeypatch):
    env = {"RANK": "3", "LOCAL_RANK": "1"}
    assert early_open.trainer_process(env) and env[early_open.ENV_TRAINER] == f"{os.getpid()}:3:1"
    assert early_open.trainer_process(env)                                 # asked again: still the trainer
    child = {**env, early_open.ENV_TRAINER: f"{os.getpid() + 1}:3:1"}       # inherited from another process
    assert not early_open.trainer_process(child)
    sibling = {"RANK": "4", "LOCAL_RANK": "2", early_open.ENV_TRAINER: f"{os.getpid() + 1}:3:1"}  # a launcher's rank
    assert early_open.trainer_process(sibling) and sibling[early_open.ENV_TRAINER].startswith(f"{os.getpid()}:")
    single = {}
    assert early_open.trainer_process(single) and single == {}             # no RANK: not judged, nothing set


# ---- 9. the .pth line ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pth_line() -> str:
    return runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="shardsafe_setup")["AUTOLOAD_LINE"]


@pytest.mark.parametrize("package", ["missing", "broken"])
def test_the_pth_line_is_silent_when_the_package_is_missing_or_broken(tmp_path, pth_line, package):
    """A .pth left behind by a removed or half-removed install runs at every interpreter start of the environment,
    pip's included: it must not print (a traceback each time, before)."""
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    (site_dir / "shardsafe-autoload.pth").write_text(pth_line)
    if package == "broken":
        (site_dir / "shardsafe").mkdir()
        (site_dir / "shardsafe" / "__init__.py").write_text("raise RuntimeError('half-removed install')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDSAFE_AUTO", "PYTHONPATH")}
    r = subprocess.run([sys.executable, "-S", "-c", f"import site; site.addsitedir({str(site_dir)!r}); print('ran')"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "ran\n" and r.stderr == "", r


def test_the_pth_line_still_installs_the_finder_and_honours_the_switch(tmp_path, pth_line):
    from pathlib import Path
    written = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="shardsafe_setup")["write_autoload_pth"](Path(tmp_path))
    assert written.read_text() == pth_line and pth_line.startswith("import ") and pth_line.count("\n") == 1
    probe = ("import os, sys; want = os.environ.pop('WANT'); os.environ.pop('SHARDSAFE_AUTO') if want == 'on' else None;"
             f" exec({pth_line!r}); print(any(type(f).__name__ == 'Finder' for f in sys.meta_path))")
    for want, expect in (("on", "True"), ("off", "False")):
        env = {**os.environ, "SHARDSAFE_AUTO": "0", "WANT": want}   # the installed .pth stays off in both
        r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        assert r.stdout.strip() == expect and r.stderr == "", (want, r)
