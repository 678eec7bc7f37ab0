"""The user docs cannot drift from the code: every config key, Megatron flag and environment variable the code reads
is in docs/configuration.md, every link and section reference resolves, nothing points outside the repository, and
the pages carry no dates.

Source only (ast and regular expressions over the files, the parsers built in process): no process is started.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from shardsafe.config import ShardsafeConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIG_PAGE = ROOT / "docs" / "configuration.md"
USER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "RESULTS.md"]
ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*[A-Z0-9]")


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- config keys and Megatron flags ----------------------------------------------------------------------------

def test_the_generated_tables_are_what_the_code_says():
    """docs/configuration.md's key and flag tables are scripts/gen_docs.py's output: a key or flag added, renamed,
    re-documented or given another default without `python scripts/gen_docs.py` fails here."""
    page = CONFIG_PAGE.read_text()
    assert _gen_docs().render(page) == page, \
        "docs/configuration.md differs from the code (ShardsafeConfig, the Megatron flags): run python scripts/gen_docs.py"


def test_every_config_key_is_in_the_table_with_its_docstring_and_default():
    gen = _gen_docs()
    docs = gen._field_docs()
    table = CONFIG_PAGE.read_text()
    for f in dataclasses.fields(ShardsafeConfig):
        assert docs.get(f.name, "").strip(), f"ShardsafeConfig.{f.name} has no docstring"
        assert re.search(rf"^\| `{f.name}` \|", table, re.M), f"{f.name} is not in docs/configuration.md"


def test_every_config_key_has_a_megatron_flag_that_says_its_default():
    """Megatron users reach every key (but the DeepSpeed-only one) by a flag, and every valued flag's help says its
    default (a switch defaults to off)."""
    gen = _gen_docs()
    actions = gen.megatron_actions()
    keys = {gen.megatron_key(a) for a in actions}
    no_flag = {k for k, flag in gen.MEGATRON_SPECIAL.items() if flag is None}
    missing = [f.name for f in dataclasses.fields(ShardsafeConfig) if f.name not in keys | no_flag]
    assert not missing, f"ShardsafeConfig keys without a --shardsafe-* flag in adapters/megatron/args.py: {missing}"
    assert keys <= {f.name for f in dataclasses.fields(ShardsafeConfig)}, keys
    silent = [a.option_strings[0] for a in actions if a.nargs != 0 and "default" not in (a.help or "").lower()]
    assert not silent, f"Megatron flags whose help does not say the default: {silent}"


# ---- environment variables -------------------------------------------------------------------------------------

def _python_sources() -> list[Path]:
    out = [ROOT / "setup.py"]
    for top in ("shardsafe", "adapters", "kernels"):
        out += sorted((ROOT / top).rglob("*.py"))
    return out


def _envish(node: ast.AST) -> bool:
    """An expression that names an environment mapping: os.environ, environ, env, self.env, os.getenv."""
    return re.search(r"environ|\benv\b|getenv", ast.unparse(node)) is not None


def python_env_reads() -> dict[str, set[str]]:
    """Variable -> where the code reads it: ``os.environ[...]``, ``environ.get(...)``, ``env.get(...)``,
    ``os.getenv(...)``, ``"X" in env``, with the name a literal, a module constant (``ENV_X = "..."``, also imported
    ones: constants are collected over all the sources) or a loop variable over literals or such constants."""
    trees = {p: ast.parse(p.read_text(), str(p)) for p in _python_sources()}
    consts: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                v = node.value
                elts = v.elts if isinstance(v, (ast.Tuple, ast.List, ast.Set)) else [v]
                if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts):
                    consts.setdefault(node.targets[0].id, set()).update(e.value for e in elts)

    def names(e: ast.AST, loops: dict[str, set[str]]) -> set[str]:
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            return {e.value}
        if isinstance(e, ast.Name):
            return loops.get(e.id) or consts.get(e.id, set())
        if isinstance(e, ast.Attribute):
            return consts.get(e.attr, set())
        return set()

    reads: dict[str, set[str]] = {}
    for path, tree in trees.items():
        loops: dict[str, set[str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
                it = node.iter
                vals = set().union(*(names(e, {}) for e in it.elts)) if isinstance(it, (ast.Tuple, ast.List)) \
                    else names(it, {})
                if vals:
                    loops.setdefault(node.target.id, set()).update(vals)
        for node in ast.walk(tree):
            keys: set[str] = set()
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
                    node.func.attr == "getenv" or
                    node.func.attr in ("get", "setdefault", "pop") and _envish(node.func.value)):
                keys = names(node.args[0], loops)
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _envish(node.value):
                keys = names(node.slice, loops)
            elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)) and \
                    _envish(node.comparators[0]):
                keys = names(node.left, loops)
            for k in keys:
                if ENV_NAME.fullmatch(k):
                    reads.setdefault(k, set()).add(f"{path.relative_to(ROOT)}:{node.lineno}")
    # shardsafe's own variables also count where a literal names one without a recognisable read (a launcher
    # hands it on, a helper takes the name as an argument).
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"SHARDSAFE_[A-Z0-9_]*[A-Z0-9]", node.value):
                reads.setdefault(node.value, set()).add(f"{path.relative_to(ROOT)}:{node.lineno}")
    return reads


SCRIPTS = [ROOT / "scripts" / "slurm" / "common.sh", *sorted((ROOT / "scripts" / "slurm").glob("*.sbatch"))]


def _shell_code(path: Path) -> list[str]:
    """The script's lines without comments (whole-line, and `  # ...` after code)."""
    out = []
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        out.append(re.sub(r"\s#\s.*$", "", line))
    return out


def script_env_reads() -> dict[str, set[str]]:
    """Variable -> script: what the sbatch scripts take from the environment. An SS_* variable is an input when its
    first use in a script reads it (``$SS_X``, ``${SS_X...}``, as ``: "${SS_X:=default}"`` does); the scripts'
    own state (``SS_T0=...``, ``SS_WORLD=...``, arrays) is assigned first. Every SLURM variable they read is an
    input, and so is any other variable read with a default (``${X:-...}``, ``${X:=...}``)."""
    reads: dict[str, set[str]] = {}
    for path in SCRIPTS:
        first: dict[str, str] = {}
        for line in _shell_code(path):
            for m in re.finditer(r"(\$\{?)?\b(SS_[A-Z0-9_]*[A-Z0-9])\b", line):
                first.setdefault(m.group(2), "read" if m.group(1) else "assigned")
            for m in re.finditer(r"\$\{?(SLURMD?_[A-Z0-9_]*[A-Z0-9])\b", line):
                reads.setdefault(m.group(1), set()).add(path.name)
            for m in re.finditer(r"\$\{([A-Z][A-Z0-9_]*[A-Z0-9]):[-=]", line):
                if not m.group(1).startswith("SS_"):
                    reads.setdefault(m.group(1), set()).add(path.name)
        for name, how in first.items():
            if how == "read":
                reads.setdefault(name, set()).add(path.name)
    return reads


def documented_env() -> set[str]:
    """The variables docs/configuration.md's "Environment variables" section lists: the names in the first column
    of its tables (several per cell allowed; a pattern such as ``PET_*`` is listed, not checked)."""
    text = CONFIG_PAGE.read_text()
    section = text.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            names.update(n for n in re.findall(r"`([^`]+)`", first) if "*" not in n)
    return names


def test_every_environment_variable_read_is_documented():
    reads = {**python_env_reads()}
    for k, v in script_env_reads().items():
        reads.setdefault(k, set()).update(v)
    missing = {k: sorted(v)[:3] for k, v in sorted(reads.items()) if k not in documented_env()}
    assert not missing, f"read but not in docs/configuration.md \"Environment variables\": {missing}"


def test_every_documented_environment_variable_is_read_somewhere():
    read = set(python_env_reads()) | set(script_env_reads())
    stale = sorted(documented_env() - read)
    assert not stale, f"documented in docs/configuration.md but read nowhere: {stale}"


def test_the_scanners_see_the_reads_they_are_meant_to():
    """The scanners themselves: a literal read, a constant, a loop over literals, a mapping argument; a script knob
    and a script's own state."""
    py, sh = python_env_reads(), script_env_reads()
    assert {"SHARDSAFE_RUN_NAME", "SHARDSAFE_EARLY_OPEN", "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID",
            "OMPI_COMM_WORLD_LOCAL_RANK", "SHARDSAFE_SKIP_CUDA_BUILD"} <= set(py)
    assert {"SS_SPARES", "SS_RUN_NAME", "SS_MEGATRON_PATH", "SLURM_SUBMIT_DIR", "CUDA_DEVICE_MAX_CONNECTIONS"} <= set(sh)
    assert not {"SS_T0", "SS_WORLD", "SS_ACTIVE", "SS_CONTROLLER_PID", "SS_HOLDER_PID"} & set(sh)


# ---- links, section references, dates ---------------------------------------------------------------------------

def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    h = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return h.replace(" ", "-")


def _headings(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)]


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_section_references_resolve(page):
    """Every relative link goes to a file of the repository (and to a heading of it, with #anchor), and every
    reference in the prose of the form docs/NAME.md "Heading" (or NAME.md, "Heading") names a heading there."""
    text = page.read_text()
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or ROOT not in dest.parents and dest != ROOT:
            bad.append(f"link {target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in {_anchor(h) for h in _headings(dest)}:
            bad.append(f"link {target}: no such heading")
    for m in re.finditer(r"\b((?:docs/|bench/)?([A-Za-z_]+)\.md),? \"([^\"]+)\"", text):
        name = m.group(2)
        dest = next((p for p in (ROOT / "docs" / f"{name}.md", ROOT / "bench" / f"{name}.md") if p.exists()), None)
        if dest is None:
            continue
        ref = " ".join(m.group(3).split())
        if not any(h == ref or h.startswith((ref + ":", ref + " (")) for h in _headings(dest)):
            bad.append(f'{m.group(1)} "{ref}": no such heading in {dest.relative_to(ROOT)}')
    assert not bad, bad


def _repository_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file() and not p.startswith(("bench/gpu/",))]


def test_nothing_in_the_repository_points_outside_it():
    """The repository is self-contained: no link or reference to notes that live beside it."""
    pattern = re.compile(r"\.\./shared|shared/reference|/work/shared|\breference/[\w.-]+\.md|\bDESIGN\.md")
    found = []
    for path in _repository_files():
        if path.suffix not in (".md", ".py", ".sh", ".sbatch", ".toml", ".cfg", ".ini", ".txt", ".args", ".json", "") \
                or path == Path(__file__).resolve():
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, found


DATE = re.compile(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]|[0-2][0-9]:[0-5][0-9] UTC")


def test_the_user_pages_carry_no_dates_or_times_of_day():
    """README, docs/ and bench/RESULTS.md state what holds, not when it was seen (history lives in git)."""
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for p in USER_PAGES
             for n, line in enumerate(p.read_text().splitlines(), 1) if DATE.search(line)]
    assert not found, found


def test_the_readme_shows_the_two_commands_and_links_the_reference():
    readme = (ROOT / "README.md").read_text()
    for needed in ("make demo", "make test", "pip install", "docs/configuration.md", "bench/RESULTS.md"):
        assert needed in readme, needed
