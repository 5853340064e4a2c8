#pragma once
#include <cstdint>

#include "cpu_features.h"

namespace specengine {

// The bfloat16 weight type's few-row product, the BF16 entry of blocks.cpp's kTypeFunctions
// (every product goes through linear_blocks; a dense bfloat16 matrix is one BF16 part):
// out[r, n] = bias[n] + sum_k x[r, k] * w[n, k] for columns n in [n_begin, n_end), with bfloat16
// weights widened to float32 on the fly and float32 accumulation, on `path`'s kernels. Decoding
// on a CPU streams every weight once per step, so storing a bfloat16 checkpoint as bfloat16
// halves the bytes read against an upcast float32 copy, and the arithmetic is the same
// (bfloat16 -> float32 is exact). Each column's sums run in one order whatever the slice and the
// rows beside it, so a thread's share changes no bit.
// x [R, K] float32 and w [>= n_end, K] bfloat16 (as raw uint16 bits) row-major and contiguous;
// bias [>= n_end] float32 or nullptr; out [R, N] float32 (row stride N).
void linear_bf16_columns(VectorPath path, const float* x, const uint16_t* w, const float* bias, float* out,
                         int64_t R, int64_t K, int64_t N, int64_t n_begin, int64_t n_end);

}  // namespace specengine
