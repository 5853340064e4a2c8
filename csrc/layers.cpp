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
#include "vector_math.h"

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

// scores[j] = (q . k_j) * scale for keys j = lo..hi.
using DotScoresFn = void (*)(const float* q, const float* keys, int64_t key_stride, int64_t lo, int64_t hi,
                             int64_t D, float scale, float* scores);
// scores[lo..hi] = exp(scores[j] - m) in place; returns their sum.
using ExpScoresFn = float (*)(float* scores, int64_t lo, int64_t hi, float m);

void dot_scores_portable(const float* q, const float* keys, int64_t key_stride, int64_t lo, int64_t hi, int64_t D,
                         float scale, float* scores) {
  for (int64_t j = lo; j <= hi; ++j) scores[j] = dot(q, keys + j * key_stride, D) * scale;
}

float exp_scores_portable(float* scores, int64_t lo, int64_t hi, float m) {
  float total = 0.f;
  for (int64_t j = lo; j <= hi; ++j) {
    scores[j] = std::exp(scores[j] - m);
    total += scores[j];
  }
  return total;
}

// One query's attention over keys lo..hi (inclusive) of its row: o [D] = softmax(q . k_j * scale
// + bias_j) v_j, where bias_j = bias[j * bias_stride] (no bias when bias is null).
// Inlined into a portable and an AVX2/FMA caller below, so the same loops are compiled for both
// (the build itself targets baseline x86-64). scores has room for hi + 1 entries.
__attribute__((always_inline)) inline void attend(const float* q, const float* keys, const float* values,
                                                  int64_t key_stride, int64_t lo, int64_t hi, int64_t D, float scale,
                                                  const float* bias, int64_t bias_stride, float* scores, float* o,
                                                  DotScoresFn dot_scores, ExpScoresFn exp_scores) {
  dot_scores(q, keys, key_stride, lo, hi, D, scale, scores);
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = lo; j <= hi; ++j) {
    if (bias != nullptr) scores[j] += bias[j * bias_stride];
    m = std::max(m, scores[j]);
  }
  const float total = exp_scores(scores, lo, hi, m);
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
  attend(q, keys, values, key_stride, lo, hi, D, scale, bias, bias_stride, scores, o, dot_scores_portable,
         exp_scores_portable);
}

#ifdef SPECENGINE_X86
// Four keys at a time, each with its own accumulator: one dot product at a time waits on the
// FMA latency of a single chain, and its horizontal sum, for every key (D a multiple of 8;
// other head sizes take the portable loop).
SPECENGINE_AVX2 void dot_scores_avx2(const float* q, const float* keys, int64_t key_stride, int64_t lo, int64_t hi,
                                     int64_t D, float scale, float* scores) {
  if (D % 8 != 0) return dot_scores_portable(q, keys, key_stride, lo, hi, D, scale, scores);
  const __m128 scale_v = _mm_set1_ps(scale);
  int64_t j = lo;
  for (; j + 4 <= hi + 1; j += 4) {
    const float* k0 = keys + j * key_stride;
    const float* k1 = k0 + key_stride;
    const float* k2 = k1 + key_stride;
    const float* k3 = k2 + key_stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
      a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
      a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
    }
    // Pairwise sums leave lane i of each 128-bit half holding a partial sum of key i.
    const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m128 dots = _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
    _mm_storeu_ps(scores + j, _mm_mul_ps(dots, scale_v));
  }
  dot_scores_portable(q, keys, key_stride, j, hi, D, scale, scores);
}

SPECENGINE_AVX2 float exp_scores_avx2(float* scores, int64_t lo, int64_t hi, float m) {
  const __m256 max = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t j = lo;
  for (; j + 8 <= hi + 1; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), max));
    _mm256_storeu_ps(scores + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  return horizontal_sum(sum) + exp_scores_portable(scores, j, hi, m);
}

SPECENGINE_AVX2 void attend_avx2(const float* q, const float* keys, const float* values, int64_t key_stride,
                                 int64_t lo, int64_t hi, int64_t D, float scale, const float* bias,
                                 int64_t bias_stride, float* scores, float* o) {
  attend(q, keys, values, key_stride, lo, hi, D, scale, bias, bias_stride, scores, o, dot_scores_avx2,
         exp_scores_avx2);
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

// What one (row, token, head) item attends with: its query, its kv head, its first key, its bias.
struct Item {
  const float* q;
  int64_t kv_head, lo;
  const float* bias;  // nullptr: none
  int64_t bias_stride;
};

// Every item's attention into out [B, T, H, D], one item per iteration (in parallel when the work
// is large): item(bt, h, p) says what query (row-token bt, head h, position p) attends with; it
// sees keys item.lo..min(p, kv_len - 1) of its row (none: zeros).
template <typename ItemOf>
void attend_items(int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, const int64_t* positions,
                  const float* cache_k, const float* cache_v, int64_t cache_row_stride, int64_t kv_len, float scale,
                  float* out, ItemOf item_of) {
  const int64_t items = B * T * H;
  const bool parallel = items * kv_len * D > kParallelWork;
  const AttendFn attend_one = attend_fn();
#pragma omp parallel if (parallel)
  {
    std::vector<float> scores(static_cast<size_t>(std::max<int64_t>(kv_len, 1)));
#pragma omp for schedule(static)
    for (int64_t index = 0; index < items; ++index) {
      const int64_t bt = index / H, h = index % H, b = bt / T;
      const int64_t p = positions[bt];
      const int64_t hi = std::min(p, kv_len - 1);
      const Item item = item_of(bt, h, p);
      float* o = out + index * D;
      if (hi < item.lo) {
        std::fill(o, o + D, 0.f);
        continue;
      }
      const int64_t offset = b * cache_row_stride + item.kv_head * D;
      attend_one(item.q, cache_k + offset, cache_v + offset, Hkv * D, item.lo, hi, D, scale, item.bias,
                 item.bias_stride, scores.data(), o);
    }
  }
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
  const float* rotated = q_rot.data();
  attend_items(B, T, H, Hkv, D, positions, cache_k, cache_v, cache_row_stride, kv_len,
               1.f / std::sqrt(static_cast<float>(D)), out, [&](int64_t bt, int64_t h, int64_t p) {
                 const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
                 return Item{rotated + (bt * H + h) * D, h / group, lo, nullptr, 0};
               });
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
  // Key j lies p - j positions back: its bias is row p - j of the table (the host sizes it past
  // every position).
  attend_items(B, T, H, H, D, positions, cache_k, cache_v, cache_row_stride, kv_len, 1.f, out,
               [&](int64_t bt, int64_t h, int64_t p) {
                 const float* bias = bias_table != nullptr ? bias_table + p * H + h : nullptr;
                 return Item{q + bt * q_token_stride + h * D, h, 0, bias, -H};
               });
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
