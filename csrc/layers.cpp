// Decoder-layer ops for float32 decoding on a CPU: attention over a static KV cache, and RMSNorm
// (see layers.h).
//
// Why in C++: the shipped models are small (hidden 192 and 512), so a decode step's torch ops
// each do microseconds of arithmetic behind tens of microseconds of dispatch: the ~10 torch ops
// between a layer's projections (rotary, cache write, mask, SDPA, transposes) and an RMSNorm
// module were most of a step (measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md). Each is one call here.
//
// Attention, shape of the work. A prefill's attention is compute-bound (SmolLM2-135M, 512 tokens:
// ~9 GFLOP over 30 layers), so queries are taken in tiles that share their keys and values: a unit
// of work is a few consecutive tokens of one row times the query heads of one kv head (GQA), ~12
// queries. Per unit:
//   1. scores: keys are transposed into blocks of 16 ([D][16] each), so a tile of queries runs
//      down d with one broadcast of q[d] per query and one 16-key vector per block: each score is
//      one lane of one accumulator, nothing reduced across lanes (the layout gemm_blocks.cpp uses
//      for the same reason). Keys several units read (a prefill) are transposed once per call;
//      a unit alone on its keys (a decode step) transposes them itself;
//   2. softmax over each query's own keys: exact max, exp, sum;
//   3. values: per key, one broadcast of each query's weight and the key's value row [D].
// The units go to threads dynamically, the costliest first (a causal prefill's late tokens see
// the most keys), so that the threads finish together.
//
// Why a query's bits do not depend on its tile (layers.h states the order): every score is its
// own FMA chain over d; the exponentials' sum runs in 16 lanes, lane j % 16 taking key j, so a
// key's lane is fixed by its index, not by where a tile starts; each output element is one FMA
// chain over the query's keys in order, split into runs (keys before, inside and after the range
// the tile's queries share) that continue the same chain. Key blocks start at multiples of 16 from
// key 0, and scores computed for keys a query does not see (its tile's union of ranges) are never
// read. AVX-512 and AVX2 run the same operations per lane and agree bit for bit.
#include "layers.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
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

// ---- attention kernels ---------------------------------------------------------------------------
// Keys per transposed block: one 512-bit (two 256-bit) vector of scores per query, and the lanes
// of the exponentials' sum (key j in lane j % kKeyBlock).
constexpr int64_t kKeyBlock = 16;
// Queries per unit of work, about: enough rows to reuse each key and value row from registers.
constexpr int64_t kUnitQueries = 12;

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// Floats per transposed block of keys: [D rounded up to 16][kKeyBlock], so that the vector paths
// store whole 16 x 16 (8 x 8) transposes; rows past D are zeros, never read.
inline int64_t block_floats(int64_t D) { return (D + 15) / 16 * 16 * kKeyBlock; }

// The kernels one instruction set runs (portable, AVX2, AVX-512):
//   transpose_keys: block[d * 16 + j] = keys[j * key_stride + d] for the keys j < count (<= 16),
//     zeros for the others (block_floats(D) floats).
//   scores: s[r * ld + n * 16 + l] = scale * (q_r . key l of block n) for query rows q [rows, D]
//     (rows <= score_rows) and blocks n < blocks_count, block_floats(D) apart.
//   softmax_row: s[lo..hi] = exp(s[j] - max) over those keys (indices from a multiple of 16, so
//     index % 16 is the key's lane); returns their sum.
//   weigh_values: acc[r * acc_ld + d] += w[r * ld + j] * values[j * value_stride + d] for keys
//     j < count in order, rows r < rows (<= value_rows), d < D.
struct AttentionKernels {
  void (*transpose_keys)(const float* keys, int64_t key_stride, int64_t count, int64_t D, float* block);
  void (*scores)(const float* q, int64_t rows, const float* blocks, int64_t blocks_count, int64_t D,
                 float scale, float* s, int64_t ld);
  float (*softmax_row)(float* s, int64_t lo, int64_t hi);
  void (*weigh_values)(const float* w, int64_t ld, int64_t rows, const float* values, int64_t value_stride,
                       int64_t count, int64_t D, float* acc, int64_t acc_ld);
  int64_t score_rows, value_rows;
};

// Calls f(std::integral_constant<int, R>{}) for R = n in [1, MAX]: a runtime count onto a tile
// size the compiler unrolls.
template <int MAX, typename F>
void with_count(int64_t n, F&& f) {
  if constexpr (MAX > 0) {
    if (n == MAX) return f(std::integral_constant<int, MAX>{});
    with_count<MAX - 1>(n, f);
  }
}

// 16 lane sums into one, as a fixed tree: halves, then quarters, then pairs, then the last two
// (the order horizontal_sum of vector_math.h adds a 256-bit vector of the first two levels in).
inline float lane_tree_sum(const float (&lanes)[kKeyBlock]) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// ---- portable path: the same chains, as a rounded multiply and a rounded add; std::exp ---------
namespace portable {

void transpose_keys(const float* keys, int64_t key_stride, int64_t count, int64_t D, float* block) {
  for (int64_t d = 0; d < D; ++d)
    for (int64_t j = 0; j < kKeyBlock; ++j) block[d * kKeyBlock + j] = j < count ? keys[j * key_stride + d] : 0.f;
}

void scores(const float* q, int64_t rows, const float* blocks, int64_t blocks_count, int64_t D,
            float scale, float* s, int64_t ld) {
  for (int64_t n = 0; n < blocks_count; ++n) {
    const float* block = blocks + n * block_floats(D);
    for (int64_t r = 0; r < rows; ++r) {
      float acc[kKeyBlock] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float qd = q[r * D + d];
        for (int64_t l = 0; l < kKeyBlock; ++l) acc[l] += qd * block[d * kKeyBlock + l];
      }
      for (int64_t l = 0; l < kKeyBlock; ++l) s[r * ld + n * kKeyBlock + l] = acc[l] * scale;
    }
  }
}

float softmax_row(float* s, int64_t lo, int64_t hi) {
  float m = kNegativeInfinity;
  for (int64_t j = lo; j <= hi; ++j) m = std::max(m, s[j]);
  float lanes[kKeyBlock] = {};
  for (int64_t j = lo; j <= hi; ++j) {
    s[j] = std::exp(s[j] - m);
    lanes[j % kKeyBlock] += s[j];
  }
  return lane_tree_sum(lanes);
}

void weigh_values(const float* w, int64_t ld, int64_t rows, const float* values, int64_t value_stride, int64_t count,
                  int64_t D, float* acc, int64_t acc_ld) {
  for (int64_t j = 0; j < count; ++j) {
    const float* v = values + j * value_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const float weight = w[r * ld + j];
      float* a = acc + r * acc_ld;
      for (int64_t d = 0; d < D; ++d) a[d] += weight * v[d];
    }
  }
}

const AttentionKernels kernels{transpose_keys, scores, softmax_row, weigh_values, 4, 4};

}  // namespace portable

#ifdef SPECENGINE_X86
// ---- AVX2 path: a 16-key block is two 256-bit vectors ---------------------------------------------
namespace avx2 {

SPECENGINE_AVX2 void transpose_keys(const float* keys, int64_t key_stride, int64_t count, int64_t D, float* block) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), none = _mm256_setzero_si256();
  for (int64_t half = 0; half < kKeyBlock; half += 8) {
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(8, D - d0))), lane);
      __m256 v[8];
      for (int j = 0; j < 8; ++j)  // a zero mask reads nothing (keys past count may lie past the cache)
        v[j] = _mm256_maskload_ps(keys + (half + j) * key_stride + d0, half + j < count ? valid : none);
      transpose8x8(v);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(block + (d0 + i) * kKeyBlock + half, v[i]);
    }
  }
}

// ROWS queries against NB blocks: 2 * ROWS * NB accumulators.
template <int ROWS, int NB>
SPECENGINE_AVX2 void score_tile(const float* q, const float* blocks, int64_t D, float scale, float* s,
                                int64_t ld) {
  __m256 acc[ROWS][NB][2];
  for (int r = 0; r < ROWS; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n][0] = acc[r][n][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m256 k[NB][2];
    for (int n = 0; n < NB; ++n) {
      k[n][0] = _mm256_loadu_ps(blocks + n * block_floats(D) + d * kKeyBlock);
      k[n][1] = _mm256_loadu_ps(blocks + n * block_floats(D) + d * kKeyBlock + 8);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m256 qd = _mm256_set1_ps(q[r * D + d]);
      for (int n = 0; n < NB; ++n) {
        acc[r][n][0] = _mm256_fmadd_ps(qd, k[n][0], acc[r][n][0]);
        acc[r][n][1] = _mm256_fmadd_ps(qd, k[n][1], acc[r][n][1]);
      }
    }
  }
  const __m256 scale_v = _mm256_set1_ps(scale);
  for (int r = 0; r < ROWS; ++r)
    for (int n = 0; n < NB; ++n) {
      _mm256_storeu_ps(s + r * ld + n * kKeyBlock, _mm256_mul_ps(acc[r][n][0], scale_v));
      _mm256_storeu_ps(s + r * ld + n * kKeyBlock + 8, _mm256_mul_ps(acc[r][n][1], scale_v));
    }
}

// At least 8 accumulators (two FMA units, 4 cycles each), at most 12 of the 16 registers.
template <int ROWS>
void score_rows(const float* q, const float* blocks, int64_t blocks_count, int64_t D, float scale,
                float* s, int64_t ld) {
  constexpr int NB = ROWS == 1 ? 4 : ROWS <= 3 ? 2 : 1;
  int64_t n = 0;
  for (; n + NB <= blocks_count; n += NB)
    score_tile<ROWS, NB>(q, blocks + n * block_floats(D), D, scale, s + n * kKeyBlock, ld);
  with_count<NB - 1>(blocks_count - n, [&](auto rest) {
    score_tile<ROWS, decltype(rest)::value>(q, blocks + n * block_floats(D), D, scale, s + n * kKeyBlock, ld);
  });
}

void scores(const float* q, int64_t rows, const float* blocks, int64_t blocks_count, int64_t D,
            float scale, float* s, int64_t ld) {
  with_count<6>(rows, [&](auto R) { score_rows<decltype(R)::value>(q, blocks, blocks_count, D, scale, s, ld); });
}

// Lanes [c0, c0 + 8) of a row that fall in [lo, hi], as a mask.
SPECENGINE_AVX2 inline __m256 lanes_within(int64_t c0, int64_t lo, int64_t hi) {
  const __m256i index =
      _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(c0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i before = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(lo)), index);
  const __m256i after = _mm256_cmpgt_epi32(index, _mm256_set1_epi32(static_cast<int>(hi)));
  return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_or_si256(before, after), _mm256_set1_epi32(-1)));
}

SPECENGINE_AVX2 float softmax_row(float* s, int64_t lo, int64_t hi) {
  const __m256 neg_inf = _mm256_set1_ps(kNegativeInfinity);
  const int64_t first = lo - lo % kKeyBlock;
  __m256 m = neg_inf;
  for (int64_t c0 = first; c0 <= hi; c0 += 8)
    m = _mm256_max_ps(m, _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(s + c0), lanes_within(c0, lo, hi)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const __m256 max = _mm256_set1_ps(_mm_cvtss_f32(m4));
  __m256 sums[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // lanes 0-7 and 8-15 of each block
  for (int64_t c0 = first; c0 <= hi; c0 += 8) {
    const __m256 x = _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(s + c0), lanes_within(c0, lo, hi));
    const __m256 e = exp_nonpositive(_mm256_sub_ps(x, max));
    _mm256_storeu_ps(s + c0, e);
    sums[(c0 / 8) % 2] = _mm256_add_ps(sums[(c0 / 8) % 2], e);
  }
  return horizontal_sum(_mm256_add_ps(sums[0], sums[1]));
}

// ROWS queries, NV 8-float vectors of D (the last masked by `last`): ROWS * NV accumulators.
template <int ROWS, int NV>
SPECENGINE_AVX2 void weigh_tile(const float* w, int64_t ld, const float* values, int64_t value_stride, int64_t count,
                                __m256i last, float* acc, int64_t acc_ld) {
  if (count <= 0) return;
  __m256 a[ROWS][NV];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < NV; ++c) a[r][c] = _mm256_loadu_ps(acc + r * acc_ld + c * 8);
  int64_t j = 0;  // a do-while, as in the AVX-512 weigh_tile
  do {
    const float* v = values + j * value_stride;
    __m256 vc[NV];
    for (int c = 0; c < NV; ++c) vc[c] = c == NV - 1 ? _mm256_maskload_ps(v + c * 8, last) : _mm256_loadu_ps(v + c * 8);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 weight = _mm256_set1_ps(w[r * ld + j]);
      for (int c = 0; c < NV; ++c) a[r][c] = _mm256_fmadd_ps(weight, vc[c], a[r][c]);
    }
  } while (++j < count);
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(acc + r * acc_ld + c * 8, a[r][c]);
}

SPECENGINE_AVX2 void weigh_values(const float* w, int64_t ld, int64_t rows, const float* values, int64_t value_stride,
                                  int64_t count, int64_t D, float* acc, int64_t acc_ld) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    const int64_t width = std::min<int64_t>(32, D - d0), vectors = (width + 7) / 8;
    const int tail = static_cast<int>(width - (vectors - 1) * 8);
    const __m256i last = _mm256_cmpgt_epi32(_mm256_set1_epi32(tail), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    with_count<3>(rows, [&](auto R) {
      with_count<4>(vectors, [&](auto NV) {
        weigh_tile<decltype(R)::value, decltype(NV)::value>(w, ld, values + d0, value_stride, count, last, acc + d0,
                                                            acc_ld);
      });
    });
  }
}

const AttentionKernels kernels{transpose_keys, scores, softmax_row, weigh_values, 6, 3};

}  // namespace avx2

// ---- AVX-512 path: a 16-key block is one vector -------------------------------------------------
namespace avx512 {

SPECENGINE_AVX512 void transpose_keys(const float* keys, int64_t key_stride, int64_t count, int64_t D, float* block) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, D - d0)) - 1);
    __m512 v[16];
    for (int j = 0; j < 16; ++j)  // a zero mask reads nothing (keys past count may lie past the cache)
      v[j] = _mm512_maskz_loadu_ps(j < count ? valid : __mmask16(0), keys + j * key_stride + d0);
    transpose16x16(v);
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(block + (d0 + i) * kKeyBlock, v[i]);
  }
}

// ROWS queries against NB blocks: ROWS * NB accumulators; per d, NB loads and ROWS broadcasts.
template <int ROWS, int NB>
SPECENGINE_AVX512 void score_tile(const float* q, const float* blocks, int64_t D, float scale, float* s,
                                  int64_t ld) {
  __m512 acc[ROWS][NB];
  for (int r = 0; r < ROWS; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 k[NB];
    for (int n = 0; n < NB; ++n) k[n] = _mm512_loadu_ps(blocks + n * block_floats(D) + d * kKeyBlock);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 qd = _mm512_set1_ps(q[r * D + d]);
      for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_fmadd_ps(qd, k[n], acc[r][n]);
    }
  }
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int r = 0; r < ROWS; ++r)
    for (int n = 0; n < NB; ++n) _mm512_storeu_ps(s + r * ld + n * kKeyBlock, _mm512_mul_ps(acc[r][n], scale_v));
}

// At least 8 accumulators (two FMA units, 4 cycles each), at most 24 of the 32 registers.
template <int ROWS>
void score_rows(const float* q, const float* blocks, int64_t blocks_count, int64_t D, float scale,
                float* s, int64_t ld) {
  constexpr int NB = ROWS <= 2 ? 8 : 4;
  int64_t n = 0;
  for (; n + NB <= blocks_count; n += NB)
    score_tile<ROWS, NB>(q, blocks + n * block_floats(D), D, scale, s + n * kKeyBlock, ld);
  with_count<NB - 1>(blocks_count - n, [&](auto rest) {
    score_tile<ROWS, decltype(rest)::value>(q, blocks + n * block_floats(D), D, scale, s + n * kKeyBlock, ld);
  });
}

void scores(const float* q, int64_t rows, const float* blocks, int64_t blocks_count, int64_t D,
            float scale, float* s, int64_t ld) {
  with_count<6>(rows, [&](auto R) { score_rows<decltype(R)::value>(q, blocks, blocks_count, D, scale, s, ld); });
}

// Lanes [c0, c0 + 16) of a row that fall in [lo, hi], as a mask.
inline __mmask16 lanes_within(int64_t c0, int64_t lo, int64_t hi) {
  const int64_t from = std::max<int64_t>(lo - c0, 0), to = std::min<int64_t>(hi - c0, 15);
  return static_cast<__mmask16>(((2u << to) - 1) & ~((1u << from) - 1));
}

// exp(x - max) stored at s, and added to the lane sums.
SPECENGINE_AVX512 inline void exp_into(float* s, __m512 x, __m512 max, __m512& sums) {
  const __m512 e = exp_nonpositive(_mm512_sub_ps(x, max));
  _mm512_storeu_ps(s, e);
  sums = _mm512_add_ps(sums, e);
}

// Masked loads (the hidden lanes -inf) only for the first and last blocks.
SPECENGINE_AVX512 float softmax_row(float* s, int64_t lo, int64_t hi) {
  const __m512 neg_inf = _mm512_set1_ps(kNegativeInfinity);
  const int64_t first = lo - lo % kKeyBlock, last = hi - hi % kKeyBlock;
  const __m512 head = _mm512_mask_loadu_ps(neg_inf, lanes_within(first, lo, hi), s + first);
  const __m512 tail = _mm512_mask_loadu_ps(neg_inf, lanes_within(last, lo, hi), s + last);
  __m512 m = _mm512_max_ps(head, tail);
  for (int64_t c0 = first + kKeyBlock; c0 < last; c0 += kKeyBlock) m = _mm512_max_ps(m, _mm512_loadu_ps(s + c0));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  __m512 sums = _mm512_setzero_ps();
  exp_into(s + first, head, max, sums);
  for (int64_t c0 = first + kKeyBlock; c0 < last; c0 += kKeyBlock) exp_into(s + c0, _mm512_loadu_ps(s + c0), max, sums);
  if (last > first) exp_into(s + last, tail, max, sums);
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums), 1));
  return horizontal_sum(_mm256_add_ps(_mm512_castps512_ps256(sums), high));
}

// ROWS queries, NV 16-float vectors of D (the last masked by `last`): ROWS * NV accumulators; per
// key, NV loads and ROWS broadcasts.
template <int ROWS, int NV>
SPECENGINE_AVX512 void weigh_tile(const float* w, int64_t ld, const float* values, int64_t value_stride,
                                  int64_t count, __mmask16 last, float* acc, int64_t acc_ld) {
  if (count <= 0) return;
  __m512 a[ROWS][NV];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < NV; ++c) a[r][c] = _mm512_loadu_ps(acc + r * acc_ld + c * 16);
  // A do-while: with a loop that may run zero times, GCC 12 kept a copy of every accumulator in
  // memory and stored all of them on each key.
  int64_t j = 0;
  do {
    const float* v = values + j * value_stride;
    __m512 vc[NV];
    for (int c = 0; c < NV; ++c) vc[c] = _mm512_maskz_loadu_ps(c == NV - 1 ? last : __mmask16(0xFFFF), v + c * 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 weight = _mm512_set1_ps(w[r * ld + j]);
      for (int c = 0; c < NV; ++c) a[r][c] = _mm512_fmadd_ps(weight, vc[c], a[r][c]);
    }
  } while (++j < count);
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + r * acc_ld + c * 16, a[r][c]);
}

SPECENGINE_AVX512 void weigh_values(const float* w, int64_t ld, int64_t rows, const float* values,
                                    int64_t value_stride, int64_t count, int64_t D, float* acc, int64_t acc_ld) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t width = std::min<int64_t>(64, D - d0), vectors = (width + 15) / 16;
    const __mmask16 last = static_cast<__mmask16>((1u << (width - (vectors - 1) * 16)) - 1);
    with_count<6>(rows, [&](auto R) {
      with_count<4>(vectors, [&](auto NV) {
        weigh_tile<decltype(R)::value, decltype(NV)::value>(w, ld, values + d0, value_stride, count, last, acc + d0,
                                                            acc_ld);
      });
    });
  }
}

const AttentionKernels kernels{transpose_keys, scores, softmax_row, weigh_values, 6, 6};

}  // namespace avx512
#endif  // SPECENGINE_X86

const AttentionKernels& attention_kernels() {
#ifdef SPECENGINE_X86
  if (use_avx512()) return avx512::kernels;
  if (use_avx2()) return avx2::kernels;
#endif
  return portable::kernels;
}

// ---- attention over units of queries ------------------------------------------------------------

// What one (row, token, head) query attends with.
struct Item {
  const float* q;     // [D]
  const float* cos;   // [D] rotary tables for q, or nullptr: q as it is
  const float* sin;   // [D]
  int64_t kv_head;
  int64_t lo;         // its first visible key
  const float* bias;  // its score bias for key j at bias[j * bias_stride], or nullptr: none
  int64_t bias_stride;
};

// A query of a unit that sees keys lo..hi (>= lo) of its row.
struct Query {
  int64_t lo, hi;
  const float* bias;  // as in Item
  int64_t bias_stride;
  float* out;         // [D]
};

// Tokens [t0, t1) of row b times the query heads of kv head kv_head, and the keys they see in
// all (cost: the unit's share of the work, for ordering).
struct Unit {
  int64_t b, kv_head, t0, t1, cost;
};

// One thread's buffers, kept between calls (growing only).
struct Scratch {
  std::vector<Query> queries;
  std::vector<float> q;           // [queries, D] rotated
  std::vector<float> s;           // [queries, ld] scores, then weights, from key `base`
  std::vector<float> acc;         // [queries, acc_ld] weighted sums of values
  std::vector<float> totals;      // [queries] sums of the weights
  std::vector<float> key_blocks;  // a unit's own transposed keys
};

Scratch& thread_scratch() {
  static thread_local Scratch scratch;
  return scratch;
}

// The transposed keys of a call: key blocks of (row b, kv head) at ((b * Hkv + kv_head) * blocks
// + n) * block_floats(D). Kept per calling thread between calls (a prefill's layers reuse it).
float* transposed_keys(int64_t count) {
  static thread_local std::vector<float> storage;
  if (storage.size() < static_cast<size_t>(count)) storage.resize(static_cast<size_t>(count));
  return storage.data();
}

// Asks for rows [0, count) (row j at j * stride, D floats each) to be brought into the cache.
inline void prefetch_rows(const float* rows, int64_t stride, int64_t count, int64_t D) {
  for (int64_t j = 0; j < count; ++j)
    for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(rows + j * stride + d);
}

// Key blocks [first, last] of one kv head of a row (key j at keys + j * stride, its value at
// values + j * stride; kv_len keys) transposed into blocks, consecutive. A decode step's keys
// and values come from memory (the layer's weights have streamed through the caches since the
// last step), and the transposition reads 16 rows a line at a time, which the hardware
// prefetchers follow late: so the keys are asked for two blocks ahead and each block's values as
// it is transposed (in whole decode steps at context 64 on the Zen 5 VM, this halved the
// transposition's time).
void transpose_own_keys(const AttentionKernels& kernels, const float* keys, const float* values, int64_t stride,
                        int64_t first, int64_t last, int64_t kv_len, int64_t D, float* blocks) {
  constexpr int64_t kAhead = 2 * kKeyBlock;
  prefetch_rows(keys + first * kKeyBlock * stride, stride, std::min(kAhead, kv_len - first * kKeyBlock), D);
  for (int64_t n = first; n <= last; ++n) {
    const int64_t key = n * kKeyBlock, count = std::min(kKeyBlock, kv_len - key);
    if (key + kAhead < kv_len)
      prefetch_rows(keys + (key + kAhead) * stride, stride, std::min(kKeyBlock, kv_len - key - kAhead), D);
    prefetch_rows(values + key * stride, stride, count, D);
    kernels.transpose_keys(keys + key * stride, stride, count, D, blocks + (n - first) * block_floats(D));
  }
}

// One unit's queries into out. keys, values: its row's kv head at key 0 (key j at j * Hkv * D);
// key_blocks: the keys transposed (block n at n * block_floats(D)), or nullptr: the unit
// transposes the blocks it sees itself (when no other unit shares them).
template <typename ItemOf>
void attend_unit(const AttentionKernels& kernels, const Unit& unit, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                 const int64_t* positions, const float* keys, const float* key_blocks, const float* values,
                 int64_t kv_len, float scale, float* out, const ItemOf& item_of) {
  Scratch& scratch = thread_scratch();
  const int64_t group = H / Hkv, h0 = unit.kv_head * group, stride = Hkv * D;
  std::vector<Query>& queries = scratch.queries;
  queries.clear();
  scratch.q.resize(static_cast<size_t>((unit.t1 - unit.t0) * group * D));
  // The queries that see a key, token by token, each token's heads in order; the others get zeros.
  for (int64_t t = unit.t0; t < unit.t1; ++t) {
    const int64_t bt = unit.b * T + t, p = positions[bt], hi = std::min(p, kv_len - 1);
    for (int64_t h = h0; h < h0 + group; ++h) {
      const Item item = item_of(bt, h, p);
      float* o = out + (bt * H + h) * D;
      if (hi < item.lo) {
        std::fill(o, o + D, 0.f);
        continue;
      }
      float* q = scratch.q.data() + static_cast<int64_t>(queries.size()) * D;
      if (item.cos != nullptr) {
        rotate(item.q, item.cos, item.sin, q, D);
      } else {
        std::copy(item.q, item.q + D, q);
      }
      queries.push_back(Query{item.lo, hi, item.bias, item.bias_stride, o});
    }
  }
  const int64_t M = static_cast<int64_t>(queries.size());
  if (M == 0) return;
  // The keys seen by rows [r0, r1): all of them (first, last), and by every one (shared).
  auto first_seen = [&](int64_t r0, int64_t r1) {
    int64_t key = queries[r0].lo;
    for (int64_t r = r0 + 1; r < r1; ++r) key = std::min(key, queries[r].lo);
    return key;
  };
  auto last_seen = [&](int64_t r0, int64_t r1) {
    int64_t key = queries[r0].hi;
    for (int64_t r = r0 + 1; r < r1; ++r) key = std::max(key, queries[r].hi);
    return key;
  };
  auto shared_first = [&](int64_t r0, int64_t r1) {
    int64_t key = queries[r0].lo;
    for (int64_t r = r0 + 1; r < r1; ++r) key = std::max(key, queries[r].lo);
    return key;
  };
  auto shared_last = [&](int64_t r0, int64_t r1) {
    int64_t key = queries[r0].hi;
    for (int64_t r = r0 + 1; r < r1; ++r) key = std::min(key, queries[r].hi);
    return key;
  };
  const int64_t first_key = first_seen(0, M), last_key = last_seen(0, M);
  const int64_t base = first_key - first_key % kKeyBlock;  // rows of s start at key `base`
  const int64_t ld = ((last_key - base) / kKeyBlock + 1) * kKeyBlock;
  const int64_t acc_ld = (D + 15) / 16 * 16;
  scratch.s.resize(static_cast<size_t>(M * ld));
  scratch.acc.assign(static_cast<size_t>(M * acc_ld), 0.f);
  scratch.totals.resize(static_cast<size_t>(M));
  float* s = scratch.s.data();
  float* acc = scratch.acc.data();
  int64_t first_block = 0;  // key_blocks' first block
  if (key_blocks == nullptr) {
    first_block = first_key / kKeyBlock;
    const int64_t last_block = last_key / kKeyBlock;
    scratch.key_blocks.resize(static_cast<size_t>((last_block + 1 - first_block) * block_floats(D)));
    transpose_own_keys(kernels, keys, values, stride, first_block, last_block, kv_len, D, scratch.key_blocks.data());
    key_blocks = scratch.key_blocks.data();
  }

  // 1. Scores of each tile of rows against the key blocks any of them sees.
  for (int64_t r0 = 0; r0 < M; r0 += kernels.score_rows) {
    const int64_t r1 = std::min(M, r0 + kernels.score_rows);
    const int64_t from = first_seen(r0, r1) / kKeyBlock, to = last_seen(r0, r1) / kKeyBlock;
    kernels.scores(scratch.q.data() + r0 * D, r1 - r0, key_blocks + (from - first_block) * block_floats(D),
                   to - from + 1, D, scale, s + r0 * ld + from * kKeyBlock - base, ld);
  }
  // 2. Each row's softmax over its own keys (bias first), in place.
  for (int64_t r = 0; r < M; ++r) {
    const Query& query = queries[r];
    float* row = s + r * ld - base;  // row[j]: key j
    if (query.bias != nullptr)
      for (int64_t j = query.lo; j <= query.hi; ++j) row[j] += query.bias[j * query.bias_stride];
    scratch.totals[r] = kernels.softmax_row(s + r * ld, query.lo - base, query.hi - base);
  }
  // 3. Weighted values: a tile of rows runs the keys all of them see together, each row its own
  // keys before and after alone, so every row's chain over its keys stays in key order.
  auto weigh = [&](int64_t r, int64_t rows, int64_t from, int64_t to) {
    if (to < from) return;
    kernels.weigh_values(s + r * ld + from - base, ld, rows, values + from * stride, stride, to - from + 1, D,
                         acc + r * acc_ld, acc_ld);
  };
  for (int64_t r0 = 0; r0 < M; r0 += kernels.value_rows) {
    const int64_t r1 = std::min(M, r0 + kernels.value_rows);
    const int64_t from = shared_first(r0, r1), to = shared_last(r0, r1);
    if (from > to) {
      for (int64_t r = r0; r < r1; ++r) weigh(r, 1, queries[r].lo, queries[r].hi);
      continue;
    }
    for (int64_t r = r0; r < r1; ++r) weigh(r, 1, queries[r].lo, from - 1);
    weigh(r0, r1 - r0, from, to);
    for (int64_t r = r0; r < r1; ++r) weigh(r, 1, to + 1, queries[r].hi);
  }
  for (int64_t r = 0; r < M; ++r) {
    const float inv = 1.f / scratch.totals[r];
    float* o = queries[r].out;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[r * acc_ld + d] * inv;
  }
}

// Every query's attention into out [B, T, H, D]: item_of(bt, h, p) says what query (row-token bt,
// head h, position p) attends with; it sees keys item.lo..min(p, kv_len - 1) of its row (none:
// zeros). Keys and values: row b at b * cache_row_stride, [*, Hkv, D] per row.
template <typename ItemOf>
void attend_items(int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, const int64_t* positions,
                  const float* cache_k, const float* cache_v, int64_t cache_row_stride, int64_t kv_len, float scale,
                  float* out, ItemOf item_of) {
  if (B * T == 0) return;
  const AttentionKernels& kernels = attention_kernels();
  const int64_t group = H / Hkv, tokens_per_unit = std::max<int64_t>(1, kUnitQueries / group);
  // Units, their cost the keys their queries see; and the keys each row's queries see in all,
  // whose blocks are transposed.
  std::vector<Unit> units;
  std::vector<int64_t> row_first(static_cast<size_t>(B), kv_len), row_last(static_cast<size_t>(B), -1);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t0 = 0; t0 < T; t0 += tokens_per_unit) {
      const int64_t t1 = std::min(T, t0 + tokens_per_unit);
      for (int64_t kv_head = 0; kv_head < Hkv; ++kv_head) {
        int64_t cost = 0;
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t bt = b * T + t, p = positions[bt], hi = std::min(p, kv_len - 1);
          for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
            const int64_t lo = item_of(bt, h, p).lo;
            if (hi < lo) continue;
            cost += hi - lo + 1 + kKeyBlock;
            row_first[b] = std::min(row_first[b], lo);
            row_last[b] = std::max(row_last[b], hi);
          }
        }
        units.push_back(Unit{b, kv_head, t0, t1, cost});
      }
    }
  }
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
  // Keys that several units read (a row's tokens in more than one unit) are transposed once, up
  // front; a unit alone on its keys (decoding, verification) transposes them itself, into the
  // cache of the core that reads them.
  const bool shared_keys = T > tokens_per_unit;
  const int64_t blocks = (kv_len + kKeyBlock - 1) / kKeyBlock, block_size = block_floats(D), stride = Hkv * D;
  const int64_t transposes = shared_keys ? B * Hkv * blocks : 0, unit_count = static_cast<int64_t>(units.size());
  float* key_blocks = shared_keys ? transposed_keys(transposes * block_size) : nullptr;
#pragma omp parallel if (B * T * H * kv_len * D > kParallelWork)
  {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < transposes; ++task) {
      const int64_t n = task % blocks, b = task / blocks / Hkv, kv_head = task / blocks % Hkv;
      if (row_last[b] < row_first[b] || n < row_first[b] / kKeyBlock || n > row_last[b] / kKeyBlock) continue;
      kernels.transpose_keys(cache_k + b * cache_row_stride + n * kKeyBlock * stride + kv_head * D, stride,
                             std::min(kKeyBlock, kv_len - n * kKeyBlock), D, key_blocks + task * block_size);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < unit_count; ++index) {
      const Unit& unit = units[static_cast<size_t>(index)];
      const int64_t offset = unit.b * cache_row_stride + unit.kv_head * D;
      attend_unit(kernels, unit, T, H, Hkv, D, positions, cache_k + offset,
                  shared_keys ? key_blocks + (unit.b * Hkv + unit.kv_head) * blocks * block_size : nullptr,
                  cache_v + offset, kv_len, scale, out, item_of);
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
  // 1: rotated keys and values into the cache, every write before any read below, so a query also
  // sees the keys of its own call (in token order: padding tokens share the spill slot, the last wins).
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t slot = std::min(positions[bt], capacity);
    float* k_dst = cache_k + (bt / T) * cache_row_stride + slot * Hkv * D;
    float* v_dst = cache_v + (bt / T) * cache_row_stride + slot * Hkv * D;
    for (int64_t h = 0; h < Hkv; ++h)
      rotate(k + bt * k_token_stride + h * D, cos + bt * D, sin + bt * D, k_dst + h * D, D);
    std::copy(v + bt * v_token_stride, v + bt * v_token_stride + Hkv * D, v_dst);
  }
  // 2: the queries, rotated as their units take them.
  attend_items(B, T, H, Hkv, D, positions, cache_k, cache_v, cache_row_stride, kv_len,
               1.f / std::sqrt(static_cast<float>(D)), out, [&](int64_t bt, int64_t h, int64_t p) {
                 const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
                 return Item{q + bt * q_token_stride + h * D, cos + bt * D, sin + bt * D, h / group, lo, nullptr, 0};
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
                 return Item{q + bt * q_token_stride + h * D, nullptr, nullptr, h, 0, bias, -H};
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
