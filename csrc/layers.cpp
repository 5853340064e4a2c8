// Decoder-layer ops for float32 decoding on a CPU: attention over a static KV cache, and RMSNorm
// (see layers.h).
//
// Why in C++: the shipped models are small (hidden 192 and 512), so a decode step's torch ops
// each do microseconds of arithmetic behind tens of microseconds of dispatch. Measured on the
// 2-core machine this was written on: the ~10 torch ops between a layer's projections (rotary,
// cache write, mask, SDPA, transposes) took 0.5 ms per layer and an RMSNorm module 70 us, most
// of the shipped target's 12 ms step. Each is one call here.
#include "layers.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_features.h"

namespace specengine {
namespace {

// Below this many multiply-adds a call stays on one thread: waking the OpenMP team costs more.
constexpr int64_t kParallelWork = 1 << 16;

// out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x[D/2:], x[:D/2]].
inline void rotate(const float* x, const float* cos, const float* sin, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] - x[i + half] * sin[i];
  for (int64_t i = half; i < D; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

__attribute__((always_inline)) inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// One query's attention over keys lo..hi (inclusive) of its row: o [D] = softmax(q . k_j * scale
// + bias_j) v_j, where bias_j = bias[j * bias_stride] (no bias when bias is null).
// Inlined into a portable and an AVX2/FMA caller below, so the same loops are compiled for both
// (the build itself targets baseline x86-64). scores has room for hi + 1 entries.
__attribute__((always_inline)) inline void attend(const float* q, const float* keys, const float* values,
                                                  int64_t key_stride, int64_t lo, int64_t hi, int64_t D, float scale,
                                                  const float* bias, int64_t bias_stride, float* scores, float* o) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = lo; j <= hi; ++j) {
    scores[j] = dot(q, keys + j * key_stride, D) * scale;
    if (bias != nullptr) scores[j] += bias[j * bias_stride];
    m = std::max(m, scores[j]);
  }
  float total = 0.f;
  for (int64_t j = lo; j <= hi; ++j) {
    scores[j] = std::exp(scores[j] - m);
    total += scores[j];
  }
  std::fill(o, o + D, 0.f);
  for (int64_t j = lo; j <= hi; ++j) {
    const float e = scores[j];
    const float* vj = values + j * key_stride;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) o[i] += e * vj[i];
  }
  const float inv = 1.f / total;
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) o[i] *= inv;
}

void attend_portable(const float* q, const float* keys, const float* values, int64_t key_stride, int64_t lo,
                     int64_t hi, int64_t D, float scale, const float* bias, int64_t bias_stride, float* scores,
                     float* o) {
  attend(q, keys, values, key_stride, lo, hi, D, scale, bias, bias_stride, scores, o);
}

#ifdef SPECENGINE_X86
SPECENGINE_AVX2 void attend_avx2(const float* q, const float* keys, const float* values, int64_t key_stride,
                                 int64_t lo, int64_t hi, int64_t D, float scale, const float* bias,
                                 int64_t bias_stride, float* scores, float* o) {
  attend(q, keys, values, key_stride, lo, hi, D, scale, bias, bias_stride, scores, o);
}
#endif

using AttendFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, float,
                          const float*, int64_t, float*, float*);

AttendFn attend_fn() {
#ifdef SPECENGINE_X86
  return use_avx2() ? attend_avx2 : attend_portable;
#else
  return attend_portable;
#endif
}

}  // namespace

void cached_attention(const float* q, const float* k, const float* v, int64_t q_token_stride,
                      int64_t k_token_stride, int64_t v_token_stride, const float* cos, const float* sin,
                      const int64_t* positions, float* cache_k, float* cache_v, float* out, int64_t B, int64_t T,
                      int64_t H, int64_t Hkv, int64_t D, int64_t capacity, int64_t cache_row_stride, int64_t kv_len,
                      int64_t window) {
  const int64_t group = H / Hkv;
  // 1-2: rotated keys and values into the cache, rotated queries into a scratch buffer. Every
  // write lands before any read below, so a query also sees the keys of its own call.
  std::vector<float> q_rot(static_cast<size_t>(B * T * H * D));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t bt = b * T + t;
      const float* c = cos + bt * D;
      const float* s = sin + bt * D;
      for (int64_t h = 0; h < H; ++h)
        rotate(q + bt * q_token_stride + h * D, c, s, q_rot.data() + (bt * H + h) * D, D);
      const int64_t slot = std::min(positions[bt], capacity);
      float* k_dst = cache_k + b * cache_row_stride + slot * Hkv * D;
      float* v_dst = cache_v + b * cache_row_stride + slot * Hkv * D;
      for (int64_t h = 0; h < Hkv; ++h) rotate(k + bt * k_token_stride + h * D, c, s, k_dst + h * D, D);
      std::copy(v + bt * v_token_stride, v + bt * v_token_stride + Hkv * D, v_dst);
    }
  }
  // 3: one (row, token, head) per iteration.
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const int64_t items = B * T * H;
  const bool parallel = items * kv_len * D > kParallelWork;
  const AttendFn attend_one = attend_fn();
#pragma omp parallel if (parallel)
  {
    std::vector<float> scores(static_cast<size_t>(std::max<int64_t>(kv_len, 1)));
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t bt = item / H, h = item % H, b = bt / T;
      const int64_t p = positions[bt];
      const int64_t hi = std::min(p, kv_len - 1);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      float* o = out + item * D;
      if (hi < lo) {
        std::fill(o, o + D, 0.f);
        continue;
      }
      attend_one(q_rot.data() + item * D, cache_k + b * cache_row_stride + (h / group) * D,
                 cache_v + b * cache_row_stride + (h / group) * D, Hkv * D, lo, hi, D, scale, nullptr, 0,
                 scores.data(), o);
    }
  }
}

void relative_attention(const float* q, int64_t q_token_stride, const float* k, const float* v,
                        int64_t k_token_stride, int64_t v_token_stride, const int64_t* positions, float* cache_k,
                        float* cache_v, int64_t capacity, int64_t cache_row_stride, int64_t kv_len,
                        const float* bias_table, float* out, int64_t B, int64_t T, int64_t H,
                        int64_t D) {
  if (k != nullptr) {  // every write before any read: a query also sees the keys of its own call
    for (int64_t bt = 0; bt < B * T; ++bt) {
      const int64_t slot = std::min(positions[bt], capacity);
      const int64_t offset = (bt / T) * cache_row_stride + slot * H * D;
      std::copy(k + bt * k_token_stride, k + bt * k_token_stride + H * D, cache_k + offset);
      std::copy(v + bt * v_token_stride, v + bt * v_token_stride + H * D, cache_v + offset);
    }
  }
  const int64_t items = B * T * H;
  const bool parallel = items * kv_len * D > kParallelWork;
  const AttendFn attend_one = attend_fn();
#pragma omp parallel if (parallel)
  {
    std::vector<float> scores(static_cast<size_t>(std::max<int64_t>(kv_len, 1)));
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t bt = item / H, h = item % H, b = bt / T;
      const int64_t p = positions[bt];
      const int64_t hi = std::min(p, kv_len - 1);
      float* o = out + item * D;
      if (hi < 0) {
        std::fill(o, o + D, 0.f);
        continue;
      }
      // Key j lies p - j positions back: its bias is row p - j of the table (the last row beyond).
      const float* bias = nullptr;
      int64_t bias_stride = 0;
      if (bias_table != nullptr) {  // the host sizes the table past every position (bias_rows > p)
        bias = bias_table + p * H + h;
        bias_stride = -H;
      }
      attend_one(q + bt * q_token_stride + h * D, cache_k + b * cache_row_stride + h * D,
                 cache_v + b * cache_row_stride + h * D, H * D, 0, hi, D, 1.f, bias, bias_stride, scores.data(), o);
    }
  }
}

void rms_norm(const float* x, const float* weight, float* out, int64_t R, int64_t N, float eps) {
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * N;
    float* o = out + r * N;
    const float inv_rms = 1.f / std::sqrt(dot(xr, xr, N) / static_cast<float>(N) + eps);
#pragma omp simd
    for (int64_t i = 0; i < N; ++i) o[i] = weight[i] * (xr[i] * inv_rms);
  }
}

}  // namespace specengine
