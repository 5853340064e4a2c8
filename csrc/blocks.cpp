// Products and lookups over matrices stored as ggml blocks (see blocks.h).
//
// Decoding streams every weight once per step, so the bytes read set the speed, and a block
// format reads fewer of them than bfloat16 (Q4_1: 5 bits a weight against 16). What it costs
// instead is the arithmetic that turns a block into float32 weights, paid once per weight per
// row tile: a group of 4 weight rows has its blocks' scales converted once, then its blocks are
// dequantized into registers and multiplied against all rows of x at once (up to kDirectRows),
// or, past kDirectRows rows, dequantized once into an L1 buffer that tiles of rows run over. (So
// the AVX-512 path; the AVX2 one, below, takes up to 8 rows of x in one register tile.)
//
// The 4- and 5-bit formats dequantize through a table: a block's (or sub-block's) weights take
// only 16 (32) values, d * q + m for q = 0..15, one 512-bit register (two) built by one FMA,
// which is exact here (see exact_affine); each weight is then a lookup (vpermps; vpermt2ps)
// indexed by its nibble, which ignores the bits above the index, so nibbles need no masking.
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

// How far ahead of the block being dequantized its thread's weight stream is prefetched, into
// L2: linear.cpp's distance, tuned for the same kind of stream on the same kind of machine.
constexpr int64_t kPrefetchBytes = 16384;
// AVX-512 path: rows of x up to which blocks are dequantized into registers, in one tile with
// every row; from kDirectRows + 1 rows on, a group's rows are dequantized once into an L1
// buffer first, which tiles of up to kBufferedRows rows read. (A register tile of more rows
// keeps more rows of x in L1 than it holds: measured slower, bench/results/avx512-direct-rows-2026-12-03.md.)
// The AVX2 path has its own bound, kDirectRowsAvx2.
constexpr int64_t kDirectRows = 4;
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
  const float* x_lanes;  // AVX-512: x [R, K32] in lane order (see Avx512Blocks), where a part needs it
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

// ---- AVX2 path -------------------------------------------------------------------------------
// The AVX-512 path's design on 8-lane vectors: a block is dequantized into registers, 8 weights
// at a time in natural order, and multiplied against every row of x while there, up to
// kDirectRowsAvx2 rows; past them, a group of weight rows is dequantized once into a buffer that
// tiles of 6 rows of x run over. Without a 16-entry permute, a nibble becomes a weight by
// widening (vpmovzxbd), an integer to float conversion and one FMA, exact as exact_affine
// (AVX-512 path, below) explains. Each (row of x, weight row) has one vector of partial sums over
// k in steps of 8, the same from registers or the buffer. (F16C converts the scale fields: every AVX2 CPU has it, the path
// still asks.) For one row of x the scales bound the loop: converting them into an array and
// reading them back is a large share of the work (measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md), so a
// one-tile call broadcasts the legacy types' d and m into registers straight from the block.
#define BLOCKS_AVX2 __attribute__((target("avx2,fma,f16c")))
#define BLOCKS_AVX2_INLINE BLOCKS_AVX2 SPECENGINE_INLINE

// kPrefetchBytes for this path, not linear.cpp's: 4 KB ahead was the best distance for these
// loops on an AVX2 CPU (measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md).
constexpr int64_t kPrefetchBytesAvx2 = 4096;

bool use_blocks_avx2() {
  static const bool f16c = __builtin_cpu_supports("f16c");
  return f16c && use_avx2();
}

// Bytes p[0..7] as 8 int32 lanes: unsigned, signed.
BLOCKS_AVX2_INLINE __m256i widen_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
BLOCKS_AVX2_INLINE __m256i widen_i8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Lane l of kBitMasks + 8 v: bit 8 v + l (Q5_0 and Q5_1's fifth bits, one per weight of a block).
alignas(32) constexpr uint32_t kBitMasks[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,  1u << 8,  1u << 9,  1u << 10,
    1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15, 1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21,
    1u << 22, 1u << 23, 1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

// All ones in the lanes l of piece v whose bit 8 v + l of qh (broadcast) is set.
BLOCKS_AVX2_INLINE __m256i fifth_bit_set(__m256i qh, int v) {
  const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(kBitMasks + 8 * v));
  return _mm256_cmpeq_epi32(_mm256_and_si256(qh, mask), mask);
}

// A format's blocks in 256-bit registers:
//   scales(b, s)                   the block's kScales float32 scales, written to s (once, ahead)
//   piece<kProduct>(s, b, g, v)    its weights 32 g + 8 v .. 32 g + 8 v + 7 (g < kGroups, v < 4);
//                                  the legacy 4-, 5- and 8-bit types' pieces are Avx2Group's
// kProduct: the piece goes into a product, not to memory. Such a piece may differ from gguf's
// bits in the sign of a zero weight, which no sum can see (an accumulator starts at +0, and
// x * (+-0) added to it leaves it as it is), so an offset code's weight d (q - c) can be one
// exact FMA, d q + (-c d): -c d is exact (c is a power of two), and the FMA rounds the exact
// d (q - c) once, as gguf's product does; only q = c gives +0 where gguf gives -0 for d < 0.
// The float types are taken as "blocks" of 32 weights.
template <WeightType T>
struct Avx2Blocks {
  static constexpr WeightTypeLayout L = layout_of(T);
  static constexpr bool kFloat = L.block_weights == 1;
  static constexpr int64_t kWeights = kFloat ? 32 : L.block_weights, kBytes = kWeights * L.block_bytes / L.block_weights;
  static constexpr int64_t kGroups = kWeights / 32;
  static constexpr int64_t kScales = T == WeightType::Q4_K || T == WeightType::Q5_K || T == WeightType::Q6_K ? 16
                                     : T == WeightType::Q4_1 || T == WeightType::Q5_1                         ? 2
                                     : T == WeightType::Q8_0 || T == WeightType::Q4_0 || T == WeightType::Q5_0 ? 1
                                                                                                               : 0;

  // (Each float16 field is moved into a zeroed register, not inserted into a live one: an
  // insert would chain every block's conversion to the last one's.)
  BLOCKS_AVX2_INLINE static void scales(const uint8_t* b, float* s) {
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
  // one-row tile converts as it goes, see tile_direct_avx2).
  BLOCKS_AVX2_INLINE static void group_scales(const uint8_t* b, int g, float* s) {
    const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(b + L.d))));
    int sc, m;
    scale_min_k4(b + L.scales, g, sc, m);
    s[g] = _mm_cvtss_f32(d_dmin) * static_cast<float>(sc);
    s[8 + g] = _mm_cvtss_f32(_mm_movehdup_ps(d_dmin)) * static_cast<float>(m);
  }

  template <bool kProduct>
  BLOCKS_AVX2_INLINE static __m256 piece(const float* s, const uint8_t* b, int g, int v) {
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

// Group g's 4 pieces, made one at a time in order (piece<kProduct>(v) = Avx2Blocks<T>::piece's),
// so that one is live at a time. The legacy 4- and 5-bit blocks widen each byte once, on
// construction, for its two nibbles (pieces v and v + 2), and broadcast the fifth bits once.
template <WeightType T>
struct Avx2Group {
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

  // Scales from s (Avx2Blocks<T>::scales), or with s null (kRegisterScales), from the block.
  BLOCKS_AVX2_INLINE Avx2Group(const float* scales, const uint8_t* block, int group) : s(scales), b(block), g(group) {
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
  BLOCKS_AVX2_INLINE __m256 piece(int v) const {
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
      return Avx2Blocks<T>::template piece<kProduct>(s, b, g, v);
    }
  }
};

// A vector of partial sums reduced in one fixed order (halves, then pairs, then the last two).
BLOCKS_AVX2_INLINE float reduce_avx2(__m256 acc) {
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}

// kTail: the tile's type may be a float type, whose rows have a tail past K32 (a block type's
// never has: its direct tiles then store without a branch).
template <bool kTail, int ROWS, int COLS>
BLOCKS_AVX2_INLINE void store_tile_avx2(const Slice& s, const __m256 (&acc)[ROWS][COLS], int64_t r0, int64_t n0) {
  const bool tail = kTail && s.K32 < s.K;
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) {
      const int64_t n = n0 + j;
      const float sum = reduce_avx2(acc[i][j]);
      s.out[(r0 + i) * s.N + n] = tail ? sum : sum + (s.bias ? s.bias[n] : 0.f);
    }
  if (tail) add_tails(s, r0, ROWS, n0, COLS);
}

// Rows [r0, r0 + ROWS) of x against COLS weight rows from n0, blocks dequantized into registers,
// their scales converted here.
template <WeightType T, int ROWS, int COLS>
BLOCKS_AVX2 void tile_direct_avx2(const Slice& s, int64_t r0, int64_t n0) {
  using D = Avx2Blocks<T>;
  const uint8_t* w = s.data + n0 * s.row_bytes;
  const float* x = s.x + r0 * s.K;
  const int64_t blocks = s.K32 / D::kWeights;
  const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchBytesAvx2;  // as tile_direct
  __m256 acc[ROWS][COLS];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_setzero_ps();
  // Scales a tile converts itself: the legacy types' into registers (Avx2Group). Q4_K and Q5_K's
  // for all 8 sub-blocks of each column once a block, from 2 rows of x on (their conversion shared
  // by the rows); at 1 row each group's own two as it goes, as Q6_K's, whose conversion is cheap
  // either way (measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md).
  constexpr bool kK4 = T == WeightType::Q4_K || T == WeightType::Q5_K;
  constexpr bool kBlockScales = kK4 && ROWS > 1;
  constexpr bool kGroupScales = !Avx2Group<T>::kRegisterScales && D::kScales > 0 && !kBlockScales;
  alignas(32) float own[kBlockScales ? COLS : 1][D::kScales > 0 ? D::kScales : 1];
  for (int64_t blk = 0; blk < blocks; ++blk) {
    if (r0 == 0)
      for (int64_t offset = 0; offset < COLS * D::kBytes; offset += 64)
        _mm_prefetch(ahead + blk * COLS * D::kBytes + offset, _MM_HINT_T1);
    if constexpr (kBlockScales)
      for (int j = 0; j < COLS; ++j) D::scales(w + j * s.row_bytes + blk * D::kBytes, own[j]);
#pragma GCC unroll 8
    for (int g = 0; g < D::kGroups; ++g) {
      const int64_t k = blk * D::kWeights + 32 * g;
      for (int j = 0; j < COLS; ++j) {
        const uint8_t* bj = w + j * s.row_bytes + blk * D::kBytes;
        const float* sj = nullptr;  // the legacy types' scales: from the block, into registers
        alignas(32) float group_scales[D::kScales > 0 ? D::kScales : 1];
        if constexpr (kBlockScales) {
          sj = own[j];
        } else if constexpr (kGroupScales && kK4) {
          D::group_scales(bj, g, group_scales);
          sj = group_scales;
        } else if constexpr (kGroupScales) {
          D::scales(bj, group_scales);
          sj = group_scales;
        }
        const Avx2Group<T> pieces(sj, bj, g);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          const __m256 wv = pieces.template piece<true>(v);
          for (int i = 0; i < ROWS; ++i)
            acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * s.K + k + 8 * v), wv, acc[i][j]);
        }
      }
    }
  }
  store_tile_avx2<Avx2Blocks<T>::kFloat, ROWS, COLS>(s, acc, r0, n0);
}

// All R (<= kDirectRowsAvx2) rows of x against COLS weight rows from n0 in one tile, so that
// each block is dequantized once for all rows: up to 8 accumulators (COLS 8 at 1 row, 2 up to 4
// rows, 1 up to 8).
template <WeightType T, int COLS>
BLOCKS_AVX2 void columns_direct_avx2(const Slice& s, int64_t n0) {
  static_assert(COLS == 1 || COLS == 2 || COLS == 8);
  switch (s.R) {
    case 8: if constexpr (COLS == 1) return tile_direct_avx2<T, 8, COLS>(s, 0, n0); break;
    case 7: if constexpr (COLS == 1) return tile_direct_avx2<T, 7, COLS>(s, 0, n0); break;
    case 6: if constexpr (COLS == 1) return tile_direct_avx2<T, 6, COLS>(s, 0, n0); break;
    case 5: if constexpr (COLS == 1) return tile_direct_avx2<T, 5, COLS>(s, 0, n0); break;
    case 4: if constexpr (COLS <= 2) return tile_direct_avx2<T, 4, COLS>(s, 0, n0); break;
    case 3: if constexpr (COLS <= 2) return tile_direct_avx2<T, 3, COLS>(s, 0, n0); break;
    case 2: if constexpr (COLS <= 2) return tile_direct_avx2<T, 2, COLS>(s, 0, n0); break;
    case 1: return tile_direct_avx2<T, 1, COLS>(s, 0, n0);
  }
}

// Weights [0, K32) of `cols` weight rows into out [cols, K32], natural order.
template <WeightType T>
BLOCKS_AVX2 void dequantize_avx2(const uint8_t* row, int64_t row_bytes, int64_t cols, int64_t K32, float* out) {
  using D = Avx2Blocks<T>;
  alignas(32) float scales[D::kScales > 0 ? D::kScales : 1];
  for (int64_t j = 0; j < cols; ++j) {
    const uint8_t* w = row + j * row_bytes;
    float* o = out + j * K32;
    for (int64_t blk = 0; blk < K32 / D::kWeights; ++blk) {
      const uint8_t* block = w + blk * D::kBytes;
      for (int64_t offset = 0; offset < D::kBytes; offset += 64)
        _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytesAvx2 + offset, _MM_HINT_T1);
      D::scales(block, scales);
#pragma GCC unroll 8
      for (int g = 0; g < D::kGroups; ++g) {
        const Avx2Group<T> pieces(scales, block, g);
        for (int v = 0; v < 4; ++v) _mm256_storeu_ps(o + blk * D::kWeights + 32 * g + 8 * v, pieces.template piece<false>(v));
      }
    }
  }
}

// ROWS rows of x against COLS dequantized weight rows w [COLS, K32] (the buffer): the same sums
// in the same order as tile_direct_avx2.
template <int ROWS, int COLS>
BLOCKS_AVX2 void tile_buffered_avx2(const Slice& s, const float* w, int64_t r0, int64_t n0) {
  __m256 acc[ROWS][COLS];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < s.K32; k += 8) {
    __m256 wv[COLS];
    for (int j = 0; j < COLS; ++j) wv[j] = _mm256_loadu_ps(w + j * s.K32 + k);
    for (int i = 0; i < ROWS; ++i) {
      const __m256 xv = _mm256_loadu_ps(s.x + (r0 + i) * s.K + k);
      for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  store_tile_avx2<true, ROWS, COLS>(s, acc, r0, n0);
}

// All R rows of x, in tiles of 6 (12 accumulators) against COLS buffered weight rows.
template <int COLS>
BLOCKS_AVX2 void rows_buffered_avx2(const Slice& s, const float* w, int64_t n0) {
  int64_t r = 0;
  for (; r + 6 <= s.R; r += 6) tile_buffered_avx2<6, COLS>(s, w, r, n0);
  switch (s.R - r) {
    case 5: return tile_buffered_avx2<5, COLS>(s, w, r, n0);
    case 4: return tile_buffered_avx2<4, COLS>(s, w, r, n0);
    case 3: return tile_buffered_avx2<3, COLS>(s, w, r, n0);
    case 2: return tile_buffered_avx2<2, COLS>(s, w, r, n0);
    case 1: return tile_buffered_avx2<1, COLS>(s, w, r, n0);
    default: return;
  }
}

// Rows of x up to which this path dequantizes blocks into registers (one tile of all rows), and
// past which into the buffer, once per group of weight rows, for tiles of 6 rows of x against
// 2 weight rows: up to 8 rows the registers are faster than the buffer's store and reload, past
// them the buffer is faster than tiles that each dequantize again (measured: see
// bench/results/kernel-tuning-2026-11-29-to-12-03.md).
constexpr int64_t kDirectRowsAvx2 = 8;

template <WeightType T>
BLOCKS_AVX2 void slice_avx2(const Slice& s, float* buffer) {
  int64_t n = s.begin;
  if (s.R <= kDirectRowsAvx2) {
    if (s.R == 1)  // one row of x: eight independent sums to hide FMA latency
      for (; n + 8 <= s.end; n += 8) columns_direct_avx2<T, 8>(s, n);
    // 5 to 8 rows: one column at a time, every block dequantized once for all rows, not in
    // several tiles that each dequantize it (measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md).
    if (s.R <= 4)
      for (; n + 2 <= s.end; n += 2) columns_direct_avx2<T, 2>(s, n);
    for (; n < s.end; ++n) columns_direct_avx2<T, 1>(s, n);
    return;
  }
  for (; n < s.end; n += kGroupRows) {
    const int64_t cols = std::min(kGroupRows, s.end - n);
    dequantize_avx2<T>(s.data + n * s.row_bytes, s.row_bytes, cols, s.K32, buffer);
    int64_t j = 0;
    for (; j + 2 <= cols; j += 2) rows_buffered_avx2<2>(s, buffer + j * s.K32, n + j);
    if (j < cols) rows_buffered_avx2<1>(s, buffer + j * s.K32, n + j);
  }
}

// ---- AVX-512 path ----------------------------------------------------------------------------
// (F16C for the scale fields: every CPU with AVX-512 has it.)
#define BLOCKS_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define BLOCKS_AVX512_INLINE BLOCKS_AVX512 SPECENGINE_INLINE

bool use_blocks_avx512() {
  static const bool f16c = __builtin_cpu_supports("f16c");
  return f16c && use_avx512();
}

// What bounds these loops is shuffles (vpermps lookups, broadcasts of scales from registers,
// vpmovzxbd widenings) more than the two 512-bit FMAs a cycle (measured: see
// bench/results/kernel-tuning-2026-11-29-to-12-03.md). So a block's scales are converted ahead into a small float array and
// broadcast from memory (a load, folded into the FMA that builds a table), and a block's bytes
// are spread over the 16 lanes by a 128-bit broadcast load and a per-lane shift (vpsrlvd),
// not widened: lane l of a vector of 16 weights then holds byte kLaneByte[l] = 4 (l % 4) + l / 4
// of its 16 (dword l % 4, shifted right by 8 (l / 4) bits). Those weights come in "lane order",
// and x is given to them in the same order (Slice::x_lanes); the order is an involution, so the
// same permutation restores the natural one (dequantize_rows).
BLOCKS_AVX512_INLINE __m512i lane_bytes() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}
BLOCKS_AVX512_INLINE __m512i lane_shifts(int extra) {
  return _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24),
                          _mm512_set1_epi32(extra));
}

// The 16 bytes at p in lane order, each in its lane's low bits (garbage above them), shifted
// right by `extra` bits more (4: the high nibbles).
BLOCKS_AVX512_INLINE __m512i bytes_in_lanes(const uint8_t* p, int extra) {
  return _mm512_srlv_epi32(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                           lane_shifts(extra));
}

BLOCKS_AVX512_INLINE __m512 iota_ps(float start) {
  return _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(start));
}

// Two float16 fields side by side (a block's d and m, or d and dmin) -> float32 lanes 0 and 1.
BLOCKS_AVX512_INLINE __m128 f16_pair(const uint8_t* p) { return _mm_cvtph_ps(_mm_cvtsi32_si128(load_u32(p))); }

// index's bits 0-3 from `low`, bit 4 from bit 0 of `bit` (bits above 4 are garbage: the 5-bit
// lookups ignore them).
BLOCKS_AVX512_INLINE __m512i five_bit_index(__m512i low, __m512i bit) {
  return _mm512_ternarylogic_epi32(low, _mm512_slli_epi32(bit, 4), _mm512_set1_epi32(0x0F), 0xE4);  // c ? a : b
}

// A format's blocks in 512-bit registers:
//   scales(b, s)          the block's kScales float32 scales, written to s (converted once, ahead)
//   group(s, b, g, lo, hi) its weights 32 g .. 32 g + 31 (g < kGroups), lane order if kLanes
// The float types are taken as "blocks" of 32 weights.
template <WeightType T>
struct Avx512Blocks;

template <>
struct Avx512Blocks<WeightType::F32> {
  static constexpr int64_t kWeights = 32, kBytes = 128, kGroups = 1, kScales = 0;
  static constexpr bool kLanes = false;
  static constexpr int kCols = 4;
  BLOCKS_AVX512_INLINE static void scales(const uint8_t*, float*) {}
  BLOCKS_AVX512_INLINE static void group(const float*, const uint8_t* b, int, __m512& lo, __m512& hi) {
    lo = _mm512_loadu_ps(b);
    hi = _mm512_loadu_ps(b + 64);
  }
};

template <>
struct Avx512Blocks<WeightType::F16> {
  static constexpr int64_t kWeights = 32, kBytes = 64, kGroups = 1, kScales = 0;
  static constexpr bool kLanes = false;
  static constexpr int kCols = 4;
  BLOCKS_AVX512_INLINE static void scales(const uint8_t*, float*) {}
  BLOCKS_AVX512_INLINE static void group(const float*, const uint8_t* b, int, __m512& lo, __m512& hi) {
    lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32)));
  }
};

template <>
struct Avx512Blocks<WeightType::BF16> {
  static constexpr int64_t kWeights = 32, kBytes = 64, kGroups = 1, kScales = 0;
  static constexpr bool kLanes = false;
  static constexpr int kCols = 4;
  BLOCKS_AVX512_INLINE static void scales(const uint8_t*, float*) {}
  BLOCKS_AVX512_INLINE static __m512 widen(const uint8_t* p) {
    const __m512i raw = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  }
  BLOCKS_AVX512_INLINE static void group(const float*, const uint8_t* b, int, __m512& lo, __m512& hi) {
    lo = widen(b);
    hi = widen(b + 32);
  }
};

template <>
struct Avx512Blocks<WeightType::Q8_0> {
  static constexpr WeightTypeLayout L = layout_of(WeightType::Q8_0);
  static constexpr int64_t kWeights = L.block_weights, kBytes = L.block_bytes, kGroups = 1, kScales = 1;
  static constexpr bool kLanes = false;
  static constexpr int kCols = 4;
  BLOCKS_AVX512_INLINE static void scales(const uint8_t* b, float* s) { s[0] = _cvtsh_ss(load_u16(b + L.d)); }
  BLOCKS_AVX512_INLINE static __m512 widen(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  BLOCKS_AVX512_INLINE static void group(const float* s, const uint8_t* b, int, __m512& lo, __m512& hi) {
    lo = _mm512_mul_ps(widen(b + L.qs), _mm512_set1_ps(s[0]));  // gguf: q * d
    hi = _mm512_mul_ps(widen(b + L.qs + 16), _mm512_set1_ps(s[0]));
  }
};

// Q4_0 and Q4_1: a table of the block's 16 values, looked up by nibble.
template <>
struct Avx512Blocks<WeightType::Q4_0> {
  static constexpr WeightTypeLayout L = layout_of(WeightType::Q4_0);
  static constexpr int64_t kWeights = L.block_weights, kBytes = L.block_bytes, kGroups = 1, kScales = 1;
  static constexpr bool kLanes = true;
  static constexpr int kCols = 4;
  BLOCKS_AVX512_INLINE static void scales(const uint8_t* b, float* s) { s[0] = _cvtsh_ss(load_u16(b + L.d)); }
  BLOCKS_AVX512_INLINE static void group(const float* s, const uint8_t* b, int, __m512& lo, __m512& hi) {
    const __m512 table = _mm512_mul_ps(_mm512_set1_ps(s[0]), iota_ps(-8.f));  // d * (q - 8)
    lo = _mm512_permutexvar_ps(bytes_in_lanes(b + L.qs, 0), table);
    hi = _mm512_permutexvar_ps(bytes_in_lanes(b + L.qs, 4), table);
  }
};

// d * q + m with one rounding: d * q is exact in float32 (d a float16, 11 significant bits; q < 32,
// 5 bits), so the fused form is bit for bit gguf's two roundings, in one instruction.
BLOCKS_AVX512_INLINE __m512 exact_affine(__m512 d, __m512 q, __m512 m) { return _mm512_fmadd_ps(d, q, m); }

template <>
struct Avx512Blocks<WeightType::Q4_1> {
  static constexpr WeightTypeLayout L = layout_of(WeightType::Q4_1);
  static constexpr int64_t kWeights = L.block_weights, kBytes = L.block_bytes, kGroups = 1, kScales = 2;
  static constexpr bool kLanes = true;
  static constexpr int kCols = 4;
  BLOCKS_AVX512_INLINE static void scales(const uint8_t* b, float* s) {
    static_assert(L.m == L.d + 2, "d and m side by side");
    _mm_storel_pi(reinterpret_cast<__m64*>(s), f16_pair(b + L.d));  // d, m
  }
  BLOCKS_AVX512_INLINE static void group(const float* s, const uint8_t* b, int, __m512& lo, __m512& hi) {
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
  BLOCKS_AVX512_INLINE static void scales(const uint8_t* b, float* s) {
    static_assert(L.d + 2 == (L.m >= 0 ? L.m : L.qh), "d and then m (Q5_1) or qh (Q5_0)");
    _mm_storel_pi(reinterpret_cast<__m64*>(s), f16_pair(b + L.d));  // d, m (Q5_0: m is qh's bytes, unused)
  }
  BLOCKS_AVX512_INLINE static void group(const float* s, const uint8_t* b, int, __m512& lo, __m512& hi) {
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
struct Avx512Blocks<WeightType::Q5_0> : Avx512Q5<WeightType::Q5_0> {};
template <>
struct Avx512Blocks<WeightType::Q5_1> : Avx512Q5<WeightType::Q5_1> {};

// Q4_K and Q5_K: 8 sub-blocks of 32, each with its scale d * sc and shift dmin * m, and its own
// table. scales: s[0..7] the scales, s[8..15] the shifts.
template <WeightType T>
struct Avx512K4 {
  static constexpr WeightTypeLayout L = layout_of(T);
  static constexpr int64_t kWeights = L.block_weights, kBytes = L.block_bytes, kGroups = 8, kScales = 16;
  static constexpr bool kLanes = true;
  static constexpr int kCols = 4;
  BLOCKS_AVX512_INLINE static void scales(const uint8_t* b, float* s) {
    static_assert(L.m == L.d + 2, "d and dmin side by side");
    const __m512 fields = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scale_min_k4_bytes(b + L.scales)));
    const __m512 d_dmin = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                                _mm512_castps128_ps512(f16_pair(b + L.d)));
    _mm512_storeu_ps(s, _mm512_mul_ps(d_dmin, fields));  // d * sc, dmin * m
  }
  BLOCKS_AVX512_INLINE static void group(const float* s, const uint8_t* b, int g, __m512& lo, __m512& hi) {
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
struct Avx512Blocks<WeightType::Q4_K> : Avx512K4<WeightType::Q4_K> {};
template <>
struct Avx512Blocks<WeightType::Q5_K> : Avx512K4<WeightType::Q5_K> {};

// Q6_K: 16 scales d * scale[i], one per 16 weights; q = low nibble | 2 high bits << 4, minus 32.
template <>
struct Avx512Blocks<WeightType::Q6_K> {
  static constexpr WeightTypeLayout L = layout_of(WeightType::Q6_K);
  static constexpr int64_t kWeights = L.block_weights, kBytes = L.block_bytes, kGroups = 8, kScales = 16;
  static constexpr bool kLanes = true;
  static constexpr int kCols = 2;  // 4 x 4 tiles spilled registers
  BLOCKS_AVX512_INLINE static void scales(const uint8_t* b, float* s) {
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(b + L.d)));
    const __m512i scales = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + L.scales)));
    _mm512_storeu_ps(s, _mm512_mul_ps(d, _mm512_cvtepi32_ps(scales)));
  }
  // Weights 16 part .. 16 part + 15 of group g (0..7): 128 weights per half of the block, 4 groups each.
  BLOCKS_AVX512_INLINE static __m512 sixteen(const float* s, const uint8_t* b, int g, int part) {
    const int half = g / 4, k = g % 4;
    const __m512i low = bytes_in_lanes(b + L.qs + 64 * half + 32 * (k & 1) + 16 * part, 4 * (k >> 1));
    const __m512i qh = bytes_in_lanes(b + L.qh + 32 * half + 16 * part, 0);
    const __m512i high = k < 3 ? _mm512_slli_epi32(qh, 4 - 2 * k) : _mm512_srli_epi32(qh, 2);  // bits 2k, 2k+1 -> 4, 5
    const __m512i q = _mm512_and_si512(_mm512_ternarylogic_epi32(low, high, _mm512_set1_epi32(0x0F), 0xE4),
                                       _mm512_set1_epi32(0x3F));
    return _mm512_mul_ps(_mm512_set1_ps(s[2 * g + part]),
                         _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(32))));
  }
  BLOCKS_AVX512_INLINE static void group(const float* s, const uint8_t* b, int g, __m512& lo, __m512& hi) {
    lo = sixteen(s, b, g, 0);
    hi = sixteen(s, b, g, 1);
  }
};

// x [R, K] -> [R, K32], each run of 16 in lane order.
BLOCKS_AVX512 std::vector<float> x_in_lanes(const float* x, int64_t R, int64_t K, int64_t K32) {
  std::vector<float> lanes(static_cast<size_t>(R * K32));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K32; k += 16)
      _mm512_storeu_ps(lanes.data() + r * K32 + k, _mm512_permutexvar_ps(lane_bytes(), _mm512_loadu_ps(x + r * K + k)));
  return lanes;
}

// The sums of four vectors, in lanes 0-3 (a's, b's, c's, d's): each reduced by the tree of
// _mm512_reduce_add_ps (lane l with l + 8, then l + 4, l + 2, l + 1), so a sum is the same
// bits whichever way it was reduced, four at a time or alone.
BLOCKS_AVX512_INLINE __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
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
template <bool kTail, int ROWS, int COLS>  // kTail as store_tile_avx2's
BLOCKS_AVX512_INLINE void store_tile(const Slice& s, const __m512 (&acc)[ROWS][COLS], int64_t r0, int64_t n0) {
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

// Rows [r0, r0 + ROWS) of x against COLS weight rows from n0, blocks dequantized into
// registers; `scales` holds the blocks' scales (group_scales).
template <WeightType T, int ROWS, int COLS>
BLOCKS_AVX512 void tile_direct(const Slice& s, int64_t r0, int64_t n0, const float* scales) {
  using D = Avx512Blocks<T>;
  const uint8_t* w = s.data + n0 * s.row_bytes;
  const int64_t xs = D::kLanes ? s.K32 : s.K;  // x's row stride
  const float* x = (D::kLanes ? s.x_lanes : s.x) + r0 * xs;
  const int64_t blocks = s.K32 / D::kWeights;
  // The group's rows are contiguous: its stream kPrefetchBytes ahead is prefetched in equal
  // steps, COLS * kBytes a block (each line about once, with no test per block), by the first
  // row tile.
  const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchBytes;
  __m512 acc[ROWS][COLS];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < blocks; ++blk) {
    if (r0 == 0)
      for (int64_t offset = 0; offset < COLS * D::kBytes; offset += 64)
        _mm_prefetch(ahead + blk * COLS * D::kBytes + offset, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int g = 0; g < D::kGroups; ++g) {
      const int64_t k = blk * D::kWeights + 32 * g;
      __m512 x_lo[ROWS], x_hi[ROWS];  // loaded once for all COLS weight rows
      for (int i = 0; i < ROWS; ++i) {
        x_lo[i] = _mm512_loadu_ps(x + i * xs + k);
        x_hi[i] = _mm512_loadu_ps(x + i * xs + k + 16);
      }
      for (int j = 0; j < COLS; ++j) {
        __m512 lo, hi;
        D::group(scales + (j * blocks + blk) * D::kScales, w + j * s.row_bytes + blk * D::kBytes, g, lo, hi);
        for (int i = 0; i < ROWS; ++i) {
          acc[i][j] = _mm512_fmadd_ps(x_lo[i], lo, acc[i][j]);
          acc[i][j] = _mm512_fmadd_ps(x_hi[i], hi, acc[i][j]);
        }
      }
    }
  }
  store_tile<layout_of(T).block_weights == 1, ROWS, COLS>(s, acc, r0, n0);
}

// All R (<= kDirectRows) rows of x against COLS weight rows from n0 in one tile: first the
// blocks' scales, converted once into s.scratch, then the tile, dequantizing each block once.
template <WeightType T, int COLS>
BLOCKS_AVX512 void columns_direct(const Slice& s, int64_t n0) {
  using D = Avx512Blocks<T>;
  const uint8_t* w = s.data + n0 * s.row_bytes;
  const int64_t blocks = s.K32 / D::kWeights;
  float* scales = s.scratch;
  if constexpr (D::kScales > 0)
    for (int j = 0; j < COLS; ++j)
      for (int64_t blk = 0; blk < blocks; ++blk)
        D::scales(w + j * s.row_bytes + blk * D::kBytes, scales + (j * blocks + blk) * D::kScales);
  static_assert(kDirectRows == 4, "a tile for each row count up to kDirectRows");
  if constexpr (COLS == 8) {  // one row of x (decoding): eight FMA chains
    return tile_direct<T, 1, COLS>(s, 0, n0, scales);
  } else {
    switch (s.R) {
      case 4: return tile_direct<T, 4, COLS>(s, 0, n0, scales);
      case 3: return tile_direct<T, 3, COLS>(s, 0, n0, scales);
      case 2: return tile_direct<T, 2, COLS>(s, 0, n0, scales);
      default: return tile_direct<T, 1, COLS>(s, 0, n0, scales);
    }
  }
}

// ROWS rows of x (row stride xs) against COLS dequantized weight rows w [COLS, K32] (the buffer):
// the same sums in the same order as tile_direct.
template <int ROWS, int COLS>
BLOCKS_AVX512 void tile_buffered(const Slice& s, const float* x, int64_t xs, const float* w, int64_t r0, int64_t n0) {
  __m512 acc[ROWS][COLS];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < COLS; ++j) acc[i][j] = _mm512_setzero_ps();
  x += r0 * xs;
  for (int64_t k = 0; k < s.K32; k += 16) {
    __m512 wv[COLS];
    for (int j = 0; j < COLS; ++j) wv[j] = _mm512_loadu_ps(w + j * s.K32 + k);
    for (int i = 0; i < ROWS; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * xs + k);
      for (int j = 0; j < COLS; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  store_tile<true, ROWS, COLS>(s, acc, r0, n0);
}

// All R rows of x against COLS buffered weight rows, in tiles of at most kBufferedRows rows
// (ROWS x COLS accumulators, COLS weight vectors and a row of x within the 32 registers), the
// rows shared out evenly: a tile of one or two rows loads about as many vectors as it multiplies.
// Seven rows take one tile of 7 (GCC takes a weight vector from memory), faster than tiles of 3
// and 4; 13 and 14 rows take tiles of 4-6, faster than tiles of 7 (measured: see
// bench/results/kernel-tuning-2026-11-29-to-12-03.md).
constexpr int64_t kBufferedRows = 6;
template <int COLS>
BLOCKS_AVX512 void columns_buffered(const Slice& s, const float* x, int64_t xs, const float* w, int64_t n0) {
  const int64_t tiles = s.R == 7 ? 1 : (s.R + kBufferedRows - 1) / kBufferedRows;
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int64_t rows = (s.R - r) / (tiles - t);  // the rows left, shared by the tiles left
    switch (rows) {
      case 7: tile_buffered<7, COLS>(s, x, xs, w, r, n0); break;
      case 6: tile_buffered<6, COLS>(s, x, xs, w, r, n0); break;
      case 5: tile_buffered<5, COLS>(s, x, xs, w, r, n0); break;
      case 4: tile_buffered<4, COLS>(s, x, xs, w, r, n0); break;
      case 3: tile_buffered<3, COLS>(s, x, xs, w, r, n0); break;
      case 2: tile_buffered<2, COLS>(s, x, xs, w, r, n0); break;
      default: tile_buffered<1, COLS>(s, x, xs, w, r, n0); break;
    }
    r += rows;
  }
}

// Weights [0, K32) of `cols` weight rows into out [cols, K32]: in lane order where the format
// has one, unless `natural`.
template <WeightType T, bool natural>
BLOCKS_AVX512 void dequantize_avx512(const uint8_t* row, int64_t row_bytes, int64_t cols, int64_t K32, float* out) {
  using D = Avx512Blocks<T>;
  alignas(64) float scales[D::kScales > 0 ? D::kScales : 1];
  for (int64_t j = 0; j < cols; ++j) {
    const uint8_t* w = row + j * row_bytes;
    float* o = out + j * K32;
    for (int64_t blk = 0; blk < K32 / D::kWeights; ++blk) {
      const uint8_t* block = w + blk * D::kBytes;
      for (int64_t offset = 0; offset < D::kBytes; offset += 64)
        _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes + offset, _MM_HINT_T1);
      D::scales(block, scales);
#pragma GCC unroll 8
      for (int g = 0; g < D::kGroups; ++g) {
        __m512 lo, hi;
        D::group(scales, block, g, lo, hi);
        if constexpr (natural && D::kLanes) {
          lo = _mm512_permutexvar_ps(lane_bytes(), lo);
          hi = _mm512_permutexvar_ps(lane_bytes(), hi);
        }
        _mm512_storeu_ps(o + blk * D::kWeights + 32 * g, lo);
        _mm512_storeu_ps(o + blk * D::kWeights + 32 * g + 16, hi);
      }
    }
  }
}

template <WeightType T>
BLOCKS_AVX512 void slice_avx512(const Slice& s, float* buffer) {
  int64_t n = s.begin;
  if (s.R == 1) {  // a row of x against eight weight rows: eight independent sums to hide FMA latency
    for (; n + 8 <= s.end; n += 8) columns_direct<T, 8>(s, n);
  }
  if (s.R <= kDirectRows) {  // kCols weight rows at a time: tiles of 4 x kCols accumulators
    constexpr int cols = Avx512Blocks<T>::kCols;
    for (; n + cols <= s.end; n += cols) columns_direct<T, cols>(s, n);
    for (; n < s.end; ++n) columns_direct<T, 1>(s, n);
    return;
  }
  using D = Avx512Blocks<T>;
  const float* x = D::kLanes ? s.x_lanes : s.x;
  const int64_t xs = D::kLanes ? s.K32 : s.K;
  for (; n < s.end; n += kGroupRows) {
    const int64_t cols = std::min(kGroupRows, s.end - n);
    dequantize_avx512<T, false>(s.data + n * s.row_bytes, s.row_bytes, cols, s.K32, buffer);
    if (cols == kGroupRows) {
      columns_buffered<kGroupRows>(s, x, xs, buffer, n);
    } else {
      for (int64_t j = 0; j < cols; ++j) columns_buffered<1>(s, x, xs, buffer + j * s.K32, n + j);
    }
  }
}
#endif  // SPECENGINE_X86

using Path = VectorPath;

Path choose_path() {
#ifdef SPECENGINE_X86
  return vector_path(use_blocks_avx512(), use_blocks_avx2());
#else
  return vector_path(false, false);
#endif
}

template <WeightType T>
void run_slice(Path path, const Slice& s, float* buffer) {
#ifdef SPECENGINE_X86
  if (path == Path::avx512) return slice_avx512<T>(s, buffer);
  if (path == Path::avx2) return slice_avx2<T>(s, buffer);
#endif
  slice_portable<T>(s, buffer);
}

// Whole rows [0, K) of `count` consecutive rows of one part into out [count, K].
template <WeightType T>
void dequantize_part_rows(Path path, const uint8_t* rows, int64_t row_bytes, int64_t count, int64_t K, float* out) {
#ifdef SPECENGINE_X86
  if (path == Path::avx512) {
    const int64_t K32 = K & ~(kStep - 1);
    if (K32 == K) return dequantize_avx512<T, true>(rows, row_bytes, count, K, out);
    for (int64_t j = 0; j < count; ++j) {  // a float type's tail: each row on its own
      dequantize_avx512<T, true>(rows + j * row_bytes, row_bytes, 1, K32, out + j * K);
      dequantize_row_portable<T>(rows + j * row_bytes + K32 * block_bytes(static_cast<int64_t>(T)), K - K32,
                                 out + j * K + K32);
    }
    return;
  }
  if (path == Path::avx2) {
    const int64_t K32 = K & ~(kStep - 1);
    if (K32 == K) return dequantize_avx2<T>(rows, row_bytes, count, K, out);
    for (int64_t j = 0; j < count; ++j) {
      dequantize_avx2<T>(rows + j * row_bytes, row_bytes, 1, K32, out + j * K);
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
// dequantize_block (portable), Avx2Blocks/Avx2Group and Avx512Blocks specializations.
struct TypeFunctions {
  WeightType type;
  void (*slice)(Path, const Slice&, float*);  // a thread's rows of the product (run_slice)
  void (*rows)(Path, const uint8_t* rows, int64_t row_bytes, int64_t count, int64_t K,
               float* out);  // whole rows dequantized (dequantize_part_rows)
  TailWeight tail;           // a float type's weight k of a row (float_weight)
  bool lane_order;           // AVX-512: its weights come in lane order, so x must too (Avx512Blocks)
};

// bfloat16 weights: linear.cpp's column tiles (x de-interleaved to their pairs of weights).
void slice_bf16(Path path, const Slice& s, float*) {
  linear_bf16_columns(path, s.x, reinterpret_cast<const uint16_t*>(s.data), s.bias, s.out, s.R, s.K, s.N, s.begin,
                      s.end);
}

template <WeightType T>
constexpr TypeFunctions functions_of() {
#ifdef SPECENGINE_X86
  constexpr bool lanes = Avx512Blocks<T>::kLanes;
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
  // Buffered paths hold a group of dequantized rows; the AVX-512 one only past kDirectRows rows.
  const bool buffered = path != Path::avx512 || R > kDirectRows;
  std::vector<float> x_lanes;
#ifdef SPECENGINE_X86
  bool lanes = false;
  for (int64_t p = 0; p < w.part_count; ++p) lanes = lanes || functions(w.parts[p].type).lane_order;
  if (path == Path::avx512 && lanes) x_lanes = x_in_lanes(x, R, K, K32);
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
