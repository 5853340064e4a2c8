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

#include "philox.h"

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

void build_warp(Warp& w, const void* base, LogitDtype dtype, int64_t offset, int64_t V, float temperature,
                int64_t top_k, float top_p, float min_p, std::vector<float>& scratch) {
  std::vector<float>& x = w.probs;
  x.resize(V);
  for (int64_t v = 0; v < V; ++v) x[v] = load(base, dtype, offset + v);
  w.argmax = std::max_element(x.begin(), x.end()) - x.begin();  // the first maximum
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
  double z = 0.0;
  for (int64_t v = 0; v < V; ++v) {
    x[v] = x[v] >= kth ? std::exp(x[v]) : 0.f;
    z += x[v];
  }
  const float z1 = static_cast<float>(z);
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
  double z2 = 0.0;
  for (int64_t v = 0; v < V; ++v) {
    if (x[v] < floor_prob) x[v] = 0.f;
    z2 += x[v];
  }
  const float total = static_cast<float>(z2);
  for (int64_t v = 0; v < V; ++v) x[v] /= total;
}

// Inverse-CDF sample of an unnormalised distribution given by mass(v) (as sample_from_probs):
// the first index whose cumulative mass exceeds u * total, never a zero-mass index.
template <typename Mass>
int64_t sample(int64_t V, float u, Mass mass, bool renormalise = true) {
  double total = 0.0;
  int64_t last_positive = 0;
  for (int64_t v = 0; v < V; ++v) {
    const float m = mass(v);
    total += m;
    if (m > 0.f) last_positive = v;
  }
  const float threshold = renormalise ? u * static_cast<float>(total) : u;
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
    if (a.planted_bug == PlantedBug::kReusedUniform) u = uniform(a.u_accept, n, kStreamAccept);
    if (a.planted_bug == PlantedBug::kWrongRow) warp_target(n + 1);
    auto q_prob = [&](int64_t v) { return a.draft_logits ? q.prob(v) : (v == x ? 1.f : 0.f); };
    auto residual = [&](int64_t v) { return std::max(0.f, p.prob(v) - q_prob(v)); };
    double mass = 0.0;
    for (int64_t v = 0; v < V; ++v) mass += residual(v);
    token = mass > 0.0 ? sample(V, u, residual, a.planted_bug != PlantedBug::kNoRenormalisation)
                       : sample(V, u, [&](int64_t v) { return p.prob(v); });
  } else {
    warp_target(n);
    token = sample(V, u, [&](int64_t v) { return p.prob(v); });
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
