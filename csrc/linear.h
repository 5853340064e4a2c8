#pragma once
#include <cstdint>

namespace specengine {

// out[r, n] = bias[n] + sum_k x[r, k] * w[n, k], with bfloat16 weights widened to float32 on
// the fly and float32 accumulation. Decoding on a CPU streams every weight once per step, so
// storing a bfloat16 checkpoint as bfloat16 halves the bytes read against an upcast float32
// copy, and the arithmetic is the same (bfloat16 -> float32 is exact).
// x [R, K] float32 and w [N, K] bfloat16 (as raw uint16 bits) row-major and contiguous;
// bias [N] float32 or nullptr; out [R, N] float32. The Python host wrapper
// (specengine/ops/linear.py) validates and allocates.
void linear_bf16_weight(const float* x, const uint16_t* w, const float* bias, float* out, int64_t R, int64_t K,
                        int64_t N);

}  // namespace specengine
