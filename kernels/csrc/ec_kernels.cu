// CUDA Reed-Solomon encode/reconstruct over GF(2^8) (shardsafe), ISA-L-compatible Cauchy code.
//
// One kernel does everything: out[r] = sum_i coef[r][i] * src[i] byte-wise. Encode passes the
// parity rows of the generator; reconstruct passes rows of the inverted surviving sub-matrix
// (computed on the host with the same header). All math is in gf256.h, which the CPU tests
// compile with g++ and check bit-for-bit against ISA-L, pyeclib and the numpy reference.
//
// Kernel shape: grid-stride over 16-byte groups (128-bit loads) with a byte-wise tail, ROWS
// accumulators in registers (template), one 256-entry product table per coefficient in shared
// memory; a launch whose coefficients are all 0/1 (XOR, e.g. an all-ones row) builds no tables.
// Everything is enqueued on the caller's stream; nothing synchronizes.
//
// C ABI (ctypes): pointers to fragments are device pointers passed in host arrays; every launcher
// returns a cudaError_t as int (0 = success).
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "gf256.h"

#define SS_EC_ABI_VERSION 1
#define SS_THREADS 256

namespace {

// Passed by value; __grid_constant__ lets threads index the arrays without a local-memory copy.
struct SsEcParams {
  const uint8_t* src[SS_MAX_K];
  uint8_t* dst[SS_MAX_ROWS];
  uint8_t coef[SS_MAX_ROWS * SS_MAX_K];  // row stride SS_MAX_K
  size_t len;
  int k;
  int accumulate;
  int vec_ok;  // every pointer 16-byte aligned: use 128-bit loads
};

template <int ROWS, bool TABLES>
__global__ void __launch_bounds__(SS_THREADS) ss_ec_kernel(const __grid_constant__ SsEcParams p) {
  extern __shared__ uint8_t s_tables[];
  if (TABLES) {
    ss_gf_fill_tables(p.coef, SS_MAX_K, p.k, ROWS, s_tables, threadIdx.x, blockDim.x);
    __syncthreads();
  }
  const uint8_t* tables = TABLES ? s_tables : nullptr;
  const size_t gid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t gstride = (size_t)gridDim.x * blockDim.x;
  const size_t nvec = p.vec_ok ? p.len / 16 : 0;
  for (size_t v = gid; v < nvec; v += gstride)
    ss_ec_encode_vec16<ROWS>(tables, p.coef, SS_MAX_K, p.k, p.src, p.dst, v, p.accumulate);
  ss_ec_encode_bytes(tables, p.coef, SS_MAX_K, p.k, ROWS, p.src, p.dst, nvec * 16 + gid, p.len, gstride,
                     p.accumulate);
}

template <int ROWS>
cudaError_t launch_rows(const SsEcParams& p, bool tables, size_t smem, int blocks, cudaStream_t stream) {
  auto kern = tables ? ss_ec_kernel<ROWS, true> : ss_ec_kernel<ROWS, false>;
  if (smem > 48 * 1024) {  // above the default dynamic shared memory limit: opt in
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  kern<<<blocks, SS_THREADS, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch(const SsEcParams& p, int rows, bool tables, size_t smem, int blocks, cudaStream_t stream) {
  switch (rows) {
    case 1: return launch_rows<1>(p, tables, smem, blocks, stream);
    case 2: return launch_rows<2>(p, tables, smem, blocks, stream);
    case 3: return launch_rows<3>(p, tables, smem, blocks, stream);
    case 4: return launch_rows<4>(p, tables, smem, blocks, stream);
    case 5: return launch_rows<5>(p, tables, smem, blocks, stream);
    case 6: return launch_rows<6>(p, tables, smem, blocks, stream);
    case 7: return launch_rows<7>(p, tables, smem, blocks, stream);
    case 8: return launch_rows<8>(p, tables, smem, blocks, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" {

int shardsafe_ec_abi_version(void) { return SS_EC_ABI_VERSION; }

// Number of visible devices, or -(cudaError_t) (e.g. -35 "driver insufficient", -100 "no device").
int shardsafe_ec_device_count(void) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  return e == cudaSuccess ? n : -(int)e;
}

const char* shardsafe_ec_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

// dst[r] (=|^=) sum_i coef[r*k + i] * src[i] for len bytes, r < rows, on `stream` of the current device.
// src: k device pointers, dst: rows device pointers (host arrays), coef: rows x k host matrix.
// Outputs must not overlap inputs. accumulate != 0 xors into dst (incremental parity updates).
int shardsafe_ec_encode(const uint8_t* const* src, int k, uint8_t* const* dst, int rows, const uint8_t* coef,
                        size_t len, int accumulate, cudaStream_t stream) {
  if (k < 1 || rows < 1 || src == nullptr || dst == nullptr || coef == nullptr) return cudaErrorInvalidValue;
  if (len == 0) return cudaSuccess;
  int dev = 0, sms = 0, smem_optin = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) return e;
  int vec_ok = 1;
  for (int i = 0; i < k; ++i) vec_ok &= ((uintptr_t)src[i] % 16 == 0);
  for (int r = 0; r < rows; ++r) vec_ok &= ((uintptr_t)dst[r] % 16 == 0);
  // Enough blocks to fill every SM several times over; the grid-stride loop covers the rest, which
  // keeps the per-block table fill amortised over many 16-byte groups.
  const size_t units = vec_ok ? std::max<size_t>(len / 16, len % 16) : len;
  const int blocks = (int)std::max<size_t>(1, std::min<size_t>((units + SS_THREADS - 1) / SS_THREADS,
                                                                (size_t)sms * 8));
  for (int r0 = 0; r0 < rows; r0 += SS_MAX_ROWS) {
    const int nr = std::min(SS_MAX_ROWS, rows - r0);
    // Sources per pass: bounded by the parameter block and by shared memory for the tables.
    const int kmax = std::max(1, std::min(SS_MAX_K, smem_optin / (nr * 256)));
    for (int i0 = 0; i0 < k; i0 += kmax) {
      const int nk = std::min(kmax, k - i0);
      SsEcParams p;
      memset(&p, 0, sizeof(p));
      bool tables = false;
      for (int i = 0; i < nk; ++i) p.src[i] = src[i0 + i];
      for (int r = 0; r < nr; ++r) {
        p.dst[r] = dst[r0 + r];
        for (int i = 0; i < nk; ++i) {
          const uint8_t c = coef[(size_t)(r0 + r) * k + i0 + i];
          p.coef[r * SS_MAX_K + i] = c;
          tables |= c > 1;
        }
      }
      p.len = len;
      p.k = nk;
      p.accumulate = (accumulate || i0 > 0) ? 1 : 0;
      p.vec_ok = vec_ok;
      const size_t smem = tables ? (size_t)nr * nk * 256 : 0;
      e = launch(p, nr, tables, smem, blocks, stream);
      if (e != cudaSuccess) return e;
    }
  }
  return cudaSuccess;
}

// parity[j] = row k+j of the Cauchy generator applied to data[0..k-1].
int shardsafe_ec_encode_cauchy(const uint8_t* const* data, int k, uint8_t* const* parity, int m, size_t len,
                               cudaStream_t stream) {
  if (k < 1 || m < 1 || k + m > SS_MAX_FRAGMENTS) return cudaErrorInvalidValue;
  std::vector<uint8_t> a((size_t)(k + m) * k);
  ss_gf_gen_cauchy1(a.data(), k, m);
  return shardsafe_ec_encode(data, k, parity, m, a.data() + (size_t)k * k, len, 0, stream);
}

// out[t] = fragment target_idx[t] rebuilt from the k fragments sources[s] (= fragment source_idx[s]).
// Same kernel as encode, with rows of the inverted surviving sub-matrix.
int shardsafe_ec_reconstruct(const uint8_t* const* sources, const uint8_t* source_idx, int k, int m,
                             uint8_t* const* out, const uint8_t* target_idx, int ntargets, size_t len,
                             cudaStream_t stream) {
  if (k < 1 || m < 0 || ntargets < 1 || k + m > SS_MAX_FRAGMENTS || source_idx == nullptr || target_idx == nullptr)
    return cudaErrorInvalidValue;
  std::vector<uint8_t> rows((size_t)ntargets * k);
  std::vector<uint8_t> work(ss_gf_decode_work_size(k, m));
  if (ss_gf_decode_matrix(k, m, source_idx, target_idx, ntargets, rows.data(), work.data()) != 0)
    return cudaErrorInvalidValue;
  return shardsafe_ec_encode(sources, k, out, ntargets, rows.data(), len, 0, stream);
}

}  // extern "C"
