"""The part of shardsafe's build that needs code; everything declarative is in pyproject.toml.

* build_py also compiles the optional native helpers into the package: the CUDA erasure-coding kernels in
  kernels/csrc with nvcc when CUDA is present (SHARDSAFE_SKIP_CUDA_BUILD=1 skips), the CPU helper (the snapshot
  copy with its checksums fused, kernels/csrc/copy_hash.c) with the system C compiler (SHARDSAFE_SKIP_CPU_BUILD=1
  skips). The package imports and works without either; a failed build never fails the install.
* build_py and editable_wheel put the activation hook, shardsafe-autoload.pth, into site-packages: wheels carry
  it at their root, editable installs beside their own path hooks.
* editable installs read kernels/ in place, so they build the helpers next to the sources
  (SHARDSAFE_BUILD_INPLACE=0 skips); ``python setup.py build_kernels`` does only that.
* bdist_wheel tags a wheel that carries a compiled helper for this platform (py3-none-<platform>): the
  libraries are loaded with ctypes, so any Python 3 takes it, but not another machine architecture.
"""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build_py import build_py
# pyproject.toml's build requirement brings both; scripts/gpu_check.sh imports the build helpers below with
# whatever setuptools a GPU machine has, so an older one must still import this file.
try:
    from setuptools.command.bdist_wheel import bdist_wheel, get_platform
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:   # setuptools < 70.1
    bdist_wheel = editable_wheel = None

HERE = Path(__file__).resolve().parent


def _nvcc():
    if os.environ.get("SHARDSAFE_SKIP_CUDA_BUILD") == "1":
        return None
    cand = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    for c in cand:
        p = Path(c) / "bin" / "nvcc"
        if c and p.exists():
            return str(p)
    return shutil.which("nvcc")


_BUILT: dict = {}
"""This process's one kernel build: {"lib": Path} after a success, {"error": str} after a failure. ``python
setup.py`` / pip's setuptools backend run the in-place build and then build_py in one process: the second
asks here instead of running nvcc again."""


def build_cuda_kernels(out_dir: Path) -> None:
    """Compile kernels/csrc/*.cu into libshardsafe_ec.so (sm_80, sm_90) when nvcc exists.

    Also embeds compute_90 PTX so GPUs newer than Hopper can JIT the kernels. cudart is linked
    statically (nvcc's default), so the library needs a driver at least as new as this nvcc.

    Raises:
        subprocess.CalledProcessError, OSError: nvcc failed (callers that install use
        :func:`build_cuda_kernels_optional`).
    """
    nvcc = _nvcc()
    srcs = sorted((HERE / "kernels" / "csrc").glob("*.cu"))
    if nvcc is None or not srcs:
        print("shardsafe: CUDA kernels not built (no nvcc, no sources, or SHARDSAFE_SKIP_CUDA_BUILD=1)")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "libshardsafe_ec.so"
    cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "--shared",
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=[sm_90,compute_90]",
           "-I", str(HERE / "kernels" / "csrc"), "-o", str(out), *map(str, srcs)]
    print("shardsafe: building CUDA kernels:", " ".join(cmd))
    subprocess.check_call(cmd)


def build_cuda_kernels_optional(out_dir: Path) -> None:
    """:func:`build_cuda_kernels` for installs: at most one nvcc run per process (a later call copies the
    library already built, or skips after a failure), and never an exception: the kernels are optional
    (the CPU/ISA-L codec works without them), so a broken nvcc must not fail the install."""
    out = out_dir / "libshardsafe_ec.so"
    if "lib" in _BUILT:
        if _BUILT["lib"].resolve() != out.resolve():
            out_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy2(_BUILT["lib"], out)
        return
    if "error" in _BUILT:
        print(f"shardsafe: CUDA kernels not built (nvcc failed earlier in this install: {_BUILT['error']})")
        return
    try:
        build_cuda_kernels(out_dir)
    except (subprocess.CalledProcessError, OSError) as e:
        _BUILT["error"] = str(e)
        print(f"shardsafe: CUDA kernel build failed ({e}); installing without them: the CPU (ISA-L) codec is used")
        return
    if out.is_file():
        _BUILT["lib"] = out


def build_cpu_helper_optional(out_dir: Path) -> None:
    """Compile kernels/csrc/copy_hash.c into libshardsafe_cpu.so with the C compiler ($CC, else cc/gcc), once
    per process. Never an exception: without the library the snapshot copies, then hashes (unfused)."""
    out = out_dir / "libshardsafe_cpu.so"
    if "cpu" in _BUILT:
        if _BUILT["cpu"] is not None and _BUILT["cpu"].resolve() != out.resolve():
            out_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy2(_BUILT["cpu"], out)
        return
    _BUILT["cpu"] = None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    src = HERE / "kernels" / "csrc" / "copy_hash.c"
    if os.environ.get("SHARDSAFE_SKIP_CPU_BUILD") == "1" or cc is None or not src.is_file():
        print("shardsafe: CPU helper not built (no C compiler, no source, or SHARDSAFE_SKIP_CPU_BUILD=1): "
              "snapshots copy, then hash")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [cc, "-O2", "-fPIC", "-shared", "-o", str(out), str(src)]
    try:
        subprocess.check_call(cmd)
    except (subprocess.CalledProcessError, OSError) as e:
        print(f"shardsafe: CPU helper build failed ({e}); snapshots copy, then hash")
        return
    _BUILT["cpu"] = out


# Automatic activation (adapters/autoload.py): site-packages/shardsafe-autoload.pth runs at every interpreter
# start. It only installs an import finder (nothing else of shardsafe is imported until the program imports
# DeepSpeed); SHARDSAFE_AUTO=0 skips even that. One line: site.py executes .pth lines that start with "import".
# The line swallows every error: a .pth left behind by a removed or broken install must not print a traceback
# at the start of every interpreter of the environment (pip's included); the try needs statements, hence exec.
AUTOLOAD_PTH = "shardsafe-autoload.pth"
AUTOLOAD_LINE = ("import os; exec(\"try:\\n if os.environ.get('SHARDSAFE_AUTO', '').strip().lower() not in "
                 "('0', 'false', 'off', 'no'):\\n  __import__('shardsafe.adapters.autoload', fromlist=['install'])"
                 ".install()\\nexcept Exception:\\n pass\")\n")


def write_autoload_pth(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / AUTOLOAD_PTH
    out.write_text(AUTOLOAD_LINE)
    return out


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        build_cuda_kernels_optional(Path(self.build_lib) / "shardsafe" / "kernels")
        build_cpu_helper_optional(Path(self.build_lib) / "shardsafe" / "kernels")
        write_autoload_pth(Path(self.build_lib))   # the wheel's root: lands in site-packages

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / AUTOLOAD_PTH)]


def build_in_place() -> None:
    """The native helpers next to their sources, where an editable install (and a checkout on PYTHONPATH)
    loads them."""
    build_cuda_kernels_optional(HERE / "kernels")
    build_cpu_helper_optional(HERE / "kernels")


class EditableWheelWithAutoload(editable_wheel or object):
    """``pip install -e``: setuptools' editable wheel holds only its own path hooks, not build_py's extra
    outputs; the files beside the wheel's dist-info are written to site-packages, so the .pth goes there. The
    package is read from the checkout, so the native helpers are built in kernels/ too."""

    def run(self):
        if os.environ.get("SHARDSAFE_BUILD_INPLACE", "1") == "1":
            build_in_place()
        super().run()

    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        out = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        write_autoload_pth(Path(unpacked_wheel))
        return out


class BuildKernels(Command):
    """``python setup.py build_kernels``: build the native helpers in kernels/ (what an editable install does)."""
    description = "build the CUDA kernels and the CPU helper next to their sources in kernels/"
    user_options: list = []

    def initialize_options(self):
        pass

    def finalize_options(self):
        pass

    def run(self):
        build_in_place()


class BdistWheelPlatform(bdist_wheel or object):
    """A wheel with a compiled helper inside is for this platform (any Python 3: ctypes, no extension module)."""

    def get_tag(self):
        impl, abi, plat = super().get_tag()
        if any(Path(self.bdist_dir).rglob("libshardsafe_*.so")):
            return "py3", "none", get_platform(self.bdist_dir).lower().replace("-", "_").replace(".", "_")
        return impl, abi, plat


if __name__ == "__main__":
    setup(cmdclass={"build_py": BuildPyWithKernels, "build_kernels": BuildKernels,
                    **({"bdist_wheel": BdistWheelPlatform, "editable_wheel": EditableWheelWithAutoload}
                       if editable_wheel is not None else {})})
