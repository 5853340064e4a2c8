// Few-row matrix products with bfloat16 weights (see linear.h).
//
// Work is split over output columns (by linear_blocks): each thread owns a slice of the weight
// matrix and streams it once, computing every row of x against a few weight rows at a time while
// those rows sit in L1. x (at most a few rows of a few KB) stays in L2 for the whole call.
// One row is bound by memory bandwidth, a few rows by the FMA units (measured: see
// bench/results/kernel-tuning-2026-11-29-to-12-03.md). CPUs with AVX-512 take 512-bit tiles of the same loop order.
#include "linear.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_features.h"
#include "vector_math.h"

namespace specengine {
namespace {

// How far ahead of the tile being computed its thread's weight stream is prefetched, into L2.
// The stream is one contiguous run of rows per thread, yet the hardware prefetchers alone leave
// it well short of the memory's bandwidth; 16 KB ahead into L2 was the best distance measured,
// and better than any prefetch into L1 (measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md).
constexpr int64_t kPrefetchBytes = 16384;

// Weight rows between a tile's first row and the row it prefetches (rows of K bfloat16 weights).
inline int64_t prefetch_rows(int64_t K) { return (kPrefetchBytes + 2 * K - 1) / (2 * K); }

inline float bf16_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &widened, sizeof f);
  return f;
}

// Portable path (any CPU): the same loop order, left to the compiler to vectorise.
void columns_generic(const float* x, const uint16_t* w, const float* bias, float* out, int64_t R, int64_t K,
                     int64_t N, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint16_t* wn = w + n * K;
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + r * K;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += xr[k] * bf16_to_float(wn[k]);
      out[r * N + n] = acc + (bias ? bias[n] : 0.f);
    }
  }
}

#ifdef SPECENGINE_X86
// Sixteen bfloat16 weights are one 256-bit load. Each 32-bit lane holds an even-indexed
// weight in its low half and the next odd one in its high half, so a shift and a mask give
// both as float32 without a shuffle. x is stored de-interleaved to match (see
// deinterleave_x): per block of 16, its 8 even-indexed then its 8 odd-indexed entries.
//
// ROWS rows of x against COLS weight rows: ROWS * COLS independent accumulators.
template <int ROWS, int COLS>
SPECENGINE_AVX2 void tile(const float* x, const float* x_split, int64_t K16, const uint16_t* w, const float* bias,
                          float* out, int64_t K, int64_t N, int64_t r0, int64_t n0) {
  __m256 acc[ROWS][COLS];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_setzero_ps();
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  // Weight rows kPrefetchBytes ahead, fetched while this tile computes (see kPrefetchBytes).
  const int64_t ahead = prefetch_rows(K);
  const uint16_t* next = w + (n0 + ahead) * K;
  const bool prefetch = n0 + ahead + COLS <= N;
  for (int64_t k = 0; k < K16; k += 16) {
    if (prefetch && (k & 31) == 0)  // one 64-byte line of each row per two steps
      for (int j = 0; j < COLS; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * K + k), _MM_HINT_T1);
    __m256 w_even[COLS], w_odd[COLS];
    for (int j = 0; j < COLS; ++j) {
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n0 + j) * K + k));
      w_even[j] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      w_odd[j] = _mm256_castsi256_ps(_mm256_and_si256(raw, high_half));
    }
    for (int i = 0; i < ROWS; ++i) {
      __m256 x_even = _mm256_loadu_ps(x_split + (r0 + i) * K16 + k);
      __m256 x_odd = _mm256_loadu_ps(x_split + (r0 + i) * K16 + k + 8);
      for (int j = 0; j < COLS; ++j) {
        acc[i][j] = _mm256_fmadd_ps(x_even, w_even[j], acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(x_odd, w_odd[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < ROWS; ++i) {
    for (int j = 0; j < COLS; ++j) {
      float sum = horizontal_sum(acc[i][j]);
      for (int64_t k = K16; k < K; ++k) sum += x[(r0 + i) * K + k] * bf16_to_float(w[(n0 + j) * K + k]);
      out[(r0 + i) * N + n0 + j] = sum + (bias ? bias[n0 + j] : 0.f);
    }
  }
}

template <int COLS>
SPECENGINE_AVX2 void column_group(const float* x, const float* x_split, int64_t K16, const uint16_t* w,
                                  const float* bias, float* out, int64_t R, int64_t K, int64_t N, int64_t n0) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) tile<4, COLS>(x, x_split, K16, w, bias, out, K, N, r, n0);
  switch (R - r) {
    case 3: tile<3, COLS>(x, x_split, K16, w, bias, out, K, N, r, n0); break;
    case 2: tile<2, COLS>(x, x_split, K16, w, bias, out, K, N, r, n0); break;
    case 1: tile<1, COLS>(x, x_split, K16, w, bias, out, K, N, r, n0); break;
    default: break;
  }
}

SPECENGINE_AVX2 void columns_avx2(const float* x, const float* x_split, const uint16_t* w, const float* bias,
                                  float* out, int64_t R, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t K16 = K & ~int64_t{15};
  int64_t n = n_begin;
  if (R == 1)  // more weight rows in flight where x has no rows to reuse them on
    for (; n + 4 <= n_end; n += 4) column_group<4>(x, x_split, K16, w, bias, out, R, K, N, n);
  for (; n + 2 <= n_end; n += 2) column_group<2>(x, x_split, K16, w, bias, out, R, K, N, n);
  if (n < n_end) column_group<1>(x, x_split, K16, w, bias, out, R, K, N, n);
}

// x [R, K] -> split [R, K & ~(block - 1)]: per block, its even-indexed entries, then its odd ones
// (block 16 for the AVX2 tiles, 32 for the AVX-512 ones).
void deinterleave_x(const float* x, int64_t R, int64_t K, int64_t block, std::vector<float>& split) {
  const int64_t whole = K & ~(block - 1), half = block / 2;
  if (split.size() < static_cast<size_t>(R * whole)) split.resize(static_cast<size_t>(R * whole));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < whole; k += block)
      for (int64_t i = 0; i < half; ++i) {
        split[r * whole + k + i] = x[r * K + k + 2 * i];
        split[r * whole + k + half + i] = x[r * K + k + 2 * i + 1];
      }
}

// The AVX-512 form of tile: 32 bfloat16 weights per 512-bit load, x de-interleaved per block
// of 32. Twice the lanes per FMA matter from two rows on (a verification of gamma + 1 tokens),
// where the AVX2 tiles made the product FMA-bound on top of the weight stream.
template <int ROWS, int COLS>
SPECENGINE_AVX512 void tile512(const float* x, const float* x_split, int64_t K32, const uint16_t* w,
                               const float* bias, float* out, int64_t K, int64_t N, int64_t r0, int64_t n0) {
  __m512 acc[ROWS][COLS];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t ahead = prefetch_rows(K);
  const uint16_t* next = w + (n0 + ahead) * K;
  const bool prefetch = n0 + ahead + COLS <= N;
  for (int64_t k = 0; k < K32; k += 32) {
    if (prefetch)  // one 64-byte line of each row per step
      for (int j = 0; j < COLS; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * K + k), _MM_HINT_T1);
    __m512 w_even[COLS], w_odd[COLS];
    for (int j = 0; j < COLS; ++j) {
      __m512i raw = _mm512_loadu_si512(reinterpret_cast<const void*>(w + (n0 + j) * K + k));
      w_even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      w_odd[j] = _mm512_castsi512_ps(_mm512_and_si512(raw, high_half));
    }
    for (int i = 0; i < ROWS; ++i) {
      __m512 x_even = _mm512_loadu_ps(x_split + (r0 + i) * K32 + k);
      __m512 x_odd = _mm512_loadu_ps(x_split + (r0 + i) * K32 + k + 16);
      for (int j = 0; j < COLS; ++j) {
        acc[i][j] = _mm512_fmadd_ps(x_even, w_even[j], acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(x_odd, w_odd[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < ROWS; ++i) {
    for (int j = 0; j < COLS; ++j) {
      float sum = _mm512_reduce_add_ps(acc[i][j]);
      for (int64_t k = K32; k < K; ++k) sum += x[(r0 + i) * K + k] * bf16_to_float(w[(n0 + j) * K + k]);
      out[(r0 + i) * N + n0 + j] = sum + (bias ? bias[n0 + j] : 0.f);
    }
  }
}

template <int COLS>
SPECENGINE_AVX512 void column_group512(const float* x, const float* x_split, int64_t K32, const uint16_t* w,
                                       const float* bias, float* out, int64_t R, int64_t K, int64_t N, int64_t n0) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) tile512<4, COLS>(x, x_split, K32, w, bias, out, K, N, r, n0);
  switch (R - r) {
    case 3: tile512<3, COLS>(x, x_split, K32, w, bias, out, K, N, r, n0); break;
    case 2: tile512<2, COLS>(x, x_split, K32, w, bias, out, K, N, r, n0); break;
    case 1: tile512<1, COLS>(x, x_split, K32, w, bias, out, K, N, r, n0); break;
    default: break;
  }
}

SPECENGINE_AVX512 void columns_avx512(const float* x, const float* x_split, const uint16_t* w, const float* bias,
                                      float* out, int64_t R, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t K32 = K & ~int64_t{31};
  int64_t n = n_begin;
  for (; n + 4 <= n_end; n += 4) column_group512<4>(x, x_split, K32, w, bias, out, R, K, N, n);
  for (; n + 2 <= n_end; n += 2) column_group512<2>(x, x_split, K32, w, bias, out, R, K, N, n);
  if (n < n_end) column_group512<1>(x, x_split, K32, w, bias, out, R, K, N, n);
}

#endif

}  // namespace

void linear_bf16_columns(VectorPath path, const float* x, const uint16_t* w, const float* bias, float* out,
                         int64_t R, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
#ifdef SPECENGINE_X86
  // Each thread de-interleaves x for its own slice: R * K floats against its (n_end - n_begin) * K weights.
  thread_local std::vector<float> x_split;
  if (path == VectorPath::avx512) {
    deinterleave_x(x, R, K, 32, x_split);
    return columns_avx512(x, x_split.data(), w, bias, out, R, K, N, n_begin, n_end);
  }
  if (path == VectorPath::avx2) {
    deinterleave_x(x, R, K, 16, x_split);
    return columns_avx2(x, x_split.data(), w, bias, out, R, K, N, n_begin, n_end);
  }
#endif
  columns_generic(x, w, bias, out, R, K, N, n_begin, n_end);
}

}  // namespace specengine
