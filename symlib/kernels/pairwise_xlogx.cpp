// The pairwise term of symlib.metrics.pairwise_mi on the CPU, fused: for every pair of models i < j,
//
//     S_ij = sum_f q_f log q_f,   q_f = h_i[f] + h_j[f],
//
// where h holds each model's halved probabilities (floored at the smallest normal float, rows padded to a
// whole number of vectors with 1/2, where q log q = 0 exactly). One pass per pair: the addition, the
// logarithm and the product-sum run in registers, 16 floats at a time. The logarithm is Cephes' logf
// (range reduction to [sqrt(1/2), sqrt(2)), a degree-9 polynomial; about one unit in the last place); the
// sums are taken per lane in float32 over 256 values and accumulated in float64.
//
// Rows are processed in blocks of R models against every later model, so that each later row is read once
// per block (R pairs) while the block's rows stay in cache.

#include <cstdint>

namespace {

typedef float VF __attribute__((vector_size(64)));
typedef int32_t VI __attribute__((vector_size(64)));
typedef double VD __attribute__((vector_size(64)));

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

// S for rows a and b of length F (a multiple of 16)
inline double pair_sum(const float* __restrict a, const float* __restrict b, int64_t F) {
  VD acc_lo = {}, acc_hi = {};
  const int64_t nv = F / 16;
  for (int64_t v0 = 0; v0 < nv; v0 += 16) {
    const int64_t v1 = v0 + 16 < nv ? v0 + 16 : nv;
    VF part = {};
    for (int64_t v = v0; v < v1; ++v) {
      VF va, vb;
      __builtin_memcpy(&va, a + 16 * v, sizeof(VF));
      __builtin_memcpy(&vb, b + 16 * v, sizeof(VF));
      const VF q = va + vb;
      part += q * vlog(q);
    }
    acc_lo += __builtin_convertvector(__builtin_shufflevector(part, part, 0, 1, 2, 3, 4, 5, 6, 7), VD);
    acc_hi += __builtin_convertvector(__builtin_shufflevector(part, part, 8, 9, 10, 11, 12, 13, 14, 15), VD);
  }
  const VD acc = acc_lo + acc_hi;
  double s = 0;
  for (int l = 0; l < 8; ++l) s += acc[l];
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
  for (int64_t i = 0; i + 16 <= n; i += 16) {
    VF v;
    __builtin_memcpy(&v, x + i, sizeof(VF));
    const VF r = vlog(v);
    __builtin_memcpy(out + i, &r, sizeof(VF));
  }
}

}  // extern "C"
