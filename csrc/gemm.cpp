// Prompt-sized products with bfloat16 weights on AMX tiles, accurate to float32 (see gemm.h).
//
// Why: a prefill is compute-bound, and one AMX bfloat16 tile product does 16 x 16 x 32
// multiply-adds, far more a cycle than float32 FMAs on the weights widened to float32 (oneDNN's
// sgemm). Three of them per step (x split in three bfloat16 terms) keep the result as accurate as
// a float32 sum, and still run several times an sgemm's rate on prompt-sized products
// (measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md).
//
// Layout of one step (k advances by 32): result tiles C0, C1 (16 rows x 16 float32 columns
// each) += A (16 rows x 32 bfloat16 of one term of x) . B0, B1 (32 k x 16 columns of weights,
// stored as 16 rows of 16 (k, k+1) pairs: the "VNNI" order the tile product reads).
#include "gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_features.h"
#ifdef _OPENMP
#include <omp.h>
#endif

namespace specengine {

bool gemm_amx_available() { return use_amx(); }

#ifdef SPECENGINE_HAS_AMX
namespace {

constexpr int64_t kTileRows = 16;   // rows of x per result tile, and float32 columns per result tile
constexpr int64_t kStepK = 32;      // bfloat16 k per tile row (64 bytes)
constexpr int64_t kBlockCols = 32;  // output columns per work item: two result tiles
constexpr int kTerms = 3;           // bfloat16 terms of x: 3 x 8 bits of significand cover float32's 24

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// v rounded to the nearest bfloat16 (ties to even), as float32 bits whose low half is zero.
SPECENGINE_AMX inline __m512i round_to_bfloat16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return _mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

// Row r of x [R, K] as its three bfloat16 terms: terms[t][r] ([kTerms, Rp, Kp], zeros past K).
// Each term is the rounding of what the previous ones left, a difference float32 holds exactly.
SPECENGINE_AMX void split_row(const float* x, int64_t K, int64_t Kp, int64_t Rp, int64_t r, uint16_t* terms) {
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 valid = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
    __m512 rest = _mm512_maskz_loadu_ps(valid, x + r * K + k);
    for (int t = 0; t < kTerms; ++t) {
      const __m512i term = round_to_bfloat16(rest);
      rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(term));
      // k + 16 <= Kp: the row has room for the whole vector (zeros past K).
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(terms + (t * Rp + r) * Kp + k),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(term, 16)));
    }
  }
}

// The weights of output columns c0..c0+15 (those below N) as one B operand per k step:
// packed[kk][n] = (w[c0 + n][2kk], w[c0 + n][2kk + 1]) for kk < Kp / 2, zero past K or N.
SPECENGINE_AMX void pack_columns(const uint16_t* w, int64_t K, int64_t Kp, int64_t N, int64_t c0, uint32_t* packed) {
  const int64_t columns = std::clamp<int64_t>(N - c0, 0, kTileRows);
  int64_t kk = 0;
  if (K % 2 == 0 && columns > 0) {  // pair kk of the 16 columns is one gather
    const __mmask16 valid = columns == 16 ? __mmask16(0xFFFF) : __mmask16((1u << columns) - 1);
    const __m512i row_bytes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                 _mm512_set1_epi32(static_cast<int>(2 * K)));
    const char* base = reinterpret_cast<const char*>(w + c0 * K);
    for (; kk < K / 2; ++kk)
      _mm512_store_si512(packed + kk * 16,
                         _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, row_bytes, base + 4 * kk, 1));
  } else {
    for (; kk < (K + 1) / 2; ++kk)
      for (int64_t n = 0; n < kTileRows; ++n) {
        uint32_t pair = 0;
        if (n < columns) {
          const uint16_t* row = w + (c0 + n) * K;
          pair = row[2 * kk] | (2 * kk + 1 < K ? static_cast<uint32_t>(row[2 * kk + 1]) << 16 : 0u);
        }
        packed[kk * 16 + n] = pair;
      }
  }
  std::memset(packed + kk * 16, 0, static_cast<size_t>(Kp / 2 - kk) * 16 * sizeof(uint32_t));
}

SPECENGINE_AMX void column_blocks(const uint16_t* terms, const uint16_t* w, const float* bias, float* out, int64_t R,
                                  int64_t Rp, int64_t K, int64_t Kp, int64_t N) {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
  const int64_t tile_bytes = (Kp / 2) * 16 * sizeof(uint32_t);
  uint32_t* packed = static_cast<uint32_t*>(std::aligned_alloc(64, 2 * tile_bytes));
  uint32_t* packed1 = packed + (Kp / 2) * 16;  // the second result tile's columns
  alignas(64) float result[kTileRows * kTileRows];
  const int64_t blocks = (N + kBlockCols - 1) / kBlockCols;
  const int64_t term_stride = Rp * Kp, row_bytes = Kp * sizeof(uint16_t);
#pragma omp for schedule(static)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t n0 = block * kBlockCols;
    pack_columns(w, K, Kp, N, n0, packed);
    pack_columns(w, K, Kp, N, n0 + kTileRows, packed1);
    for (int64_t m0 = 0; m0 < Rp; m0 += kTileRows) {
      _tile_zero(0);
      _tile_zero(1);
      const uint16_t* a = terms + m0 * Kp;
      static_assert(kTerms == 3, "the step below loads and multiplies three terms");
      for (int64_t k = 0; k < Kp; k += kStepK) {
        _tile_loadd(4, packed + (k / 2) * 16, 64);
        _tile_loadd(5, packed1 + (k / 2) * 16, 64);
        // The smallest term first: the running sums grow from the small contributions up.
        _tile_loadd(2, a + 2 * term_stride + k, row_bytes);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 2, 5);
        _tile_loadd(3, a + term_stride + k, row_bytes);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_loadd(6, a + k, row_bytes);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(1, 6, 5);
      }
      for (int half = 0; half < 2; ++half) {
        if (half == 0) {
          _tile_stored(0, result, kTileRows * sizeof(float));
        } else {
          _tile_stored(1, result, kTileRows * sizeof(float));
        }
        const int64_t c0 = n0 + half * kTileRows;
        const int64_t columns = std::clamp<int64_t>(N - c0, 0, kTileRows);
        for (int64_t i = 0; i < kTileRows && m0 + i < R; ++i)
          for (int64_t j = 0; j < columns; ++j)
            out[(m0 + i) * N + c0 + j] = result[i * kTileRows + j] + (bias ? bias[c0 + j] : 0.f);
      }
    }
  }
  std::free(packed);
  _tile_release();
}

}  // namespace

void gemm_bf16_weight_amx(const float* x, const uint16_t* w, const float* bias, float* out, int64_t R, int64_t K,
                          int64_t N) {
  if (R == 0 || N == 0) return;
  const int64_t Rp = (R + kTileRows - 1) / kTileRows * kTileRows, Kp = (K + kStepK - 1) / kStepK * kStepK;
  std::vector<uint16_t> terms(static_cast<size_t>(kTerms * Rp * Kp), 0);
  // Below this many multiply-adds a second thread costs more to wake than it saves.
  const bool parallel = R * K * N >= (int64_t{1} << 20);
#pragma omp parallel if (parallel)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) split_row(x, K, Kp, Rp, r, terms.data());
    column_blocks(terms.data(), w, bias, out, R, Rp, K, Kp, N);
  }
}
#else
void gemm_bf16_weight_amx(const float*, const uint16_t*, const float*, float*, int64_t, int64_t, int64_t) {
  throw std::logic_error("gemm_bf16_weight_amx: this build has no AMX code (check gemm_amx_available())");
}
#endif

}  // namespace specengine
