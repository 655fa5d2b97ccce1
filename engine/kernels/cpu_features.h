// CPU features the kernels choose a path by at run time (the build itself targets what torch detected).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// Functions that use VDPBF16PS are compiled for it one by one (the build targets only what torch detected, and a
// whole-file -mavx512bf16 could let the compiler use the instruction set where the CPU lacks it); callers check
// cpu_has_avx512_bf16 first (Bf16Dot, the skinny linear's bf16 path).
#define BUCKETSERVE_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512bf16")))
// The same for the AMX tile instructions (callers check amx_bf16_usable first), and for both at once.
#define BUCKETSERVE_AMX_BF16 __attribute__((target("avx512f,avx512bw,amx-tile,amx-bf16")))
#define BUCKETSERVE_AMX_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// Whether this process may use AMX bf16 tiles: the CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and
// 22) and Linux granted the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, which a
// process must request before its first tile instruction; asking again is harmless). Read once per process.
inline bool amx_bf16_usable() {
#if defined(__linux__) && defined(__x86_64__)
  static const bool ok = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    if (((edx >> 22) & 1u) == 0 || ((edx >> 24) & 1u) == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// Whether the CPU's vendor string is AMD's. Read once per process.
inline bool cpu_is_amd() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool amd = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return false;
    char vendor[13] = {};
    std::memcpy(vendor, &ebx, 4);
    std::memcpy(vendor + 4, &edx, 4);
    std::memcpy(vendor + 8, &ecx, 4);
    return std::strcmp(vendor, "AuthenticAMD") == 0;
  }();
  return amd;
#else
  return false;
#endif
}

// Whether a kernel multiplies bf16 by bf16 through VDPBF16PS (two products a lane per instruction) or widens both
// to fp32 for FMAs. By default only on AMD CPUs that have it: on a Zen 4 EPYC the dot product gave the skinny
// linear 0.48-0.90 and the attention tiles 0.82-0.93 of the widened code's time, but on a Xeon with AMX (Sapphire
// Rapids class) the instruction issued at a quarter of the FMA's rate (1.8 against 7.0 G a second on one core,
// independent chains), half the FMA's flops, and the same code took 1.25-1.41x / 1.27x as long. set() pins the
// choice for the process (tests pin each path on any CPU that has the instruction). The paged attention keeps one
// Bf16Dot; the skinny linear chooses among its three bf16 paths itself (linear_bf16_path).
inline bool bf16_dot_pays() { return cpu_has_avx512_bf16() && cpu_is_amd(); }

class Bf16Dot {
 public:
  // mode: -1 the CPU's default, 0 widen, 1 the dot product; build_has: the caller's build has the code that uses
  // it. nullptr, or why the mode is refused (then nothing changes).
  const char* set(int64_t mode, bool build_has) {
    if (mode < -1 || mode > 1) return "mode -1 (the CPU's default), 0 (widen) or 1 (dot product)";
    if (mode == 1 && !build_has) return "this build has no AVX-512 code";
    if (mode == 1 && !cpu_has_avx512_bf16()) return "this CPU has no AVX512_BF16";
    mode_.store(static_cast<int>(mode), std::memory_order_relaxed);
    return nullptr;
  }
  bool on() const {
    const int m = mode_.load(std::memory_order_relaxed);
    return m < 0 ? bf16_dot_pays() : m == 1;
  }

 private:
  std::atomic<int> mode_{-1};
};

#if defined(__AVX512F__)
// An AMX tile configuration (palette 1): rows and bytes per row of each of the eight tiles, zero where unused.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures this thread's tiles (callers check amx_bf16_usable first, and release them when done).
BUCKETSERVE_AMX_BF16 inline void amx_load_tiles(const AmxTileConfig& c) {
  // GCC does not count ldtilecfg as a read of c: without this the stores that filled it are dropped as dead
  // (the first build faulted with SIGILL on its first tile load).
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

BUCKETSERVE_AMX_BF16 inline void amx_release_tiles() { _tile_release(); }
#endif

}  // namespace bucketserve
