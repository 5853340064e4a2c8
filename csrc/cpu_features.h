#pragma once
// Runtime choice between the wide-vector code paths and the portable ones. Functions marked
// SPECENGINE_AVX2 (AVX2 + FMA) or SPECENGINE_AVX512 (AVX-512F) are compiled for those
// instructions whatever the build flags, and are only called when the running CPU has them
// and the instruction-set limit (lowered by tests, to run the narrower paths) allows them.
#include <atomic>

#if defined(__x86_64__) || defined(_M_X64)
#define SPECENGINE_X86 1
#define SPECENGINE_AVX2 __attribute__((target("avx2,fma")))
#define SPECENGINE_AVX512 __attribute__((target("avx512f,avx2,fma")))
#include <immintrin.h>
#endif

namespace specengine {

// Ordered: a limit allows its own level and every one below it.
enum class CpuIsa : int { portable = 0, avx2 = 1, avx512 = 2 };

inline std::atomic<int>& isa_limit() {
  static std::atomic<int> limit{static_cast<int>(CpuIsa::avx512)};
  return limit;
}

inline bool isa_allowed(CpuIsa isa) {
  return isa_limit().load(std::memory_order_relaxed) >= static_cast<int>(isa);
}

inline bool use_avx2() {
#ifdef SPECENGINE_X86
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return supported && isa_allowed(CpuIsa::avx2);
#else
  return false;
#endif
}

inline bool use_avx512() {
#ifdef SPECENGINE_X86
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
                                __builtin_cpu_supports("fma");
  return supported && isa_allowed(CpuIsa::avx512);
#else
  return false;
#endif
}

}  // namespace specengine
