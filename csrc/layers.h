#pragma once
#include <cstdint>

namespace specengine {

// One attention layer's work after the q/k/v projections, for a batch of rows that each
// append T tokens to their own region of a static KV cache (decoding, verification, prefill):
//   1. rotate q and k (Llama rotate-half rotary embedding with the given cos/sin tables);
//   2. write the rotated k and v into the cache at each token's position (positions at or past
//      `capacity` go to the spill slot `capacity`, which no query reads);
//   3. each query at position p attends, in float32, to cache keys j with j <= p, j < kv_len and
//      (window > 0) j > p - window, with scale 1/sqrt(D); grouped heads share kv head h / (H / Hkv).
// q [B, T, H, D], k and v [B, T, Hkv, D]: token (b, t) at (b * T + t) * {q,k,v}_token_stride, its
// heads contiguous (so q, k and v may be column blocks of one packed projection's output).
// cos and sin [B, T, D], positions [B, T] int64: contiguous.
// cache_k, cache_v: one layer, row b at b * cache_row_stride, [capacity + 1, Hkv, D] per row.
// out [B, T, H * D]. A query that sees no key (only padding past kv_len can) gets zeros.
//
// Order of operations, the same for every query (and for relative_attention's): with q the
// rotated query and keys j = lo..hi the ones it sees,
//   s_j = (q . k_j) * scale, the dot product one chain over d = 0..D-1 from 0 (an FMA each on the
//         AVX-512 and AVX2 paths, a rounded multiply and a rounded add on the portable one);
//         then + bias_j where there is one;
//   e_j = exp(s_j - max_j s_j) (vector_math.h's exp_nonpositive; std::exp on the portable path);
//   total = the sum of e_j in 16 lanes, lane l adding the keys j % 16 == l in key order, the
//         lanes then added as a fixed tree (lane_tree_sum in layers.cpp);
//   out[d] = (the chain over j = lo..hi in order of acc + e_j * v_j[d], from 0) * (1 / total).
// So a query's bits depend only on its q, its keys and values and its position: not on T, B,
// kv_len past its keys, where it lands among the other queries, or the thread count (decoding,
// verification and chunked prefill give it the same result). The AVX-512 and AVX2 paths agree
// bit for bit; the portable path keeps the order, with its own rounding.
// The Python host wrapper (specengine/ops/attention.py) validates and allocates.
void cached_attention(const float* q, const float* k, const float* v, int64_t q_token_stride,
                      int64_t k_token_stride, int64_t v_token_stride, const float* cos, const float* sin,
                      const int64_t* positions, float* cache_k, float* cache_v, float* out, int64_t B, int64_t T,
                      int64_t H, int64_t Hkv, int64_t D, int64_t capacity, int64_t cache_row_stride, int64_t kv_len,
                      int64_t window);

// T5's attention over a static cache (no rotary embedding, no scale, heads not grouped):
//   1. with k and v (self-attention), write each new token's k and v [H, D] at its position
//      (positions at or past `capacity` go to the spill slot `capacity`); without (cross-attention
//      over cached encoder keys), write nothing;
//   2. each query at position p attends, in float32, to cache keys j <= p, j < kv_len, its score
//      q . k_j plus (bias_table, [>p rows, H]) bias_table[p - j][h]: the learned bias of a key p - j
//      positions back. For cross-attention, p is the row's last encoder token and there is no bias.
// q [B, T, H, D] (token (b, t) at (b * T + t) * q_token_stride, heads contiguous), k and v likewise;
// positions [B, T] int64 contiguous; cache rows at b * cache_row_stride, [*, H, D] each; out
// [B, T, H * D]. Same order of operations as cached_attention's (scale 1, the bias added to each
// score). The Python host wrapper (specengine/ops/attention.py) validates and allocates.
void relative_attention(const float* q, int64_t q_token_stride, const float* k, const float* v,
                        int64_t k_token_stride, int64_t v_token_stride, const int64_t* positions, float* cache_k,
                        float* cache_v, int64_t capacity, int64_t cache_row_stride, int64_t kv_len,
                        const float* bias_table, float* out, int64_t B, int64_t T, int64_t H, int64_t D);

// out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)) for rows r of x [R, N] float32 (Llama RMSNorm,
// normalised first and then scaled, as transformers does). x, weight [N] and out contiguous.
void rms_norm(const float* x, const float* weight, float* out, int64_t R, int64_t N, float eps);

}  // namespace specengine
