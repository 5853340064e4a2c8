#pragma once
#include <cstdint>

#include "blocks.h"

namespace specengine {

// out[r, n] = bias[n] + sum_k x[r, k] * w[n, k] for prompt-sized R (a prefill: ops.product's
// GEMM_MIN_TOKENS_PER_ROW or more tokens per row), w a matrix of ggml blocks (blocks.h) or of float32/float16/bfloat16 weights,
// dequantized to float32 a few rows at a time on the way in.
//
// x [R, K] float32, contiguous; bias [N] float32 or nullptr; out rows out_stride floats apart
// (out_stride >= N): only columns [0, N) of each row are written, so out may be columns of a
// wider array.
//
// Summation order, the same for every output: one chain over k = 0, 1, .., K - 1 in order,
// acc = acc + x[r, k] * w[n, k] as an FMA (AVX-512 and AVX2 alike, so those two paths agree bit
// for bit) or as a rounded multiply then a rounded add (the portable path), from acc = 0; then
// acc + bias[n]. So an output's bits depend only on its row of x and its weight row: not on R,
// the row's position, the rows beside it, the tile or thread it lands in, or the thread count
// (batch invariance: a prompt prefills alike alone, in a batch, or in chunks). The error is a
// sequential float32 sum's, at most about (K + 1) * 2^-24 * (sum_k |x[r, k] w[n, k]| + |bias[n]|).
//
// The Python host wrapper (specengine/ops/blocks_cpp.py) validates and allocates.
void gemm_blocks(const float* x, const Matrix& w, const float* bias, float* out, int64_t R, int64_t out_stride);

}  // namespace specengine
