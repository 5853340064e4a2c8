// Products and lookups over matrices stored as ggml blocks (see blocks.h).
//
// Decoding streams every weight once per step, so the bytes read set the speed, and a block
// format reads fewer of them than bfloat16 (Q4_1: 5 bits a weight against 16). What it costs
// instead is the arithmetic that turns a block into float32 weights, paid once per weight per
// row tile: a group of weight rows has its blocks dequantized into registers and multiplied
// against all rows of x at once (up to the width's kDirectRows), or, past them, dequantized once
// into an L1 buffer that tiles of rows run over. That design is written once
// (blocks_simd.inc) and compiled at two widths, AVX2 and AVX-512, each with its formats'
// decoders and the choices its measurements made (how many rows a register tile takes, whether
// scales are converted ahead, the buffered tiles' shape).
//
// AVX-512's 4- and 5-bit formats dequantize through a table: a block's (or sub-block's) weights
// take only 16 (32) values, d * q + m for q = 0..15, one 512-bit register (two) built by one FMA,
// which is exact here (see exact_affine); each weight is then a lookup (vpermps; vpermt2ps)
// indexed by its nibble, which ignores the bits above the index, so nibbles need no masking.
// AVX2 has no 16-entry lookup (its vpermps indexes 8 lanes): a nibble becomes a weight by
// widening, a conversion and one exact FMA.
//
// Every path (AVX-512, AVX2, portable) sums a row's products in one order of its own, the same
// for any R and whether its weights came from registers or the buffer: per (row of x, weight
// row), a vector of partial sums over k in steps of its width, reduced in a fixed order, then
// the float types' tail past the last 32 weights, then the bias. So a row's result does not
// depend on the rows beside it (blocks.h: batch invariance).
#include "blocks.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_features.h"
#include "linear.h"
#ifdef _OPENMP
#include <omp.h>
#endif

namespace specengine {

namespace {

#define SPECENGINE_INLINE inline __attribute__((always_inline))

// Weight rows per group: dequantized together, each thread's rows a whole number of groups.
constexpr int64_t kGroupRows = 4;
// The products' vectors of partial sums cover k in steps of 32 weights (a legacy block); the
// float types' last K % 32 weights are summed one by one.
constexpr int64_t kStep = 32;

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// IEEE half -> float, exact (as numpy's astype(float32)), with no F16C.
SPECENGINE_INLINE float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // * 2^-24, exact
  return sign ? -magnitude : magnitude;
}

SPECENGINE_INLINE float bf16_to_float(uint16_t bits) { return bits_to_float(static_cast<uint32_t>(bits) << 16); }

// Q4_K and Q5_K: sub-block j's 6-bit scale and min from their 12 bytes s (gguf's get_scale_min_k4).
SPECENGINE_INLINE void scale_min_k4(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// ---- portable dequantization: one block -> its weights, gguf's float32 operations in order ----

template <WeightType T>
SPECENGINE_INLINE void dequantize_block(const uint8_t* b, float* out) {
  constexpr WeightTypeLayout L = layout_of(T);
  if constexpr (T == WeightType::F32) {
    std::memcpy(out, b, 4);
  } else if constexpr (T == WeightType::F16) {
    out[0] = f16_to_float(load_u16(b));
  } else if constexpr (T == WeightType::BF16) {
    out[0] = bf16_to_float(load_u16(b));
  } else if constexpr (T == WeightType::Q8_0) {
    const float d = f16_to_float(load_u16(b + L.d));
    for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(static_cast<int8_t>(b[L.qs + i])) * d;
  } else if constexpr (T == WeightType::Q4_0) {
    const float d = f16_to_float(load_u16(b + L.d));
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>((b[L.qs + i] & 0x0F) - 8);
      out[i + 16] = d * static_cast<float>((b[L.qs + i] >> 4) - 8);
    }
  } else if constexpr (T == WeightType::Q4_1) {
    const float d = f16_to_float(load_u16(b + L.d)), m = f16_to_float(load_u16(b + L.m));
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>(b[L.qs + i] & 0x0F) + m;
      out[i + 16] = d * static_cast<float>(b[L.qs + i] >> 4) + m;
    }
  } else if constexpr (T == WeightType::Q5_0 || T == WeightType::Q5_1) {
    const float d = f16_to_float(load_u16(b + L.d));
    const uint32_t qh = load_u32(b + L.qh);
    const uint8_t* qs = b + L.qs;
    for (int i = 0; i < 16; ++i) {
      const int lo = (qs[i] & 0x0F) | (((qh >> i) & 1) << 4), hi = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
      if constexpr (T == WeightType::Q5_0) {
        out[i] = d * static_cast<float>(lo - 16);
        out[i + 16] = d * static_cast<float>(hi - 16);
      } else {
        const float m = f16_to_float(load_u16(b + L.m));
        out[i] = d * static_cast<float>(lo) + m;
        out[i + 16] = d * static_cast<float>(hi) + m;
      }
    }
  } else if constexpr (T == WeightType::Q4_K || T == WeightType::Q5_K) {
    const float d = f16_to_float(load_u16(b + L.d)), dmin = f16_to_float(load_u16(b + L.m));
    const uint8_t* qh = b + L.qh;  // Q5_K
    const uint8_t* qs = b + L.qs;
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min_k4(b + L.scales, j, sc, m);
      const float scale = d * static_cast<float>(sc), shift = dmin * static_cast<float>(m);
      for (int l = 0; l < 32; ++l) {
        int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
        if constexpr (T == WeightType::Q5_K) q |= ((qh[l] >> j) & 1) << 4;
        out[32 * j + l] = scale * static_cast<float>(q) - shift;
      }
    }
  } else if constexpr (T == WeightType::Q6_K) {
    const uint8_t *ql = b + L.qs, *qh = b + L.qh;
    const float d = f16_to_float(load_u16(b + L.d));
    for (int g = 0; g < 16; ++g) {
      const float scale = d * static_cast<float>(static_cast<int8_t>(b[L.scales + g]));
      for (int l16 = 0; l16 < 16; ++l16) {
        const int i = 16 * g + l16, half = i / 128, group = (i % 128) / 32, l = i % 32;
        const int low = (ql[64 * half + 32 * (group & 1) + l] >> (4 * (group >> 1))) & 0x0F;
        const int high = (qh[32 * half + l] >> (2 * group)) & 3;
        out[i] = scale * static_cast<float>((low | (high << 4)) - 32);
      }
    }
  }
}

template <WeightType T>
SPECENGINE_INLINE void dequantize_row_portable(const uint8_t* row, int64_t K, float* out) {
  constexpr int64_t weights = layout_of(T).block_weights, bytes = layout_of(T).block_bytes;
  for (int64_t b = 0; b < K / weights; ++b) dequantize_block<T>(row + b * bytes, out + b * weights);
}

// The weight k of a row of a float type (the tail past the last whole step: block types have
// none, K being a multiple of their 32 or 256).
template <WeightType T>
float float_weight(const uint8_t* row, int64_t k) {
  float w = 0.f;
  if constexpr (layout_of(T).block_weights == 1) dequantize_block<T>(row + k * layout_of(T).block_bytes, &w);
  return w;
}
using TailWeight = float (*)(const uint8_t* row, int64_t k);

// Where one thread's work lies: its rows [begin, end) of one part, written at out[:, column +
// (n - begin)] (out's rows N apart) with bias[column + ...].
struct Slice {
  const float* x;
  const float* x_lanes;  // AVX-512: x [R, K32] in lane order (see the AVX-512 Blocks), where a part needs it
  float* scratch;        // AVX-512: this thread's room for a group's scales (K / 2 + 16 floats)
  int64_t R, K, K32;
  TailWeight tail;      // the part's type's float_weight
  const uint8_t* data;  // the part's rows
  int64_t row_bytes, begin, end;
  const float* bias;  // at the part's first row, or nullptr
  float* out;         // at the part's first row's column
  int64_t N;
};

// The end every path shares, so that a row's sum is the same wherever its vector sums came from:
// out[r, n] of rows [r0, r0 + rows) and columns [n0, n0 + cols) holds the sum of the row's
// vector partial sums (already reduced); the float types' tail past K32 is added to it weight by
// weight, then the bias. Out of line, called once a tile has stored its sums: a call inside the
// tile, with its accumulators live, would change how the tile's loop keeps them in registers.
__attribute__((noinline)) void add_tails(const Slice& s, int64_t r0, int64_t rows, int64_t n0, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* xr = s.x + (r0 + i) * s.K;
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t n = n0 + j;
      const uint8_t* row = s.data + n * s.row_bytes;
      float sum = s.out[(r0 + i) * s.N + n];
      for (int64_t k = s.K32; k < s.K; ++k) sum += xr[k] * s.tail(row, k);
      s.out[(r0 + i) * s.N + n] = sum + (s.bias ? s.bias[n] : 0.f);
    }
  }
}

// ---- portable path ---------------------------------------------------------------------------

// Sixteen partial sums per (row of x, weight row), mirroring the AVX-512 vectors.
void tile_portable(const Slice& s, const float* w, int64_t cols, int64_t r0, int64_t rows, int64_t n0) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* xr = s.x + (r0 + i) * s.K;
    for (int64_t j = 0; j < cols; ++j) {
      float acc[16] = {};
      const float* wj = w + j * s.K32;
      for (int64_t k = 0; k < s.K32; k += 16)
        for (int l = 0; l < 16; ++l) acc[l] += xr[k + l] * wj[k + l];
      for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
      const int64_t n = n0 + j;
      s.out[(r0 + i) * s.N + n] = s.K32 < s.K ? acc[0] : acc[0] + (s.bias ? s.bias[n] : 0.f);
    }
  }
  if (s.K32 < s.K) add_tails(s, r0, rows, n0, cols);
}

template <WeightType T>
void slice_portable(const Slice& s, float* buffer) {
  for (int64_t n = s.begin; n < s.end; n += kGroupRows) {
    const int64_t cols = std::min(kGroupRows, s.end - n);
    for (int64_t j = 0; j < cols; ++j)
      dequantize_row_portable<T>(s.data + (n + j) * s.row_bytes, s.K32, buffer + j * s.K32);
    tile_portable(s, buffer, cols, 0, s.R, n);
  }
}

#ifdef SPECENGINE_X86
// Q4_K and Q5_K's 16 sub-block fields from their 12 bytes at p, four at a time in 32-bit
// words (ggml's unpacking of get_scale_min_k4): bytes 0-7 the scales of sub-blocks 0-7, bytes
// 8-15 their mins. Sub-blocks 0-3 keep their low 6 bits; 4-7 take a nibble of bytes 8-11 and the
// top 2 bits of bytes 0-3 (scales) or 4-7 (mins).
SPECENGINE_INLINE __m128i scale_min_k4_bytes(const uint8_t* p) {
  const uint32_t w0 = load_u32(p), w1 = load_u32(p + 4), w2 = load_u32(p + 8);
  const uint32_t sc_lo = w0 & 0x3F3F3F3Fu, m_lo = w1 & 0x3F3F3F3Fu;
  const uint32_t sc_hi = (w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u);
  const uint32_t m_hi = ((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u);
  return _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi), static_cast<int>(m_lo),
                        static_cast<int>(m_hi));
}

// ---- The vector paths: one design at two widths -------------------------------------------
// blocks_simd.inc holds the tiles, the buffered path, the dequantization and a thread's slice,
// written once; each width below provides its vector operations, its formats' decoders (Blocks,
// Group) and its measured choices, and includes it under its own instruction-set target (a
// pragma over the region: GCC's and clang's differ).

bool use_blocks_avx2() {
  static const bool f16c = __builtin_cpu_supports("f16c");
  return f16c && use_avx2();
}

// (F16C for the scale fields: every CPU with AVX-512 has it.)
bool use_blocks_avx512() {
  static const bool f16c = __builtin_cpu_supports("f16c");
  return f16c && use_avx512();
}

#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
// ---- AVX2: 8 lanes ---------------------------------------------------------------------------
// A group of 32 weights is 4 vectors of 8 in natural order, each made as it is used (Group: one
// live at a time in 16 registers). Without a 16-entry permute, a nibble becomes a weight by
// widening (vpmovzxbd), an integer to float conversion and one FMA, exact as exact_affine
// (AVX-512, below) explains. F16C converts the scale fields (every AVX2 CPU has it; the path
// still asks). For one row of x the scales bound the loop: converting them into an array and
// reading them back is a large share of the work (measured: see
// bench/results/kernel-tuning-2026-11-29-to-12-03.md), so a tile broadcasts the legacy types' d
// and m into registers straight from the block.

using V = __m256;
constexpr int kLanes = 8;
// 4 KB ahead was the best distance for these loops on an AVX2 CPU (measured: see
// bench/results/kernel-tuning-2026-11-29-to-12-03.md).
constexpr int64_t kPrefetch = 4096;
// Up to 8 rows the registers are faster than the buffer's store and reload; past them the
// buffer is faster than tiles that each dequantize again (measured: see
// bench/results/kernel-tuning-2026-11-29-to-12-03.md). 5 to 8 rows take one weight row at a
// time, every block dequantized once for all rows.
constexpr int64_t kDirectRows = 8;
constexpr bool kScalesAhead = false;  // for one row of x the scales bound the loop (above)
constexpr bool kHoistX = false;       // up to 8 rows x 4 vectors of x: more than 16 registers
// Buffered tiles: up to 6 rows x 2 weight rows (12 accumulators, 2 weight vectors, one of x).
constexpr int64_t kBufferCols = 2, kBufferedRows = 6, kOneTileRows = 0;

SPECENGINE_INLINE V vzero() { return _mm256_setzero_ps(); }
SPECENGINE_INLINE V vload(const float* p) { return _mm256_loadu_ps(p); }
SPECENGINE_INLINE void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
SPECENGINE_INLINE V vfmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
SPECENGINE_INLINE V to_natural_order(V v) { return v; }  // (no format here has a lane order)

// Bytes p[0..7] as 8 int32 lanes: unsigned, signed.
SPECENGINE_INLINE __m256i widen_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
SPECENGINE_INLINE __m256i widen_i8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Lane l of kBitMasks + 8 v: bit 8 v + l (Q5_0 and Q5_1's fifth bits, one per weight of a block).
alignas(32) constexpr uint32_t kBitMasks[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,  1u << 8,  1u << 9,  1u << 10,
    1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15, 1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21,
    1u << 22, 1u << 23, 1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

// All ones in the lanes l of piece v whose bit 8 v + l of qh (broadcast) is set.
SPECENGINE_INLINE __m256i fifth_bit_set(__m256i qh, int v) {
  const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(kBitMasks + 8 * v));
  return _mm256_cmpeq_epi32(_mm256_and_si256(qh, mask), mask);
}

// A format's blocks in 256-bit registers:
//   scales(b, s)                   the block's kScales float32 scales, written to s (once, ahead)
//   piece<kProduct>(s, b, g, v)    its weights 32 g + 8 v .. 32 g + 8 v + 7 (g < kGroups, v < 4);
//                                  the legacy 4-, 5- and 8-bit types' pieces are Group's
// kProduct: the piece goes into a product, not to memory. Such a piece may differ from gguf's
// bits in the sign of a zero weight, which no sum can see (an accumulator starts at +0, and
// x * (+-0) added to it leaves it as it is), so an offset code's weight d (q - c) can be one
// exact FMA, d q + (-c d): -c d is exact (c is a power of two), and the FMA rounds the exact
// d (q - c) once, as gguf's product does; only q = c gives +0 where gguf gives -0 for d < 0.
// The float types are taken as "blocks" of 32 weights.
template <WeightType T>
struct Blocks {
  static constexpr WeightTypeLayout L = layout_of(T);
  static constexpr bool kFloat = L.block_weights == 1;
  static constexpr int64_t kWeights = kFloat ? 32 : L.block_weights, kBytes = kWeights * L.block_bytes / L.block_weights;
  static constexpr int64_t kGroups = kWeights / 32;
  static constexpr bool kLanes = false;  // natural order
  static constexpr int kCols = 2;
  static constexpr int64_t kScales = T == WeightType::Q4_K || T == WeightType::Q5_K || T == WeightType::Q6_K ? 16
                                     : T == WeightType::Q4_1 || T == WeightType::Q5_1                         ? 2
                                     : T == WeightType::Q8_0 || T == WeightType::Q4_0 || T == WeightType::Q5_0 ? 1
                                                                                                               : 0;

  // (Each float16 field is moved into a zeroed register, not inserted into a live one: an
  // insert would chain every block's conversion to the last one's.)
  SPECENGINE_INLINE static void scales(const uint8_t* b, float* s) {
    if constexpr (T == WeightType::Q8_0 || T == WeightType::Q4_0 || T == WeightType::Q5_0) {
      s[0] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(load_u16(b + L.d))));
    } else if constexpr (T == WeightType::Q4_1 || T == WeightType::Q5_1) {
      static_assert(L.m == L.d + 2, "d and m side by side");
      _mm_storel_pi(reinterpret_cast<__m64*>(s), _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(b + L.d)))));
    } else if constexpr (T == WeightType::Q4_K || T == WeightType::Q5_K) {
      static_assert(L.m == L.d + 2, "d and dmin side by side");
      const __m128i fields = scale_min_k4_bytes(b + L.scales);
      const __m128i sc = fields, m = _mm_unpackhi_epi64(fields, fields);
      const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(b + L.d))));
      _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_broadcastss_ps(d_dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc))));
      _mm256_storeu_ps(s + 8, _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(d_dmin)),
                                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m))));
    } else if constexpr (T == WeightType::Q6_K) {
      const __m256 d = _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(load_u16(b + L.d)))));
      for (int half = 0; half < 2; ++half)
        _mm256_storeu_ps(s + 8 * half, _mm256_mul_ps(d, _mm256_cvtepi32_ps(widen_i8(b + L.scales + 8 * half))));
    }
  }

  // Q4_K and Q5_K: sub-block g's scale and min alone, into s[g] and s[8 + g] (scalar; what a
  // one-row tile converts as it goes, see tile_direct).
  SPECENGINE_INLINE static void group_scales(const uint8_t* b, int g, float* s) {
    const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(b + L.d))));
    int sc, m;
    scale_min_k4(b + L.scales, g, sc, m);
    s[g] = _mm_cvtss_f32(d_dmin) * static_cast<float>(sc);
    s[8 + g] = _mm_cvtss_f32(_mm_movehdup_ps(d_dmin)) * static_cast<float>(m);
  }

  template <bool kProduct>
  SPECENGINE_INLINE static __m256 piece(const float* s, const uint8_t* b, int g, int v) {
    if constexpr (T == WeightType::F32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(b) + 8 * v);
    } else if constexpr (T == WeightType::F16) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * v)));
    } else if constexpr (T == WeightType::BF16) {
      const __m256i raw = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * v)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    } else if constexpr (T == WeightType::Q4_K || T == WeightType::Q5_K) {
      // Sub-block g: byte l of its 32 holds weight l in its low (g even) or high (g odd) nibble.
      // (Widened per sub-block, not once for both of a pair: one row of x against 8 weight rows
      // would then run out of registers.)
      const __m256i bytes = widen_u8(b + L.qs + 32 * (g / 2) + 8 * v);
      __m256i q = g % 2 == 0 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(bytes, 4);
      if constexpr (T == WeightType::Q5_K) {  // bit g of qh byte l
        const __m256i high = _mm256_and_si256(_mm256_srli_epi32(widen_u8(b + L.qh + 8 * v), g), _mm256_set1_epi32(1));
        q = _mm256_or_si256(q, _mm256_slli_epi32(high, 4));
      }
      return _mm256_fmsub_ps(_mm256_set1_ps(s[g]), _mm256_cvtepi32_ps(q), _mm256_set1_ps(s[8 + g]));
    } else if constexpr (T == WeightType::Q6_K) {
      // Group g: half g / 4 of the block, quarter k = g % 4: weight l's low nibble from ql, its two
      // high bits from qh; scale 2 g + l / 16.
      const int half = g / 4, k = g % 4;
      const __m256i low = _mm256_and_si256(
          _mm256_srli_epi32(widen_u8(b + L.qs + 64 * half + 32 * (k & 1) + 8 * v), 4 * (k >> 1)), _mm256_set1_epi32(0x0F));
      const __m256i high = _mm256_and_si256(_mm256_srli_epi32(widen_u8(b + L.qh + 32 * half + 8 * v), 2 * k),
                                            _mm256_set1_epi32(3));
      const __m256i q = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
      return _mm256_mul_ps(_mm256_set1_ps(s[2 * g + v / 2]), _mm256_cvtepi32_ps(q));
    }
  }
};

// Group g's 4 pieces, made one at a time in order (piece<kProduct>(v) = Blocks<T>::piece's),
// so that one is live at a time. The legacy 4- and 5-bit blocks widen each byte once, on
// construction, for its two nibbles (pieces v and v + 2), and broadcast the fifth bits once.
template <WeightType T>
struct Group {
  static constexpr bool kNibbles = T == WeightType::Q4_0 || T == WeightType::Q4_1 || T == WeightType::Q5_0 ||
                                   T == WeightType::Q5_1;
  static constexpr bool kFifthBit = T == WeightType::Q5_0 || T == WeightType::Q5_1;
  // The legacy types' d (and m) can be broadcast into registers straight from the block.
  static constexpr bool kRegisterScales = kNibbles || T == WeightType::Q8_0;
  static constexpr WeightTypeLayout L = layout_of(T);
  static constexpr bool kHasMin = L.m >= 0;
  // Q4_0 and Q5_0's codes are offset by c = 8, 16: weight d (q - c).
  static constexpr int kOffset = T == WeightType::Q4_0 ? 8 : T == WeightType::Q5_0 ? 16 : 0;
  const float* s;
  const uint8_t* b;
  int g;
  __m256i bytes[2], qh;
  __m256 d, m;  // m: Q4_1 and Q5_1's min; Q4_0 and Q5_0's -c d (exact)

  // Scales from s (Blocks<T>::scales), or with s null (kRegisterScales), from the block.
  SPECENGINE_INLINE Group(const float* scales, const uint8_t* block, int group) : s(scales), b(block), g(group) {
    if constexpr (kRegisterScales) {
      if (s == nullptr) {
        static_assert(!kHasMin || L.m == L.d + 2, "d and m side by side");
        const __m128 fields =
            _mm_cvtph_ps(_mm_cvtsi32_si128(kHasMin ? static_cast<int>(load_u32(b + L.d)) : load_u16(b + L.d)));
        d = _mm256_broadcastss_ps(fields);
        if constexpr (kHasMin) m = _mm256_broadcastss_ps(_mm_movehdup_ps(fields));
      } else {
        d = _mm256_set1_ps(s[0]);
        if constexpr (kHasMin) m = _mm256_set1_ps(s[1]);
      }
      if constexpr (kOffset > 0) m = _mm256_mul_ps(d, _mm256_set1_ps(-static_cast<float>(kOffset)));
    }
    if constexpr (kNibbles) {
      bytes[0] = widen_u8(b + L.qs);
      bytes[1] = widen_u8(b + L.qs + 8);
    }
    if constexpr (kFifthBit) qh = _mm256_set1_epi32(static_cast<int>(load_u32(b + L.qh)));
  }

  template <bool kProduct>
  SPECENGINE_INLINE __m256 piece(int v) const {
    if constexpr (kNibbles) {
      const __m256i low = v < 2 ? _mm256_and_si256(bytes[v], _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(bytes[v - 2], 4);
      if constexpr (kProduct && T == WeightType::Q5_0) {
        // The fifth bit adds 16, cancelling the offset: d q_low, or d q_low - 16 d where it is clear.
        const __m256 offset = _mm256_andnot_ps(_mm256_castsi256_ps(fifth_bit_set(qh, v)), m);
        return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(low), offset);
      }
      __m256i q = low;
      if constexpr (kFifthBit) q = _mm256_or_si256(q, _mm256_and_si256(fifth_bit_set(qh, v), _mm256_set1_epi32(16)));
      if constexpr (kOffset == 0 || kProduct) return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m);  // d q + m
      return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(kOffset))));  // gguf: d (q - c)
    } else if constexpr (T == WeightType::Q8_0) {
      return _mm256_mul_ps(_mm256_cvtepi32_ps(widen_i8(b + L.qs + 8 * v)), d);  // gguf: q * d
    } else {
      return Blocks<T>::template piece<kProduct>(s, b, g, v);
    }
  }
};

// A vector of partial sums reduced in one fixed order (halves, then pairs, then the last two).
SPECENGINE_INLINE float reduce(__m256 acc) {
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}

// kTail: the tile's type may be a float type, whose rows have a tail past K32 (a block type's
// never has: its direct tiles then store without a branch).
template <bool kTail, int ROWS, int COLS>
SPECENGINE_INLINE void store_tile(const Slice& s, const __m256 (&acc)[ROWS][COLS], int64_t r0, int64_t n0) {
  const bool tail = kTail && s.K32 < s.K;
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) {
      const int64_t n = n0 + j;
      const float sum = reduce(acc[i][j]);
      s.out[(r0 + i) * s.N + n] = tail ? sum : sum + (s.bias ? s.bias[n] : 0.f);
    }
  if (tail) add_tails(s, r0, ROWS, n0, COLS);
}

#include "blocks_simd.inc"
}  // namespace avx2
#ifdef __clang__
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#endif
namespace avx512 {
// ---- AVX-512: 16 lanes ------------------------------------------------------------------------

using V = __m512;
constexpr int kLanes = 16;
// How far ahead of the block being dequantized its thread's weight stream is prefetched, into
// L2: linear.cpp's distance, tuned for the same kind of stream on the same kind of machine.
constexpr int64_t kPrefetch = 16384;
// Register tiles of more rows of x measured slower (bench/results/avx512-direct-rows-2026-12-03.md).
constexpr int64_t kDirectRows = 4;
constexpr bool kScalesAhead = true;  // (see below)
constexpr bool kHoistX = true;       // up to 4 rows x 2 vectors of x: 8 of 32 registers
// Buffered tiles: up to 6 rows x 4 weight rows (24 accumulators, 4 weight vectors, one of x).
// Seven rows take one tile of 7 (GCC takes a weight vector from memory), faster than tiles of 3
// and 4; 13 and 14 rows take tiles of 4-6, faster than tiles of 7 (measured: see
// bench/results/kernel-tuning-2026-11-29-to-12-03.md).
constexpr int64_t kBufferCols = kGroupRows, kBufferedRows = 6, kOneTileRows = 7;

SPECENGINE_INLINE V vzero() { return _mm512_setzero_ps(); }
SPECENGINE_INLINE V vload(const float* p) { return _mm512_loadu_ps(p); }
SPECENGINE_INLINE void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
SPECENGINE_INLINE V vfmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }

// What bounds these loops is shuffles (vpermps lookups, broadcasts of scales from registers,
// vpmovzxbd widenings) more than the two 512-bit FMAs a cycle (measured: see
// bench/results/kernel-tuning-2026-11-29-to-12-03.md). So a block's scales are converted ahead into a small float array and
// broadcast from memory (a load, folded into the FMA that builds a table), and a block's bytes
// are spread over the 16 lanes by a 128-bit broadcast load and a per-lane shift (vpsrlvd),
// not widened: lane l of a vector of 16 weights then holds byte kLaneByte[l] = 4 (l % 4) + l / 4
// of its 16 (dword l % 4, shifted right by 8 (l / 4) bits). Those weights come in "lane order",
// and x is given to them in the same order (Slice::x_lanes); the order is an involution, so the
// same permutation restores the natural one (dequantize_rows).
SPECENGINE_INLINE __m512i lane_bytes() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}
SPECENGINE_INLINE __m512i lane_shifts(int extra) {
  return _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24),
                          _mm512_set1_epi32(extra));
}

// The 16 bytes at p in lane order, each in its lane's low bits (garbage above them), shifted
// right by `extra` bits more (4: the high nibbles).
SPECENGINE_INLINE __m512i bytes_in_lanes(const uint8_t* p, int extra) {
  return _mm512_srlv_epi32(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                           lane_shifts(extra));
}

SPECENGINE_INLINE __m512 iota_ps(float start) {
  return _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(start));
}

// Two float16 fields side by side (a block's d and m, or d and dmin) -> float32 lanes 0 and 1.
SPECENGINE_INLINE __m128 f16_pair(const uint8_t* p) { return _mm_cvtph_ps(_mm_cvtsi32_si128(load_u32(p))); }

// index's bits 0-3 from `low`, bit 4 from bit 0 of `bit` (bits above 4 are garbage: the 5-bit
// lookups ignore them).
SPECENGINE_INLINE __m512i five_bit_index(__m512i low, __m512i bit) {
  return _mm512_ternarylogic_epi32(low, _mm512_slli_epi32(bit, 4), _mm512_set1_epi32(0x0F), 0xE4);  // c ? a : b
}

// A format's blocks in 512-bit registers:
//   scales(b, s)          the block's kScales float32 scales, written to s (converted once, ahead)
//   group(s, b, g, lo, hi) its weights 32 g .. 32 g + 31 (g < kGroups), lane order if kLanes
// The float types are taken as "blocks" of 32 weights.
template <WeightType T>
struct Blocks;

template <>
struct Blocks<WeightType::F32> {
  static constexpr int64_t kWeights = 32, kBytes = 128, kGroups = 1, kScales = 0;
  static constexpr bool kLanes = false;
  static constexpr int kCols = 4;
  SPECENGINE_INLINE static void scales(const uint8_t*, float*) {}
  SPECENGINE_INLINE static void group(const float*, const uint8_t* b, int, __m512& lo, __m512& hi) {
    lo = _mm512_loadu_ps(b);
    hi = _mm512_loadu_ps(b + 64);
  }
};

template <>
struct Blocks<WeightType::F16> {
  static constexpr int64_t kWeights = 32, kBytes = 64, kGroups = 1, kScales = 0;
  static constexpr bool kLanes = false;
  static constexpr int kCols = 4;
  SPECENGINE_INLINE static void scales(const uint8_t*, float*) {}
  SPECENGINE_INLINE static void group(const float*, const uint8_t* b, int, __m512& lo, __m512& hi) {
    lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32)));
  }
};

template <>
struct Blocks<WeightType::BF16> {
  static constexpr int64_t kWeights = 32, kBytes = 64, kGroups = 1, kScales = 0;
  static constexpr bool kLanes = false;
  static constexpr int kCols = 4;
  SPECENGINE_INLINE static void scales(const uint8_t*, float*) {}
  SPECENGINE_INLINE static __m512 widen(const uint8_t* p) {
    const __m512i raw = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  }
  SPECENGINE_INLINE static void group(const float*, const uint8_t* b, int, __m512& lo, __m512& hi) {
    lo = widen(b);
    hi = widen(b + 32);
  }
};

template <>
struct Blocks<WeightType::Q8_0> {
  static constexpr WeightTypeLayout L = layout_of(WeightType::Q8_0);
  static constexpr int64_t kWeights = L.block_weights, kBytes = L.block_bytes, kGroups = 1, kScales = 1;
  static constexpr bool kLanes = false;
  static constexpr int kCols = 4;
  SPECENGINE_INLINE static void scales(const uint8_t* b, float* s) { s[0] = _cvtsh_ss(load_u16(b + L.d)); }
  SPECENGINE_INLINE static __m512 widen(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  SPECENGINE_INLINE static void group(const float* s, const uint8_t* b, int, __m512& lo, __m512& hi) {
    lo = _mm512_mul_ps(widen(b + L.qs), _mm512_set1_ps(s[0]));  // gguf: q * d
    hi = _mm512_mul_ps(widen(b + L.qs + 16), _mm512_set1_ps(s[0]));
  }
};

// Q4_0 and Q4_1: a table of the block's 16 values, looked up by nibble.
template <>
struct Blocks<WeightType::Q4_0> {
  static constexpr WeightTypeLayout L = layout_of(WeightType::Q4_0);
  static constexpr int64_t kWeights = L.block_weights, kBytes = L.block_bytes, kGroups = 1, kScales = 1;
  static constexpr bool kLanes = true;
  static constexpr int kCols = 4;
  SPECENGINE_INLINE static void scales(const uint8_t* b, float* s) { s[0] = _cvtsh_ss(load_u16(b + L.d)); }
  SPECENGINE_INLINE static void group(const float* s, const uint8_t* b, int, __m512& lo, __m512& hi) {
    const __m512 table = _mm512_mul_ps(_mm512_set1_ps(s[0]), iota_ps(-8.f));  // d * (q - 8)
    lo = _mm512_permutexvar_ps(bytes_in_lanes(b + L.qs, 0), table);
    hi = _mm512_permutexvar_ps(bytes_in_lanes(b + L.qs, 4), table);
  }
};

// d * q + m with one rounding: d * q is exact in float32 (d a float16, 11 significant bits; q < 32,
// 5 bits), so the fused form is bit for bit gguf's two roundings, in one instruction.
SPECENGINE_INLINE __m512 exact_affine(__m512 d, __m512 q, __m512 m) { return _mm512_fmadd_ps(d, q, m); }

template <>
struct Blocks<WeightType::Q4_1> {
  static constexpr WeightTypeLayout L = layout_of(WeightType::Q4_1);
  static constexpr int64_t kWeights = L.block_weights, kBytes = L.block_bytes, kGroups = 1, kScales = 2;
  static constexpr bool kLanes = true;
  static constexpr int kCols = 4;
  SPECENGINE_INLINE static void scales(const uint8_t* b, float* s) {
    static_assert(L.m == L.d + 2, "d and m side by side");
    _mm_storel_pi(reinterpret_cast<__m64*>(s), f16_pair(b + L.d));  // d, m
  }
  SPECENGINE_INLINE static void group(const float* s, const uint8_t* b, int, __m512& lo, __m512& hi) {
    const __m512 table = exact_affine(_mm512_set1_ps(s[0]), iota_ps(0.f), _mm512_set1_ps(s[1]));
    lo = _mm512_permutexvar_ps(bytes_in_lanes(b + L.qs, 0), table);
    hi = _mm512_permutexvar_ps(bytes_in_lanes(b + L.qs, 4), table);
  }
};

// Q5_0 and Q5_1: 32 values in two registers (vpermt2ps takes a 5-bit index), the fifth bit of
// weight i being bit i of the block's qh word.
template <WeightType T>
struct Avx512Q5 {
  static constexpr WeightTypeLayout L = layout_of(T);
  static constexpr int64_t kWeights = L.block_weights, kBytes = L.block_bytes, kGroups = 1, kScales = 2;
  static constexpr bool kLanes = true;
  static constexpr int kCols = 4;
  SPECENGINE_INLINE static void scales(const uint8_t* b, float* s) {
    static_assert(L.d + 2 == (L.m >= 0 ? L.m : L.qh), "d and then m (Q5_1) or qh (Q5_0)");
    _mm_storel_pi(reinterpret_cast<__m64*>(s), f16_pair(b + L.d));  // d, m (Q5_0: m is qh's bytes, unused)
  }
  SPECENGINE_INLINE static void group(const float* s, const uint8_t* b, int, __m512& lo, __m512& hi) {
    const __m512 d = _mm512_set1_ps(s[0]);
    __m512 low, high;  // the values of q = 0..15 and 16..31
    if constexpr (T == WeightType::Q5_0) {
      low = _mm512_mul_ps(d, iota_ps(-16.f));
      high = _mm512_mul_ps(d, iota_ps(0.f));
    } else {
      low = exact_affine(d, iota_ps(0.f), _mm512_set1_ps(s[1]));
      high = exact_affine(d, iota_ps(16.f), _mm512_set1_ps(s[1]));
    }
    const __m512i qh = _mm512_set1_epi32(static_cast<int>(load_u32(b + L.qh)));
    const __m512i byte = lane_bytes();  // weight kLaneByte[l] (and 16 + that) of lane l
    const __m512i lo_index = five_bit_index(bytes_in_lanes(b + L.qs, 0), _mm512_srlv_epi32(qh, byte));
    const __m512i hi_index = five_bit_index(bytes_in_lanes(b + L.qs, 4),
                                            _mm512_srlv_epi32(qh, _mm512_add_epi32(byte, _mm512_set1_epi32(16))));
    lo = _mm512_permutex2var_ps(low, lo_index, high);
    hi = _mm512_permutex2var_ps(low, hi_index, high);
  }
};
template <>
struct Blocks<WeightType::Q5_0> : Avx512Q5<WeightType::Q5_0> {};
template <>
struct Blocks<WeightType::Q5_1> : Avx512Q5<WeightType::Q5_1> {};

// Q4_K and Q5_K: 8 sub-blocks of 32, each with its scale d * sc and shift dmin * m, and its own
// table. scales: s[0..7] the scales, s[8..15] the shifts.
template <WeightType T>
struct Avx512K4 {
  static constexpr WeightTypeLayout L = layout_of(T);
  static constexpr int64_t kWeights = L.block_weights, kBytes = L.block_bytes, kGroups = 8, kScales = 16;
  static constexpr bool kLanes = true;
  static constexpr int kCols = 4;
  SPECENGINE_INLINE static void scales(const uint8_t* b, float* s) {
    static_assert(L.m == L.d + 2, "d and dmin side by side");
    const __m512 fields = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scale_min_k4_bytes(b + L.scales)));
    const __m512 d_dmin = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                                _mm512_castps128_ps512(f16_pair(b + L.d)));
    _mm512_storeu_ps(s, _mm512_mul_ps(d_dmin, fields));  // d * sc, dmin * m
  }
  SPECENGINE_INLINE static void group(const float* s, const uint8_t* b, int g, __m512& lo, __m512& hi) {
    // (d * sc) * q - dmin * m: d * sc (17 significant bits) times q (5) is exact, so one rounding
    // (fused) is gguf's two.
    const __m512 scale = _mm512_set1_ps(s[g]), shift = _mm512_set1_ps(s[8 + g]);
    const __m512 table0 = _mm512_fmsub_ps(scale, iota_ps(0.f), shift);
    const uint8_t* qs = b + L.qs + 32 * (g / 2);
    const int nibble = 4 * (g % 2);
    const __m512i q0 = bytes_in_lanes(qs, nibble), q1 = bytes_in_lanes(qs + 16, nibble);
    if constexpr (T == WeightType::Q4_K) {
      lo = _mm512_permutexvar_ps(q0, table0);
      hi = _mm512_permutexvar_ps(q1, table0);
    } else {
      const __m512 table1 = _mm512_fmsub_ps(scale, iota_ps(16.f), shift);
      // Bit g of qh byte kLaneByte[l] (of the first or second 16) in lane l.
      const __m512i h0 = bytes_in_lanes(b + L.qh, g), h1 = bytes_in_lanes(b + L.qh + 16, g);
      lo = _mm512_permutex2var_ps(table0, five_bit_index(q0, h0), table1);
      hi = _mm512_permutex2var_ps(table0, five_bit_index(q1, h1), table1);
    }
  }
};
template <>
struct Blocks<WeightType::Q4_K> : Avx512K4<WeightType::Q4_K> {};
template <>
struct Blocks<WeightType::Q5_K> : Avx512K4<WeightType::Q5_K> {};

// Q6_K: 16 scales d * scale[i], one per 16 weights; q = low nibble | 2 high bits << 4, minus 32.
template <>
struct Blocks<WeightType::Q6_K> {
  static constexpr WeightTypeLayout L = layout_of(WeightType::Q6_K);
  static constexpr int64_t kWeights = L.block_weights, kBytes = L.block_bytes, kGroups = 8, kScales = 16;
  static constexpr bool kLanes = true;
  static constexpr int kCols = 2;  // 4 x 4 tiles spilled registers
  SPECENGINE_INLINE static void scales(const uint8_t* b, float* s) {
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(b + L.d)));
    const __m512i scales = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + L.scales)));
    _mm512_storeu_ps(s, _mm512_mul_ps(d, _mm512_cvtepi32_ps(scales)));
  }
  // Weights 16 part .. 16 part + 15 of group g (0..7): 128 weights per half of the block, 4 groups each.
  SPECENGINE_INLINE static __m512 sixteen(const float* s, const uint8_t* b, int g, int part) {
    const int half = g / 4, k = g % 4;
    const __m512i low = bytes_in_lanes(b + L.qs + 64 * half + 32 * (k & 1) + 16 * part, 4 * (k >> 1));
    const __m512i qh = bytes_in_lanes(b + L.qh + 32 * half + 16 * part, 0);
    const __m512i high = k < 3 ? _mm512_slli_epi32(qh, 4 - 2 * k) : _mm512_srli_epi32(qh, 2);  // bits 2k, 2k+1 -> 4, 5
    const __m512i q = _mm512_and_si512(_mm512_ternarylogic_epi32(low, high, _mm512_set1_epi32(0x0F), 0xE4),
                                       _mm512_set1_epi32(0x3F));
    return _mm512_mul_ps(_mm512_set1_ps(s[2 * g + part]),
                         _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(32))));
  }
  SPECENGINE_INLINE static void group(const float* s, const uint8_t* b, int g, __m512& lo, __m512& hi) {
    lo = sixteen(s, b, g, 0);
    hi = sixteen(s, b, g, 1);
  }
};

// Group g's two vectors of 16 (Blocks<T>::group), made together: the lookups share a table.
template <WeightType T>
struct Group {
  static constexpr bool kRegisterScales = false;  // kScalesAhead: always from s
  V halves[2];
  SPECENGINE_INLINE Group(const float* s, const uint8_t* b, int g) { Blocks<T>::group(s, b, g, halves[0], halves[1]); }
  template <bool kProduct>
  SPECENGINE_INLINE V piece(int v) const { return halves[v]; }
};

SPECENGINE_INLINE V to_natural_order(V v) { return _mm512_permutexvar_ps(lane_bytes(), v); }  // an involution

// x [R, K] -> [R, K32], each run of 16 in lane order.
std::vector<float> x_in_lanes(const float* x, int64_t R, int64_t K, int64_t K32) {
  std::vector<float> lanes(static_cast<size_t>(R * K32));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K32; k += 16)
      _mm512_storeu_ps(lanes.data() + r * K32 + k, _mm512_permutexvar_ps(lane_bytes(), _mm512_loadu_ps(x + r * K + k)));
  return lanes;
}

// The sums of four vectors, in lanes 0-3 (a's, b's, c's, d's): each reduced by the tree of
// _mm512_reduce_add_ps (lane l with l + 8, then l + 4, l + 2, l + 1), so a sum is the same
// bits whichever way it was reduced, four at a time or alone.
SPECENGINE_INLINE __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(
      _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v));
}

// out[r0 + i, n0 + j] from the tile's partial sums: reduced, plus the float types' tail, plus bias.
template <bool kTail, int ROWS, int COLS>  // kTail as the AVX2 store_tile's
SPECENGINE_INLINE void store_tile(const Slice& s, const __m512 (&acc)[ROWS][COLS], int64_t r0, int64_t n0) {
  if (kTail && s.K32 < s.K) {  // a tail (float types only): one by one
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < COLS; ++j) s.out[(r0 + i) * s.N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
    return add_tails(s, r0, ROWS, n0, COLS);
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int i = 0; i < ROWS; ++i) {
    float* out = s.out + (r0 + i) * s.N + n0;
    for (int j = 0; j < COLS; j += 4) {
      const __m128 sums = reduce4(acc[i][j], j + 1 < COLS ? acc[i][j + 1] : zero, j + 2 < COLS ? acc[i][j + 2] : zero,
                                  j + 3 < COLS ? acc[i][j + 3] : zero);
      if (COLS - j >= 4) {
        _mm_storeu_ps(out + j, _mm_add_ps(sums, s.bias ? _mm_loadu_ps(s.bias + n0 + j) : _mm_setzero_ps()));
      } else {
        alignas(16) float lanes[4];
        _mm_store_ps(lanes, sums);
        for (int jj = j; jj < COLS; ++jj) out[jj] = lanes[jj - j] + (s.bias ? s.bias[n0 + jj] : 0.f);
      }
    }
  }
}

#include "blocks_simd.inc"
}  // namespace avx512
#ifdef __clang__
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // SPECENGINE_X86

using Path = VectorPath;

Path choose_path() {
#ifdef SPECENGINE_X86
  return vector_path(use_blocks_avx512(), use_blocks_avx2());
#else
  return vector_path(false, false);
#endif
}

// Rows of x up to which the path's tiles hold blocks in registers (the portable path buffers always).
int64_t direct_rows(Path path) {
#ifdef SPECENGINE_X86
  if (path == Path::avx512) return avx512::kDirectRows;
  if (path == Path::avx2) return avx2::kDirectRows;
#endif
  (void)path;
  return 0;
}

template <WeightType T>
void run_slice(Path path, const Slice& s, float* buffer) {
#ifdef SPECENGINE_X86
  if (path == Path::avx512) return avx512::slice<T>(s, buffer);
  if (path == Path::avx2) return avx2::slice<T>(s, buffer);
#endif
  slice_portable<T>(s, buffer);
}

// Whole rows [0, K) of `count` consecutive rows of one part into out [count, K].
template <WeightType T>
void dequantize_part_rows(Path path, const uint8_t* rows, int64_t row_bytes, int64_t count, int64_t K, float* out) {
#ifdef SPECENGINE_X86
  using Dequantize = void (*)(const uint8_t*, int64_t, int64_t, int64_t, float*);
  const Dequantize vectors = path == Path::avx512 ? &avx512::dequantize<T, true>
                             : path == Path::avx2 ? &avx2::dequantize<T, true>
                                                  : nullptr;
  if (vectors != nullptr) {
    const int64_t K32 = K & ~(kStep - 1);
    if (K32 == K) return vectors(rows, row_bytes, count, K, out);
    for (int64_t j = 0; j < count; ++j) {  // a float type's tail: each row on its own
      vectors(rows + j * row_bytes, row_bytes, 1, K32, out + j * K);
      dequantize_row_portable<T>(rows + j * row_bytes + K32 * block_bytes(static_cast<int64_t>(T)), K - K32,
                                 out + j * K + K32);
    }
    return;
  }
#else
  (void)path;
#endif
  for (int64_t j = 0; j < count; ++j) dequantize_row_portable<T>(rows + j * row_bytes, K, out + j * K);
}

// Each weight type's functions, which choose their instruction-set path inside; one entry per
// type of kWeightTypes (blocks.h), in its order. A new type's entry comes from its
// dequantize_block (portable) and each width's Blocks and Group.
struct TypeFunctions {
  WeightType type;
  void (*slice)(Path, const Slice&, float*);  // a thread's rows of the product (run_slice)
  void (*rows)(Path, const uint8_t* rows, int64_t row_bytes, int64_t count, int64_t K,
               float* out);  // whole rows dequantized (dequantize_part_rows)
  TailWeight tail;           // a float type's weight k of a row (float_weight)
  bool lane_order;           // AVX-512: its weights come in lane order, so x must too (avx512::Blocks)
};

// bfloat16 weights: linear.cpp's column tiles (x de-interleaved to their pairs of weights).
void slice_bf16(Path path, const Slice& s, float*) {
  linear_bf16_columns(path, s.x, reinterpret_cast<const uint16_t*>(s.data), s.bias, s.out, s.R, s.K, s.N, s.begin,
                      s.end);
}

template <WeightType T>
constexpr TypeFunctions functions_of() {
#ifdef SPECENGINE_X86
  constexpr bool lanes = avx512::Blocks<T>::kLanes;
#else
  constexpr bool lanes = false;
#endif
  if constexpr (T == WeightType::BF16) return {T, &slice_bf16, &dequantize_part_rows<T>, &float_weight<T>, lanes};
  else return {T, &run_slice<T>, &dequantize_part_rows<T>, &float_weight<T>, lanes};
}

template <size_t... I>
constexpr std::array<TypeFunctions, sizeof...(I)> functions_table(std::index_sequence<I...>) {
  return {functions_of<kWeightTypes[I].type>()...};
}

constexpr std::array<TypeFunctions, kWeightTypeCount> kTypeFunctions =
    functions_table(std::make_index_sequence<kWeightTypeCount>{});

// The functions of `type` (a type the bindings checked: every part's is one of kWeightTypes).
const TypeFunctions& functions(WeightType type) {
  for (const TypeFunctions& f : kTypeFunctions)
    if (f.type == type) return f;
  return kTypeFunctions[0];
}

int64_t part_row_bytes(const MatrixPart& part, int64_t K) {
  return K / block_weights(static_cast<int64_t>(part.type)) * block_bytes(static_cast<int64_t>(part.type));
}

// This thread's share [begin, end) of `units` units of work.
void thread_share(int64_t units, int64_t& begin, int64_t& end) {
#ifdef _OPENMP
  const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
#else
  const int64_t threads = 1, id = 0;
#endif
  begin = units * id / threads;
  end = units * (id + 1) / threads;
}

// Below this many weights a second thread costs more to wake than it saves (linear.cpp's bound).
constexpr int64_t kParallelWeights = int64_t{1} << 16;

}  // namespace

void linear_blocks(const float* x, const Matrix& w, const float* bias, float* out, int64_t R) {
  const int64_t K = w.in_features, N = w.out_features();
  if (R <= 0 || N <= 0) return;
  if (K == 0) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t n = 0; n < N; ++n) out[r * N + n] = bias ? bias[n] : 0.f;
    return;
  }
  const Path path = choose_path();
  const int64_t K32 = K & ~(kStep - 1);
  // A group of dequantized rows is buffered past the path's register tiles' rows.
  const bool buffered = R > direct_rows(path);
  std::vector<float> x_lanes;
#ifdef SPECENGINE_X86
  bool lanes = false;
  for (int64_t p = 0; p < w.part_count; ++p) lanes = lanes || functions(w.parts[p].type).lane_order;
  if (path == Path::avx512 && lanes) x_lanes = avx512::x_in_lanes(x, R, K, K32);
#endif
#pragma omp parallel if (N * K >= kParallelWeights)
  {
    thread_local std::vector<float> buffer, scratch;
    if (buffered && buffer.size() < static_cast<size_t>(kGroupRows * K32)) buffer.resize(kGroupRows * K32);
    if (scratch.size() < static_cast<size_t>(K / 2 + 16)) scratch.resize(K / 2 + 16);
    int64_t group_begin, group_end;
    thread_share((N + kGroupRows - 1) / kGroupRows, group_begin, group_end);
    const int64_t begin = std::min(N, group_begin * kGroupRows), end = std::min(N, group_end * kGroupRows);
    int64_t first = 0;  // the part's first row in the matrix
    for (int64_t p = 0; p < w.part_count; ++p) {
      const MatrixPart& part = w.parts[p];
      const int64_t lo = std::max(begin, first), hi = std::min(end, first + part.rows);
      if (lo < hi) {
        const TypeFunctions& f = functions(part.type);
        const Slice s{x,          x_lanes.data(), scratch.data(), R, K, K32, f.tail, part.data, part_row_bytes(part, K),
                      lo - first, hi - first,     bias ? bias + first : nullptr, out + first, N};
        f.slice(path, s, buffer.data());
      }
      first += part.rows;
    }
  }
}

void dequantize_rows(const Matrix& w, int64_t row_begin, int64_t row_end, float* out) {
  const int64_t K = w.in_features;
  if (row_end <= row_begin || K == 0) return;
#pragma omp parallel if ((row_end - row_begin) * K >= kParallelWeights)
  {
    int64_t begin, end;
    thread_share(row_end - row_begin, begin, end);
    dequantize_rows_serial(w, row_begin + begin, row_begin + end, out + begin * K);
  }
}

void dequantize_rows_serial(const Matrix& w, int64_t row_begin, int64_t row_end, float* out) {
  const int64_t K = w.in_features;
  if (row_end <= row_begin || K == 0) return;
  const Path path = choose_path();
  int64_t first = 0;  // the part's first row in the matrix
  for (int64_t p = 0; p < w.part_count; ++p) {
    const MatrixPart& part = w.parts[p];
    const int64_t lo = std::max(row_begin, first), hi = std::min(row_end, first + part.rows);
    if (lo < hi) {
      const int64_t row_bytes = part_row_bytes(part, K);
      functions(part.type).rows(path, part.data + (lo - first) * row_bytes, row_bytes, hi - lo, K,
                                out + (lo - row_begin) * K);
    }
    first += part.rows;
  }
}

void gather_rows(const Matrix& w, const int64_t* ids, int64_t count, float* out) {
  const int64_t K = w.in_features;
  if (count <= 0 || K == 0) return;
  const Path path = choose_path();
#pragma omp parallel if (count * K >= kParallelWeights)
  {
    int64_t begin, end;
    thread_share(count, begin, end);
    for (int64_t i = begin; i < end; ++i) {
      int64_t row = ids[i], p = 0;
      while (p + 1 < w.part_count && row >= w.parts[p].rows) row -= w.parts[p++].rows;
      const MatrixPart& part = w.parts[p];
      const int64_t row_bytes = part_row_bytes(part, K);
      functions(part.type).rows(path, part.data + row * row_bytes, row_bytes, 1, K, out + i * K);
    }
  }
}

}  // namespace specengine
