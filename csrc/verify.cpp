// Fused speculative-sampling verify step on CPU (Leviathan et al., Algorithm 1).
//
// Same contract as specengine.sampling.verify.verify_reference and the warps of
// specengine/sampling/warp.py, which is the oracle of its tests. Rows run in parallel
// (OpenMP); each row's logits are warped into a small per-row state (max, thresholds,
// normalisers) so probabilities are computed on the fly and never stored.
#include "verify.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_features.h"
#include "philox.h"
#include "vector_math.h"

namespace specengine {
namespace {

constexpr uint32_t kStreamAccept = 0;  // as specengine/sampling/rng.py
constexpr uint32_t kStreamSample = 1;

inline float load(const void* base, LogitDtype dtype, int64_t index) {
  switch (dtype) {
    case LogitDtype::kFloat32:
      return static_cast<const float*>(base)[index];
    case LogitDtype::kBFloat16: {
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[index]) << 16;
      float out;
      std::memcpy(&out, &bits, sizeof out);
      return out;
    }
    case LogitDtype::kFloat16: {
      const uint16_t h = static_cast<const uint16_t*>(base)[index];
      const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
      uint32_t bits;
      if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
      } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
      } else if (man) {  // subnormal half: renormalise
        int e = -1;
        uint32_t m = man;
        do { ++e; m <<= 1; } while (!(m & 0x400));
        bits = sign | ((112 - e) << 23) | ((m & 0x3FF) << 13);
      } else {
        bits = sign;
      }
      float out;
      std::memcpy(&out, &bits, sizeof out);
      return out;
    }
  }
  return 0.f;
}

// The warped distribution of one logit row, held in a per-row buffer (cache-resident, never
// written back to memory): one exp per entry, then every lookup is a load.
struct Warp {
  std::vector<float> probs;  // the row's logits, turned in place into the warped probabilities
  bool greedy = false;
  int64_t argmax = 0;

  float prob(int64_t v) const { return greedy ? (v == argmax ? 1.f : 0.f) : probs[v]; }
};

void load_row(float* x, const void* base, LogitDtype dtype, int64_t offset, int64_t V) {
  switch (dtype) {  // outside the loop, so the float32 and bfloat16 loops vectorise
    case LogitDtype::kFloat32:
      std::memcpy(x, static_cast<const float*>(base) + offset, V * sizeof(float));
      return;
    case LogitDtype::kBFloat16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      uint32_t* dst = reinterpret_cast<uint32_t*>(x);
      for (int64_t v = 0; v < V; ++v) dst[v] = static_cast<uint32_t>(src[v]) << 16;
      return;
    }
    case LogitDtype::kFloat16:
      for (int64_t v = 0; v < V; ++v) x[v] = load(base, dtype, offset + v);
      return;
  }
}

// The passes of build_warp, portable versions (the AVX2 ones below compute the same values up
// to the last bit of exp and the order of the sums).
int64_t first_argmax_portable(const float* x, int64_t V) { return std::max_element(x, x + V) - x; }

// x[v] = x[v] >= threshold ? f(x[v]) : 0, returning the sum, where f is exp (kExp, used on
// scaled logits <= 0 with the top-k threshold) or the identity (probabilities and the top-p /
// min-p floor). Both warp passes are this one mask-map-sum.
template <bool kExp>
double keep_at_least_portable(float* x, int64_t V, float threshold) {
  double z = 0.0;
  for (int64_t v = 0; v < V; ++v) {
    if constexpr (kExp) {
      x[v] = x[v] >= threshold ? std::exp(x[v]) : 0.f;
    } else {
      x[v] = x[v] >= threshold ? x[v] : 0.f;
    }
    z += x[v];
  }
  return z;
}

#ifdef SPECENGINE_X86
SPECENGINE_AVX2 inline double sum_as_double(__m256d a, __m256d b) {
  __m256d s = _mm256_add_pd(a, b);
  __m128d h = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
  return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}

// Adds the 8 floats of v into two double accumulators: sums over a whole vocabulary keep
// float32 rounding out of the normalisers, as the portable loops do.
SPECENGINE_AVX2 inline void accumulate(__m256d& lo, __m256d& hi, __m256 v) {
  lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

SPECENGINE_AVX2 int64_t first_argmax_avx2(const float* x, int64_t V) {
  const int64_t V8 = V & ~int64_t{7};
  if (V8 == 0) return first_argmax_portable(x, V);
  __m256 m = _mm256_loadu_ps(x);
  for (int64_t v = 8; v < V8; v += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + v));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = *std::max_element(lanes, lanes + 8);
  for (int64_t v = V8; v < V; ++v) best = std::max(best, x[v]);
  const __m256 target = _mm256_set1_ps(best);
  for (int64_t v = 0; v < V8; v += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + v), target, _CMP_EQ_OQ));
    if (mask) return v + __builtin_ctz(mask);
  }
  for (int64_t v = V8; v < V; ++v)
    if (x[v] == best) return v;
  return first_argmax_portable(x, V);  // only for NaN rows, which the host rejects
}

template <bool kExp>
SPECENGINE_AVX2 double keep_at_least_avx2(float* x, int64_t V, float threshold) {
  const int64_t V8 = V & ~int64_t{7};
  const __m256 threshold_v = _mm256_set1_ps(threshold);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (int64_t v = 0; v < V8; v += 8) {
    const __m256 xv = _mm256_loadu_ps(x + v);
    __m256 value = xv;
    if constexpr (kExp) value = exp_nonpositive(xv);
    const __m256 kept = _mm256_and_ps(_mm256_cmp_ps(xv, threshold_v, _CMP_GE_OQ), value);
    _mm256_storeu_ps(x + v, kept);
    accumulate(lo, hi, kept);
  }
  return sum_as_double(lo, hi) + keep_at_least_portable<kExp>(x + V8, V - V8, threshold);
}
#endif

int64_t first_argmax(const float* x, int64_t V) {
#ifdef SPECENGINE_X86
  if (use_avx2()) return first_argmax_avx2(x, V);
#endif
  return first_argmax_portable(x, V);
}

template <bool kExp>
double keep_at_least(float* x, int64_t V, float threshold) {
#ifdef SPECENGINE_X86
  if (use_avx2()) return keep_at_least_avx2<kExp>(x, V, threshold);
#endif
  return keep_at_least_portable<kExp>(x, V, threshold);
}

void build_warp(Warp& w, const void* base, LogitDtype dtype, int64_t offset, int64_t V, float temperature,
                int64_t top_k, float top_p, float min_p, std::vector<float>& scratch) {
  std::vector<float>& x = w.probs;
  x.resize(V);
  load_row(x.data(), base, dtype, offset, V);
  w.argmax = first_argmax(x.data(), V);
  w.greedy = temperature == 0.f;
  if (w.greedy) return;
  // Divide like the reference, (logit - max) / T: a multiply by 1/T rounds differently.
  const float row_max = x[w.argmax];
  for (int64_t v = 0; v < V; ++v) x[v] = (x[v] - row_max) / temperature;
  float kth = -std::numeric_limits<float>::infinity();
  if (top_k > 0 && top_k < V) {  // keep scaled logits >= the k-th largest (ties kept)
    scratch.assign(x.begin(), x.end());
    std::nth_element(scratch.begin(), scratch.begin() + (top_k - 1), scratch.end(), std::greater<float>());
    kth = scratch[top_k - 1];
  }
  const float z1 = static_cast<float>(keep_at_least<true>(x.data(), V, kth));
  for (int64_t v = 0; v < V; ++v) x[v] /= z1;
  float floor_prob = 0.f;
  if (top_p < 1.f) {
    // The nucleus: sorted descending, keep entries whose mass strictly before them is < top_p.
    // Sort only the largest m probabilities, doubling m until the nucleus closes inside them.
    scratch.assign(x.begin(), x.end());
    int64_t m = std::min<int64_t>(V, 64);
    for (;;) {
      std::partial_sort(scratch.begin(), scratch.begin() + m, scratch.end(), std::greater<float>());
      double before = 0.0;
      int64_t kept = 0;
      while (kept < m && static_cast<float>(before) < top_p) before += scratch[kept++];
      if (kept < m || m == V) {
        floor_prob = scratch[std::max<int64_t>(kept, 1) - 1];
        break;
      }
      m = std::min(V, m * 2);
    }
  }
  if (min_p > 0.f) floor_prob = std::max(floor_prob, min_p * (1.f / z1));
  const float total = static_cast<float>(keep_at_least<false>(x.data(), V, floor_prob));
  for (int64_t v = 0; v < V; ++v) x[v] /= total;
}

// Inverse-CDF sample of an unnormalised distribution given by mass(v) (as sample_from_probs):
// the first index whose cumulative mass exceeds u * total, never a zero-mass index.
template <typename Mass>
int64_t sample(int64_t V, float u, Mass mass) {
  double total = 0.0;
  int64_t last_positive = 0;
  for (int64_t v = 0; v < V; ++v) {
    const float m = mass(v);
    total += m;
    if (m > 0.f) last_positive = v;
  }
  const float threshold = u * static_cast<float>(total);
  double cdf = 0.0;
  for (int64_t v = 0; v < V; ++v) {
    cdf += mass(v);
    if (static_cast<float>(cdf) > threshold) return std::min(v, last_positive);
  }
  return last_positive;
}

void verify_row(const VerifyArgs& a, int64_t b, Warp& p, Warp& q, std::vector<float>& scratch) {
  const int64_t G = a.G, V = a.V, G1 = G + 1;
  const int64_t drafts = a.num_drafts[b];
  const int64_t* tokens = a.draft_tokens + b * G;
  const uint64_t seed = static_cast<uint64_t>(a.seeds[b]);
  const uint64_t position = static_cast<uint64_t>(a.positions[b]);
  auto uniform = [&](const float* explicit_u, int64_t i, uint32_t stream) {
    return explicit_u ? explicit_u[b * G1 + i] : philox_uniform(seed, position + i, stream);
  };
  auto warp_target = [&](int64_t i) {
    build_warp(p, a.target_logits, a.dtype, b * a.target_stride_b + i * a.target_stride_g, V, a.temperature[b],
               a.top_k[b], a.top_p[b], a.min_p[b], scratch);
  };
  auto warp_draft = [&](int64_t i) {
    build_warp(q, a.draft_logits, a.dtype, b * a.draft_stride_b + i * a.draft_stride_g, V, a.temperature[b],
               a.top_k[b], a.top_p[b], a.min_p[b], scratch);
  };

  int64_t n = 0;
  for (; n < drafts; ++n) {
    const int64_t x = tokens[n];
    warp_target(n);
    float q_x = 1.f;
    if (a.draft_logits) {
      warp_draft(n);
      q_x = q.prob(x);
    }
    if (!(uniform(a.u_accept, n, kStreamAccept) * q_x < p.prob(x))) break;
    a.emitted[b * G1 + n] = x;
  }
  float u = uniform(a.u_sample, n, kStreamSample);
  int64_t token;
  if (n < drafts) {  // rejected: p and q of position n are warped already
    const int64_t x = tokens[n];
    auto q_prob = [&](int64_t v) { return a.draft_logits ? q.prob(v) : (v == x ? 1.f : 0.f); };
    auto residual = [&](int64_t v) { return std::max(0.f, p.prob(v) - q_prob(v)); };
    if (p.greedy) {
      token = p.argmax;  // p is one-hot on its argmax and x was not it: the residual is that one-hot
    } else {
      double mass = 0.0;
      for (int64_t v = 0; v < V; ++v) mass += residual(v);
      token = mass > 0.0 ? sample(V, u, residual)
                         : sample(V, u, [&](int64_t v) { return p.prob(v); });
    }
  } else {
    warp_target(n);
    // Sampling a one-hot gives its index for every u in [0, 1): skip the two passes over V.
    token = p.greedy ? p.argmax : sample(V, u, [&](int64_t v) { return p.prob(v); });
  }
  a.emitted[b * G1 + n] = token;
  for (int64_t i = n + 1; i < G1; ++i) a.emitted[b * G1 + i] = -1;
  a.num_emitted[b] = n + 1;
  if (a.target_lengths) {
    a.target_lengths[b] += n + 1;
    if (a.draft_lengths) a.draft_lengths[b] = std::min(a.draft_lengths[b], a.target_lengths[b]);
  }
}

}  // namespace

void verify_cpu(const VerifyArgs& args) {
#pragma omp parallel
  {
    Warp p, q;
    std::vector<float> scratch;
#pragma omp for schedule(dynamic)
    for (int64_t b = 0; b < args.B; ++b) verify_row(args, b, p, q, scratch);
  }
}

}  // namespace specengine
