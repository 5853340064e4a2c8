// A whole decoder layer (Llama) or decoder block (T5) in one call (see decoder.h), composed of
// the layer ops of layers.h and blocks.h: at the shipped models' sizes the Python and torch calls
// between those ops cost as much as the ops (measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md).
#include "decoder.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "blocks.h"
#include "cpu_features.h"
#include "layers.h"
#include "vector_math.h"

namespace specengine {
namespace {

// out = silu(gate) * up for rows of [gate | up] (each `intermediate` wide).
void silu_mul_portable(const float* gate_up, float* out, int64_t R, int64_t intermediate) {
  for (int64_t r = 0; r < R; ++r) {
    const float* gate = gate_up + r * 2 * intermediate;
    const float* up = gate + intermediate;
    float* o = out + r * intermediate;
    for (int64_t i = 0; i < intermediate; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  }
}

#ifdef SPECENGINE_X86
// sigmoid(g) from e = exp(-|g|), whose argument is never positive: 1 / (1 + e) for g >= 0 and
// e / (1 + e) below. (std::exp stays one scalar call per entry: the build has no -ffast-math,
// without which the compiler does not vectorise it.)
SPECENGINE_AVX2 void silu_mul_avx2(const float* gate_up, float* out, int64_t R, int64_t intermediate) {
  const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
  for (int64_t r = 0; r < R; ++r) {
    const float* gate = gate_up + r * 2 * intermediate;
    const float* up = gate + intermediate;
    float* o = out + r * intermediate;
    int64_t i = 0;
    for (; i + 8 <= intermediate; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign));
      const __m256 numerator = _mm256_blendv_ps(one, e, g);  // e where g's sign bit is set
      const __m256 sigmoid = _mm256_div_ps(numerator, _mm256_add_ps(one, e));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
    }
    for (; i < intermediate; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  }
}
#endif

void silu_mul(const float* gate_up, float* out, int64_t R, int64_t intermediate) {
#ifdef SPECENGINE_X86
  if (use_avx2()) return silu_mul_avx2(gate_up, out, R, intermediate);
#endif
  silu_mul_portable(gate_up, out, R, intermediate);
}

float activate(float x, T5Activation activation) {
  switch (activation) {
    case T5Activation::kRelu:
      return x > 0.f ? x : 0.f;
    case T5Activation::kGeluTanh:  // transformers' gelu_new
      return 0.5f * x * (1.f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    case T5Activation::kGelu:
      return 0.5f * x * (1.f + std::erf(x * 0.7071067811865476f));
    case T5Activation::kSilu:
      return x / (1.f + std::exp(-x));
  }
  return x;
}

void add_into(float* x, const float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

}  // namespace

void decoder_layer(const DecoderLayerWeights& w, const AttentionStep& step, float* x) {
  const int64_t R = step.B * step.T;
  const int64_t q_size = w.H * w.D, kv_size = w.Hkv * w.D, qkv_size = q_size + 2 * kv_size;
  std::vector<float> normed(static_cast<size_t>(R * w.hidden));
  std::vector<float> projected(static_cast<size_t>(R * std::max(qkv_size, 2 * w.intermediate)));
  std::vector<float> mixed(static_cast<size_t>(R * std::max(q_size, w.intermediate)));
  std::vector<float> back(static_cast<size_t>(R * w.hidden));

  // Attention block. q, k and v stay packed in `projected`: the attention reads them in place.
  rms_norm(x, w.input_norm, normed.data(), R, w.hidden, w.eps);
  linear_blocks(normed.data(), w.qkv, w.qkv_bias, projected.data(), R);
  if (w.q_norm != nullptr) {
    for (int64_t r = 0; r < R; ++r) {  // per head, in place (rms_norm reads each entry before writing it)
      float* q = projected.data() + r * qkv_size;
      rms_norm(q, w.q_norm, q, w.H, w.D, w.eps);
      rms_norm(q + q_size, w.k_norm, q + q_size, w.Hkv, w.D, w.eps);
    }
  }
  const float* q = projected.data();
  cached_attention(q, q + q_size, q + q_size + kv_size, qkv_size, qkv_size, qkv_size, step.cos, step.sin,
                   step.positions, step.cache_k, step.cache_v, mixed.data(), step.B, step.T, w.H, w.Hkv, w.D,
                   step.capacity, step.cache_row_stride, step.kv_len, step.window);
  linear_blocks(mixed.data(), w.o, w.o_bias, back.data(), R);
  add_into(x, back.data(), R * w.hidden);

  // MLP block.
  rms_norm(x, w.post_norm, normed.data(), R, w.hidden, w.eps);
  linear_blocks(normed.data(), w.gate_up, w.gate_up_bias, projected.data(), R);
  silu_mul(projected.data(), mixed.data(), R, w.intermediate);
  linear_blocks(mixed.data(), w.down, w.down_bias, back.data(), R);
  add_into(x, back.data(), R * w.hidden);
}

void t5_decoder_block(const T5BlockWeights& w, const T5Step& step, float* x) {
  const int64_t R = step.B * step.T, inner = w.H * w.D, wi_rows = (w.gated ? 2 : 1) * w.d_ff;
  std::vector<float> normed(static_cast<size_t>(R * w.hidden));
  std::vector<float> projected(static_cast<size_t>(R * std::max(3 * inner, wi_rows)));
  std::vector<float> mixed(static_cast<size_t>(R * std::max(inner, w.d_ff)));
  std::vector<float> back(static_cast<size_t>(R * w.hidden));

  // Self-attention: q, k and v stay packed in `projected`, read in place.
  rms_norm(x, w.self_norm, normed.data(), R, w.hidden, w.eps);
  linear_blocks(normed.data(), bf16_matrix(w.qkv, w.hidden, 3 * inner), nullptr, projected.data(), R);
  const float* q = projected.data();
  relative_attention(q, 3 * inner, q + inner, q + 2 * inner, 3 * inner, 3 * inner, step.positions, step.cache_k,
                     step.cache_v, step.capacity, step.cache_row_stride, step.kv_len, step.bias_table, mixed.data(),
                     step.B, step.T, w.H, w.D);
  linear_blocks(mixed.data(), bf16_matrix(w.self_o, inner, w.hidden), nullptr, back.data(), R);
  add_into(x, back.data(), R * w.hidden);

  // Cross-attention over the encoder's keys (nothing written).
  rms_norm(x, w.cross_norm, normed.data(), R, w.hidden, w.eps);
  linear_blocks(normed.data(), bf16_matrix(w.cross_q, w.hidden, inner), nullptr, projected.data(), R);
  relative_attention(projected.data(), inner, nullptr, nullptr, 0, 0, step.source_last, step.cross_k, step.cross_v,
                     step.source_capacity, step.cross_row_stride, step.source_capacity, nullptr, mixed.data(), step.B,
                     step.T, w.H, w.D);
  linear_blocks(mixed.data(), bf16_matrix(w.cross_o, inner, w.hidden), nullptr, back.data(), R);
  add_into(x, back.data(), R * w.hidden);

  // Feed-forward.
  rms_norm(x, w.ff_norm, normed.data(), R, w.hidden, w.eps);
  linear_blocks(normed.data(), bf16_matrix(w.wi, w.hidden, wi_rows), nullptr, projected.data(), R);
  for (int64_t r = 0; r < R; ++r) {
    const float* h = projected.data() + r * wi_rows;
    float* o = mixed.data() + r * w.d_ff;
    if (w.gated) {
      for (int64_t i = 0; i < w.d_ff; ++i) o[i] = activate(h[i], w.activation) * h[w.d_ff + i];
    } else {
      for (int64_t i = 0; i < w.d_ff; ++i) o[i] = activate(h[i], w.activation);
    }
  }
  linear_blocks(mixed.data(), bf16_matrix(w.wo, w.d_ff, w.hidden), nullptr, back.data(), R);
  add_into(x, back.data(), R * w.hidden);
}

}  // namespace specengine
