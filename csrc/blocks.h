#pragma once
#include <cstdint>

namespace specengine {

// Matrices kept as a GGUF file stores them (see specengine/ops/blocks.py for the terms).
//
// Layout: a matrix [N, K] is its parts' rows stacked in part order; a part is `rows` rows of one
// weight type, each row K / block_weights(type) blocks of block_bytes(type) bytes back to back
// (ggml's block structs, little-endian). The float types are blocks of one weight. Parts may
// differ in type (a Q4_K_M file's packed q/k/v: Q4_K, Q4_K, Q6_K).
//
// Exactness: every weight is the float32 value the gguf package's numpy dequantization computes
// (the same float32 operations in the same order, none fused: Q4_1 is d * q + m as a rounded
// multiply, then a rounded add; Q4_K (d * sc) * q - dmin * m; Q6_K (d * scale) * q). This file
// is built with -ffp-contract=off so that the compiler does not fuse them either. The products'
// sums over k (weights times activations) use FMAs, in an order of their own.
//
// Batch invariance: a row of x gets the same result, bit for bit, whatever R is and whatever the
// other rows hold (on one instruction-set path), so a request samples alike in any batch.
//
// The Python host wrapper (specengine/ops/blocks_cpp.py, behind specengine/ops/blocks.py)
// validates and allocates.

// ggml's type ids (gguf.GGMLQuantizationType).
enum class WeightType : int32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

// A weight type's block: block_weights weights in block_bytes bytes (the float types: one weight),
// and where its fields start in a block, -1 where it has none (kernels/weight_types.py says what
// each field holds): d the float16 scale, m the float16 min or dmin, scales the sub-block scales,
// qh the codes' high bits, qs their low bits (or a float type's value).
struct WeightTypeLayout {
  WeightType type;
  const char* name;
  int64_t block_weights, block_bytes;
  int d, m, scales, qh, qs;
};

// The weight types: kernels/weight_types.py holds the same table for Python and Triton, and
// tests/test_weight_types.py compares the two (through _C.weight_type_traits). Adding a type is an
// entry here and its functions in blocks.cpp (see kTypeFunctions there).
inline constexpr WeightTypeLayout kWeightTypes[] = {
    // type           name   weights bytes  d    m scales  qh  qs
    {WeightType::F32,  "F32",    1,   4,  -1, -1,  -1,  -1,  0},
    {WeightType::F16,  "F16",    1,   2,  -1, -1,  -1,  -1,  0},
    {WeightType::Q4_0, "Q4_0",  32,  18,   0, -1,  -1,  -1,  2},
    {WeightType::Q4_1, "Q4_1",  32,  20,   0,  2,  -1,  -1,  4},
    {WeightType::Q5_0, "Q5_0",  32,  22,   0, -1,  -1,   2,  6},
    {WeightType::Q5_1, "Q5_1",  32,  24,   0,  2,  -1,   4,  8},
    {WeightType::Q8_0, "Q8_0",  32,  34,   0, -1,  -1,  -1,  2},
    {WeightType::Q4_K, "Q4_K", 256, 144,   0,  2,   4,  -1, 16},
    {WeightType::Q5_K, "Q5_K", 256, 176,   0,  2,   4,  16, 48},
    {WeightType::Q6_K, "Q6_K", 256, 210, 208, -1, 192, 128,  0},
    {WeightType::BF16, "BF16",   1,   2,  -1, -1,  -1,  -1,  0},
};
inline constexpr int64_t kWeightTypeCount = sizeof kWeightTypes / sizeof kWeightTypes[0];

// The layout of the type with ggml id `type`; nullptr for an id that names no WeightType.
constexpr const WeightTypeLayout* find_layout(int64_t type) {
  for (const WeightTypeLayout& layout : kWeightTypes)
    if (static_cast<int64_t>(layout.type) == type) return &layout;
  return nullptr;
}

// The layout of a type known at compile time (the kernels' block structs read it).
constexpr const WeightTypeLayout& layout_of(WeightType type) { return *find_layout(static_cast<int64_t>(type)); }

// Weights per block and bytes per block of `type`; 0 for an id that names no WeightType.
constexpr int64_t block_weights(int64_t type) { return find_layout(type) ? find_layout(type)->block_weights : 0; }
constexpr int64_t block_bytes(int64_t type) { return find_layout(type) ? find_layout(type)->block_bytes : 0; }

struct MatrixPart {
  WeightType type;
  const uint8_t* data;  // [rows, row bytes], contiguous
  int64_t rows;
};

constexpr int64_t kMaxMatrixParts = 3;  // q, k and v

struct Matrix {
  int64_t in_features;  // K, a multiple of every part's block_weights
  int64_t part_count;   // 1 .. kMaxMatrixParts
  MatrixPart parts[kMaxMatrixParts];

  int64_t out_features() const {
    int64_t n = 0;
    for (int64_t p = 0; p < part_count; ++p) n += parts[p].rows;
    return n;
  }
};

// A dense bfloat16 matrix w [N, K] (raw bits, row-major) as one BF16 part.
inline Matrix bf16_matrix(const uint16_t* w, int64_t K, int64_t N) {
  Matrix m{K, 1, {}};
  m.parts[0] = {WeightType::BF16, reinterpret_cast<const uint8_t*>(w), N};
  return m;
}

// out[r, n] = bias[n] + sum_k x[r, k] * w[n, k] for the few rows of decoding and verification
// (R = 1 .. 32; any R works). Each weight block is read from memory once per call for all R rows:
// dequantized into registers (a few rows) or an L1 buffer (more), then multiplied against every
// row. x [R, K] float32 contiguous; bias [N] float32 or nullptr; out [R, N] float32.
void linear_blocks(const float* x, const Matrix& w, const float* bias, float* out, int64_t R);

// The exact float32 weights of rows [row_begin, row_end): out [row_end - row_begin, K].
void dequantize_rows(const Matrix& w, int64_t row_begin, int64_t row_end, float* out);

// The same, on the calling thread alone: for callers that already share their work among threads.
void dequantize_rows_serial(const Matrix& w, int64_t row_begin, int64_t row_end, float* out);

// out[i] = the exact float32 weights of row ids[i] (an embedding lookup): out [count, K]; each id
// in [0, N).
void gather_rows(const Matrix& w, const int64_t* ids, int64_t count, float* out);

}  // namespace specengine
