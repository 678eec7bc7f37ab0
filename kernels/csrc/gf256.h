// GF(2^8) Reed-Solomon math shared by the CUDA kernels (nvcc) and the CPU test shim (g++).
//
// One definition of the code, compiled twice: tests build gf256_host.cpp with g++ and compare it
// bit-for-bit with the numpy reference, ISA-L and pyeclib, so the arithmetic the GPU runs is
// checked on machines without a GPU. Only the load/store instructions differ between the two
// builds (see ss_load16/ss_store16).
//
// The code: field polynomial 0x11D, systematic generator of ISA-L's gf_gen_cauchy1_matrix,
//   A[i][j] = (i == j)          for data rows   0 <= i < k
//   A[i][j] = 1 / (i ^ j)       for parity rows k <= i < k + m
// Fragment i = sum_j A[i][j] * data_j (byte-wise). Matrices are row-major uint8.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define SS_HD __host__ __device__ __forceinline__
#else
#define SS_HD static inline
#endif

#if defined(__CUDACC__)
#define SS_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define SS_UNROLL _Pragma("GCC unroll 16")
#else
#define SS_UNROLL
#endif

#define SS_GF_POLY 0x11D
// Per kernel launch; larger k is done in passes that accumulate into the outputs, more rows in
// several launches. Both bound the by-value kernel parameter block (~1.1 KB of 4 KB).
#define SS_MAX_K 64
#define SS_MAX_ROWS 8
#define SS_MAX_FRAGMENTS 256  // k + m: i ^ j must stay distinct field elements

// Carry-less multiply then reduce: no tables, so it runs anywhere (device table fill included).
SS_HD uint8_t ss_gf_mul(uint8_t a, uint8_t b) {
  uint32_t r = 0;
  for (int i = 0; i < 8; ++i)
    if (b & (1u << i)) r ^= (uint32_t)a << i;
  for (int i = 14; i >= 8; --i)
    if (r & (1u << i)) r ^= (uint32_t)SS_GF_POLY << (i - 8);
  return (uint8_t)r;
}

// a^254 = a^-1 (the multiplicative group has order 255); 0 maps to 0.
SS_HD uint8_t ss_gf_inv(uint8_t a) {
  uint8_t r = 1, p = a;
  for (int e = 254; e; e >>= 1) {
    if (e & 1) r = ss_gf_mul(r, p);
    p = ss_gf_mul(p, p);
  }
  return a ? r : 0;
}

// a: (k+m) x k. Same layout and values as ISA-L gf_gen_cauchy1_matrix(a, k + m, k).
SS_HD void ss_gf_gen_cauchy1(uint8_t* a, int k, int m) {
  for (int i = 0; i < k; ++i)
    for (int j = 0; j < k; ++j) a[i * k + j] = (uint8_t)(i == j);
  for (int i = k; i < k + m; ++i)
    for (int j = 0; j < k; ++j) a[i * k + j] = ss_gf_inv((uint8_t)(i ^ j));
}

// c (r x n) = a (r x s) . b (s x n)
SS_HD void ss_gf_matmul(const uint8_t* a, const uint8_t* b, uint8_t* c, int r, int s, int n) {
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < n; ++j) {
      uint8_t acc = 0;
      for (int t = 0; t < s; ++t) acc ^= ss_gf_mul(a[i * s + t], b[t * n + j]);
      c[i * n + j] = acc;
    }
}

// Gauss-Jordan inverse of an n x n matrix. work: n*n bytes. Returns 0, or -1 if singular.
SS_HD int ss_gf_invert_matrix(const uint8_t* in, uint8_t* out, int n, uint8_t* work) {
  for (int i = 0; i < n * n; ++i) work[i] = in[i];
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) out[i * n + j] = (uint8_t)(i == j);
  for (int col = 0; col < n; ++col) {
    int p = col;
    while (p < n && work[p * n + col] == 0) ++p;
    if (p == n) return -1;
    if (p != col)
      for (int j = 0; j < n; ++j) {
        uint8_t t = work[col * n + j]; work[col * n + j] = work[p * n + j]; work[p * n + j] = t;
        t = out[col * n + j]; out[col * n + j] = out[p * n + j]; out[p * n + j] = t;
      }
    uint8_t s = ss_gf_inv(work[col * n + col]);
    for (int j = 0; j < n; ++j) {
      work[col * n + j] = ss_gf_mul(s, work[col * n + j]);
      out[col * n + j] = ss_gf_mul(s, out[col * n + j]);
    }
    for (int r = 0; r < n; ++r) {
      uint8_t f = work[r * n + col];
      if (r == col || f == 0) continue;
      for (int j = 0; j < n; ++j) {
        work[r * n + j] ^= ss_gf_mul(f, work[col * n + j]);
        out[r * n + j] ^= ss_gf_mul(f, out[col * n + j]);
      }
    }
  }
  return 0;
}

// Bytes of scratch ss_gf_decode_matrix needs.
SS_HD size_t ss_gf_decode_work_size(int k, int m) {
  return (size_t)(k + m) * k + 3 * (size_t)k * k;
}

// out (ntargets x k): coefficients rebuilding fragments `targets` from the k fragments `sources`
// (column s of out multiplies fragment sources[s]): out = A[targets] . inverse(A[sources]).
// Returns 0, -1 if singular (impossible for a Cauchy generator), -2 on bad indices.
SS_HD int ss_gf_decode_matrix(int k, int m, const uint8_t* sources, const uint8_t* targets, int ntargets,
                              uint8_t* out, uint8_t* work) {
  if (k < 1 || m < 0 || k + m > SS_MAX_FRAGMENTS) return -2;
  uint8_t* a = work;                        // (k+m) x k
  uint8_t* sub = a + (size_t)(k + m) * k;   // k x k
  uint8_t* inv = sub + (size_t)k * k;       // k x k
  uint8_t* scratch = inv + (size_t)k * k;   // k x k
  ss_gf_gen_cauchy1(a, k, m);
  int identity = 1;
  for (int s = 0; s < k; ++s) {
    if (sources[s] >= k + m) return -2;
    for (int t = 0; t < s; ++t)
      if (sources[t] == sources[s]) return -2;
    identity &= (sources[s] == s);
    for (int j = 0; j < k; ++j) sub[s * k + j] = a[sources[s] * k + j];
  }
  for (int t = 0; t < ntargets; ++t)
    if (targets[t] >= k + m) return -2;
  if (identity) {  // all data present: re-encode with the generator rows
    for (int t = 0; t < ntargets; ++t)
      for (int j = 0; j < k; ++j) out[t * k + j] = a[targets[t] * k + j];
    return 0;
  }
  if (ss_gf_invert_matrix(sub, inv, k, scratch)) return -1;
  for (int t = 0; t < ntargets; ++t)
    for (int j = 0; j < k; ++j) {
      uint8_t acc = 0;
      for (int s = 0; s < k; ++s) acc ^= ss_gf_mul(a[targets[t] * k + s], inv[s * k + j]);
      out[t * k + j] = acc;
    }
  return 0;
}

// Product tables: tables[(r*k + i)*256 + x] = coef[r*coef_stride + i] * x, filled cooperatively
// (entries begin, begin+step, ...). On the GPU they live in shared memory, one 256-byte table per
// coefficient, so a multiply is a single lookup.
SS_HD void ss_gf_fill_tables(const uint8_t* coef, int coef_stride, int k, int rows, uint8_t* tables,
                             int begin, int step) {
  const int total = rows * k * 256;
  for (int idx = begin; idx < total; idx += step) {
    const int e = idx >> 8;
    tables[idx] = ss_gf_mul(coef[(e / k) * coef_stride + e % k], (uint8_t)(idx & 255));
  }
}

// 4 byte-wise products of one 32-bit word through a coefficient's 256-entry table.
SS_HD uint32_t ss_gf_mul_word(const uint8_t* t, uint32_t w) {
  return (uint32_t)t[w & 0xff] | ((uint32_t)t[(w >> 8) & 0xff] << 8) |
         ((uint32_t)t[(w >> 16) & 0xff] << 16) | ((uint32_t)t[w >> 24] << 24);
}

// Byte-wise encode of positions begin, begin+step, ... < end: the scalar tail on the GPU and a full
// encoder on the host. Coefficients 0 and 1 skip the tables (so tables may be NULL when every
// coefficient is 0 or 1: the XOR path). accumulate: dst ^= result instead of dst = result.
SS_HD void ss_ec_encode_bytes(const uint8_t* tables, const uint8_t* coef, int coef_stride, int k, int rows,
                              const uint8_t* const* src, uint8_t* const* dst, size_t begin, size_t end,
                              size_t step, int accumulate) {
  for (size_t pos = begin; pos < end; pos += step) {
    for (int r = 0; r < rows; ++r) {
      uint8_t acc = accumulate ? dst[r][pos] : 0;
      for (int i = 0; i < k; ++i) {
        const uint8_t c = coef[r * coef_stride + i];
        const uint8_t b = src[i][pos];
        if (c == 1) acc ^= b;
        else if (c) acc ^= tables[(r * k + i) * 256 + b];
      }
      dst[r][pos] = acc;
    }
  }
}

// 16-byte loads/stores: 128-bit non-coherent loads on the device, memcpy on the host (no alignment
// or aliasing assumptions there). The arithmetic around them is shared.
SS_HD void ss_load16(const uint8_t* p, uint32_t w[4]) {
#if defined(__CUDA_ARCH__)
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
#else
  memcpy(w, p, 16);
#endif
}

SS_HD void ss_store16(uint8_t* p, const uint32_t w[4]) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
#else
  memcpy(p, w, 16);
#endif
}

// One 16-byte group (index v) for ROWS outputs, accumulators in registers. The coefficient branch
// is uniform across a warp (every thread uses the same matrix), so it does not diverge.
template <int ROWS>
SS_HD void ss_ec_encode_vec16(const uint8_t* tables, const uint8_t* coef, int coef_stride, int k,
                              const uint8_t* const* src, uint8_t* const* dst, size_t v, int accumulate) {
  uint32_t acc[ROWS][4];
  const size_t off = v * 16;
SS_UNROLL
  for (int r = 0; r < ROWS; ++r) {
    if (accumulate) {
      ss_load16(dst[r] + off, acc[r]);
    } else {
      acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0;
    }
  }
  for (int i = 0; i < k; ++i) {
    uint32_t x[4];
    ss_load16(src[i] + off, x);
SS_UNROLL
    for (int r = 0; r < ROWS; ++r) {
      const uint8_t c = coef[r * coef_stride + i];
      if (c == 0) continue;
      if (c == 1) {
SS_UNROLL
        for (int w = 0; w < 4; ++w) acc[r][w] ^= x[w];
      } else {
        const uint8_t* t = tables + (r * k + i) * 256;
SS_UNROLL
        for (int w = 0; w < 4; ++w) acc[r][w] ^= ss_gf_mul_word(t, x[w]);
      }
    }
  }
SS_UNROLL
  for (int r = 0; r < ROWS; ++r) ss_store16(dst[r] + off, acc[r]);
}
