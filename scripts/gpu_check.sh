#!/usr/bin/env bash
# One-shot GPU check for a fresh CUDA machine (e.g. a rented H200) holding a copy of the repo's
# working tree but no .venv. Run from anywhere:   bash scripts/gpu_check.sh
#
# Phases (each prints a banner, its duration and rc, and the script keeps going on failure so one
# run gives all the information):
#   1. environment     GPU, driver, toolkit, python
#   2. python deps     a venv (.venv-gpu, system site-packages visible so a preinstalled CUDA torch
#                      is reused); installs torch (PyPI wheels are CUDA builds), numpy, xxhash,
#                      pytest, pyeclib (ISA-L for the CPU cross-check) only when missing; then
#                      the checkout itself, editable (shardsafe.kernels maps to kernels/)
#   3. build           kernels/csrc/*.cu -> kernels/libshardsafe_ec.so via setup.py's build_cuda_kernels
#   4. tests           tests/gpu -rs (kernels vs reference, bit-for-bit) + the fast CPU codec tests
#   5. throughput      bench/parity_bench.py --gpu: encode m=1,2,4 and rebuild vs device-to-device
#                      copy, bit-identity vs the CPU reference; JSON on stdout and in
#                      "$OUT/gpu_results.json" when $OUT is set
#   6. snapshot pipeline checks (added by the snapshot owner)
#   7. Megatron: bench/megatron_bench.py on the GPUs (stall and restore vs dist_checkpointing save/load)
# Exit status: 0 if every phase passed, else 1 (see the summary at the end).
set -uo pipefail
# The GPU machine reaches no package index: never let pip wait on the network there.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=${PIP_NO_INDEX:-1}

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
OUT_DIR="${OUT:-}"
VENV="$REPO/.venv-gpu"
# GPU images ship a python with a CUDA torch (and no package index): use it as is when it has one.
if python3 -c "import torch, numpy, pytest; assert torch.cuda.is_available()" 2>/dev/null; then
  PY="$(python3 -c 'import sys; print(sys.executable)')"; USE_SYSTEM_PY=1
else
  PY="$VENV/bin/python"; USE_SYSTEM_PY=0
fi
PHASE_TIMEOUT="${PHASE_TIMEOUT:-420}"
MIB="${GPU_CHECK_MIB:-256}"
declare -a SUMMARY=()
FAILED=0

banner() { printf '\n==================== %s ====================\n' "$*"; }

# run_phase NAME FUNCTION: run an exported shell function in a child bash under a timeout, record
# its rc and seconds, never abort the script. Phase functions must be `export -f`ed.
run_phase() {
  local name="$1" fn="$2"
  banner "$name"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$PHASE_TIMEOUT" bash -c "set -uo pipefail; $fn"
  rc=$?
  local dt=$((SECONDS - t0))
  [ "$rc" -eq 124 ] && echo "!! $name timed out after ${PHASE_TIMEOUT}s"
  echo "-------------------- $name: rc=$rc (${dt}s) --------------------"
  SUMMARY+=("$name: rc=$rc ${dt}s")
  [ "$rc" -ne 0 ] && FAILED=1
  return 0
}

# --- 1. environment -------------------------------------------------------------------------------
phase_env() {
  echo "host: $(hostname)  cores: $(nproc)  date: $(date -u +%FT%TZ)"
  free -g | head -2
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1 || echo "nvidia-smi unavailable"
  NVCC="$(find_nvcc)"; echo "nvcc: ${NVCC:-none}"; [ -n "$NVCC" ] && "$NVCC" --version | tail -2
  command -v python3 && python3 --version
  command -v g++ || echo "g++ missing (the CPU header test will skip)"
  return 0
}

find_nvcc() {
  local c
  for c in "${CUDA_HOME:-}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
    [ -x "$c" ] && { echo "$c"; return; }
  done
  command -v nvcc 2>/dev/null || true
}

# --- 2. python deps -------------------------------------------------------------------------------
phase_deps() {
  if [ "$USE_SYSTEM_PY" = 1 ]; then
    echo "using $PY (CUDA torch preinstalled); no venv, no installs"
    [ -e "$REPO/shardsafe/kernels" ] || ln -s ../kernels "$REPO/shardsafe/kernels"
    [ -e "$REPO/shardsafe/adapters" ] || ln -s ../adapters "$REPO/shardsafe/adapters"
    (cd /tmp && PYTHONPATH="$REPO" "$PY" -c "import shardsafe.kernels.reference, shardsafe.parity.topology, xxhash, torch; print('shardsafe importable; torch', torch.__version__, 'cuda', torch.cuda.is_available())")
    return $?
  fi
  local py
  py="$(command -v python3.11 || command -v python3.12 || command -v python3.10 || command -v python3)"
  [ -z "$py" ] && { echo "no python3 found"; return 1; }
  if [ ! -x "$PY" ]; then
    "$py" -m venv --system-site-packages "$VENV" || return 1
  fi
  local vpy="$PY"
  if "$vpy" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "CUDA torch present: not reinstalling"
  else
    echo "installing torch from PyPI (CUDA build)"
    "$vpy" -m pip install -q torch || echo "!! pip install torch failed"
  fi
  local mod pkg missing=()
  for pair in numpy:numpy xxhash:xxhash pytest:pytest pytest_timeout:pytest-timeout pyeclib:pyeclib psutil:psutil; do
    mod="${pair%%:*}"; pkg="${pair##*:}"
    "$vpy" -c "import $mod" 2>/dev/null || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "installing: ${missing[*]}"
    "$vpy" -m pip install -q "${missing[@]}" || echo "!! pip install ${missing[*]} failed (pyeclib is optional)"
  fi
  # shardsafe.kernels and shardsafe.adapters live in top-level folders that setup.py maps into the
  # package, so the checkout must be installed (editable) to import; never build CUDA here (phase 3).
  if ! SHARDSAFE_SKIP_CUDA_BUILD=1 "$vpy" -m pip install -q --no-deps -e "$REPO" 2>/dev/null &&
     ! SHARDSAFE_SKIP_CUDA_BUILD=1 "$vpy" -m pip install -q --no-deps --no-build-isolation -e "$REPO"; then
    echo "!! editable install failed: linking shardsafe/kernels and shardsafe/adapters into the copy instead"
    [ -e "$REPO/shardsafe/kernels" ] || ln -s ../kernels "$REPO/shardsafe/kernels"
    [ -e "$REPO/shardsafe/adapters" ] || ln -s ../adapters "$REPO/shardsafe/adapters"
  fi
  (cd /tmp && PYTHONPATH="$REPO" "$vpy" -c "import shardsafe.kernels.reference as r, shardsafe.parity.topology; print('shardsafe importable from', r.__file__)") || return 1
  "$vpy" - <<'EOF'
import importlib
for m in ("torch", "numpy", "xxhash", "pytest", "pyeclib"):
    try:
        mod = importlib.import_module(m)
        print(f"  {m:8s} {getattr(mod, '__version__', '?')}")
    except Exception as e:  # report, keep going
        print(f"  {m:8s} MISSING ({e})")
import torch
print("  torch.cuda.is_available():", torch.cuda.is_available(), "devices:", torch.cuda.device_count())
assert torch.cuda.is_available(), "torch cannot see the GPU"
EOF
}

# --- 3. build -------------------------------------------------------------------------------------
phase_build() {
  local nvcc; nvcc="$(find_nvcc)"
  if [ -z "$nvcc" ]; then
    echo "no nvcc (CUDA_HOME/bin, /usr/local/cuda/bin, PATH): cannot build the kernels"
    return 1
  fi
  export CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")}"
  unset SHARDSAFE_SKIP_CUDA_BUILD
  rm -f kernels/libshardsafe_ec.so
  PYTHONPATH="$REPO" "$PY" - <<'EOF' || return 1
import importlib.util, pathlib
spec = importlib.util.spec_from_file_location("shardsafe_setup", "setup.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)  # defines build_cuda_kernels; setup() only runs under __main__
mod.build_cuda_kernels(pathlib.Path("kernels"))
mod.build_cpu_helper_optional(pathlib.Path("kernels"))   # the CPU snapshot copy fused with its xxh3
EOF
  ls -l kernels/libshardsafe_ec.so || return 1
  command -v nm >/dev/null && nm -D --defined-only kernels/libshardsafe_ec.so | grep ' T shardsafe_ec_'
  # a CUDA runtime newer than the driver fails here with "driver version is insufficient"
  PYTHONPATH="$REPO" "$PY" -c "
from shardsafe.kernels import cuda
lib = cuda.load()
print('libshardsafe_ec loaded, devices:', lib.shardsafe_ec_device_count())
from shardsafe.payload import checksum
print('xxh3:', checksum.implementation())"
}

# --- 4. tests -------------------------------------------------------------------------------------
phase_tests() {
  PYTHONPATH="$REPO" "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu \
    tests/unit/test_codec.py tests/unit/test_topology.py -s
}

# --- 5. throughput --------------------------------------------------------------------------------
phase_bench() {
  local args=(--gpu --mib "$MIB" --reps 5 --configs 3,1 6,2 12,4 --json)
  [ -n "$OUT_DIR" ] && { mkdir -p "$OUT_DIR"; args+=(--json-out "$OUT_DIR/gpu_results.json"); }
  PYTHONPATH="$REPO" "$PY" bench/parity_bench.py "${args[@]}"
}

export REPO VENV OUT_DIR MIB PY USE_SYSTEM_PY
export -f banner find_nvcc phase_env phase_deps phase_build phase_tests phase_bench

run_phase "1 environment" phase_env
run_phase "2 python deps" phase_deps
run_phase "3 build kernels" phase_build
run_phase "4 tests (gpu + codec)" phase_tests
run_phase "5 gpu throughput" phase_bench

# --- snapshot pipeline checks (added by the snapshot owner) ---
# D2H on a side stream into cudaHostRegister'ed holder memory: ordering, round trip, bandwidth, stall.
phase_snapshot() {
  PYTHONPATH="$REPO" OUT="$OUT_DIR" "$PY" -m pytest -q -rs -p no:cacheprovider -s tests/gpu/test_snapshot_cuda.py
}
export -f phase_snapshot
run_phase "6 snapshot pipeline (GPU path)" phase_snapshot

# --- Megatron: snapshot stall / restore vs dist_checkpointing on the GPU ---------------------------
# bench/megatron_bench.py on this machine's GPUs (one rank each, NCCL): the same state and baseline as the
# CPU runs in bench/RESULTS.md (torch_dist save made durable, load warm and cold), restore = H2D from the
# holder's memory. MEGATRON_BENCH_ARGS scales the model (e.g. "--hidden 1536 --layers 12").
phase_megatron_bench() {
  if ! PYTHONPATH="$REPO" "$PY" -c "import megatron.core, psutil" 2>/dev/null; then
    echo "SKIPPED: megatron-core or psutil is not importable by $PY (pip install megatron-core psutil)"
    return 0
  fi
  local ranks; ranks="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"; [ "${ranks:-0}" -ge 1 ] || ranks=1
  local out="${OUT_DIR:-/tmp}/megatron_bench.json"
  mkdir -p "$(dirname "$out")"
  # shellcheck disable=SC2086  # MEGATRON_BENCH_ARGS is a list of flags
  # --early-open: the restore finds its slot mapped and verified as a restarted trainer's does
  # (shardsafe/holder/early_open.py)
  PYTHONPATH="$REPO" "$PY" bench/megatron_bench.py --ranks "$ranks" --repeats 5 --early-open ${MEGATRON_BENCH_ARGS:-} \
    --json | tee "$out"
}
export -f phase_megatron_bench
run_phase "7 Megatron bench vs dist_checkpointing (GPU)" phase_megatron_bench

# --- snapshot and restore at real shard sizes on the GPU (issue 19) ------------------------------------
# bench/scale_bench.py with the rank state on the GPU: snapshot (D2H on a side stream into the holder's
# registered memory + checksums) vs a pinned D2H copy of the same bytes, restore (verify, then H2D into the
# live tensors) vs a pinned H2D copy, at 0.25-2 GiB per rank; one rank (all of the node's cores for its hash
# threads), then one rank per GPU when there are several. Targets: snapshot >= 0.9x D2H, restore <= 2x H2D.
phase_scale_gpu() {
  local out="${OUT_DIR:-/tmp}"; mkdir -p "$out"
  local gpus; gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"; [ "${gpus:-0}" -ge 1 ] || gpus=1
  PYTHONPATH="$REPO" "$PY" bench/scale_bench.py --device cuda --ranks 1 --sizes 0.25,0.5,1,2 --repeats 5 \
    | tee "$out/scale_gpu_1rank.txt" || return 1
  # the same restore from pageable memory (restore_h2d=pageable): what page-locking the mapping buys
  PYTHONPATH="$REPO" "$PY" bench/scale_bench.py --device cuda --ranks 1 --sizes 1 --repeats 5 --h2d pageable \
    | tee "$out/scale_gpu_1rank_pageable.txt" || return 1
  # a restarted trainer's restore: the slot mapped (page tables filled) and verified while it set up, so the
  # restore is the pinning (it walks present pages) and the H2D; then mapped only, the restore verifying beside
  # the pinning (shardsafe/holder/early_open.py, SHARDSAFE_EARLY_OPEN=map)
  PYTHONPATH="$REPO" "$PY" bench/scale_bench.py --device cuda --ranks 1 --sizes 1,2 --repeats 5 --early-open verify \
    | tee "$out/scale_gpu_1rank_early_open.txt" || return 1
  PYTHONPATH="$REPO" "$PY" bench/scale_bench.py --device cuda --ranks 1 --sizes 1,2 --repeats 5 --early-open map \
    | tee "$out/scale_gpu_1rank_early_map.txt" || return 1
  if [ "$gpus" -ge 2 ]; then
    PYTHONPATH="$REPO" "$PY" bench/scale_bench.py --device cuda --ranks "$gpus" --sizes 0.5,2 --repeats 5 \
      | tee "$out/scale_gpu_${gpus}ranks.txt" || return 1
  fi
}
export -f phase_scale_gpu
run_phase "8 snapshot/restore scale sweep (GPU)" phase_scale_gpu

# --- summary --------------------------------------------------------------------------------------
banner "summary"
printf '%s\n' "${SUMMARY[@]}"
if [ -n "$OUT_DIR" ]; then
  mkdir -p "$OUT_DIR"
  printf '%s\n' "${SUMMARY[@]}" > "$OUT_DIR/gpu_check_summary.txt"
fi
exit "$FAILED"
