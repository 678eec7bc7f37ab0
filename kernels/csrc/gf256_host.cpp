// CPU build of gf256.h for tests: g++ -O2 -shared -fPIC gf256_host.cpp -o libgf256_host.so
//
// Exposes the exact header code the CUDA kernels use (math, table fill, the byte loop and the
// 16-byte-group routine) through a C ABI, so CPU-only CI checks it bit-for-bit against ISA-L,
// pyeclib and the numpy reference. Not shipped in the wheel; not on any hot path.
#include <vector>

#include "gf256.h"

namespace {

template <int ROWS>
void vec_pass(const uint8_t* tables, const uint8_t* coef, int k, const uint8_t* const* src, uint8_t* const* dst,
              size_t nvec, int accumulate) {
  for (size_t v = 0; v < nvec; ++v) ss_ec_encode_vec16<ROWS>(tables, coef, SS_MAX_K, k, src, dst, v, accumulate);
}

int vec_dispatch(int rows, const uint8_t* tables, const uint8_t* coef, int k, const uint8_t* const* src,
                 uint8_t* const* dst, size_t nvec, int accumulate) {
  switch (rows) {
    case 1: vec_pass<1>(tables, coef, k, src, dst, nvec, accumulate); return 0;
    case 2: vec_pass<2>(tables, coef, k, src, dst, nvec, accumulate); return 0;
    case 3: vec_pass<3>(tables, coef, k, src, dst, nvec, accumulate); return 0;
    case 4: vec_pass<4>(tables, coef, k, src, dst, nvec, accumulate); return 0;
    case 5: vec_pass<5>(tables, coef, k, src, dst, nvec, accumulate); return 0;
    case 6: vec_pass<6>(tables, coef, k, src, dst, nvec, accumulate); return 0;
    case 7: vec_pass<7>(tables, coef, k, src, dst, nvec, accumulate); return 0;
    case 8: vec_pass<8>(tables, coef, k, src, dst, nvec, accumulate); return 0;
    default: return -1;
  }
}

}  // namespace

extern "C" {

uint8_t ss_host_gf_mul(uint8_t a, uint8_t b) { return ss_gf_mul(a, b); }
uint8_t ss_host_gf_inv(uint8_t a) { return ss_gf_inv(a); }
void ss_host_gen_cauchy1(uint8_t* a, int k, int m) { ss_gf_gen_cauchy1(a, k, m); }

int ss_host_invert_matrix(const uint8_t* in, uint8_t* out, int n) {
  std::vector<uint8_t> work((size_t)n * n);
  return ss_gf_invert_matrix(in, out, n, work.data());
}

int ss_host_decode_matrix(int k, int m, const uint8_t* sources, const uint8_t* targets, int ntargets, uint8_t* out) {
  std::vector<uint8_t> work(ss_gf_decode_work_size(k, m));
  return ss_gf_decode_matrix(k, m, sources, targets, ntargets, out, work.data());
}

// Same pass structure as the CUDA launcher (row blocks of SS_MAX_ROWS, source blocks of SS_MAX_K
// accumulating into dst). use_vec16: 16-byte groups + byte tail (the GPU's aligned path), else the
// byte loop alone (the GPU's unaligned path).
int ss_host_encode(const uint8_t* const* src, int k, uint8_t* const* dst, int rows, const uint8_t* coef, size_t len,
                   int accumulate, int use_vec16) {
  if (k < 1 || rows < 1) return -1;
  std::vector<uint8_t> pcoef(SS_MAX_ROWS * SS_MAX_K);
  std::vector<uint8_t> tables((size_t)SS_MAX_ROWS * SS_MAX_K * 256);
  for (int r0 = 0; r0 < rows; r0 += SS_MAX_ROWS) {
    const int nr = rows - r0 < SS_MAX_ROWS ? rows - r0 : SS_MAX_ROWS;
    for (int i0 = 0; i0 < k; i0 += SS_MAX_K) {
      const int nk = k - i0 < SS_MAX_K ? k - i0 : SS_MAX_K;
      for (int r = 0; r < nr; ++r)
        for (int i = 0; i < nk; ++i) pcoef[r * SS_MAX_K + i] = coef[(size_t)(r0 + r) * k + i0 + i];
      ss_gf_fill_tables(pcoef.data(), SS_MAX_K, nk, nr, tables.data(), 0, 1);
      const int acc = (accumulate || i0 > 0) ? 1 : 0;
      const size_t nvec = use_vec16 ? len / 16 : 0;
      if (nvec && vec_dispatch(nr, tables.data(), pcoef.data(), nk, src + i0, dst + r0, nvec, acc)) return -1;
      ss_ec_encode_bytes(tables.data(), pcoef.data(), SS_MAX_K, nk, nr, src + i0, dst + r0, nvec * 16, len, 1, acc);
    }
  }
  return 0;
}

}  // extern "C"
