#pragma once
#include <cstdint>

namespace specengine {

// Philox4x32-10 (Salmon et al., SC'11); the same generator as specengine/sampling/rng.py.
struct Philox4x32 {
  static inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
    const uint64_t product = static_cast<uint64_t>(a) * b;
    hi = static_cast<uint32_t>(product >> 32);
    lo = static_cast<uint32_t>(product);
  }

  static inline uint32_t first_word(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                    uint32_t k1) {
    for (int round = 0; round < 10; ++round) {
      if (round) {
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
      }
      uint32_t hi0, lo0, hi1, lo1;
      mulhilo(0xD2511F53u, c0, hi0, lo0);
      mulhilo(0xCD9E8D57u, c2, hi1, lo1);
      c0 = hi1 ^ c1 ^ k0;
      c1 = lo1;
      c2 = hi0 ^ c3 ^ k1;
      c3 = lo0;
    }
    return c0;
  }
};

// Uniform in [0, 1) on a 2^-24 grid keyed by (seed, position, stream): the top 24 bits of
// the first Philox word for counter (position lo, position hi, stream, 0), key (seed lo, seed hi).
inline float philox_uniform(uint64_t seed, uint64_t position, uint32_t stream) {
  const uint32_t word = Philox4x32::first_word(
      static_cast<uint32_t>(position), static_cast<uint32_t>(position >> 32), stream, 0u,
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return static_cast<float>(word >> 8) * (1.0f / 16777216.0f);
}

}  // namespace specengine
