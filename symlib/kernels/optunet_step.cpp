// One training step of M stacked OptuNets on the CPU: the loss and its exact gradient, fused.
//
// symlib.kernels compiles this file on first use (g++ -O3 -march=native) and calls it through ctypes;
// symlib.train.optunet_loss_grads is the PyTorch formulation of the same function and the reference the
// tests compare it with. Every model is processed on its own, with all activations laid out image-innermost
// ((feature, ..., image), B contiguous values), so each loop below runs over the B images of a batch as
// independent SIMD lanes: no reassociation is needed for vectorisation, and the working set of one model
// (its transposed images, about 3 KiB per image) stays in the core's L2 cache. The lanes are explicit (GCC
// vector extensions, one register wide: 16 floats or 8 doubles with AVX-512, 8 or 4 with AVX2); the batch is
// padded with zero images to a whole number of vectors, whose gradient is zero.
//
// Network (symlib.models.OptuNet): conv 1 (2 x 1 x 4 x 4, no bias) on 28 x 28, max-pool 3 (rows and columns
// 0..23 of the 25 x 25 map; first maximum of each window in row-major order, PyTorch's rule), ReLU, grouped
// conv 2 (2 groups of 1 -> 5 channels, 5 x 5, no bias) on 8 x 8, ReLU, global average pooling over 4 x 4,
// an optional dropout multiplier of the 10 features, linear 10 -> 10 with bias, mean cross-entropy.
//
// Backward: with p = softmax(l), dl = (p - e_y) / B; the linear layer, the ReLU masks, GAP (1/16), conv 2's
// weight and input gradients, the pool routes the gradient to its recorded maximum, and conv 1's weight
// gradient sums, for every pooled output, the gradient times the 4 x 4 input patch under the maximum.
// Sums over images run per lane and are reduced over the lanes at the end.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "vector_width.h"

namespace {

// One register wide (vector_width.h): conv 1's 18 accumulators stay in registers.
template <typename T>
struct Lanes {
  typedef T V __attribute__((vector_size(SYMLIB_VECTOR_BYTES)));
  static constexpr int L = SYMLIB_VECTOR_BYTES / sizeof(T);
};

// Scratch of one thread: every buffer is (features, Bp) with Bp = B rounded up to whole vectors.
template <typename T>
struct Buffers {
  using V = typename Lanes<T>::V;
  static constexpr int SIZES[] = {784, 128, 128, 160, 10, 10, 10, 160, 128, 32, 250, 784, 128};
  V* base = nullptr;
  V *xt, *pooled, *argk, *u, *feats, *dl, *dfe, *du, *da, *acc1, *acc2, *stage, *act;
  explicit Buffers(int nv) {
    int total = 0;
    for (int n : SIZES) total += n;
    base = static_cast<V*>(std::aligned_alloc(64, sizeof(V) * total * nv));
    V** slots[] = {&xt, &pooled, &argk, &u, &feats, &dl, &dfe, &du, &da, &acc1, &acc2, &stage, &act};
    V* p = base;
    for (int i = 0; i < 13; ++i) {
      *slots[i] = p;
      p += SIZES[i] * nv;
    }
  }
  ~Buffers() { std::free(base); }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
};

template <typename T>
static bool any_nonzero(const typename Lanes<T>::V& v) {
  bool any = false;
  for (int l = 0; l < Lanes<T>::L; ++l) any |= v[l] != T(0);
  return any;
}

template <typename T>
static T lane_sum(const typename Lanes<T>::V* v, int nv) {
  typename Lanes<T>::V a = {};
  for (int i = 0; i < nv; ++i) a += v[i];
  T s = 0;
  for (int l = 0; l < Lanes<T>::L; ++l) s += a[l];
  return s;
}

// Register blocks: conv 2's weight gradient sums its 25 taps in two passes (13, then 12) and conv 1's sums
// 2 of its 16 taps per pass for both channels, instead of 25 and 32 accumulators at once, which spilled to
// memory (with AVX2's 16 vector registers, and with AVX-512's 32 beside the patch): 1.38 ms instead of 1.72
// for a step of 16 models x 64 images with AVX-512, 2.21 instead of 2.78 with AVX2 on the same cores (one
// thread; docs/performance.md). Every accumulator sums the same terms in the same order as in one pass: the
// results are the same to the bit.
constexpr int kConv1Taps = 2;

// conv 2's weight gradient, taps t0 .. t0 + N - 1 of output channel o (group g), one vector of images: the
// N sums over the 16 output positions in registers.
template <typename T, int N>
static inline void conv2_weight_grad(int t0, int o, int g, int v, int nv, const typename Lanes<T>::V* du,
                                     const typename Lanes<T>::V* act, typename Lanes<T>::V* acc2) {
  using V = typename Lanes<T>::V;
  V acc[N];
  for (int i = 0; i < N; ++i) acc[i] = V{};
  for (int st = 0; st < 16; ++st) {
    const V d = du[(o * 16 + st) * nv + v];
    const int s0 = st / 4, c0 = st % 4;
    for (int i = 0; i < N; ++i) {
      const int t = t0 + i;
      acc[i] += d * act[(g * 64 + (s0 + t / 5) * 8 + c0 + t % 5) * nv + v];
    }
  }
  for (int i = 0; i < N; ++i) acc2[(o * 25 + t0 + i) * nv + v] = acc[i];
}

template <typename T>
static void one_model(int B, const T* __restrict x, const int64_t* __restrict start, int64_t row,
                      const int64_t* __restrict y, const T* __restrict w1,
                      const T* __restrict w2, const T* __restrict fw, const T* __restrict fb,
                      const T* __restrict mask, T* __restrict loss, T* __restrict g1, T* __restrict g2,
                      T* __restrict gfw, T* __restrict gfb, Buffers<T>& s) {
  using V = typename Lanes<T>::V;
  constexpr int L = Lanes<T>::L;
  const int nv = (B + L - 1) / L, bp = nv * L;
  const V zero = {};
  V* __restrict xt = s.xt;
  V* __restrict pooled = s.pooled;
  V* __restrict argk = s.argk;
  V* __restrict u = s.u;
  V* __restrict feats = s.feats;
  V* __restrict dl = s.dl;
  V* __restrict dfe = s.dfe;
  V* __restrict du = s.du;
  V* __restrict da = s.da;
  V* __restrict acc1 = s.acc1;
  V* __restrict acc2 = s.acc2;

  // images, innermost: xt[(r * 28 + c), b] = pixel (r, c) of image b, at x[start[b] + r * row + c] (a
  // window of a padded image: the random crop is this copy); padded lanes are zero images. First each
  // window is copied row by row into a contiguous stage (sequential reads of one image, which the
  // hardware prefetches), then the stage is transposed 16 images at a time (contiguous writes).
  {
    T* st = reinterpret_cast<T*>(s.stage);
    for (int b = 0; b < B; ++b) {
      const T* img = x + start[b];
      for (int r = 0; r < 28; ++r)
        for (int c = 0; c < 28; ++c) st[b * 784 + r * 28 + c] = img[r * row + c];
    }
    T* xs = reinterpret_cast<T*>(xt);
    if (bp != B) std::memset(xs, 0, sizeof(T) * 784 * bp);
    for (int b0 = 0; b0 < B; b0 += 16) {
      const int nb = B - b0 < 16 ? B - b0 : 16;
      for (int k = 0; k < 784; ++k) {
        T* dst = xs + k * bp + b0;
        const T* src = st + b0 * 784 + k;
        for (int b = 0; b < nb; ++b) dst[b] = src[b * 784];
      }
    }
  }

  // conv 1 + max-pool 3: pooled output (c, p, q) covers conv outputs (3p + di, 3q + dj), which read the
  // 6 x 6 input patch at (3p, 3q).
  for (int p = 0; p < 8; ++p) {
    for (int q = 0; q < 8; ++q) {
      const V* xp = xt + (3 * p * 28 + 3 * q) * nv;
      const int e = p * 8 + q;
      for (int v = 0; v < nv; ++v) {
        // the 9 x 2 conv outputs of the window stay in registers; each tap's two weights are broadcast
        // once, each input value loaded once per use (two multiply-adds per load)
        V a0[9], a1[9];
        for (int k = 0; k < 9; ++k) a0[k] = a1[k] = zero;
        for (int t = 0; t < 16; ++t) {
          const V wa = zero + w1[t], wb = zero + w1[16 + t];
          const int ti = t / 4, tj = t % 4;
          for (int k = 0; k < 9; ++k) {
            const V xv = xp[((k / 3 + ti) * 28 + k % 3 + tj) * nv + v];
            a0[k] += wa * xv;
            a1[k] += wb * xv;
          }
        }
        V best0 = zero, best1 = zero, arg0 = zero, arg1 = zero;
        for (int k = 0; k < 9; ++k) {
          const V v0 = a0[k], v1 = a1[k];
          if (k == 0) {
            best0 = v0;
            best1 = v1;
          } else {
            // a later position wins only if strictly larger (or NaN): the first maximum is kept
            const auto up0 = (v0 > best0) | (v0 != v0);
            const auto up1 = (v1 > best1) | (v1 != v1);
            best0 = up0 ? v0 : best0;
            arg0 = up0 ? zero + T(k) : arg0;
            best1 = up1 ? v1 : best1;
            arg1 = up1 ? zero + T(k) : arg1;
          }
        }
        pooled[e * nv + v] = best0;
        pooled[(64 + e) * nv + v] = best1;
        argk[e * nv + v] = arg0;
        argk[(64 + e) * nv + v] = arg1;
      }
    }
  }

  // conv 2 on a = relu(pooled): channel o of group g reads input channel g; u: (10, 4 x 4). The 16
  // outputs of a channel stay in registers, each weight is broadcast once.
  V* __restrict act = s.act;
  for (int i = 0; i < 128 * nv; ++i) act[i] = pooled[i] > zero ? pooled[i] : zero;
  for (int o = 0; o < 10; ++o) {
    const int g = o / 5;
    const T* w = w2 + o * 25;
    for (int v = 0; v < nv; ++v) {
      V acc[16];
      for (int st = 0; st < 16; ++st) acc[st] = zero;
      for (int t = 0; t < 25; ++t) {
        const V wt = zero + w[t];
        const int ki = t / 5, kj = t % 5;
        for (int st = 0; st < 16; ++st) acc[st] += wt * act[(g * 64 + (st / 4 + ki) * 8 + st % 4 + kj) * nv + v];
      }
      for (int st = 0; st < 16; ++st) u[(o * 16 + st) * nv + v] = acc[st];
    }
  }

  // ReLU, global average pooling, dropout multiplier
  for (int o = 0; o < 10; ++o)
    for (int v = 0; v < nv; ++v) {
      V acc = zero;
      for (int st = 0; st < 16; ++st) {
        const V z = u[(o * 16 + st) * nv + v];
        acc += z > zero ? z : zero;
      }
      feats[o * nv + v] = acc / T(16);
    }
  if (mask != nullptr) {
    T* f = reinterpret_cast<T*>(feats);
    for (int o = 0; o < 10; ++o)
      for (int b = 0; b < B; ++b) f[o * bp + b] *= mask[o * B + b];
  }

  // linear layer, log-softmax, loss, and the logits' gradient dl = (p - e_y) / B (zero in padded lanes)
  {
    const T* f = reinterpret_cast<const T*>(feats);
    T* d = reinterpret_cast<T*>(dl);
    std::memset(d, 0, sizeof(T) * 10 * bp);
    T total = 0;
    for (int b = 0; b < B; ++b) {
      T logits[10];
      T mx = -INFINITY;
      for (int k = 0; k < 10; ++k) {
        T val = fb[k];
        for (int o = 0; o < 10; ++o) val += fw[k * 10 + o] * f[o * bp + b];
        logits[k] = val;
        mx = val > mx ? val : mx;
      }
      T se = 0;
      for (int k = 0; k < 10; ++k) se += std::exp(logits[k] - mx);
      const T lse = mx + std::log(se);
      const int64_t yb = y[b];
      total += lse - logits[yb];
      for (int k = 0; k < 10; ++k) d[k * bp + b] = (std::exp(logits[k] - lse) - (k == yb ? T(1) : T(0))) / B;
    }
    *loss = total / B;
  }

  // linear layer's gradients, and the features' gradient (times the dropout multiplier)
  for (int k = 0; k < 10; ++k) {
    gfb[k] = lane_sum<T>(dl + k * nv, nv);
    for (int o = 0; o < 10; ++o) {
      V acc = zero;
      for (int v = 0; v < nv; ++v) acc += dl[k * nv + v] * feats[o * nv + v];
      T sum = 0;
      for (int l = 0; l < L; ++l) sum += acc[l];
      gfw[k * 10 + o] = sum;
    }
  }
  for (int o = 0; o < 10; ++o)
    for (int v = 0; v < nv; ++v) {
      V acc = zero;
      for (int k = 0; k < 10; ++k) acc += fw[k * 10 + o] * dl[k * nv + v];
      dfe[o * nv + v] = acc;
    }
  if (mask != nullptr) {
    T* d = reinterpret_cast<T*>(dfe);
    for (int o = 0; o < 10; ++o)
      for (int b = 0; b < B; ++b) d[o * bp + b] *= mask[o * B + b];
  }

  // GAP and ReLU 2: du = dfe / 16 where u > 0
  for (int o = 0; o < 10; ++o)
    for (int st = 0; st < 16; ++st)
      for (int v = 0; v < nv; ++v) {
        const int i = (o * 16 + st) * nv + v;
        du[i] = u[i] > zero ? dfe[o * nv + v] / T(16) : zero;
      }

  // conv 2: weight gradient (per-lane sums over the 16 positions, in registers: 13 taps, then 12) and input
  // gradient (each input's sum gathered in a register)
  for (int o = 0; o < 10; ++o) {
    const int g = o / 5;
    for (int v = 0; v < nv; ++v) {
      conv2_weight_grad<T, 13>(0, o, g, v, nv, du, act, acc2);
      conv2_weight_grad<T, 12>(13, o, g, v, nv, du, act, acc2);
    }
  }
  for (int g = 0; g < 2; ++g)
    for (int pq = 0; pq < 64; ++pq) {
      const int pp = pq / 8, qq = pq % 8;
      for (int v = 0; v < nv; ++v) {
        V acc = zero;
        for (int o = 5 * g; o < 5 * g + 5; ++o)
          for (int s0 = 0; s0 < 4; ++s0) {
            const int ki = pp - s0;
            if (ki < 0 || ki > 4) continue;
            for (int t0 = 0; t0 < 4; ++t0) {
              const int kj = qq - t0;
              if (kj < 0 || kj > 4) continue;
              acc += w2[o * 25 + ki * 5 + kj] * du[(o * 16 + s0 * 4 + t0) * nv + v];
            }
          }
        da[(g * 64 + pq) * nv + v] = acc;
      }
    }

  // ReLU 1 (after the pool: pass where pooled > 0), the pool's routing and conv 1's weight gradient:
  // acc1[(c, t)] += dpool[c, p, q] * (the 4 x 4 patch under the maximum), lane by lane
  for (int i = 0; i < 32 * nv; ++i) acc1[i] = zero;
  for (int p = 0; p < 8; ++p) {
    for (int q = 0; q < 8; ++q) {
      const V* xp = xt + (3 * p * 28 + 3 * q) * nv;
      const int e = p * 8 + q;
      for (int v = 0; v < nv; ++v) {
        const V d0 = pooled[e * nv + v] > zero ? da[e * nv + v] : zero;
        const V d1 = pooled[(64 + e) * nv + v] > zero ? da[(64 + e) * nv + v] : zero;
        // windows whose ReLU is closed for every image of this vector (typically the constant border of
        // digit images, where all images agree) contribute nothing: skip their 288 multiply-adds
        if (!any_nonzero<T>(d0) && !any_nonzero<T>(d1)) continue;
        V patch[36];
        for (int r = 0; r < 6; ++r)
          for (int c = 0; c < 6; ++c) patch[r * 6 + c] = xp[(r * 28 + c) * nv + v];
        const V k0 = argk[e * nv + v], k1 = argk[(64 + e) * nv + v];
        for (int t0 = 0; t0 < 16; t0 += kConv1Taps) {  // kConv1Taps taps of both channels per pass
          V s0[kConv1Taps], s1[kConv1Taps];
          for (int i = 0; i < kConv1Taps; ++i) s0[i] = s1[i] = zero;
          for (int k = 0; k < 9; ++k) {
            const int di = k / 3, dj = k % 3;
            const V e0 = k0 == zero + T(k) ? d0 : zero;
            const V e1 = k1 == zero + T(k) ? d1 : zero;
            for (int i = 0; i < kConv1Taps; ++i) {
              const int t = t0 + i;
              const V xv = patch[(di + t / 4) * 6 + dj + t % 4];
              s0[i] += e0 * xv;
              s1[i] += e1 * xv;
            }
          }
          for (int i = 0; i < kConv1Taps; ++i) {
            acc1[(t0 + i) * nv + v] += s0[i];
            acc1[(16 + t0 + i) * nv + v] += s1[i];
          }
        }
      }
    }
  }
  for (int i = 0; i < 32; ++i) g1[i] = lane_sum<T>(acc1 + i * nv, nv);
  for (int i = 0; i < 250; ++i) g2[i] = lane_sum<T>(acc2 + i * nv, nv);
}

// M models; image b of model m is the 28 x 28 window at x[start[m, b] + r * row + c].
template <typename T>
static void run(int64_t M, int64_t B, const T* x, const int64_t* start, int64_t row, const int64_t* y,
                const T* w1, const T* w2, const T* fw, const T* fb, const T* mask, T* loss, T* g1, T* g2,
                T* gfw, T* gfb) {
  constexpr int L = Lanes<T>::L;
  Buffers<T> s(static_cast<int>((B + L - 1) / L));
  for (int64_t m = 0; m < M; ++m)
    one_model<T>(static_cast<int>(B), x, start + m * B, row, y + m * B, w1 + m * 32, w2 + m * 250,
                 fw + m * 100, fb + m * 10, mask == nullptr ? nullptr : mask + m * 10 * B, loss + m,
                 g1 + m * 32, g2 + m * 250, gfw + m * 100, gfb + m * 10, s);
}

}  // namespace

extern "C" {

int symlib_kernel_version() { return 2; }

void symlib_optunet_step_f32(int64_t M, int64_t B, const float* x, const int64_t* start, int64_t row,
                             const int64_t* y, const float* w1, const float* w2, const float* fw, const float* fb,
                             const float* mask, float* loss, float* g1, float* g2, float* gfw, float* gfb) {
  run<float>(M, B, x, start, row, y, w1, w2, fw, fb, mask, loss, g1, g2, gfw, gfb);
}

void symlib_optunet_step_f64(int64_t M, int64_t B, const double* x, const int64_t* start, int64_t row,
                             const int64_t* y, const double* w1, const double* w2, const double* fw,
                             const double* fb, const double* mask, double* loss, double* g1, double* g2,
                             double* gfw, double* gfb) {
  run<double>(M, B, x, start, row, y, w1, w2, fw, fb, mask, loss, g1, g2, gfw, gfb);
}

}  // extern "C"
