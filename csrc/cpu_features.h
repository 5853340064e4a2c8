#pragma once
// Runtime choice between the AVX2/FMA code paths and the portable ones. Functions marked
// SPECENGINE_AVX2 are compiled for AVX2 + FMA whatever the build flags, and are only called
// when the running CPU has both (and portable kernels were not asked for).
#include <atomic>

#if defined(__x86_64__) || defined(_M_X64)
#define SPECENGINE_X86 1
#define SPECENGINE_AVX2 __attribute__((target("avx2,fma")))
#include <immintrin.h>
#endif

namespace specengine {

// Tests set this to run the portable paths on a machine that has AVX2.
inline std::atomic<bool>& force_portable() {
  static std::atomic<bool> flag{false};
  return flag;
}

inline bool use_avx2() {
#ifdef SPECENGINE_X86
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return supported && !force_portable().load(std::memory_order_relaxed);
#else
  return false;
#endif
}

}  // namespace specengine
