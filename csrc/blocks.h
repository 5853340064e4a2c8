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

// Weights per block and bytes per block of `type`; 0 for an id that names no WeightType.
int64_t block_weights(int64_t type);
int64_t block_bytes(int64_t type);

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
