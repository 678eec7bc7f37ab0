"""The package definition (pyproject.toml) against the tree and this venv; the wheel itself is built, installed
and run in tests/package/test_install.py."""
from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import shardsafe

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FOLDERS = {"shardsafe": "shardsafe", "adapters": "shardsafe.adapters", "kernels": "shardsafe.kernels"}


def test_every_package_of_the_tree_is_in_the_wheel():
    """A new subpackage missing from `packages` would be missing from every wheel (editable installs hide it)."""
    tool = PROJECT["tool"]["setuptools"]
    assert tool["package-dir"] == {pkg: folder for folder, pkg in FOLDERS.items()}
    found = {".".join((pkg, *init.parent.relative_to(ROOT / folder).parts))
             for folder, pkg in FOLDERS.items() for init in (ROOT / folder).rglob("__init__.py")
             if "__pycache__" not in init.parts}
    assert set(tool["packages"]) == found | {"shardsafe.kernels.csrc"}   # csrc: the kernels' sources, data only
    assert PROJECT["project"]["scripts"] == {"shardsafe": "shardsafe.cli:main"}


def test_one_version_everywhere():
    assert PROJECT["project"]["dynamic"] == ["version"]
    assert PROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "shardsafe.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", shardsafe.__version__)
    first = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert first and first.group(1) == shardsafe.__version__, "CHANGELOG.md's newest section is another version"
    assert importlib.metadata.version("shardsafe") == shardsafe.__version__, "reinstall: pip install -e ."


def test_the_licence_is_apache_2_in_full():
    text = (ROOT / "LICENSE").read_text()
    assert PROJECT["project"]["license"] == "Apache-2.0" and PROJECT["project"]["license-files"] == ["LICENSE"]
    for words in ("Apache License", "Version 2.0, January 2004", "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND "
                  "DISTRIBUTION", "9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS"):
        assert words in text, words


def _requirements():
    yield from ((None, r) for r in PROJECT["project"]["dependencies"])
    for extra, reqs in PROJECT["project"]["optional-dependencies"].items():
        yield from ((extra, r) for r in reqs)


def test_torch_is_nobodys_requirement_here():
    """pip keeps the torch a cluster installed: neither the package nor an extra asks for one."""
    names = {Requirement(r).name.lower() for _, r in _requirements()}
    assert not {"torch", "pytorch"} & names


@pytest.mark.parametrize("extra, req", [(e, r) for e, r in _requirements() if e is not None])
def test_each_extra_is_bounded_on_both_sides_around_the_version_tested_here(extra, req):
    r = Requirement(req)
    if r.name == "shardsafe":   # another extra of this package
        assert r.extras <= set(PROJECT["project"]["optional-dependencies"]) and not r.specifier
        return
    ops = {s.operator for s in r.specifier}
    assert ops & {">=", "=="} and ops & {"<", "<=", "=="}, f"[{extra}] {req}: needs a lower and an upper bound"
    installed = importlib.metadata.version(r.name)   # this venv is where the suite runs: the tested version
    assert r.specifier.contains(installed, prereleases=True), f"[{extra}] {req} excludes the tested {installed}"
    lowest = min(Version(s.version) for s in r.specifier if s.operator in (">=", "=="))
    assert lowest == Version(installed), f"[{extra}] {req}: the lower bound is the version tested here, {installed}"


def test_the_makefile_installs_this_package_with_its_extras():
    line = next(x for x in (ROOT / "Makefile").read_text().splitlines() if "pip install" in x and " -e " in x)
    extras = set(re.search(r"\.\[([a-z,]+)\]", line).group(1).split(","))
    assert extras <= set(PROJECT["project"]["optional-dependencies"]), line
