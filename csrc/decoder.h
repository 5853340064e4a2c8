#pragma once
#include <cstdint>

#include "blocks.h"

namespace specengine {

// One Llama-family decoder layer's weights: matrices [out, in] as ggml blocks (blocks.h: a
// bfloat16 checkpoint's as one BF16 part, a GGUF file's as stored) and float32 vectors. A bias or
// a q/k norm the architecture lacks is nullptr.
struct DecoderLayerWeights {
  const float* input_norm;         // [hidden]
  Matrix qkv;                      // [(H + 2 * Hkv) * D, hidden]: q, k and v rows packed
  const float* qkv_bias;           // [(H + 2 * Hkv) * D] or nullptr
  const float* q_norm;             // [D] per-head RMSNorm of q before the rotary (Qwen3) or nullptr
  const float* k_norm;             // [D] or nullptr (set together with q_norm)
  Matrix o;                        // [hidden, H * D]
  const float* o_bias;             // [hidden] or nullptr
  const float* post_norm;          // [hidden]
  Matrix gate_up;                  // [2 * intermediate, hidden]: gate rows, then up rows
  const float* gate_up_bias;       // [2 * intermediate] or nullptr
  Matrix down;                     // [hidden, intermediate]
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
// the same arithmetic as the model's per-op CPU path (rms_norm, linear_blocks, cached_attention), in one call: the shipped models' layers are so small that the Python and
// torch dispatch between those ops cost as much as the ops. The host wrapper
// (specengine/ops/decoder_layer.py) validates and allocates.
void decoder_layer(const DecoderLayerWeights& w, const AttentionStep& step, float* x);

// A T5 decoder block's weights: bfloat16 matrices [out, in] (raw uint16 bits), float32 norms.
enum class T5Activation : int64_t { kRelu = 0, kGeluTanh = 1, kGelu = 2, kSilu = 3 };
struct T5BlockWeights {
  const float* self_norm;          // [hidden]
  const uint16_t* qkv;             // [3 * H * D, hidden]: q, k and v rows packed
  const uint16_t* self_o;          // [hidden, H * D]
  const float* cross_norm;         // [hidden]
  const uint16_t* cross_q;         // [H * D, hidden]
  const uint16_t* cross_o;         // [hidden, H * D]
  const float* ff_norm;            // [hidden]
  const uint16_t* wi;              // [(gated ? 2 : 1) * d_ff, hidden]: wi_0 rows, then wi_1 rows when gated
  const uint16_t* wo;              // [hidden, d_ff]
  int64_t hidden, H, D, d_ff;
  T5Activation activation;
  bool gated;
  float eps;                       // of every norm of the block
};

// Where a T5 block's two attentions read and write: see relative_attention in layers.h.
struct T5Step {
  const int64_t* positions;    // [B, T] each new token's position
  float* cache_k;              // this layer's self-attention keys, row b at b * cache_row_stride
  float* cache_v;
  const float* bias_table;     // [> max position, H] the decoder's relative bias by distance back
  const int64_t* source_last;  // [B, T] each row's last encoder token
  float* cross_k;              // this layer's cross-attention keys, row b at b * cross_row_stride
  float* cross_v;
  int64_t B, T, capacity, cache_row_stride, kv_len, cross_row_stride, source_capacity;
};

// x [B * T, hidden] float32, contiguous, updated in place to the block's output:
//   x += o(relative_attention(qkv(norm(x))))            self-attention, writing the new K/V
//   x += cross_o(relative_attention(cross_q(norm(x))))  over the row's encoder keys
//   x += wo(act(wi_0 norm(x)) * wi_1 norm(x))           (or wo(act(wi norm(x))) ungated)
// the same arithmetic as the model's per-op CPU path, in one call (see decoder_layer).
void t5_decoder_block(const T5BlockWeights& w, const T5Step& step, float* x);

}  // namespace specengine
