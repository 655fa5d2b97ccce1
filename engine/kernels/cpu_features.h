// CPU features the kernels choose a path by at run time (the build itself targets what torch detected).
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

// Functions that use VDPBF16PS are compiled for it one by one (the build targets only what torch detected, and a
// whole-file -mavx512bf16 could let the compiler use the instruction set where the CPU lacks it); callers check
// cpu_has_avx512_bf16 first.
#define BUCKETSERVE_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512bf16")))

namespace bucketserve {

// Whether the CPU has AVX512_BF16 (VDPBF16PS: CPUID leaf 7, subleaf 1, EAX bit 5). Read once per process.
inline bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool on = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) != 0 && ((eax >> 5) & 1u) != 0;
  }();
  return on;
#else
  return false;
#endif
}

}  // namespace bucketserve
