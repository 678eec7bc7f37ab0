"""The command line as a user meets it: usage errors, --help, option names, export's `--`, --preload presets.

In process (``shardsafe.cli.main``), except the two module entry points: every bad input below is caught while
parsing or before anything starts, so nothing is launched.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from shardsafe import __version__, cli
from shardsafe.cliargs import Formatter
from shardsafe.errors import ConfigError
from shardsafe.launch.presets import PRELOAD_DEEPSPEED, PRELOAD_HF, PRELOAD_MEGATRON, preload_modules


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("shardsafe",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))


PARSERS = list(_walk(cli.build_parser()))


def _run(argv, capsys) -> tuple[int, str, str]:
    """main(argv): its exit code (argparse's SystemExit included), stdout, stderr."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_every_command_is_reached_and_its_help_renders():
    names = {" ".join(p) for p, _ in PARSERS}
    assert {"shardsafe holder", "shardsafe status", "shardsafe demo", "shardsafe tor report", "shardsafe tor project",
            "shardsafe tor simulate", "shardsafe launch", "shardsafe agent", "shardsafe control serve",
            "shardsafe control notify", "shardsafe export"} <= names, names
    for _, parser in PARSERS:
        assert parser.format_help()   # a stray % in a help text fails here


@pytest.mark.parametrize("path", [" ".join(p) for p, _ in PARSERS])
def test_every_option_has_help_that_shows_its_default(path):
    """Issue 41: help on every flag, defaults shown -- by the formatter, or in words where the default depends
    on something (an environment variable, the engine, another option)."""
    parser = dict((" ".join(p), q) for p, q in PARSERS)[path]
    missing = []
    for a in parser._actions:
        if a.help == argparse.SUPPRESS or isinstance(a, (argparse._HelpAction, argparse._VersionAction,
                                                         argparse._SubParsersAction)):
            continue
        if not a.help:
            missing.append(f"{a.option_strings or a.dest}: no help")
        elif a.option_strings and a.nargs != 0 and not a.required and \
                "default" not in Formatter(parser.prog)._get_help_string(a).lower():
            missing.append(f"{a.option_strings}: its help shows no default")
    assert not missing, missing


@pytest.mark.parametrize("argv, said", [
    ([], "the following arguments are required: COMMAND"),
    (["nosuch"], "invalid choice: 'nosuch'"),
    # these printed a traceback, ran with a value they silently replaced, or crashed later
    (["launch", "--inject", "explode:1@3", "train.py"], "argument --inject: bad fault spec 'explode:1@3'"),
    (["launch", "--nnodes", "0", "train.py"], "argument --nnodes: '0': expected a whole number of nodes >= 1"),
    (["launch", "--timeout-s", "soon", "train.py"], "argument --timeout-s: 'soon': expected seconds"),
    (["launch", "--preload", "torch deepspeed", "train.py"], "'torch deepspeed' is no module name"),
    (["launch", "train.py.missing.py"], "training script 'train.py.missing.py' not found"),
    (["agent", "--control", "127.0.0.1:1", "--nnodes", "abc", "--job-id", "j", "t.py"],
     "argument --nnodes: 'abc': expected N or MIN:MAX"),
    (["agent", "--control", "nohost", "--nnodes", "1", "t.py"], "argument --control: endpoint 'nohost'"),
    (["agent", "--control", "h:1", "--nnodes", "1", "--job-id", "j", "--inject", "bad", "t.py"], "bad fault spec"),
    (["control", "serve", "--run-dir", "/r"], "required: --listen, --world-size"),
    (["control", "notify", "bogus", "--run-dir", "/r"], "invalid choice: 'bogus'"),
    (["tor", "project", "--gpus", "0"], "argument --gpus: '0': expected a whole number of GPUs >= 1"),
    (["tor", "project", "--gpus-per-node", "0"], "argument --gpus-per-node"),
    (["tor", "simulate", "--horizon-days", "0"], "argument --horizon-days: '0'"),
    (["tor", "project", "--interval-s", "0"], "argument --interval-s: '0': expected seconds, a finite number > 0"),
    (["demo", "--steps", "0"], "argument --steps"),
    (["demo", "--nnodes", "0"], "argument --nnodes"),
    (["demo", "--inject", "bogus"], "argument --inject: bad fault spec"),
    (["demo", "--engine", "megatron", "--tp", "3"], "--tp 3 x --pp 1 does not divide the 4 ranks"),
    (["demo", "--kill-at", "50", "--steps", "10"], "--kill-at 50: expected a step before the last"),
    (["demo", "--memory-budget-gb", "-1"], "--memory-budget-gb must be >= 0"),
    (["holder", "--job-id", "j", "--max-clients", "0"], "argument --max-clients"),
    (["holder", "--job-id", "j", "--read-timeout-s", "-1"], "argument --read-timeout-s"),
    (["holder", "--job-id", "j", "--memory-budget-gb", "-1"], "--memory-budget-gb must be >= 0"),
    (["holder", "--job-id", "j", "--holder-dir", "/tmp/" + "x" * 120], "a Unix socket's path holds at most 107"),
    (["export", "--format", "deepspeed", "SRC", "DST", "torchrun", "x.py"], "the job's command goes after --"),
    (["export", "--format", "tarball", "SRC", "DST"], "argument --format: invalid choice: 'tarball'"),
])
def test_a_usage_error_is_one_line_on_stderr_and_exit_code_2(argv, said, capsys, monkeypatch):
    monkeypatch.delenv("SHARDSAFE_PRELOAD", raising=False)
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and said in err and len(err.splitlines()) == 1 and "Traceback" not in err, (rc, err)
    assert err.startswith("shardsafe") and ": error: " in err
    assert out == ""


def test_control_notify_does_not_create_a_run_directory(tmp_path, capsys):
    """It used to create any directory it was given and leave the notification where no controller reads it."""
    rc, _, err = _run(["control", "notify", "node-lost", "--run-dir", str(tmp_path / "nowhere"), "--node", "n1"],
                      capsys)
    assert rc == 2 and "does not exist" in err and not (tmp_path / "nowhere").exists()
    rc, out, _ = _run(["control", "notify", "node-lost", "--run-dir", str(tmp_path), "--node", "n1"], capsys)
    assert rc == 0 and json.loads(open(out.strip()).read())["node"] == "n1"


def test_status_exits_alike_with_and_without_json(tmp_path, capsys, monkeypatch):
    """Issue 41: for the same missing job `status` exited 1 as text and 0 with --json."""
    monkeypatch.delenv("SHARDSAFE_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    root = str(tmp_path / "h")
    for extra in ([], ["--json"]):
        rc, out, _ = _run(["status", "--holder-dir", root, "--job-id", "nojob", *extra], capsys)
        assert rc == 1, (extra, out)
        rc, out, _ = _run(["status", "--holder-dir", root, *extra], capsys)   # no job given, none with holders
        assert rc == 1, (extra, out)
    assert json.loads(out) == {"job_id": None, "jobs": [], "holders": []}


@pytest.fixture
def exported(monkeypatch):
    """What `shardsafe export` would run with (the export itself replaced)."""
    seen = []
    monkeypatch.setattr("shardsafe.export.replay.cmd_export", lambda a: seen.append(a) or 0)
    return seen


def test_export_parses_options_after_src_dst_and_takes_the_command_after_the_double_dash(exported):
    """The form docs/operations.md shows: options after SRC DST (`--holder-dir` was run as the job's command)."""
    assert cli.main(["export", "--format", "deepspeed", "holder://J", "/ckpt/x", "--holder-dir", "/run/h",
                     "--version", "1200"]) == 0
    a = exported.pop()
    assert (a.src, a.dst, a.holder_dir, a.version, a.command) == ("holder://J", "/ckpt/x", "/run/h", 1200, [])
    cmd = ["torchrun", "--nproc-per-node", "8", "pretrain_gpt.py", "--version", "x", "--", "y"]
    assert cli.main(["export", "--format", "megatron", "SRC", "DST", "--tag", "t", "--", *cmd]) == 0
    a = exported.pop()
    assert a.command == cmd and a.tag == "t" and a.version is None   # the command's options are its own


def test_the_version_is_the_packages(capsys):
    rc, out, _ = _run(["--version"], capsys)
    assert rc == 0 and out.strip() == f"shardsafe {__version__}"


def test_preload_presets_and_module_lists():
    assert preload_modules("deepspeed") == PRELOAD_DEEPSPEED and preload_modules("megatron") == PRELOAD_MEGATRON
    assert PRELOAD_HF[:len(PRELOAD_DEEPSPEED)] == PRELOAD_DEEPSPEED and "transformers.trainer" in PRELOAD_HF
    assert preload_modules("none") == () == preload_modules("") == preload_modules(" , ")
    assert preload_modules("torch, deepspeed,x.y:f") == ("torch", "deepspeed", "x.y:f")   # a list: as written
    for bad in ("a b", "./train.py", "torch,-x"):
        with pytest.raises(ConfigError, match="no module name"):
            preload_modules(bad)
    p = cli.build_parser()
    assert p.parse_args(["launch", "--preload", "hf", "t.py"]).preload == PRELOAD_HF
    assert p.parse_args(["agent", "--control", "h:1", "--nnodes", "2", "--preload", "megatron", "t.py"]).preload \
        == PRELOAD_MEGATRON
    assert p.parse_args(["demo"]).preload is None   # the demo picks its engine's preset


def test_torchrun_names_and_seconds_suffixes_with_the_former_spellings_hidden(monkeypatch):
    monkeypatch.delenv("SHARDSAFE_PRELOAD", raising=False)
    p = cli.build_parser()
    new = p.parse_args(["launch", "--nnodes", "3", "--nproc-per-node", "2", "--hang-timeout-s", "5", "--grace-s", "2",
                        "--timeout-s", "9", "t.py"])
    old = p.parse_args(["launch", "--nodes", "3", "--nproc_per_node", "2", "--hang-timeout", "5", "--grace", "2",
                        "--timeout", "9", "t.py"])
    assert vars(new) == {**vars(old), "func": new.func} and (new.nodes, new.hang_timeout_s, new.timeout_s) == (3, 5, 9)
    a = p.parse_args(["agent", "--control", "h:1", "--nnodes", "2:2", "--monitor-interval", "0.5", "t.py"])
    assert a.monitor_interval_s == 0.5
    a = p.parse_args(["control", "serve", "--run-dir", "/r", "--listen", "h:1", "--world-size", "2",
                      "--hang-timeout", "7", "--grace", "1"])
    assert (a.hang_timeout_s, a.grace_s) == (7, 1)
    assert p.parse_args(["tor", "project", "--nodes", "4"]).nodes == 4 == p.parse_args(["demo", "--nodes", "4"]).nodes
    helps = {" ".join(path): parser.format_help() for path, parser in PARSERS}
    for path, flags in {"shardsafe launch": ("--nnodes", "--hang-timeout-s", "--grace-s", "--timeout-s"),
                        "shardsafe agent": ("--nnodes", "--monitor-interval-s"),
                        "shardsafe control serve": ("--hang-timeout-s", "--grace-s"),
                        "shardsafe demo": ("--nnodes",), "shardsafe tor project": ("--nnodes",)}.items():
        shown = helps[path].split()
        assert all(f in shown for f in flags), (path, flags)
        assert not {"--nodes", "--hang-timeout", "--grace", "--timeout", "--monitor-interval"} & set(shown), path


@pytest.mark.parametrize("module, argv, said", [
    ("shardsafe.launch", ["launch", "--nnodes", "0", "t.py"], "python -m shardsafe.launch launch: error: argument"),
    ("shardsafe.tor", ["project", "--gpus", "0"], "python -m shardsafe.tor tor project: error: argument --gpus"),
])
def test_the_module_entry_points_say_usage_errors_alike(module, argv, said):
    r = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(said) and len(r.stderr.splitlines()) == 1, r.stderr


def test_launch_takes_the_job_id_from_the_environment(monkeypatch):
    """`shardsafe launch` without --job-id replaced an exported SHARDSAFE_JOB_ID with a random id (the trainers,
    `holder` and `status` take it): it keeps it now, and an explicit --job-id still wins."""
    from shardsafe.cli import build_parser
    monkeypatch.setenv("SHARDSAFE_JOB_ID", "mine")
    assert build_parser().parse_args(["launch", "train.py"]).job_id == "mine"
    assert build_parser().parse_args(["launch", "--job-id", "other", "train.py"]).job_id == "other"
    monkeypatch.delenv("SHARDSAFE_JOB_ID")
    assert build_parser().parse_args(["launch", "train.py"]).job_id == ""   # ElasticConfig draws launch-<hex>
