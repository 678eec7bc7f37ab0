"""The CUDA kernels compile (no GPU needed): setup.py's build path, exported C ABI, no register spills."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardsafe.kernels import cuda as kcuda

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "kernels" / "csrc"
EXPORTS = {"shardsafe_ec_abi_version", "shardsafe_ec_device_count", "shardsafe_ec_error_string",
           "shardsafe_ec_encode", "shardsafe_ec_encode_cauchy", "shardsafe_ec_reconstruct"}


def _nvcc() -> str:
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    pytest.skip("nvcc not found (CUDA_HOME/bin/nvcc or /usr/local/cuda/bin/nvcc): cannot check the CUDA build")


@pytest.fixture(scope="module")
def built_lib(tmp_path_factory) -> Path:
    _nvcc()
    spec = importlib.util.spec_from_file_location("shardsafe_setup_under_test", REPO / "setup.py")
    setup_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_mod)  # guarded by __main__: defines functions only
    out = tmp_path_factory.mktemp("cuda_build")
    env_before = os.environ.pop("SHARDSAFE_SKIP_CUDA_BUILD", None)
    try:
        setup_mod.build_cuda_kernels(out)
    finally:
        if env_before is not None:
            os.environ["SHARDSAFE_SKIP_CUDA_BUILD"] = env_before
    lib = out / "libshardsafe_ec.so"
    assert lib.is_file(), "setup.build_cuda_kernels did not produce libshardsafe_ec.so"
    return lib


def test_exports_the_c_abi(built_lib):
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) not found: cannot list the library's dynamic symbols")
    r = subprocess.run(["nm", "-D", "--defined-only", str(built_lib)], capture_output=True, text=True, check=True)
    text_symbols = {parts[2] for parts in (ln.split() for ln in r.stdout.splitlines()) if len(parts) == 3 and parts[1] == "T"}
    missing = EXPORTS - text_symbols
    assert not missing, f"missing extern \"C\" exports: {sorted(missing)}"
    # the kernels themselves stay internal (anonymous namespace): no C++ kernel symbol leaks into the ABI
    assert not [s for s in text_symbols if "ss_ec_kernel" in s]


def test_fatbinary_has_sm80_and_sm90(built_lib):
    # Without cuobjdump (not in every toolkit install) read the raw bytes: the .nv_fatbin section
    # exists and each embedded cubin records the "-arch sm_XX" it was linked for.
    blob = built_lib.read_bytes()
    assert b".nv_fatbin" in blob, "no .nv_fatbin section: device code missing"
    for arch in (b"-arch sm_80", b"-arch sm_90"):
        assert arch in blob, f"{arch.decode()} code missing from the fat binary"


def test_loads_with_ctypes_and_reports_devices_cleanly(built_lib):
    lib = ctypes.CDLL(str(built_lib))
    lib.shardsafe_ec_abi_version.restype = ctypes.c_int
    lib.shardsafe_ec_device_count.restype = ctypes.c_int
    lib.shardsafe_ec_error_string.argtypes, lib.shardsafe_ec_error_string.restype = [ctypes.c_int], ctypes.c_char_p
    assert lib.shardsafe_ec_abi_version() == kcuda.ABI_VERSION, "kernels/cuda.py ABI_VERSION != SS_EC_ABI_VERSION"
    n = lib.shardsafe_ec_device_count()
    if n < 0:  # no driver / no device here: a negative cudaError_t with a readable message
        assert lib.shardsafe_ec_error_string(-n)
    else:
        print(f"shardsafe_ec_device_count() = {n}")


def test_kernels_do_not_spill_registers(tmp_path):
    nvcc = _nvcc()
    r = subprocess.run([nvcc, "-O3", "-std=c++17", "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-I", str(CSRC),
                        str(CSRC / "ec_kernels.cu"), "-o", str(tmp_path / "ec.cubin")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    props = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    assert len(props) >= 16, f"expected 16 kernel instantiations (ROWS 1..8 x tables), ptxas said:\n{r.stderr}"
    assert all(p == ("0", "0", "0") for p in props), f"register spills / stack use in the kernels:\n{r.stderr}"
    assert "warning" not in r.stderr.lower(), r.stderr


def test_a_broken_nvcc_never_fails_the_install_and_runs_once(tmp_path):
    """The two builds of an editable install in one process, as pip's setuptools backend runs them (setup.py
    executed as __main__: the in-place build, then build_py into the build directory), with an nvcc that
    fails: the build must succeed without kernels, and nvcc must have run once, not once per build step."""
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    calls = tmp_path / "nvcc_calls"
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho 'nvcc fatal   : broken toolkit' >&2\nexit 1\n")
    nvcc.chmod(0o755)
    build_lib = tmp_path / "build_lib"
    env = {k: v for k, v in os.environ.items() if k != "SHARDSAFE_SKIP_CUDA_BUILD"}
    env.update(CUDA_HOME=str(cuda), SHARDSAFE_BUILD_INPLACE="1")
    lib_before = (REPO / "kernels" / "libshardsafe_ec.so").exists()
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_kernels", "build_py", "--build-lib", str(build_lib)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"the install failed over the optional kernels:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    n_calls = len(calls.read_text().splitlines()) if calls.exists() else 0
    assert n_calls == 1, f"nvcc ran {n_calls} times (expected once per install):\n{r.stdout[-2000:]}"
    assert "CUDA kernel build failed" in r.stdout and "CPU (ISA-L) codec" in r.stdout, r.stdout[-2000:]
    assert (build_lib / "shardsafe" / "__init__.py").is_file() and (build_lib / "shardsafe" / "kernels" / "isal.py").is_file()
    assert not (build_lib / "shardsafe" / "kernels" / "libshardsafe_ec.so").exists() or lib_before
