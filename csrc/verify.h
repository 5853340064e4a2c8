#pragma once
#include <cstdint>

namespace specengine {

enum class LogitDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Deliberate mistakes the statistical tests must catch (never set outside tests):
// the accept test's uniform reused for the residual sample; the residual taken with p of
// the next row (position); the residual sampled without renormalising it.

// Arguments of the fused verify step. Pointers are to CPU memory; the Python host wrapper
// (specengine/ops/verify.py) validates shapes, dtypes, strides and devices and allocates outputs.
struct VerifyArgs {
  const void* target_logits;  // [B, G+1, V] (row strides below, last dim contiguous)
  const void* draft_logits;   // [B, G, V], or nullptr for one-hot drafts
  LogitDtype dtype;
  int64_t B, G, V;
  int64_t target_stride_b, target_stride_g, draft_stride_b, draft_stride_g;  // in elements
  const int64_t* draft_tokens;  // [B, G]
  const int64_t* num_drafts;    // [B] in [0, G]
  const float* temperature;     // [B], 0 = greedy
  const int64_t* top_k;         // [B], 0 = off
  const float* top_p;           // [B], 1 = off
  const float* min_p;           // [B], 0 = off
  const int64_t* seeds;         // [B] Philox keys
  const int64_t* positions;     // [B] absolute position of each row's first token this round
  const float* u_accept;        // [B, G+1] explicit uniforms, or nullptr: Philox
  const float* u_sample;        // [B, G+1] explicit uniforms, or nullptr: Philox
  int64_t* emitted;             // [B, G+1] out, -1 after each row's end
  int64_t* num_emitted;         // [B] out
  int64_t* target_lengths;      // [B] in/out (+= num_emitted), or nullptr
  int64_t* draft_lengths;       // [B] in/out (= min(itself, new target length)), or nullptr
};

void verify_cpu(const VerifyArgs& args);

}  // namespace specengine
