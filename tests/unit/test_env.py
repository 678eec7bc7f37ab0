"""One home for the environment (shardsafe/env.py): no other module of the package reads a ``SHARDSAFE_*`` variable
itself, and a new one read elsewhere fails here. Writing a child's environment (launchers) may use the names."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardsafe import env

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for d in ("shardsafe", "adapters", "kernels") for p in (ROOT / d).rglob("*.py")
                 if p != ROOT / "shardsafe" / "env.py")
ENV_MODULE_ALIASES = {"env", "names", "shardsafe_env"}   # how modules import shardsafe.env


def _constants(tree: ast.Module) -> set[str]:
    """Module-level names bound to a SHARDSAFE_* name: a literal, or one of shardsafe.env's constants."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = [t for t in node.targets if isinstance(t, (ast.Name, ast.Tuple))]
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            names = [n for t in targets for n in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for n, v in zip(names, values):
                if isinstance(n, ast.Name) and _is_name(v, set()):
                    out.add(n.id)
    return out


def _is_name(node: ast.AST, consts: set[str]) -> bool:
    """Does ``node`` stand for a SHARDSAFE_* variable name?"""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.startswith("SHARDSAFE_")
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id in ENV_MODULE_ALIASES and getattr(env, node.attr, None) in env.NAMES
    return isinstance(node, ast.Name) and node.id in consts


def reads_outside_env(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    consts = _constants(tree)
    out = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_name(node.slice, consts):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args and _is_name(node.args[0], consts):
            f = node.func
            via_env = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ENV_MODULE_ALIASES
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "getenv") and not via_env) or \
                    (isinstance(f, ast.Name) and f.id == "getenv"):
                key = node.args[0]
        elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops) \
                and _is_name(node.left, consts):
            key = node.left
        if key is not None:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:100]}")
    return out


def test_no_module_but_env_reads_a_shardsafe_variable():
    found = [r for p in SOURCES for r in reads_outside_env(p)]
    assert found == [], "read these through shardsafe.env (get / node_name / holder_dir / attempt ...):\n" + \
        "\n".join(found)


def test_the_scan_finds_a_read_added_elsewhere(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('import os\nfrom shardsafe import env\nX = "SHARDSAFE_X"\nY = env.JOB_ID\n'
                     'a = os.environ.get("SHARDSAFE_RUN_DIR")\nb = os.environ[X]\nc = os.getenv(Y)\n'
                     'd = "SHARDSAFE_NODE" in os.environ\ne = env.get(env.JOB_ID)\nos.environ[Y] = "1"\n')
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        found = reads_outside_env(probe)
    finally:
        ROOT = root
    assert [f.split(":")[1] for f in found] == ["5", "6", "7", "8"], found


def test_env_reads_only_its_own_names_and_resolves_the_defaults(tmp_path, monkeypatch):
    from shardsafe.errors import InternalError
    with pytest.raises(InternalError, match="not one of shardsafe's environment variables"):
        env.get("SHARDSAFE_TYPO")
    e = {env.JOB_ID: "j", env.NODE: "n3", env.HOLDER_DIR: str(tmp_path), env.ATTEMPT: "2"}
    assert env.get(env.JOB_ID, e) == "j" and env.node_name(e) == "n3" and env.attempt(e) == 2
    assert env.holder_dir(e) == str(tmp_path / env.private_name())
    assert env.holder_socket(e) == os.path.join(str(tmp_path / env.private_name()), "j", "n3.sock")
    assert env.attempt({"TORCHELASTIC_RESTART_COUNT": "4"}) == 4 and env.launcher_job_id({"SLURM_JOB_ID": "77"}) == "77"
    assert not env.auto_enabled({env.AUTO: " Off "}) and env.auto_enabled({})


def test_a_config_reads_nothing_until_it_is_resolved(monkeypatch, tmp_path):
    """Constructing a config reads no environment (and importing it installs no hook); resolved() fills in what
    it leaves to the environment."""
    from shardsafe.config import ShardsafeConfig
    monkeypatch.setenv(env.RUN_DIR, str(tmp_path))
    monkeypatch.setenv(env.JOB_ID, "job7")
    monkeypatch.setenv(env.NODE, "nodeX")
    cfg = ShardsafeConfig()
    assert (cfg.run_dir, cfg.job_id, cfg.node, cfg.holder_dir) == ("", "", "", "")
    got = cfg.resolved()
    assert (got.run_dir, got.job_id, got.node) == (str(tmp_path), "job7", "nodeX")
    assert got.resolved() == got
    probe = ("import sys, shardsafe.config, shardsafe.adapters.deepspeed as d; "
             "print(getattr(sys.excepthook, '_shardsafe_fatal', False))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out   # importing installs no process-wide hook
