#pragma once
#include <cstdint>

namespace specengine {

// One Llama-family decoder layer's weights, bfloat16 matrices (raw uint16 bits, [out, in],
// row-major) and float32 vectors. A bias or a q/k norm the architecture lacks is nullptr.
struct DecoderLayerWeights {
  const float* input_norm;         // [hidden]
  const uint16_t* qkv;             // [(H + 2 * Hkv) * D, hidden]: q, k and v rows packed
  const float* qkv_bias;           // [(H + 2 * Hkv) * D] or nullptr
  const float* q_norm;             // [D] per-head RMSNorm of q before the rotary (Qwen3) or nullptr
  const float* k_norm;             // [D] or nullptr (set together with q_norm)
  const uint16_t* o;               // [hidden, H * D]
  const float* o_bias;             // [hidden] or nullptr
  const float* post_norm;          // [hidden]
  const uint16_t* gate_up;         // [2 * intermediate, hidden]: gate rows, then up rows
  const float* gate_up_bias;       // [2 * intermediate] or nullptr
  const uint16_t* down;            // [hidden, intermediate]
  const float* down_bias;          // [hidden] or nullptr
  int64_t hidden, H, Hkv, D, intermediate;
  float eps;                       // of every RMSNorm of the layer
};

// Where the layer's attention reads and writes: see cached_attention in layers.h.
struct AttentionStep {
  const float* cos;            // [B, T, D]
  const float* sin;            // [B, T, D]
  const int64_t* positions;    // [B, T]
  float* cache_k;              // this layer's keys, row b at b * cache_row_stride
  float* cache_v;
  int64_t B, T, capacity, cache_row_stride, kv_len, window;
};

// x [B * T, hidden] float32, contiguous, updated in place to the layer's output:
//   x += o_proj(attention(rope(qkv_proj(rms_norm(x)))))
//   x += down_proj(silu(gate) * up), [gate, up] = gate_up_proj(rms_norm(x))
// the same arithmetic as the model's per-op CPU path (rms_norm, linear_bf16_weight,
// cached_attention), in one call: the shipped models' layers are so small that the Python and
// torch dispatch between those ops cost as much as the ops. The host wrapper
// (specengine/ops/decoder_layer.py) validates and allocates.
void decoder_layer(const DecoderLayerWeights& w, const AttentionStep& step, float* x);

}  // namespace specengine
