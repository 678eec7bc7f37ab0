"""shardsafe: in-memory, erasure-coded fault tolerance for DeepSpeed and Megatron pretraining.

Top-level folders are mapped into the package (as DeepSpeed does with accelerator/ and op_builder/):
shardsafe -> shardsafe/, shardsafe.adapters -> adapters/, shardsafe.kernels -> kernels/.
The CUDA erasure-coding kernels in kernels/csrc are built with nvcc when CUDA is present
(SHARDSAFE_SKIP_CUDA_BUILD=1 skips), the CPU helper (the snapshot copy with its checksums fused,
kernels/csrc/copy_hash.c) with the system C compiler (SHARDSAFE_SKIP_CPU_BUILD=1 skips); the package
imports and works without either.
"""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:   # setuptools < 64: no PEP 660 editable installs to extend
    editable_wheel = None

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
AUTOLOAD_PTH = "shardsafe-autoload.pth"
AUTOLOAD_LINE = ("import os; os.environ.get('SHARDSAFE_AUTO', '').strip().lower() in ('0', 'false', 'off', 'no') "
                 "or __import__('shardsafe.adapters.autoload', fromlist=['install']).install()\n")


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


class EditableWheelWithAutoload(editable_wheel or object):
    """``pip install -e``: setuptools' editable wheel holds only its own path hooks, not build_py's extra
    outputs; the files beside the wheel's dist-info are written to site-packages, so the .pth goes there."""

    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        out = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        write_autoload_pth(Path(unpacked_wheel))
        return out


if __name__ == "__main__":
    # Editable installs read kernels/ in place: build the library next to the sources.
    if os.environ.get("SHARDSAFE_BUILD_INPLACE", "1") == "1":
        build_cuda_kernels_optional(HERE / "kernels")
        build_cpu_helper_optional(HERE / "kernels")
    setup(
        name="shardsafe",
        version="0.1.0",
        description="In-memory, erasure-coded fault tolerance for DeepSpeed and Megatron pretraining",
        python_requires=">=3.10",
        packages=["shardsafe", "shardsafe.holder", "shardsafe.launch", "shardsafe.parity", "shardsafe.payload", "shardsafe.snapshot", "shardsafe.export", "shardsafe.tor", "shardsafe.adapters", "shardsafe.adapters.megatron", "shardsafe.kernels"],
        package_dir={"shardsafe": "shardsafe", "shardsafe.adapters": "adapters", "shardsafe.kernels": "kernels"},
        package_data={"shardsafe.kernels": ["csrc/*.cu", "csrc/*.c", "csrc/*.h", "csrc/*.cuh", "*.so"]},
        install_requires=["numpy>=1.24,<3", "xxhash>=3.0,<4", "psutil>=5.9"],
        extras_require={
            "deepspeed": ["deepspeed>=0.16,<0.20"],
            # Tested: 0.16.1, 0.17.1 and 0.19.2 (docs/megatron.md). On Python 3.11 pip resolves this to
            # 0.16.x, the newest that declares 3.11 (the Makefile puts 0.17.1 beside it); on >= 3.12 to 0.19.x.
            "megatron": ["megatron-core>=0.16.1,<0.20"],
            # Only pyeclib's binary wheels 1.6.2-1.8.0 (x86_64 and aarch64) carry pyeclib.libs/libisal-pyeclib.so.2,
            # the ISA-L that kernels/isal.py loads; 1.6.0/1.6.1 are source-only and bundle nothing.
            "parity": ["pyeclib>=1.6.2,<1.9"],
            "plot": ["matplotlib>=3.6,<4"],
            # transformers/accelerate: tests/fault/test_hf_trainer.py (HF Trainer + DeepSpeed ZeRO-2 on CPU); the
            # Trainer hooks (adapters/hf.py) follow transformers' private loop methods, so the tested pair is pinned;
            # optuna: Trainer.hyperparameter_search (one engine per trial) in the same test. Lightning: its loop
            # hooks (adapters/lightning.py) follow private loop methods too, so its tested version is pinned.
            "test": ["pytest>=7,<10", "pytest-timeout>=2.1", "transformers==5.24.0", "accelerate==1.15.0",
                     "optuna==5.1.0", "lightning==2.6.6"],
            "mpi": ["mpi4py>=3.1,<5"],
        },
        entry_points={"console_scripts": ["shardsafe=shardsafe.cli:main"]},
        cmdclass={"build_py": BuildPyWithKernels,
                  **({"editable_wheel": EditableWheelWithAutoload} if editable_wheel is not None else {})},
    )
