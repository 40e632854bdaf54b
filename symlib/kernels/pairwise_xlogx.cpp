// The pairwise term of symlib.metrics.pairwise_mi on the CPU, fused: for every pair of models i < j,
//
//     S_ij = sum_f q_f log q_f,   q_f = h_i[f] + h_j[f],
//
// where h holds each model's halved probabilities (floored at the smallest normal float, rows padded to a
// whole number of vectors with 1/2, where q log q = 0 exactly). One pass per pair: the addition, the
// logarithm and the product-sum run in registers, a register of floats at a time (16 with AVX-512). The
// logarithm is, with AVX-512, a table-driven one (below), else Cephes' logf (range reduction to
// [sqrt(1/2), sqrt(2)), a degree-9 polynomial); both within about one unit in the last place of a float.
// The sums are taken per lane in float32 over 256 values and accumulated in float64.
//
// Rows are processed in blocks of R models against every later model, so that each later row is read once
// per block (R pairs) while the block's rows stay in cache.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vector_width.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// One register wide (vector_width.h).
constexpr int NF = SYMLIB_VECTOR_BYTES / 4;  // floats per vector
typedef float VF __attribute__((vector_size(SYMLIB_VECTOR_BYTES)));
typedef int32_t VI __attribute__((vector_size(SYMLIB_VECTOR_BYTES)));
typedef double VD __attribute__((vector_size(SYMLIB_VECTOR_BYTES)));
typedef float VH __attribute__((vector_size(SYMLIB_VECTOR_BYTES / 2)));

// Half ``h`` (0: the low lanes, 1: the high ones) of a float vector, widened to doubles.
inline VD widen(const VF& v, int h) {
  VH half;
  std::memcpy(&half, reinterpret_cast<const float*>(&v) + h * (NF / 2), sizeof(VH));
  return __builtin_convertvector(half, VD);
}

#if defined(__AVX512F__)
// AVX-512: exponent and mantissa in one instruction each, then a 16-entry table on the mantissa's top four
// bits: log x = e ln 2 - log(t_k) + log1p(m t_k - 1), with t_k ~ 1 / (1 + (k + 1/2) / 16) rounded to 9 bits
// (so m t_k - 1 is exact), |m t_k - 1| < 0.033 and log1p a degree-5 polynomial (error below 2e-10).
struct LogTable {
  alignas(64) float inv[16];
  alignas(64) float neglog[16];
  LogTable() {
    for (int k = 0; k < 16; ++k) {
      const double c = 1.0 + (k + 0.5) / 16.0;
      const double t = static_cast<double>(static_cast<int>(512.0 / c + 0.5)) / 512.0;
      inv[k] = static_cast<float>(t);
      neglog[k] = static_cast<float>(-std::log(t));
    }
  }
};

inline VF vlog(VF xv) {
  static const LogTable tab;
  const __m512 x = reinterpret_cast<__m512&>(xv);
  const __m512 e = _mm512_getexp_ps(x);
  const __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __m512i k = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 19), _mm512_set1_epi32(15));
  const __m512 t = _mm512_permutexvar_ps(k, _mm512_load_ps(tab.inv));
  const __m512 lc = _mm512_permutexvar_ps(k, _mm512_load_ps(tab.neglog));
  const __m512 r = _mm512_fmsub_ps(m, t, _mm512_set1_ps(1.0f));
  __m512 p = _mm512_set1_ps(0.2f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-0.25f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 3.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512 tail = _mm512_fmadd_ps(p, r, lc);  // log(m) = log1p(r) - log(t)
  // e ln 2 in two parts (Cephes' split), so that large exponents keep the tail's digits
  const __m512 lo = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), tail);
  const __m512 out = _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), lo);
  return reinterpret_cast<const VF&>(out);
}
#else
inline VF vlog(VF x) {
  const VI bits = reinterpret_cast<VI&>(x);
  VI e = ((bits >> 23) & 0xff) - 127;
  VI mb = (bits & 0x007fffff) | 0x3f800000;
  VF m = reinterpret_cast<VF&>(mb);  // [1, 2)
  const VI big = m > 1.41421356237f;  // -1 where true
  m = big ? m * 0.5f : m;
  e -= big;
  const VF ef = __builtin_convertvector(e, VF);
  const VF f = m - 1.0f;
  const VF z = f * f;
  VF y = 7.0376836292E-2f * f - 1.1514610310E-1f;
  y = y * f + 1.1676998740E-1f;
  y = y * f - 1.2420140846E-1f;
  y = y * f + 1.4249322787E-1f;
  y = y * f - 1.6668057665E-1f;
  y = y * f + 2.0000714765E-1f;
  y = y * f - 2.4999993993E-1f;
  y = y * f + 3.3333331174E-1f;
  y = y * f * z;
  y += -2.12194440e-4f * ef;
  y += -0.5f * z;
  return (f + y) + 0.693359375f * ef;
}
#endif

// S for rows a and b of length F (a multiple of 16)
inline double pair_sum(const float* __restrict a, const float* __restrict b, int64_t F) {
  VD acc_lo = {}, acc_hi = {};
  const int64_t nv = F / NF, block = 256 / NF;  // float32 partial sums over 256 values
  for (int64_t v0 = 0; v0 < nv; v0 += block) {
    const int64_t v1 = v0 + block < nv ? v0 + block : nv;
    VF part = {};
    for (int64_t v = v0; v < v1; ++v) {
      VF va, vb;
      __builtin_memcpy(&va, a + NF * v, sizeof(VF));
      __builtin_memcpy(&vb, b + NF * v, sizeof(VF));
      const VF q = va + vb;
      part += q * vlog(q);
    }
    acc_lo += widen(part, 0);
    acc_hi += widen(part, 1);
  }
  const VD acc = acc_lo + acc_hi;
  double s = 0;
  for (int l = 0; l < NF / 2; ++l) s += acc[l];
  return s;
}

}  // namespace

extern "C" {

// Rows i in [i0, i1) of the upper triangle: out[k(i, j)] = S_ij for j > i, with k the condensed index
// i N - i (i + 1) / 2 + j - i - 1 of scipy.spatial.distance.squareform.
void symlib_pairwise_xlogx_f32(int64_t N, int64_t F, const float* h, int64_t i0, int64_t i1, double* out) {
  const int64_t R = 8;
  for (int64_t r0 = i0; r0 < i1; r0 += R) {
    const int64_t r1 = r0 + R < i1 ? r0 + R : i1;
    for (int64_t j = r0 + 1; j < N; ++j) {
      const float* b = h + j * F;
      for (int64_t i = r0; i < r1 && i < j; ++i)
        out[i * N - i * (i + 1) / 2 + j - i - 1] = pair_sum(h + i * F, b, F);
    }
  }
}

// Cephes' logf on n floats (tests).
void symlib_vlog_f32(int64_t n, const float* x, float* out) {
  for (int64_t i = 0; i + NF <= n; i += NF) {
    VF v;
    __builtin_memcpy(&v, x + i, sizeof(VF));
    const VF r = vlog(v);
    __builtin_memcpy(out + i, &r, sizeof(VF));
  }
}

}  // extern "C"
