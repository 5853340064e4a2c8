#pragma once
#include <cstdint>

namespace specengine {

// Whether gemm_bf16_weight_amx can run here: a CPU with AMX bfloat16 tiles, granted by the OS,
// and allowed by the instruction-set limit (cpu_features.h).
bool gemm_amx_available();

// out[r, n] = bias[n] + sum_k x[r, k] * w[n, k] for prompt-sized R, on AMX tiles, accurate to
// float32: x is split into three bfloat16 terms (x = x1 + x2 + x3 to float32's 24 bits), whose
// products with bfloat16 weights are exact and are summed in float32 by the tiles. Each row's
// result depends only on that row of x (no blocking across rows), so a prompt prefills alike
// in any batch. Same layouts as a bfloat16 linear_blocks (blocks.h); call only where
// gemm_amx_available(). The Python host wrapper (specengine/ops/linear.py) validates and allocates.
void gemm_bf16_weight_amx(const float* x, const uint16_t* w, const float* bias, float* out, int64_t R, int64_t K,
                          int64_t N);

}  // namespace specengine
