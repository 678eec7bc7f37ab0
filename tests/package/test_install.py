"""The package as a user installs it: the wheel, into a fresh venv that has its own torch and no shardsafe.

Built from a clean copy of the checkout (tracked and new files, nothing git ignores: no build/ or compiled
library of this checkout can slip in) with pip, installed with the deepspeed and parity extras into a venv
created for this session, with torch installed first as a cluster would have it. Then: the venv's torch is the
one it had (pip kept it), the activation hook is in its site-packages, and an unchanged DeepSpeed program with the
"shardsafe" block in its config (examples/ds_plain_gpt.py), run by the venv's `shardsafe launch`, is SIGKILLed
and resumes bit-exact against an uninterrupted run of the same program without the block.

Every command runs outside the checkout (its own working directory, no PYTHONPATH), so the venv can only import
the installed copy. The venv's DeepSpeed optimizer is torch's AdamW (``torch_adam`` in the config): DeepSpeed's
FusedAdam would be JIT-compiled once more for this venv's torch (30-40 s here) and proves nothing about the
package.
"""
from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardsafe import __version__
from shardsafe.runcheck import compare_runs, losses_by_attempt, read_jsonl

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PLAIN = ROOT / "examples" / "ds_plain_gpt.py"
BASE = ROOT / "configs" / "deepspeed" / "plain_zero2_bf16.json"
STEPS = 10
HOOK_ONLY = ["shardsafe", "shardsafe.adapters", "shardsafe.adapters.autoload", "shardsafe.adapters.ds_config",
             "shardsafe.env", "shardsafe.errors"]


def _run(cmd, *, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)


def _ok(r: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"{what} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _source_copy(dest: Path) -> Path:
    """The checkout's files as a fresh clone plus the uncommitted work would have them."""
    r = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT)
    files = [f for f in r.stdout.split("\0") if f] if r.returncode == 0 else []
    assert files, f"cannot list the checkout's files with git: {r.stderr[-500:]}"
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            (dest / f).write_bytes(src.read_bytes())
    return dest


@pytest.fixture(scope="session")
def source(tmp_path_factory) -> Path:
    return _source_copy(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="session")
def wheel(tmp_path_factory, source) -> Path:
    src = source
    out = tmp_path_factory.mktemp("wheel")
    # A CPU venv: the CUDA build is tests/unit/test_cuda_build.py's; the CPU helper is built as for any install.
    env = {**os.environ, "SHARDSAFE_SKIP_CUDA_BUILD": "1"}
    t0 = time.time()
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, src], env=env)
    if r.returncode != 0:   # the isolated build env takes setuptools from an index; this venv's works offline
        print(f"isolated wheel build failed, building with this venv's setuptools: {r.stderr[-500:]}")
        r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out, src],
                 env=env)
    _ok(r, "pip wheel")
    (whl,) = out.glob("shardsafe-*.whl")
    print(f"\nwheel {whl.name}: {whl.stat().st_size} bytes, built in {time.time() - t0:.1f} s")
    return whl


@dataclass
class Venv:
    python: Path
    torch_before: dict
    torch_after: dict
    install_log: str

    @property
    def bin(self) -> Path:
        return self.python.parent

    def env(self, **extra) -> dict:
        """The environment a user of this venv would have: no PYTHONPATH, nothing of this test session's
        shardsafe settings, DeepSpeed's JIT builds in the venv."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("SHARDSAFE_")}
        env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(self.python.parents[1] / "ext"),
                   **extra)
        return env


_TORCH_PROBE = """
import hashlib, importlib.metadata as m, json, os
d = m.distribution("torch")
init = d.locate_file("torch/__init__.py")
st = os.stat(init)
print(json.dumps({"version": d.version, "init": str(init), "inode": st.st_ino, "mtime_ns": st.st_mtime_ns,
                  "record": hashlib.sha256(d.read_text("RECORD").encode()).hexdigest()}))
"""


def _torch_identity(python: Path, cwd: Path) -> dict:
    """Which torch files the venv has (without importing torch): a reinstall changes inode and mtime."""
    return json.loads(_ok(_run([python, "-c", _TORCH_PROBE], cwd=cwd), "torch probe").stdout)


def _link_torch(site: Path) -> bool:
    """Give a new venv this venv's torch and what torch requires, as hard links of the files pip installed here
    (their RECORD and INSTALLER included: pip sees them installed): 4 s instead of 20 s for `pip install torch`
    here. Safe for this venv: pip never writes into an installed file, it moves a replaced one away (rename)
    and writes new ones. False when the file systems differ (the caller installs torch with pip then)."""
    from packaging.requirements import Requirement
    dists, todo = {}, ["torch"]
    while todo:
        d = importlib.metadata.distribution(todo.pop())
        if d.metadata["Name"].lower() not in dists:
            dists[d.metadata["Name"].lower()] = d
            todo += [r.name for r in map(Requirement, d.requires or ())
                     if r.marker is None or r.marker.evaluate({"extra": ""})]
    try:
        for d in dists.values():
            for f in d.files or ():
                src = Path(d.locate_file(f))
                if f.parts[0] != ".." and src.is_file():   # not the console scripts: they name this venv's python
                    (site / f).parent.mkdir(parents=True, exist_ok=True)
                    os.link(src, site / f)
    except OSError as e:
        print(f"cannot hard-link torch into the new venv ({e}); installing it with pip")
        shutil.rmtree(site)
        site.mkdir()
        return False
    return True


@pytest.fixture(scope="session")
def fresh_venv(tmp_path_factory, wheel) -> Venv:
    """A new venv with the tested torch, then the wheel with its extras."""
    d = tmp_path_factory.mktemp("venv")
    venv, cwd = d / "venv", d / "cwd"
    cwd.mkdir()
    t0 = time.time()
    _ok(_run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", venv]), "venv")
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", python]   # this venv's pip, run for the new one
    torch_version = importlib.metadata.version("torch").split("+")[0]
    site = Path(_ok(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]),
                    "purelib").stdout.strip())
    if not _link_torch(site):   # the tested torch: a wheel on this machine's disk
        _ok(_run([*pip, "install", "-q", f"torch=={torch_version}"]), "pip install torch")
    t_torch = time.time() - t0
    before = _torch_identity(python, cwd)
    r = _run([python, "-c", "import shardsafe"], cwd=cwd)
    assert r.returncode != 0 and "No module named 'shardsafe'" in r.stderr, "the venv had shardsafe before the install"
    t1 = time.time()
    r = _ok(_run([*pip, "install", f"{wheel}[deepspeed,parity]"], cwd=cwd), "pip install the wheel")
    print(f"\nvenv with torch {torch_version} in {t_torch:.1f} s; the wheel with [deepspeed,parity] installed in "
          f"{time.time() - t1:.1f} s")
    return Venv(python, before, _torch_identity(python, cwd), r.stdout + r.stderr)


def test_the_wheel_holds_the_package_the_hook_and_the_kernel_sources(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(f"shardsafe-{__version__}.dist-info/METADATA").decode()
        pth = z.read("shardsafe-autoload.pth").decode()
        tag = z.read(f"shardsafe-{__version__}.dist-info/WHEEL").decode()
    # the .pth at the wheel's root lands in site-packages: one line that site.py executes
    assert pth.startswith("import ") and "shardsafe.adapters.autoload" in pth and pth.count("\n") == 1, pth
    for pkg in ("shardsafe", "shardsafe/adapters", "shardsafe/adapters/megatron", "shardsafe/kernels",
                "shardsafe/launch", "shardsafe/tor", "shardsafe/export"):
        assert f"{pkg}/__init__.py" in names, pkg
    assert {"shardsafe/kernels/csrc/ec_kernels.cu", "shardsafe/kernels/csrc/copy_hash.c",
            "shardsafe/kernels/csrc/gf256.h"} <= names
    assert not any(n.startswith(("tests/", "examples/", "bench/")) for n in names)
    assert f"shardsafe-{__version__}.dist-info/licenses/LICENSE" in names and "License-Expression: Apache-2.0" in meta
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert not any(r.split()[1].startswith("torch") for r in requires), requires   # torch: the user's own
    assert {f"Provides-Extra: {e}" for e in ("deepspeed", "megatron", "hf", "lightning", "parity", "plot", "test")} \
        <= set(meta.splitlines())
    # a compiled helper inside: tagged for this platform, any Python 3 (ctypes, no extension module)
    if "shardsafe/kernels/libshardsafe_cpu.so" in names:
        assert "Tag: py3-none-linux_" in tag, tag
    else:
        assert "Tag: py3-none-any" in tag, tag


def test_installing_with_extras_keeps_the_venvs_torch_and_installs_the_hook(fresh_venv):
    v = fresh_venv
    assert v.torch_after == v.torch_before, "pip replaced the venv's torch"
    assert "Uninstalling torch" not in v.install_log and "deepspeed" in v.install_log, v.install_log[-3000:]
    cwd = v.python.parents[2]
    purelib = _ok(_run([v.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=cwd),
                  "purelib").stdout.strip()
    assert os.path.isfile(os.path.join(purelib, "shardsafe-autoload.pth"))
    probe = ("import sys, json, shardsafe; print(json.dumps([shardsafe.__file__, shardsafe.__version__, "
             "sorted(m for m in sys.modules if m.startswith('shardsafe'))]))")
    where, version, mods = json.loads(_ok(_run([v.python, "-c", probe], cwd=cwd, env=v.env()), "probe").stdout)
    assert where.startswith(purelib) and version == __version__
    assert mods == ["shardsafe", "shardsafe.adapters", "shardsafe.adapters.autoload", "shardsafe.env",
                    "shardsafe.errors"], mods   # the hook, nothing more
    out = _ok(_run([v.bin / "shardsafe", "--version"], cwd=cwd, env=v.env()), "shardsafe --version").stdout
    assert out.strip() == f"shardsafe {__version__}"


def test_an_editable_install_reads_the_checkout_builds_in_place_and_installs_the_hook(tmp_path, source):
    """`make venv`'s `pip install -e`: the hook in site-packages, the package read from the checkout (adapters/ and
    kernels/ mapped into it), the CPU helper built next to its source. Without dependencies: only the package."""
    for lib in (source / "kernels").glob("*.so"):
        lib.unlink()
    venv, cwd = tmp_path / "venv", tmp_path / "cwd"
    cwd.mkdir()
    _ok(_run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", venv]), "venv")
    python = venv / "bin" / "python"
    env = {**os.environ, "SHARDSAFE_SKIP_CUDA_BUILD": "1"}
    _ok(_run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "-e", source], env=env),
        "pip install -e")
    probe = ("import sys, sysconfig, json, shardsafe.adapters, shardsafe.kernels; print(json.dumps([shardsafe.__file__, "
             "shardsafe.adapters.__file__, shardsafe.kernels.__file__, sysconfig.get_paths()['purelib'], "
             "sorted(m for m in sys.modules if m.startswith('shardsafe.adapters.'))]))")
    env.pop("PYTHONPATH", None)
    pkg, adapters, kernels, purelib, hook = json.loads(_ok(_run([python, "-c", probe], cwd=cwd, env=env), "probe").stdout)
    assert (pkg, adapters, kernels) == (str(source / "shardsafe" / "__init__.py"), str(source / "adapters" / "__init__.py"),
                                        str(source / "kernels" / "__init__.py"))
    assert hook == ["shardsafe.adapters.autoload"]   # the .pth ran at the interpreter's start
    assert (Path(purelib) / "shardsafe-autoload.pth").is_file()
    assert (source / "kernels" / "libshardsafe_cpu.so").is_file() or not shutil.which("cc"), "no in-place build"


def _config(path: Path, *, block: bool) -> Path:
    cfg = json.loads(BASE.read_text())
    cfg["optimizer"]["params"]["torch_adam"] = True   # see the module docstring
    if not block:
        del cfg["shardsafe"]
    path.write_text(json.dumps(cfg))
    return path


def _launch(v: Venv, run_dir: Path, config: Path, *flags) -> dict:
    """The venv's `shardsafe launch` on 2 simulated nodes, one rank each; its --json outcome."""
    holders = tempfile.mkdtemp(prefix="ss-")   # short: a holder's socket path must fit a Unix socket address
    cmd = [v.bin / "shardsafe", "launch", "--nnodes", "2", "--nproc-per-node", "1", "--run-dir", run_dir,
           "--holder-dir", holders, "--memory-budget-gb", "0.5",
           "--timeout-s", "400", "--json", *flags, "--", PLAIN, "--config", config, "--steps", STEPS, "--out", run_dir]
    try:
        r = _run(cmd, cwd=run_dir.parent, env=v.env(), timeout=500)
    finally:
        shutil.rmtree(holders, ignore_errors=True)
    logs = "".join(Path(f).read_text(errors="replace") for f in sorted(glob.glob(str(run_dir / "logs" / "agent_*"))))
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr[-3000:]}\n{logs[-3000:]}"
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "logs": logs}


def test_an_unchanged_deepspeed_program_resumes_bit_exact_from_the_installed_wheel(fresh_venv, tmp_path):
    v = fresh_venv
    t0 = time.time()
    ref = _launch(v, tmp_path / "ref", _config(tmp_path / "ref.json", block=False), "--max-restarts", "0",
                  "--preload", "none")
    t1 = time.time()
    run = _launch(v, tmp_path / "run", _config(tmp_path / "ds.json", block=True), "--max-restarts", "1",
                  "--inject", "kill-rank:1@5", "--preload", "deepspeed")
    print(f"\nreference {t1 - t0:.1f} s, killed and resumed {time.time() - t1:.1f} s")
    assert ref["ok"] and ref["attempts"] == 1 and not ref["failures"], ref
    for r in range(2):   # without the block: the hook (and, under a launcher, the holder's early open), no runtime
        mods = json.loads((tmp_path / "ref" / f"modules_rank{r}.json").read_text())
        assert set(HOOK_ONLY) <= set(mods) and not [m for m in mods if m.startswith(
            ("shardsafe.runtime", "shardsafe.snapshot", "shardsafe.adapters.deepspeed"))], mods
    assert run["ok"] and run["attempts"] == 2, run
    (failure,) = run["failures"]
    assert failure["cause"] == "rank_exit" and failure["rank"] == 1 and failure["rc"] == -9, failure   # SIGKILL
    assert "automatic activation" in run["logs"] and "workers are forked from the fork server" in run["logs"]
    assert "shardsafe.runtime" in json.loads((tmp_path / "run" / "modules_rank0.json").read_text())
    restored = {}
    for e in read_jsonl(str(tmp_path / "run" / "events.jsonl")):
        if e.get("kind") == "restore_end":
            a = int(e.get("attempt") or 0)
            restored[a] = min(restored.get(a, e["version"]), e["version"])
    assert restored[0] == -1 and restored[1] in (3, 4), restored
    for r in range(2):   # attempt 1 continued after the restored version; step 1 ran once
        by = losses_by_attempt(str(tmp_path / "run"), r)
        assert min(by[1]) == restored[1] + 1 and 1 in by[0] and 1 not in by[1] and max(by[1]) == STEPS, (r, by)
    cmp = compare_runs(str(tmp_path / "run"), str(tmp_path / "ref"), 2, STEPS)
    assert cmp.bit_identical and not cmp.resume_problems, (cmp.resume_problems, cmp.loss_mismatches,
                                                           cmp.state_mismatches)
