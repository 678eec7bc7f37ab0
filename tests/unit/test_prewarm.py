"""The fork server (shardsafe.launch.prewarm): a forked trainer must look like one started cold.

Real processes: a real server process imports its preloads and forks real children that run real
scripts; exits, signals and a SIGKILLed server are the real thing. Whether a forked DeepSpeed trainer
computes bit for bit what a cold one does is checked by the fault tests whose references start cold
(tests/fault/helpers.py: reference_preload) and by ``shardsafe demo``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shardsafe.launch import LaunchConfig, LocalLauncher
from shardsafe.launch.local import trainer_env
from shardsafe.launch.prewarm import ForkServer, PrewarmError

PROBE = textwrap.dedent("""
    import atexit, gc, json, os, random, signal, sys
    import numpy as np
    out = os.environ["SHARDSAFE_TEST_OUT"]
    atexit.register(lambda: print("atexit ran", flush=True))
    # never flushed nor closed: the interpreter's teardown writes it (the server's frozen heap must not stop that)
    leak = open(out + ".leak", "w")
    leak.write("written at teardown")
    json.probe_leak = leak   # held by another module, as a library's log file is: alive until the very end
    # a non-daemon thread still running when the script ends: the interpreter waits for it before atexit
    import threading, time
    threading.Thread(target=lambda: (time.sleep(0.3), open(out + ".thread", "w").write("joined"))).start()
    info = {
        "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
        "file": __file__ if "__file__" in globals() else None,
        "rank": os.environ.get("RANK"), "only": os.environ.get("SHARDSAFE_TEST_ONLY"),
        "leader": os.getsid(0) == os.getpid() and os.getpgid(0) == os.getpid(),
        "stdin": os.readlink("/proc/self/fd/0"),
        "random": random.random(), "np": float(np.random.random()),
        "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigpipe": signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
        "ignored": sorted(s.name for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1)
                          if signal.getsignal(s) == signal.SIG_IGN),
        "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
        "pid": os.getpid(), "ppid": os.getppid(), "gc": gc.isenabled(),
    }
    with open(out, "w") as f:
        json.dump(info, f)
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    print("stdout never flushed by the script")   # a file, so block-buffered: flushed at exit
    how = sys.argv[1]
    if how == "message":
        sys.exit("bye from the trainer")
    if how == "raise":
        raise RuntimeError("boom from the trainer")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "sleep":
        import time; time.sleep(60)
    sys.exit(int(how))
""")


@pytest.fixture
def server(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    s = ForkServer(["numpy", "numpy.random"], env=env, log_path=str(tmp_path / "prewarm.log")).start(timeout_s=120)
    yield s
    s.close()


def _spawn(server, cmd, env, log, cwd=""):
    """Fork ``cmd`` with stdout and stderr appended to ``log`` (the launcher keeps its own descriptor)."""
    with open(log, "ab") as f:
        return server.spawn(cmd, env=env, stdout=f.fileno(), stderr=f.fileno(), cwd=cwd)


def _probe(tmp_path, name="probe.py"):
    p = tmp_path / name
    p.write_text(PROBE)
    return str(p)


def _cold(script, args, env, log, cwd):
    with open(log, "ab") as f:
        p = subprocess.Popen([sys.executable, script, *args], env=env, stdin=subprocess.DEVNULL, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
    return p.wait()


def test_a_forked_trainer_looks_like_a_cold_one(tmp_path, server):
    script = _probe(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    results = {}
    for how in ("forked", "forked2", "cold"):
        out, log = str(tmp_path / f"{how}.json"), str(tmp_path / f"{how}.log")
        env = {**server.env, "RANK": "1", "SHARDSAFE_TEST_ONLY": "yes", "SHARDSAFE_TEST_OUT": out}
        cmd = [sys.executable, script, "3"]
        if how == "cold":
            rc = _cold(script, ["3"], env, log, str(work))
        else:
            assert server.accepts(cmd, env) == ""
            rc = _spawn(server, cmd, env, log, cwd=str(work)).wait(timeout=60)
        assert rc == 3, open(log).read()
        results[how] = json.load(open(out))
        text = open(log).read()
        assert "to stdout" in text and "to stderr" in text and "atexit ran" in text, text
        assert "stdout never flushed by the script" in text, text
        assert open(out + ".leak").read() == "written at teardown", how
        assert open(out + ".thread").read() == "joined", how
    f, f2, c = results["forked"], results["forked2"], results["cold"]
    assert f["ppid"] == server.proc.pid and c["ppid"] == os.getpid()   # really forked, really cold
    for key in ("argv", "path0", "cwd", "name", "file", "rank", "only", "leader", "stdin", "sigint", "sigterm",
                "sigpipe", "ignored", "gc"):
        assert f[key] == c[key], (key, f[key], c[key])
    assert f["leader"] and f["stdin"] == "/dev/null" and f["name"] == "__main__"
    assert f["fds"] == c["fds"], (f["fds"], c["fds"])   # no descriptor of the server leaks into a trainer
    # fresh seeds per trainer, as separate interpreters would have (numpy was imported by the server)
    assert f["random"] != f2["random"] and f["np"] != f2["np"]


def test_module_form_exit_codes_signals_and_exceptions(tmp_path, server):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "probe.py").write_text(PROBE)
    env = {**server.env, "PYTHONPATH": str(tmp_path), "SHARDSAFE_TEST_OUT": str(tmp_path / "m.json")}
    # PYTHONPATH differs from the server's: the module form needs a server started with it
    assert "PYTHONPATH" in server.accepts([sys.executable, "-m", "mypkg.probe"], env)
    s2 = ForkServer([], env=env, log_path=str(tmp_path / "p2.log")).start(timeout_s=60)
    try:
        out = str(tmp_path / "m.json")
        p = _spawn(s2, [sys.executable, "-m", "mypkg.probe", "0"], env=env, log=str(tmp_path / "m.log"),
                     cwd=str(tmp_path))
        assert p.wait(timeout=60) == 0
        info = json.load(open(out))
        assert info["argv"][0] == str(pkg / "probe.py") and info["path0"] == str(tmp_path)
        assert info["name"] == "__main__"
    finally:
        s2.close()
    script = _probe(tmp_path)
    # torchrun's form: python -u SCRIPT, stdout and stderr to separate files
    with open(tmp_path / "u.out", "wb") as o, open(tmp_path / "u.err", "wb") as e:
        p = server.spawn([sys.executable, "-u", script, "0"], env={**server.env, "SHARDSAFE_TEST_OUT": str(tmp_path / "u.json")},
                         stdout=o.fileno(), stderr=e.fileno())
    assert p.wait(timeout=60) == 0
    assert json.load(open(tmp_path / "u.json"))["argv"] == [script, "0"]
    assert "to stdout" in (tmp_path / "u.out").read_text() and "to stderr" not in (tmp_path / "u.out").read_text()
    assert "to stderr" in (tmp_path / "u.err").read_text()
    log = str(tmp_path / "raise.log")
    p = _spawn(server, [sys.executable, script, "raise"], env={**server.env, "SHARDSAFE_TEST_OUT": str(tmp_path / "r.json")}, log=log)
    assert p.wait(timeout=60) == 1
    assert "RuntimeError: boom from the trainer" in open(log).read()
    log = str(tmp_path / "message.log")
    p = _spawn(server, [sys.executable, script, "message"], env={**server.env, "SHARDSAFE_TEST_OUT": str(tmp_path / "x.json")},
               log=log)
    assert p.wait(timeout=60) == 1   # sys.exit("...") as a cold interpreter ends it: the message, status 1
    assert "bye from the trainer" in open(log).read() and "atexit ran" in open(log).read()
    p = _spawn(server, [sys.executable, script, "kill"], env={**server.env, "SHARDSAFE_TEST_OUT": str(tmp_path / "k.json")},
                     log=str(tmp_path / "k.log"))
    assert p.wait(timeout=60) == -signal.SIGKILL
    p = _spawn(server, [sys.executable, script, "sleep"], env={**server.env, "SHARDSAFE_TEST_OUT": str(tmp_path / "s.json")},
                     log=str(tmp_path / "s.log"))
    deadline = time.monotonic() + 30
    while not os.path.exists(tmp_path / "s.json") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.poll() is None
    os.killpg(p.pid, signal.SIGTERM)   # the launchers kill trainers by process group
    assert p.wait(timeout=30) == -signal.SIGTERM



def test_a_forked_trainer_runs_its_own_finalizers_and_not_the_preloaded_modules_ones(tmp_path):
    """A weakref finalizer still alive at exit runs in a cold interpreter's shutdown. In a forked trainer the
    trainer's own do; those registered by the server's preloaded modules (torch registers one per op library, which
    took 34 ms and 8k page copies per DeepSpeed trainer) do not: they belong to the teardown a trainer skips."""
    (tmp_path / "finmod.py").write_text("import weakref\nclass Held: pass\nHELD = Held()\n"
                                        "weakref.finalize(HELD, print, 'preloaded finalizer ran', flush=True)\n")
    script = tmp_path / "fin.py"
    script.write_text("import weakref, finmod\nclass Mine: pass\nmine = Mine()\n"
                      "weakref.finalize(mine, print, 'own finalizer ran', flush=True)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    s = ForkServer(["finmod"], env=env, log_path=str(tmp_path / "prewarm.log")).start(timeout_s=60)
    try:
        log = str(tmp_path / "forked.log")
        assert _spawn(s, [sys.executable, str(script)], env=env, log=log).wait(timeout=60) == 0
    finally:
        s.close()
    assert _cold(str(script), [], env, str(tmp_path / "cold.log"), str(tmp_path)) == 0
    cold, forked = (tmp_path / "cold.log").read_text(), open(log).read()
    assert "own finalizer ran" in cold and "preloaded finalizer ran" in cold, cold
    assert "own finalizer ran" in forked and "preloaded finalizer ran" not in forked, forked

def test_what_is_not_forked_says_why(tmp_path, server):
    env = dict(server.env)
    assert "not the interpreter" in server.accepts(["/usr/bin/python3-other", "x.py"], env)
    assert "interpreter option '-X'" in server.accepts([sys.executable, "-X", "importtime", "x.py"], env)
    assert server.accepts([sys.executable, "-u", "x.py"], env) == ""   # torchrun's form
    assert "differs from the fork server's in OMP_NUM_THREADS" in server.accepts(
        [sys.executable, "x.py"], {**env, "OMP_NUM_THREADS": "4"})
    assert "NEW_VAR" in server.accepts([sys.executable, "x.py"], {**env, "NEW_VAR": "1"})
    # per-rank variables are expected to differ
    assert server.accepts([sys.executable, "x.py"], {**env, "RANK": "3", "MASTER_PORT": "1234",
                                                     "SHARDSAFE_NODE": "node7"}) == ""


def test_preload_errors(tmp_path):
    with pytest.raises(PrewarmError, match="No module named 'no_such_module_xyz'"):
        ForkServer(["no_such_module_xyz"], env=dict(os.environ), log_path=str(tmp_path / "a.log")).start(timeout_s=60)
    # a submodule this version of a package lacks is skipped, and the log says so
    s = ForkServer(["json", "json.no_such_submodule"], env=dict(os.environ), log_path=str(tmp_path / "b.log"))
    s.start(timeout_s=60)
    s.close()
    assert "json.no_such_submodule does not exist in this version of json" in open(tmp_path / "b.log").read()


CPU_INFO_PROBE = textwrap.dedent("""
    import json, sys, time
    import cpuinfo
    t = time.perf_counter()
    info = cpuinfo.get_cpu_info()
    info["flags"].append("mutated-by-the-caller")     # a caller's change must not reach the next call
    again = cpuinfo.get_cpu_info()
    json.dump({"flags": again["flags"], "vendor": again.get("vendor_id_raw"), "s": time.perf_counter() - t,
               "doc": cpuinfo.get_cpu_info.__doc__ or ""}, open(sys.argv[1], "w"))
""")


def _forked_and_cold(tmp_path, preload: list[str], probe: str) -> tuple[dict, dict, str]:
    """Run the ``probe`` script (it writes JSON to its argv[1]) forked from a server that preloaded ``preload``, then in
    a fresh interpreter: (forked answer, cold answer, the server's log)."""
    log = tmp_path / "prewarm.log"
    script = tmp_path / "probe.py"
    script.write_text(probe)
    # a holder directory of its own: py-cpuinfo's answer is not read from one an earlier test left (ds_prewarm.py)
    env = dict(os.environ, SHARDSAFE_HOLDER_DIR=str(tmp_path / "holders"))
    s = ForkServer(preload, env=env, log_path=str(log)).start(timeout_s=120)
    try:
        p = _spawn(s, [sys.executable, str(script), str(tmp_path / "forked.json")], env=s.env, log=str(tmp_path / "f.log"))
        assert p.wait(timeout=60) == 0, open(tmp_path / "f.log").read()
    finally:
        s.close()
    cold = subprocess.run([sys.executable, str(script), str(tmp_path / "cold.json")], capture_output=True, text=True,
                          timeout=120)
    assert cold.returncode == 0, cold.stderr
    return json.load(open(tmp_path / "forked.json")), json.load(open(tmp_path / "cold.json")), log.read_text()


def test_function_entries_run_once_in_the_server_and_a_failing_one_is_skipped(tmp_path):
    """``module:function`` preload entries: shardsafe.adapters.deepspeed.prewarm:remember_cpu_info asks py-cpuinfo once in
    the server; a forked trainer gets the same flags and vendor as its own cold call would (asked here, in a
    fresh interpreter), without the subprocess py-cpuinfo starts per call; an entry that raises is logged and
    skipped, the server serves anyway."""
    entry = "shardsafe.adapters.deepspeed.prewarm:remember_cpu_info"
    forked, fresh, text = _forked_and_cold(tmp_path, [entry, "json:no_such_function"], CPU_INFO_PROBE)
    assert f"{entry}: py-cpuinfo asked once" in text, text
    assert "json:no_such_function failed (AttributeError" in text and "the trainers do that work themselves" in text
    assert forked["flags"] == fresh["flags"] and forked["vendor"] == fresh["vendor"]
    assert "mutated-by-the-caller" not in forked["flags"]
    assert "remembered by shardsafe" in forked["doc"] and "remembered" not in fresh["doc"]
    print(f"two get_cpu_info() calls: forked {forked['s']:.3f} s, cold {fresh['s']:.3f} s")


OPS_PROBE = textwrap.dedent("""
    import json, sys
    import deepspeed.ops
    inherited = "__compatible_ops__" in vars(deepspeed.ops)
    json.dump({"inherited": inherited, "ops": deepspeed.ops.__compatible_ops__}, open(sys.argv[1], "w"))
""")


def test_deepspeed_op_probe_runs_in_the_server_and_answers_what_a_cold_trainer_finds(tmp_path):
    """``shardsafe.adapters.deepspeed.prewarm:probe_compatible_ops`` (CPU accelerator): the forked trainer finds DeepSpeed's
    op-compatibility answer already made (it would otherwise run a C compiler for async_io at its start), and it
    is the answer a cold interpreter computes for itself."""
    entry = "shardsafe.adapters.deepspeed.prewarm:probe_compatible_ops"
    forked, fresh, text = _forked_and_cold(tmp_path, ["deepspeed", entry], OPS_PROBE)
    assert f"{entry}: DeepSpeed's op compatibility probed once" in text, text
    assert forked["inherited"] and not fresh["inherited"]
    assert forked["ops"] == fresh["ops"] and len(fresh["ops"]) > 5, (forked, fresh)


def test_signals_the_launcher_ignores_stay_ignored_in_a_forked_trainer(tmp_path):
    """A launcher under ``nohup`` (SIGHUP ignored) or started as a shell's background job (SIGINT ignored) passes
    those dispositions to its cold trainers; a forked trainer gets the same, not a fresh handler."""
    script = _probe(tmp_path)
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGHUP)}
    try:
        s = ForkServer(["numpy"], env=dict(os.environ), log_path=str(tmp_path / "prewarm.log")).start(timeout_s=120)
        try:
            got = {}
            for how in ("forked", "cold"):
                out, log = str(tmp_path / f"{how}.json"), str(tmp_path / f"{how}.log")
                env = {**s.env, "SHARDSAFE_TEST_OUT": out}
                rc = (_spawn(s, [sys.executable, script, "0"], env, log).wait(timeout=60) if how == "forked"
                      else _cold(script, ["0"], env, log, str(tmp_path)))
                assert rc == 0, open(log).read()
                got[how] = json.load(open(out))
        finally:
            s.close()
    finally:
        for sig, how in old.items():
            signal.signal(sig, how)
    assert got["cold"]["ignored"] == ["SIGHUP", "SIGINT"], got["cold"]
    assert got["forked"]["ignored"] == got["cold"]["ignored"] and got["forked"]["sigint"] == got["cold"]["sigint"]


def test_a_dead_server_kills_and_reports_its_trainers(tmp_path, server):
    script = _probe(tmp_path)
    p = _spawn(server, [sys.executable, script, "sleep"], env={**server.env, "SHARDSAFE_TEST_OUT": str(tmp_path / "s.json")},
                     log=str(tmp_path / "s.log"))
    deadline = time.monotonic() + 30
    while not os.path.exists(tmp_path / "s.json") and time.monotonic() < deadline:
        time.sleep(0.05)
    server.proc.kill()
    assert p.wait(timeout=30) == -signal.SIGKILL
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{p.pid}") or open(f"/proc/{p.pid}/stat").read().split()[2] == "Z"
    assert not server.alive and "gone" in server.accepts([sys.executable, script], server.env)
    with pytest.raises(PrewarmError):
        _spawn(server, [sys.executable, script, "0"], env=server.env, log=str(tmp_path / "x.log"))


def test_closing_a_worker_the_server_already_reaped_does_not_raise(tmp_path, server):
    """torch elastic stops a failed attempt's workers with the handler's close(): os.killpg of each worker whose
    poll() said running. A worker the watchdog SIGKILLed a moment earlier may be reaped by the fork server before
    its exit message is read; killpg then raised ProcessLookupError, the agent died of it and closed the
    rendezvous (seen once in test_launch.py::test_hang_detected_by_the_progress_watchdog)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler
    from shardsafe.launch.agent import forked_handler_class
    from shardsafe.launch.prewarm import ForkedProcess
    script = _probe(tmp_path)
    handler = forked_handler_class(SubprocessHandler, server, "test workers")(
        entrypoint=sys.executable, args=(script, "sleep"), env={**server.env, "SHARDSAFE_TEST_OUT": str(tmp_path / "s.json")},
        stdout=str(tmp_path / "out.log"), stderr=str(tmp_path / "err.log"), local_rank_id=0, numa_options=None)
    assert isinstance(handler.proc, ForkedProcess), "the worker was not forked"
    os.kill(handler.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{handler.proc.pid}") and time.monotonic() < deadline:   # reaped by the server
        time.sleep(0.01)
    assert handler.proc.returncode is None   # the launcher has not read the exit message yet
    handler.close(death_sig=signal.SIGTERM)
    assert handler._stdout.closed and handler._stderr.closed
    assert handler.proc.wait(timeout=30) == -signal.SIGKILL


RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    with open(os.path.join(sys.argv[1], f"r{os.environ['RANK']}.json"), "w") as f:
        json.dump({"ppid": os.getppid(), "attempt": os.environ["SHARDSAFE_ATTEMPT"]}, f)
""")


@pytest.mark.parametrize("prefix", [[], ["nice", "-n", "1"]], ids=["forked", "cold"])
def test_local_launcher_forks_trainers_or_starts_them_cold(tmp_path, prefix, caplog):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    run_dir = tmp_path / "run"
    cfg = LaunchConfig(nodes=2, nproc_per_node=2, job_id=f"pw{os.getpid()}", run_dir=str(run_dir),
                       start_holders=False, max_restarts=0, preload=("json",))
    launcher = LocalLauncher(cfg)
    with caplog.at_level("WARNING", logger="shardsafe.prewarm"):
        res = launcher.run([*prefix, sys.executable, str(script), str(run_dir)])
    assert res.ok, res
    parents = {json.load(open(run_dir / f"r{r}.json"))["ppid"] for r in range(4)}
    kinds = [e["kind"] for e in map(json.loads, open(run_dir / "events.jsonl"))]
    assert "prewarm_ready" in kinds
    if prefix:
        assert parents == {os.getpid()}
        assert "trainers start cold: nice is not the interpreter the fork server runs" in caplog.text
    else:
        assert len(parents) == 1 and parents != {os.getpid()}   # all four forked by the one server
        assert "start cold" not in caplog.text
    assert (res.forked_starts, res.cold_starts) == ((0, 4) if prefix else (4, 0))


def test_jobs_share_a_fork_server_the_caller_owns(tmp_path):
    """LocalLauncher(fork_server=): trainers of successive jobs fork from one server, which outlives
    each job (its owner closes it); a trainer the server does not accept starts cold and is counted."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = trainer_env(LaunchConfig(nodes=1, nproc_per_node=2, job_id="x", run_dir=str(tmp_path / "x")))
    server = ForkServer(("json",), env=env).launch()
    try:
        server.wait_ready()
        seen = []
        for job in ("a", "b"):
            run_dir = tmp_path / job
            cfg = LaunchConfig(nodes=1, nproc_per_node=2, job_id=f"pw{job}{os.getpid()}", run_dir=str(run_dir),
                               start_holders=False, max_restarts=0)
            res = LocalLauncher(cfg, fork_server=server).run([sys.executable, str(script), str(run_dir)])
            assert res.ok and (res.forked_starts, res.cold_starts) == (2, 0), res
            assert server.alive
            seen += [json.load(open(run_dir / f"r{r}.json"))["ppid"] for r in range(2)]
            kinds = [e["kind"] for e in map(json.loads, open(run_dir / "events.jsonl"))]
            assert "prewarm_ready" not in kinds   # the server's imports were paid before this job
        assert set(seen) == {server.proc.pid}
        cfg = LaunchConfig(nodes=1, nproc_per_node=2, job_id=f"pwc{os.getpid()}", run_dir=str(tmp_path / "c"),
                           start_holders=False, max_restarts=0, env={"SOMETHING_ELSE": "1"})
        res = LocalLauncher(cfg, fork_server=server).run([sys.executable, str(script), str(tmp_path / "c")])
        assert res.ok and (res.forked_starts, res.cold_starts) == (0, 2), res
    finally:
        server.close()
    with pytest.raises(ValueError, match="not both"):
        LocalLauncher(LaunchConfig(nodes=1, nproc_per_node=1, job_id="y", run_dir=str(tmp_path / "y"),
                                   preload=("json",)), fork_server=server)


def test_an_unprotected_runs_preset_imports_nothing_of_the_runtime():
    """The function entries a reference's server keeps (``without_runtime``) live in modules whose import leaves
    shardsafe's runtime and the adapters' runtime glue out: the Megatron adapter loads its public names lazily, so
    its ``prewarm`` module comes alone. The runtime preset's own entries do import it."""
    import json
    from shardsafe.launch.presets import PRESETS, RUNTIME_MODULES, without_runtime
    probe = ("import importlib, json, sys\n"
             "for m in sys.argv[1:]: importlib.import_module(m)\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.startswith('shardsafe'))))")
    for name, preset in PRESETS.items():
        plain = without_runtime(preset)
        mods = sorted({e.partition(":")[0] for e in plain if e.startswith("shardsafe.")})
        if not mods:
            continue
        got = json.loads(subprocess.run([sys.executable, "-c", probe, *mods], capture_output=True, text=True,
                                        check=True).stdout)
        assert not set(got) & {*RUNTIME_MODULES, "shardsafe.runtime"}, (name, mods, got)
        assert set(preset) & set(RUNTIME_MODULES) and not set(plain) & set(RUNTIME_MODULES), (name, plain)


def test_megatron_tokenizers_are_preloaded_only_where_megatron_lm_is_installed(monkeypatch):
    """Without ``megatron.training`` (a megatron-core program) nothing is imported and the log line says why."""
    import importlib.util

    from shardsafe.adapters.megatron import prewarm as mp
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "megatron.training" else real(n, *a))
    assert "megatron.training is not installed" in mp.import_tokenizers()


AGENT = textwrap.dedent("""
    import json, os, sys
    from shardsafe.launch.agentforks import fork_worker_server, why_not_here
    pre, probe, out = json.loads(os.environ["PRE"]), os.environ["PROBE"], os.environ["OUT"]
    res = {"why": why_not_here(pre)}
    if res["why"]:
        json.dump(res, open(out + ".agent.json", "w"))
        sys.exit(0)
    s = fork_worker_server(pre, env=dict(os.environ))
    res["server_ppid"] = int(open(f"/proc/{s.proc.pid}/stat").read().rsplit(")", 1)[1].split()[1])
    for how in ("0", "raise", "message"):
        with open(f"{out}.{how}.log", "ab") as f:
            p = s.spawn([sys.executable, probe, how], env={**os.environ, "SHARDSAFE_TEST_OUT": f"{out}.{how}.json"},
                        stdout=f.fileno(), stderr=f.fileno())
        res[how] = p.wait(timeout=60)
    proc = s.proc
    s.close()
    res["server_rc"] = proc.returncode
    json.dump(res, open(out + ".agent.json", "w"))
""")


def test_an_agent_forked_from_a_server_forks_its_own_server_from_itself(tmp_path):
    """shardsafe.launch.agentforks: a process forked from a server that preloaded the entries (the local launcher's
    agent) forks its fork server from itself; that server's trainers look like cold ones (name, session,
    argv, exit codes, the traceback of an uncaught exception, atexit), and a ``module:function`` entry ran once
    for all of them, in the first server. A process started cold cannot, and says why."""
    (tmp_path / "once_mod.py").write_text("import os\ndef mark():\n    open(os.environ['ONCE'], 'a').write('x')\n"
                                          "    return 'marked'\n")
    (tmp_path / "agent.py").write_text(AGENT)
    pre = ["numpy", "numpy.random", "shardsafe.launch.agentforks", "once_mod:mark"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path), "ONCE": str(tmp_path / "once"),
           "PRE": json.dumps(pre), "PROBE": _probe(tmp_path), "OUT": str(tmp_path / "w")}
    outer = ForkServer(pre, env=env, log_path=str(tmp_path / "outer.log")).start(timeout_s=120)
    try:
        agent = _spawn(outer, [sys.executable, str(tmp_path / "agent.py")], env, str(tmp_path / "agent.log"))
        assert agent.wait(timeout=120) == 0, (tmp_path / "agent.log").read_text()[-3000:]
    finally:
        outer.close()
    res = json.load(open(tmp_path / "w.agent.json"))
    assert res["why"] == "" and res["server_ppid"] == agent.pid and res["server_rc"] == 0, res
    assert (res["0"], res["raise"], res["message"]) == (0, 1, 1), res
    info = json.load(open(tmp_path / "w.0.json"))
    assert info["name"] == "__main__" and info["leader"] and info["argv"] == [env["PROBE"], "0"], info
    raised = (tmp_path / "w.raise.log").read_text()
    assert "RuntimeError: boom from the trainer" in raised and "fork_worker_server" not in raised, raised
    message = (tmp_path / "w.message.log").read_text()
    assert "bye from the trainer" in message and "atexit ran" in message, message
    assert (tmp_path / "once").read_text() == "x"   # in the outer server only
    # started cold, the same agent forks nothing and says why
    p = subprocess.run([sys.executable, str(tmp_path / "agent.py")], env={**env, "OUT": str(tmp_path / "c")},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "did not preload numpy" in json.load(open(tmp_path / "c.agent.json"))["why"]
