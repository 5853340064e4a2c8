#pragma once
// Runtime choice between the wide-vector code paths and the portable ones. Functions marked
// SPECENGINE_AVX2 (AVX2 + FMA), SPECENGINE_AVX512 (AVX-512F) or SPECENGINE_AMX (AMX tiles
// with bfloat16 products) are compiled for those instructions whatever the build flags, and
// are only called when the running CPU has them and the instruction-set limit (lowered by
// tests, to run the narrower paths) allows them.
#include <atomic>

#if defined(__x86_64__) || defined(_M_X64)
#define SPECENGINE_X86 1
#define SPECENGINE_AVX2 __attribute__((target("avx2,fma")))
#define SPECENGINE_AVX512 __attribute__((target("avx512f,avx2,fma")))
#include <immintrin.h>
// AMX intrinsics need GCC 11 or clang 12, and the tile permission a Linux system call.
#if defined(__linux__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                           (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define SPECENGINE_HAS_AMX 1
#define SPECENGINE_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx2,fma")))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace specengine {

// Ordered: a limit allows its own level and every one below it.
enum class CpuIsa : int { portable = 0, avx2 = 1, avx512 = 2, amx = 3 };

inline std::atomic<int>& isa_limit() {
  static std::atomic<int> limit{static_cast<int>(CpuIsa::amx)};
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

// AMX tiles with bfloat16 products (Sapphire Rapids and later), once Linux has granted this
// process the tile state (a system call; without it the first tile instruction faults).
inline bool use_amx() {
#ifdef SPECENGINE_HAS_AMX
  static const bool supported = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amx_bf16 = edx & (1u << 22), amx_tile = edx & (1u << 24);
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return amx_bf16 && amx_tile && __builtin_cpu_supports("avx512f") &&
           syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return supported && isa_allowed(CpuIsa::amx);
#else
  return false;
#endif
}

// The code paths of the ops that come in AVX-512, AVX2 and portable forms; `avx512_usable` and
// `avx2_usable` are the op's own tests (some also need F16C, say), which imply use_avx512() and
// use_avx2().
enum class VectorPath { portable, avx2, avx512 };

inline VectorPath vector_path(bool avx512_usable, bool avx2_usable) {
  if (avx512_usable) return VectorPath::avx512;
  if (avx2_usable) return VectorPath::avx2;
  return VectorPath::portable;
}

}  // namespace specengine
