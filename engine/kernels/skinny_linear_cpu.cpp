// A linear layer for few rows (decode batches): y[M, N] = x[M, K] . W[N, K]^T (+ bias), M <= ~64, fp32 or bf16
// weights and rows (bf16 is widened exactly as it is read; the arithmetic is fp32, rounded once to x's dtype). bf16
// rows over bf16 weights are multiplied instead on AMX tiles where the CPU has them, from 2 rows (panels_amx), or on
// an AMD CPU with AVX512_BF16 in pairs of k steps by its dot-product instruction (panel_rows_dot: exact products,
// fp32 sums; where it pays: cpu_features.h). The path is chosen once per process (linear_bf16_path).
//
//   bucketserve_cpu::skinny_linear(x[M,K], panels[NP,K,16], bias[N]?, n) -> y[M,n]
//
// A decode step multiplies a few rows by every weight of the model once: with up to ~16 rows it is bound by
// how fast the weights stream from memory, and up to ~64 rows it is still far from the GEMM rate that large
// M reaches. oneDNN's GEMM, blocked for large M, reads the weights here at 55-75% of this kernel's rate.
//
// Layout: the weight is stored as NP = ceil(N / 16) column panels, panel p holding output columns
// 16p .. 16p+15 as [K][16] (zero-padded past N): a panel is one forward stream of 64-byte lines. fp32: one line
// per k. bf16: one line per two k steps, as (k, k + 1) pairs per column (word 2c + e of the line for steps 2r, 2r + 1
// is W[16p + c][2r + e]), with an odd K's last step alone in the first half of its line: the layout VDPBF16PS and
// AMX tiles take their second operand in, so neither rearranges a line, and the widened pass splits a line into its
// two k steps with one shift and one mask. A pass takes two adjacent panels and up to 12 rows: per k, two lines of
// W are loaded and each x[m][k] is broadcast once into two FMAs, 24 accumulators in registers. More rows make more
// passes over the same two panels (64 KB at K = 512), which then come from L1/L2, not from memory. Threads take
// contiguous runs of panel pairs, so each streams its own part of the weight once. Software prefetch runs 8 KB
// ahead on AVX2, for bf16 weights, and for fp32 weights on AVX-512 except on AMD CPUs, whose hardware prefetchers
// do better alone (see panel_rows; chosen once per process, prefetches_fp32_weights).
//
// Measured on a 2-core AVX-512 host, 2 threads, fp32, weights well beyond the caches (GB/s of weights read,
// this kernel / oneDNN with a prepacked weight): [512 -> 1408] 30.5 / 24.5 at M = 1, 25.0 / 17.6 at M = 8,
// 12.7 / 10.5 at M = 32, 7.1 / 6.9 at M = 64, 5.0 / 5.1 at M = 96; [512 -> 256] 30.8 / 11.2 at M = 8. bf16
// weights, against oneDNN's bf16 GEMM (no AMX on that host): 15.4 / 10.3 at M = 8, 6.2 / 4.3 at M = 32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <type_traits>
#include <string>
#include <unordered_map>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include "cpu_features.h"

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kPrefetchLines = 128;  // k-steps (64-byte lines) ahead
constexpr int64_t kNextEvery = 2;  // AVX-512 passes after a pair's first: one line of the next pair every 2 k steps

// bf16 weights are read as their 16-bit patterns and widened exactly to fp32 (a bf16 is the top half of an fp32):
// they halve the bytes streamed, the arithmetic stays fp32.
using bf16_bits = uint16_t;

#if defined(__AVX512F__)
template <typename WT>
inline __m512 load_w(const WT* p);
template <>
inline __m512 load_w<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
// An odd K's last bf16 step: 16 words alone, widened.
template <>
inline __m512 load_w<bf16_bits>(const bf16_bits* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// A bf16 line of (k, k + 1) pairs as the two steps' 16 fp32 weights each (exact: a bf16 is an fp32's top half).
inline void widen_pairs(__m512i line, __m512& even, __m512& odd) {
  even = _mm512_castsi512_ps(_mm512_slli_epi32(line, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(line, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// A pass's accumulators start at the bias (or zero); mask[p] keeps the panel's columns that exist (cols of them
// from panel 0 on).
template <int MR, int NP>
inline void start_rows(__m512 (&acc)[NP][MR], __mmask16 (&mask)[NP], const float* bias, int64_t cols) {
  for (int p = 0; p < NP; ++p) {
    const int64_t c = std::clamp<int64_t>(cols - p * kPanel, 0, kPanel);
    mask[p] = c >= kPanel ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << c) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask[p], bias + p * kPanel) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) acc[p][m] = b;
  }
}

// A pass's results to y: the panels' columns, or for a gated pass silu(gate) * up, as ATen's own SiLU computes it
// (x / (1 + exp(-x))), so the result is the same as the separate operators on these GEMM results.
template <int MR, int NP, bool kGated>
inline void store_rows(const __m512 (&acc)[NP][MR], const __mmask16 (&mask)[NP], float* y, int64_t ldy) {
  if constexpr (kGated) {
    using Vec = at::vec::Vectorized<float>;
    for (int m = 0; m < MR; ++m) {
      const Vec g(acc[0][m]);
      const Vec h = g / (Vec(1.f) + g.neg().exp()) * Vec(acc[1][m]);
      _mm512_mask_storeu_ps(y + m * ldy, mask[0], static_cast<__m512>(h));
    }
  } else {
    for (int p = 0; p < NP; ++p)
      for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * ldy + p * kPanel, mask[p], acc[p][m]);
  }
}

// Rows [0, MR) of x times NP adjacent panels (16 * NP output columns): MR * NP accumulators in registers.
// Two panels per pass let one broadcast of x[m][k] feed two FMAs, so from ~10 rows on the FMA units, not
// the load ports, set the pace.
//
// Software prefetch (kPrefetch: 8 KB ahead) pays on one vendor and costs on the other. `small` decode steps,
// with and without it, switching every few steps in one process:
//   2-core AMD EPYC (Zen 4): fp32 batch 1 / 8 / 32 0.94-0.96 / 0.94-1.01 / 0.93-1.02 of the time with it (six runs;
//   batch 64 level), bf16 0.96-0.99 / 1.06-1.07 / 1.00-1.01 (two runs);
//   2-core Intel Xeon (Sapphire Rapids class, AMX, 480 MiB L3): fp32 batch 1 / 8 / 16 / 32 / 64 1.11-1.12 /
//   1.15-1.20 / 1.12 / 1.06-1.08 / 1.04 of the time with it (two runs; 4 KB or 2 KB ahead did no better, 16 KB worse).
// So bf16 weights are always prefetched, fp32 ones everywhere but on AMD (prefetches_fp32_weights, the vendor read
// once per process; run instantiates both and takes one).
//
// ``next`` (or null): ``next_lines`` 64-byte lines to bring into L2 during the pass, one every kNextEvery k steps
// (the next panel pair's, see panels_all_rows).
template <int MR, int NP, bool kGated, typename WT, bool kPrefetch>
inline void panel_rows(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t K,
                       const float* bias, float* __restrict y, int64_t ldy, int64_t cols, const char* next = nullptr,
                       int64_t next_lines = 0) {
  // Prefetch about 8 KB ahead whatever the weight's width.
  constexpr int64_t ahead = kPrefetchLines * static_cast<int64_t>(sizeof(float) / sizeof(WT));
  static_assert(!kGated || NP == 2, "a gated pass holds one gate and one up panel");
  __m512 acc[NP][MR];
  __mmask16 mask[NP];
  start_rows<MR, NP>(acc, mask, bias, cols);
  const int64_t stride = K * kPanel;  // from one panel to the next
  int64_t k = 0;
  if constexpr (std::is_same_v<WT, bf16_bits>) {
    // Two k steps a line; each accumulator still adds step k's product, then step k + 1's.
    for (; k + 1 < K; k += 2) {
      if (next != nullptr && k / kNextEvery < next_lines) _mm_prefetch(next + (k / kNextEvery) * 64, _MM_HINT_T1);
      __m512 w0[NP], w1[NP];
      for (int p = 0; p < NP; ++p) {
        if constexpr (kPrefetch)
          _mm_prefetch(reinterpret_cast<const char*>(w + p * stride + (k + ahead) * kPanel), _MM_HINT_T0);
        widen_pairs(_mm512_loadu_si512(w + p * stride + k * kPanel), w0[p], w1[p]);
      }
      for (int m = 0; m < MR; ++m) {
        const __m512 x0 = _mm512_set1_ps(x[m * ldx + k]), x1 = _mm512_set1_ps(x[m * ldx + k + 1]);
        for (int p = 0; p < NP; ++p) acc[p][m] = _mm512_fmadd_ps(x1, w1[p], _mm512_fmadd_ps(x0, w0[p], acc[p][m]));
      }
    }
  }
  for (; k < K; ++k) {  // fp32: every step; bf16: an odd K's last
    if (next != nullptr && k % kNextEvery == 0 && k / kNextEvery < next_lines)
      _mm_prefetch(next + (k / kNextEvery) * 64, _MM_HINT_T1);
    __m512 wv[NP];
    for (int p = 0; p < NP; ++p) {
      if constexpr (kPrefetch)
        _mm_prefetch(reinterpret_cast<const char*>(w + p * stride + (k + ahead) * kPanel), _MM_HINT_T0);
      wv[p] = load_w<WT>(w + p * stride + k * kPanel);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
      for (int p = 0; p < NP; ++p) acc[p][m] = _mm512_fmadd_ps(xv, wv[p], acc[p][m]);
    }
  }
  store_rows<MR, NP, kGated>(acc, mask, y, ldy);
}

// bf16 rows over bf16 weights where that is the bf16 path (by default on AMD CPUs with AVX512_BF16): VDPBF16PS
// multiplies 16 lanes of bf16 pairs (two k steps) and adds both products into fp32 accumulators, so one instruction
// does the work of two FMAs on widened values (on Zen 4 at the FMA's issue rate; Intel's issues it at a quarter of
// it). A panel's line holds steps k, k + 1 as the pairs it takes, and x[m][k], x[m][k + 1] are broadcast as one
// 32-bit pair. The arithmetic is the instruction's: each product exact in fp32, added in turn (k + 1, then k) with
// round-to-nearest-even, denormal inputs and results flushed to zero. An odd K's last step is an FMA on widened
// values. Compiled for that instruction set here only; called where the CPU has it and it is the bf16 path
// (linear_bf16_path).
template <int MR, int NP, bool kGated>
BUCKETSERVE_BF16_DOT __attribute__((noinline)) void panel_rows_dot(
    const bf16_bits* __restrict x, int64_t ldx, const bf16_bits* __restrict w, int64_t K, const float* bias,
    float* __restrict y, int64_t ldy, int64_t cols, const char* next, int64_t next_lines) {
  static_assert(!kGated || NP == 2, "a gated pass holds one gate and one up panel");
  constexpr int64_t ahead = kPrefetchLines * 2;  // k steps: about 8 KB of bf16 weights ahead, as panel_rows
  __m512 acc[NP][MR];
  __mmask16 mask[NP];
  start_rows<MR, NP>(acc, mask, bias, cols);
  const int64_t stride = K * kPanel;  // from one panel to the next
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    // One line of the next pair every 2 * kNextEvery k steps, the first half of this pass's share: on a 2-core Zen 4,
    // small's four linears at 16 / 32 / 64 rows took 1.01-1.02 / 1.02-1.03 / 1.01-1.03x as long with the whole share
    // (panel_rows' schedule), 1.02 / 1.00 / 1.02x with none.
    if (next != nullptr && k % (2 * kNextEvery) == 0 && k / (2 * kNextEvery) < next_lines)
      _mm_prefetch(next + (k / (2 * kNextEvery)) * 64, _MM_HINT_T1);
    __m512i wv[NP];
    for (int p = 0; p < NP; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(w + p * stride + (k + ahead) * kPanel), _MM_HINT_T0);
      wv[p] = _mm512_loadu_si512(w + p * stride + k * kPanel);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + k, sizeof pair);
      const __m512i xv = _mm512_set1_epi32(pair);
      for (int p = 0; p < NP; ++p) acc[p][m] = _mm512_dpbf16_ps(acc[p][m], (__m512bh)xv, (__m512bh)wv[p]);
    }
  }
  if (k < K) {  // odd K: the last step on widened values
    __m512 wv[NP];
    for (int p = 0; p < NP; ++p) wv[p] = load_w<bf16_bits>(w + p * stride + k * kPanel);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(x[m * ldx + k]) << 16));
      for (int p = 0; p < NP; ++p) acc[p][m] = _mm512_fmadd_ps(xv, wv[p], acc[p][m]);
    }
  }
  store_rows<MR, NP, kGated>(acc, mask, y, ldy);
}

// bf16 rows over bf16 weights on a CPU with AMX (amx_bf16_usable): the matrix unit multiplies a 16-row block of x
// by a panel 32 k steps at a time (TDPBF16PS: a [rows, 32] bf16 tile times a [32, 16] one, pairs of k steps, into a
// [rows, 16] fp32 tile), where the vector passes above take one FMA per row, column group and k step. A panel's
// 32 steps (16 lines of (k, k + 1) pairs, 1 KB, contiguous) are the tile as they are, loaded in place; only a last
// block of fewer than 32 steps is copied, zero-padded. x rows are read in place where K is a multiple of 32, else
// from a zero-padded copy. Up to 32 rows (two row blocks) a pass share each panel tile; tiles: 0-1 x blocks, 2-3
// panels, 4-7 results (block, panel). The results start at the bias and end in the same epilogue as the vector
// passes' (store_rows' SiLU for a gated pair). The instruction's arithmetic: products exact in fp32, sums in fp32,
// denormals flushed.
constexpr int64_t kAmxK = 32;  // k steps per tile product
constexpr int64_t kAmxRows = 16;  // rows per x block
constexpr int64_t kTile = kAmxRows * kPanel;  // floats in one result tile

// Tiles for a pass of r0 + r1 rows (r1 = 0: one block).
BUCKETSERVE_AMX_BF16 void amx_configure(int64_t r0, int64_t r1) {
  bucketserve::AmxTileConfig c;
  const int64_t block[2] = {r0, r1};
  for (int b = 0; b < 2; ++b) {
    if (block[b] == 0) continue;
    c.rows[b] = static_cast<uint8_t>(block[b]);  // x block: rows x 32 bf16
    c.colsb[b] = 64;
    for (int p = 0; p < 2; ++p) {  // results: rows x 16 fp32
      c.rows[4 + 2 * b + p] = static_cast<uint8_t>(block[b]);
      c.colsb[4 + 2 * b + p] = 64;
    }
  }
  for (int p = 0; p < 2; ++p) {  // panels: 16 pairs of k steps x 16 columns
    c.rows[2 + p] = 16;
    c.colsb[2 + p] = 64;
  }
  bucketserve::amx_load_tiles(c);
}

// Rows [0, r0 + r1) of x (bf16, row stride ldx, readable up to the next multiple of 32 past K) times np (1 or 2)
// adjacent panels into out [2 blocks][2 panels][16 rows][16] fp32, each starting at start (the same layout: the
// bias, or zeros). Tiles configured for (r0, r1) by amx_configure.
BUCKETSERVE_AMX_BF16 __attribute__((noinline)) void panels_amx(const bf16_bits* x, int64_t ldx, int64_t r0,
                                                                int64_t r1, const bf16_bits* w, int64_t K, int np,
                                                                const float* start, float* out) {
  alignas(64) bf16_bits tail[2][kAmxK * kPanel];  // a last k block shorter than 32 steps, zero-padded
  _tile_loadd(4, start, 64);
  _tile_loadd(5, start + kTile, 64);
  if (r1 > 0) {
    _tile_loadd(6, start + 2 * kTile, 64);
    _tile_loadd(7, start + 3 * kTile, 64);
  }
  const int64_t stride = K * kPanel;  // from one panel to the next
  for (int64_t k0 = 0; k0 < K; k0 += kAmxK) {
    const int64_t steps = std::min(kAmxK, K - k0);
    const bf16_bits* panel[2];  // this k block of each panel: 16 lines of (k, k + 1) pairs, 64 bytes apart
    for (int p = 0; p < np; ++p) {
      panel[p] = w + p * stride + k0 * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(panel[p] + 4 * kAmxK * kPanel), _MM_HINT_T0);  // 4 KB ahead
      if (steps == kAmxK) continue;
      // Steps past K must multiply as zeros, and the panel's end is the next panel's (or the tensor's) start.
      for (int64_t r = 0; r < kAmxK / 2; ++r) {
        const int64_t k = 2 * r;
        __m512i v = _mm512_setzero_si512();
        if (k + 1 < steps)
          v = _mm512_loadu_si512(panel[p] + k * kPanel);
        else if (k < steps)  // an odd K's last step, alone in its line: paired with a zero
          v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel[p] + k * kPanel)));
        _mm512_store_si512(tail[p] + r * 2 * kPanel, v);
      }
      panel[p] = tail[p];
    }
    _tile_loadd(0, x + k0, ldx * 2);
    _tile_loadd(2, panel[0], 64);
    _tile_dpbf16ps(4, 0, 2);
    if (r1 > 0) {
      _tile_loadd(1, x + kAmxRows * ldx + k0, ldx * 2);
      _tile_dpbf16ps(6, 1, 2);
    }
    if (np == 2) {
      _tile_loadd(3, panel[1], 64);
      _tile_dpbf16ps(5, 0, 3);
      if (r1 > 0) _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, out, 64);
  _tile_stored(5, out + kTile, 64);
  if (r1 > 0) {
    _tile_stored(6, out + 2 * kTile, 64);
    _tile_stored(7, out + 3 * kTile, 64);
  }
}

// The results of panels_amx for rows [0, rows) of one block (out: [2 panels][16][16]) to y, as store_rows.
template <bool kGated>
inline void store_amx_rows(const float* out, int64_t rows, int np, float* y, int64_t ldy, int64_t cols) {
  __mmask16 mask[2];
  for (int p = 0; p < 2; ++p) {
    const int64_t c = std::clamp<int64_t>(cols - p * kPanel, 0, kPanel);
    mask[p] = c >= kPanel ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << c) - 1);
  }
  for (int64_t m = 0; m < rows; ++m) {
    if constexpr (kGated) {
      using Vec = at::vec::Vectorized<float>;
      const Vec g(_mm512_load_ps(out + m * kPanel));
      const Vec h = g / (Vec(1.f) + g.neg().exp()) * Vec(_mm512_load_ps(out + kTile + m * kPanel));
      _mm512_mask_storeu_ps(y + m * ldy, mask[0], static_cast<__m512>(h));
    } else {
      for (int p = 0; p < np; ++p)
        _mm512_mask_storeu_ps(y + m * ldy + p * kPanel, mask[p], _mm512_load_ps(out + p * kTile + m * kPanel));
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2: a 16-column panel is two 8-float registers. With 16 registers, a pass keeps MR x NP x 2 accumulators
// (kRowBlock below: 3 rows x 2 panels = 12), two weight halves per panel and one broadcast.
//
// Step k of a panel (w: the pass's first step, an even one; the first `paired` steps lie in lines of pairs).
template <typename WT>
inline void load_w(const WT* w, int64_t k, int64_t paired, __m256& lo, __m256& hi);
template <>
inline void load_w<float>(const float* w, int64_t k, int64_t, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w + k * kPanel);
  hi = _mm256_loadu_ps(w + k * kPanel + 8);
}
template <>
inline void load_w<bf16_bits>(const bf16_bits* w, int64_t k, int64_t paired, __m256& lo, __m256& hi) {
  if (k < paired) {  // the low (even k) or high (odd k) halves of the line's 32-bit pairs
    const bf16_bits* line = w + (k & ~int64_t{1}) * kPanel;
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));  // columns 0-7
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 16));  // columns 8-15
    const __m128i shift = _mm_cvtsi32_si128(k & 1 ? 0 : 16);
    const __m256i top = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    lo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_sll_epi32(a, shift), top));
    hi = _mm256_castsi256_ps(_mm256_and_si256(_mm256_sll_epi32(b, shift), top));
    return;
  }
  // an odd K's last step, alone
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kPanel));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kPanel + 8));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

// One panel row's 16 results to y: whole when the panel is full, else its first `c` columns.
inline void store_cols(float* y, __m256 lo, __m256 hi, int64_t c) {
  if (c >= kPanel) {
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
  } else if (c > 0) {
    alignas(32) float buf[kPanel];
    _mm256_store_ps(buf, lo);
    _mm256_store_ps(buf + 8, hi);
    std::memcpy(y, buf, sizeof(float) * c);
  }
}

// The accumulators are named registers, not an array: GCC 12 keeps an `__m256 acc[NP][MR][2]` in registers but
// also stores every element to the stack on each k step (12 stores a step, which set the pace: 50 GFLOP/s on two
// Zen 3 cores at every row count, a third of their FMA rate).
//
// A pass may cover only `steps` of the K steps (x and w then point at the first of them; K still sets the panel
// stride): it starts from the accumulators in `acc_in` instead of the bias where given, and leaves them in
// `acc_out` instead of writing y where given (rows kAccStride floats apart: panel 0 in columns 0-15, panel 1 in
// 16-31). Each accumulator still sums its products in k order from the bias: the result is bit for bit the one
// pass's.
constexpr int64_t kAccStride = 2 * kPanel;

template <int MR, int NP, bool kGated, typename WT>
inline void panel_rows(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t K,
                       const float* bias, float* __restrict y, int64_t ldy, int64_t cols, int64_t steps = -1,
                       const float* acc_in = nullptr, float* acc_out = nullptr) {
  constexpr int64_t ahead = kPrefetchLines * static_cast<int64_t>(sizeof(float) / sizeof(WT));
  static_assert(MR >= 1 && MR <= 3 && (NP == 1 || NP == 2), "an AVX2 pass holds up to 3 rows of 2 panels");
  static_assert(!kGated || NP == 2, "a gated pass holds one gate and one up panel");
  const int64_t width0 = std::clamp<int64_t>(cols, 0, kPanel), width1 = std::clamp<int64_t>(cols - kPanel, 0, kPanel);
  alignas(32) float b0[kPanel] = {}, b1[kPanel] = {};
  if (bias && !acc_in) {
    std::memcpy(b0, bias, sizeof(float) * width0);
    if (NP == 2) std::memcpy(b1, bias + kPanel, sizeof(float) * width1);
  }
  // aR*: panel 0, row R; bR*: panel 1, row R; *l / *h: columns 0-7 / 8-15 of the panel.
  __m256 a0l = _mm256_load_ps(b0), a0h = _mm256_load_ps(b0 + 8), b0l = _mm256_load_ps(b1), b0h = _mm256_load_ps(b1 + 8);
  __m256 a1l = a0l, a1h = a0h, b1l = b0l, b1h = b0h, a2l = a0l, a2h = a0h, b2l = b0l, b2h = b0h;
  if (acc_in) {
    const float* r = acc_in;
    a0l = _mm256_load_ps(r), a0h = _mm256_load_ps(r + 8), b0l = _mm256_load_ps(r + 16), b0h = _mm256_load_ps(r + 24);
    if constexpr (MR > 1) {
      r += kAccStride;
      a1l = _mm256_load_ps(r), a1h = _mm256_load_ps(r + 8), b1l = _mm256_load_ps(r + 16), b1h = _mm256_load_ps(r + 24);
    }
    if constexpr (MR > 2) {
      r += kAccStride;
      a2l = _mm256_load_ps(r), a2h = _mm256_load_ps(r + 8), b2l = _mm256_load_ps(r + 16), b2h = _mm256_load_ps(r + 24);
    }
  }
  const int64_t stride = K * kPanel;  // from one panel to the next
  const int64_t n_steps = steps < 0 ? K : steps;
  // A pass starts at an even step, so only an odd K's last step (the last of an odd count) is not in a pair.
  const int64_t paired = n_steps & ~int64_t{1};
  for (int64_t k = 0; k < n_steps; ++k) {
    const WT* w0 = w + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(w0 + ahead * kPanel), _MM_HINT_T0);
    __m256 w0l, w0h, w1l = _mm256_setzero_ps(), w1h = w1l;
    load_w<WT>(w, k, paired, w0l, w0h);
    if constexpr (NP == 2) {
      _mm_prefetch(reinterpret_cast<const char*>(w0 + stride + ahead * kPanel), _MM_HINT_T0);
      load_w<WT>(w + stride, k, paired, w1l, w1h);
    }
    __m256 xv = _mm256_broadcast_ss(x + k);
    a0l = _mm256_fmadd_ps(xv, w0l, a0l), a0h = _mm256_fmadd_ps(xv, w0h, a0h);
    if constexpr (NP == 2) b0l = _mm256_fmadd_ps(xv, w1l, b0l), b0h = _mm256_fmadd_ps(xv, w1h, b0h);
    if constexpr (MR > 1) {
      xv = _mm256_broadcast_ss(x + ldx + k);
      a1l = _mm256_fmadd_ps(xv, w0l, a1l), a1h = _mm256_fmadd_ps(xv, w0h, a1h);
      if constexpr (NP == 2) b1l = _mm256_fmadd_ps(xv, w1l, b1l), b1h = _mm256_fmadd_ps(xv, w1h, b1h);
    }
    if constexpr (MR > 2) {
      xv = _mm256_broadcast_ss(x + 2 * ldx + k);
      a2l = _mm256_fmadd_ps(xv, w0l, a2l), a2h = _mm256_fmadd_ps(xv, w0h, a2h);
      if constexpr (NP == 2) b2l = _mm256_fmadd_ps(xv, w1l, b2l), b2h = _mm256_fmadd_ps(xv, w1h, b2h);
    }
  }
  const __m256 rows[3][4] = {{a0l, a0h, b0l, b0h}, {a1l, a1h, b1l, b1h}, {a2l, a2h, b2l, b2h}};
  if (acc_out) {
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 4; ++j) _mm256_store_ps(acc_out + m * kAccStride + 8 * j, rows[m][j]);
    return;
  }
  for (int m = 0; m < MR; ++m) {
    const __m256* r = rows[m];
    if constexpr (kGated) {
      using Vec = at::vec::Vectorized<float>;  // 8 floats in an AVX2 build
      __m256 h[2];
      for (int half = 0; half < 2; ++half) {
        const Vec g(r[half]);
        h[half] = static_cast<__m256>(g / (Vec(1.f) + g.neg().exp()) * Vec(r[2 + half]));
      }
      store_cols(y + m * ldy, h[0], h[1], width0);
    } else {
      store_cols(y + m * ldy, r[0], r[1], width0);
      if constexpr (NP == 2) store_cols(y + m * ldy + kPanel, r[2], r[3], width1);
    }
  }
}
#else
// Weight (k, c) of a panel of K steps: fp32 one row per step; bf16 in (k, k + 1) pairs per column, an odd K's last
// step alone.
inline float weight_at(const float* panel, int64_t k, int64_t c, int64_t) { return panel[k * kPanel + c]; }
inline float weight_at(const bf16_bits* panel, int64_t k, int64_t c, int64_t K) {
  const int64_t i = (k | 1) < K ? (k & ~int64_t{1}) * kPanel + 2 * c + (k & 1) : k * kPanel + c;
  uint32_t bits = static_cast<uint32_t>(panel[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <int MR, int NP, bool kGated, typename WT>
inline void panel_rows(const float* x, int64_t ldx, const WT* w, int64_t K, const float* bias, float* y,
                       int64_t ldy, int64_t cols) {
  const int64_t width = std::min<int64_t>(cols, kGated ? kPanel : NP * kPanel);
  for (int m = 0; m < MR; ++m)
    for (int64_t c = 0; c < width; ++c) {
      float s[2];
      for (int p = 0; p < (kGated ? 2 : 1); ++p) {
        const int64_t cc = kGated ? c + p * kPanel : c;
        const WT* wp = w + (cc / kPanel) * K * kPanel;
        s[p] = bias ? bias[cc] : 0.f;
        for (int64_t k = 0; k < K; ++k) s[p] += x[m * ldx + k] * weight_at(wp, k, cc % kPanel, K);
      }
      y[m * ldy + c] = kGated ? s[0] / (1.f + std::exp(-s[0])) * s[1] : s[0];
    }
}
#endif

// One pass of MR rows; kPf (software prefetch of the weights) is a choice of the AVX-512 pass only: AVX2 passes
// always prefetch (measured with it on Zen 3), the portable one never. Rows of type XT: fp32, or bf16 (over bf16
// weights, AVX-512 builds only: the dot-product pass).
template <int MR, int NP, bool kGated, typename WT, bool kPf, typename XT>
inline void pass_of(const XT* x, int64_t ldx, const WT* w, int64_t K, const float* bias, float* y, int64_t ldy,
                    int64_t cols, const char* next = nullptr, int64_t next_lines = 0) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<XT, bf16_bits>)
    panel_rows_dot<MR, NP, kGated>(x, ldx, w, K, bias, y, ldy, cols, next, next_lines);
  else
    panel_rows<MR, NP, kGated, WT, kPf>(x, ldx, w, K, bias, y, ldy, cols, next, next_lines);
#else
  panel_rows<MR, NP, kGated, WT>(x, ldx, w, K, bias, y, ldy, cols);
#endif
}

#if defined(__AVX512F__) || !(defined(__AVX2__) && defined(__FMA__))
constexpr int kRowBlock = 12;  // rows per pass: 12 x 2 panels = 24 accumulators of AVX-512's 32 registers
#else
constexpr int kRowBlock = 3;  // rows per pass: 3 x 2 panels x 2 halves = 12 accumulators of AVX2's 16 registers
#endif

template <int NP, int MR, bool kGated, typename WT, bool kPf, typename XT>
inline void rows_tail(const XT* x, int64_t K, const WT* w, const float* bias, float* y, int64_t N,
                      int64_t cols) {
  // Only remainders below a full pass ever run (and only those are instantiated).
  if constexpr (MR > 0 && MR < kRowBlock) pass_of<MR, NP, kGated, WT, kPf, XT>(x, K, w, K, bias, y, N, cols);
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2, more rows than one pass holds: the passes over a panel pair go a block of K at a time, every row's pass over
// one block before the next block. The block (8 KB of fp32 weights) then comes from memory once and from L1 for the
// other passes, and the next block streams in while they compute; whole-K passes read the pair from memory in the
// first and from L2 in the others, one after the other (on a 2-core Zen 3: memory, then compute). The accumulators
// wait in a small buffer between blocks. Measured there, `small`, context 512, two paired rounds: a batch-8 decode
// step 8.1 / 8.1 ms against 11.3 / 10.8 whole-K (its linears 4.9 / 4.0 ms a step against 6.1 / 6.3); batch 32,
// where the linears are bound by the FMA rate, the same (25.1 / 23.4 against 25.2 / 22.7).
constexpr int64_t kKBlock = 64;
static_assert(kKBlock % 2 == 0, "a block must start at an even step: bf16 lines hold pairs of steps");
constexpr int64_t kBlockedRowsMax = 64;  // the buffer: 8 KB

template <int NP, bool kGated, typename WT>
inline void pass_rows(int64_t rows, const float* x, int64_t K, const WT* w, const float* bias, float* y, int64_t N,
                      int64_t cols, int64_t steps, const float* acc_in, float* acc_out) {
  if (rows == 3)
    panel_rows<3, NP, kGated, WT>(x, K, w, K, bias, y, N, cols, steps, acc_in, acc_out);
  else if (rows == 2)
    panel_rows<2, NP, kGated, WT>(x, K, w, K, bias, y, N, cols, steps, acc_in, acc_out);
  else
    panel_rows<1, NP, kGated, WT>(x, K, w, K, bias, y, N, cols, steps, acc_in, acc_out);
}

template <int NP, bool kGated, typename WT>
inline void panels_k_blocked(const float* x, int64_t M, int64_t K, const WT* w, const float* bias, float* y,
                             int64_t N, int64_t cols) {
  alignas(32) float acc[kBlockedRowsMax * kAccStride];
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t steps = std::min(kKBlock, K - k0);
    for (int64_t m = 0; m < M; m += kRowBlock) {
      float* a = acc + m * kAccStride;
      pass_rows<NP, kGated, WT>(std::min<int64_t>(kRowBlock, M - m), x + m * K + k0, K, w + k0 * kPanel, bias,
                                nullptr, N, cols, steps, k0 == 0 ? nullptr : a, a);
    }
  }
  for (int64_t m = 0; m < M; m += kRowBlock)  // no k steps left: the epilogue writes y
    pass_rows<NP, kGated, WT>(std::min<int64_t>(kRowBlock, M - m), x, K, w, bias, y + m * N, N, cols, 0,
                              acc + m * kAccStride, nullptr);
}
#endif

// Rows [0, M) of NP adjacent panels, kRowBlock at a time, then the remainder.
//
// AVX-512, more rows than one pass (``next``: the thread's next panel pair, else null): a pair's first pass reads it
// from memory and the passes after it from L2, so the first waits on memory (one core reads at about half the
// host's rate) and the others on the FMA units, one after the other. The passes after the first therefore bring the
// next pair into L2, K / kNextEvery lines each, so its first pass finds it there. `small`'s four linears of a
// layer at 128 / 64 / 32 rows, each layer's after a 17 MB read (a decode's attention), paired in one process on a
// 2-core Xeon with AMX: 0.93-0.96 / 0.88-0.92 / 1.00 of the time (three runs at 128, two at 64); one line every 4 k
// steps into L2 gained less (0.95 at 128 rows), and into L1 as much at 128 rows but less at 64 (0.97-0.98).
template <int NP, bool kGated, typename WT, bool kPf, typename XT>
inline void panels_all_rows(const XT* x, int64_t M, int64_t K, const WT* w, const float* bias, float* y,
                            int64_t N, int64_t cols, const WT* next = nullptr) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if (M > kRowBlock && M <= kBlockedRowsMax && K > kKBlock) {
    panels_k_blocked<NP, kGated, WT>(x, M, K, w, bias, y, N, cols);
    return;
  }
#endif
  const int64_t next_lines = next ? NP * K * static_cast<int64_t>(sizeof(WT)) * kPanel / 64 : 0;  // the pair's
  const int64_t per_pass = K / kNextEvery;
  int64_t m = 0;
  for (int64_t pass = 0; m + kRowBlock <= M; m += kRowBlock, ++pass) {
    const int64_t first = (pass - 1) * per_pass;  // this pass's share of the next pair's lines
    const bool fetch = next != nullptr && pass >= 1 && first < next_lines;
    pass_of<kRowBlock, NP, kGated, WT, kPf, XT>(x + m * K, K, w, K, bias, y + m * N, N, cols,
                                           fetch ? reinterpret_cast<const char*>(next) + first * 64 : nullptr,
                                           fetch ? std::min(per_pass, next_lines - first) : 0);
  }
  const XT* xm = x + m * K;
  float* ym = y + m * N;
  switch (M - m) {
    case 11: rows_tail<NP, 11, kGated, WT, kPf, XT>(xm, K, w, bias, ym, N, cols); break;
    case 10: rows_tail<NP, 10, kGated, WT, kPf, XT>(xm, K, w, bias, ym, N, cols); break;
    case 9: rows_tail<NP, 9, kGated, WT, kPf, XT>(xm, K, w, bias, ym, N, cols); break;
    case 8: rows_tail<NP, 8, kGated, WT, kPf, XT>(xm, K, w, bias, ym, N, cols); break;
    case 7: rows_tail<NP, 7, kGated, WT, kPf, XT>(xm, K, w, bias, ym, N, cols); break;
    case 6: rows_tail<NP, 6, kGated, WT, kPf, XT>(xm, K, w, bias, ym, N, cols); break;
    case 5: rows_tail<NP, 5, kGated, WT, kPf, XT>(xm, K, w, bias, ym, N, cols); break;
    case 4: rows_tail<NP, 4, kGated, WT, kPf, XT>(xm, K, w, bias, ym, N, cols); break;
    case 3: rows_tail<NP, 3, kGated, WT, kPf, XT>(xm, K, w, bias, ym, N, cols); break;
    case 2: rows_tail<NP, 2, kGated, WT, kPf, XT>(xm, K, w, bias, ym, N, cols); break;
    case 1: rows_tail<NP, 1, kGated, WT, kPf, XT>(xm, K, w, bias, ym, N, cols); break;
    default: break;
  }
}

#if defined(__AVX512F__)
constexpr bool kAvx512Build = true;
#else
constexpr bool kAvx512Build = false;
#endif

// How bf16 rows over bf16 weights are multiplied: widened to fp32 for FMAs (panel_rows), in pairs of k steps by
// VDPBF16PS (panel_rows_dot) or on AMX tiles (panels_amx). The last two on AVX-512 builds only.
enum Bf16Path : int { kWiden = 0, kDot = 1, kAmx = 2 };
std::atomic<int> g_bf16_path{-1};  // pinned for the process (set_linear_bf16_path), or -1: the CPU's default

// The default: AMX tiles where the CPU has them (from kAmxMinRows rows), else the dot product where it pays
// (bf16_dot_pays: AMD), else widened. On a 2-core Xeon with AMX, `small`'s four linears of a layer (bf16 weights
// in its 480 MiB L3), paired in one process: AMX / widened 0.79-0.81 at 8 rows, 0.52 at 16, 0.37 at 32, 0.32 at
// 64-128; AMX / oneDNN 0.53-0.58 at 1-8 rows, 0.63-0.64 at 16-32, 0.89-0.90 at 48-64, 0.97 at 96, 1.08 at 128
// (skinny_rows.py gives where oneDNN takes over).
int default_bf16_path() {
  if (!kAvx512Build) return kWiden;
  if (bucketserve::amx_bf16_usable()) return kAmx;
  return bucketserve::bf16_dot_pays() ? kDot : kWiden;
}

// The path of bf16 rows over bf16 weights: the pinned one, or (or with default_only) the CPU's default.
int64_t linear_bf16_path(bool default_only) {
  const int m = g_bf16_path.load(std::memory_order_relaxed);
  return m < 0 || default_only ? default_bf16_path() : m;
}

// By default the AMX pass takes M rows from this many on; a single row stays widened. With bf16 panels of k pairs (no
// permute before a tile load), bf16 decode steps of `small` with the AMX pass against the widened one at 1-4 rows,
// alternating step by step in one process on a 2-core Xeon with AMX (300 MiB L3): 0.98-1.00 / 0.98-1.01 / 0.97-0.98
// / 0.95-0.97 of the time at batch 1 / 2 / 3 / 4 (three runs); the four linears of a layer alone 0.95 at 2 rows. On
// another such host the pass took 1.06x as long at one row (a timing of the pair layout's loads), 0.98 at two. A
// pinned path takes every M.
constexpr int64_t kAmxMinRows = 2;

int bf16_path_for(int64_t M) {
  const int m = g_bf16_path.load(std::memory_order_relaxed);
  if (m >= 0) return m;
  const int d = default_bf16_path();
  return d == kAmx && M < kAmxMinRows ? kWiden : d;
}

// Pins the path for this process (tests run each one where the CPU can): -1 the CPU's default, else a Bf16Path.
void set_linear_bf16_path(int64_t mode) {
  const char* op = "set_linear_bf16_path: ";
  TORCH_CHECK(mode >= -1 && mode <= kAmx, op, "mode -1 (the CPU's default), 0 (widen), 1 (dot product) or 2 (AMX)");
  TORCH_CHECK(mode <= kWiden || kAvx512Build, op, "this build has no AVX-512 code");
  TORCH_CHECK(mode != kDot || bucketserve::cpu_has_avx512_bf16(), op, "this CPU has no AVX512_BF16");
  TORCH_CHECK(mode != kAmx || bucketserve::amx_bf16_usable(), op,
              "this CPU has no AMX bf16 tiles (or the operating system did not grant them)");
  g_bf16_path.store(static_cast<int>(mode), std::memory_order_relaxed);
}

// What both operators check and convert: fp32 rows, the panels' geometry, and the weight's element type. Results
// are computed in fp32 and returned in x's dtype. bf16 rows are widened (exactly) into a buffer this thread keeps
// from call to call, and bf16 results rounded from another, instead of through two more tensors and operator calls
// (x.to(float), y.to(bf16)) around each linear. Paired in one process on a 2-core Xeon with AMX, `small`'s four
// linears of a layer (QKV, O, gated, down; bf16 weights warm in the caches) took 0.87 / 0.93 / 0.94 of the time at
// 1 / 8 / 16 rows (118 against 136, 206 against 223, 382 against 407 us): 3-10 us a call.
struct Args {
  const float* x;  // [M, K] fp32, contiguous: x_in's own data, or its rows widened into this thread's buffer
  const bf16_bits* xb;  // [M, K] bf16 rows as they are, for the dot-product or AMX pass; else null
  int64_t M, K, NP;
  int path;  // a Bf16Path: how bf16 rows over bf16 weights are multiplied (kWiden for everything else)
  bool bf16;  // weight panels in bf16 (else fp32)
  at::Tensor keep;  // x_in, contiguous, when its own data is read (keeps it alive and contiguous for the call)
};

std::vector<float>& thread_buffer(int which) {
  // 0: widened rows, 1: fp32 results to round to bf16 (both the calling thread's), 2: a worker's widened panels
  thread_local std::vector<float> buffers[3];
  return buffers[which];
}

// Rows per thread's share of a conversion between bf16 and fp32 rows of `width` values: at least 16K values, so
// that a decode's few rows stay on one thread.
inline int64_t conversion_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

Args check(const char* op, const at::Tensor& x_in, const at::Tensor& panels) {
  TORCH_CHECK(x_in.device().is_cpu() && panels.device().is_cpu(), op, ": CPU tensors only");
  const auto xt = x_in.scalar_type(), wt = panels.scalar_type();
  TORCH_CHECK((xt == at::kFloat || xt == at::kBFloat16) && (wt == at::kFloat || wt == at::kBFloat16), op,
              ": float32 or bfloat16 only");
  TORCH_CHECK(x_in.dim() == 2 && panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(), op,
              ": x [M, K] and panels [NP, K, 16] contiguous");
  TORCH_CHECK(panels.size(1) == x_in.size(1), op, ": x has K = ", x_in.size(1), ", the weight ", panels.size(1));
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const bool bf16_weights = wt == at::kBFloat16;
  if (xt == at::kFloat) {
    at::Tensor x = x_in.contiguous();
    return {x.const_data_ptr<float>(), nullptr, M, K, panels.size(0), kWiden, bf16_weights, x};
  }
  const at::Tensor x = x_in.contiguous();
  const int path = bf16_weights ? bf16_path_for(M) : kWiden;
  if (path != kWiden) {
    const auto* bits = reinterpret_cast<const bf16_bits*>(x.const_data_ptr<at::BFloat16>());
    return {nullptr, bits, M, K, panels.size(0), path, true, x};
  }
  std::vector<float>& buf = thread_buffer(0);
  buf.resize(static_cast<size_t>(M * K));
  const at::BFloat16* src = x.const_data_ptr<at::BFloat16>();
  float* dst = buf.data();
  // exact; on every thread (a prompt's rows: a serial pass took 4-10% of a bf16 call at 1024 rows)
  at::parallel_for(0, M, conversion_grain(K), [&](int64_t m0, int64_t m1) {
    for (int64_t i = m0 * K; i < m1 * K; ++i) dst[i] = static_cast<float>(src[i]);
  });
  return {buf.data(), nullptr, M, K, panels.size(0), kWiden, bf16_weights, at::Tensor()};
}

// Rows per chunk of a call with many (a prompt's): a thread takes its panel pairs over one chunk of rows before
// the next chunk, so the chunk's rows (256 x K floats: 512 KB at K 512) are read from L2 by every pair's passes
// and the thread's weights, re-read once per chunk, from L3; over all rows at once every pair read them from L3
// or memory. `small`'s QKV, O, gate/up, down and LM-head shapes at 4096 rows on a 2-core Zen 2 EPYC (L2 512 KB,
// L3 16 MiB): 156-173 GFLOP/s in chunks of 256 rows against 93-153 over all rows (oneDNN: 134-145); chunks of
// 512 and 1024 rows ran 132-167. A multiple of a pass's rows, so that only the last chunk ends in a tail.
constexpr int64_t kChunkRows = (256 + kRowBlock - 1) / kRowBlock * kRowBlock;

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2, bf16 weights over many rows: a pass widens each weight line it reads (two shifts and two masks per panel
// and k step beside its six FMAs), and every pass of the chunk widens the same lines again. From this many rows a
// thread widens its panel pair once per chunk into fp32 panels (2 x K x 16 floats, in L2) and runs the fp32
// passes over them: the same values in the same order, so the same bits. The kernel's bf16 rate on a 2-core Zen 2
// EPYC over `small`'s shapes: 78-83 GFLOP/s at 64-1024 rows widening in the pass, fp32 176-190. From 16 rows:
// `small`'s bf16 decode steps (context 512) at batch 16 took 15.7 ms against 17.3 widening in the pass, while from
// 4 rows batch 8 took 10.0 against 8.9 (the widening is one more trip over a pair the K-blocked passes then read).
constexpr int64_t kWidenOnceRows = 16;

inline void widen_panels(const bf16_bits* w, int64_t K, int np, float* out) {
  const int64_t paired = K & ~int64_t{1};
  for (int j = 0; j < np; ++j) {
    const bf16_bits* panel = w + j * K * kPanel;
    float* o = out + j * K * kPanel;
    for (int64_t k = 0; k < K; ++k) {
      __m256 lo, hi;
      load_w<bf16_bits>(panel, k, paired, lo, hi);
      _mm256_storeu_ps(o + k * kPanel, lo);
      _mm256_storeu_ps(o + k * kPanel + 8, hi);
    }
  }
}
#endif

template <bool kGated, typename WT, bool kPf, typename XT>
void run_pairs(const Args& a, const XT* xp, const WT* wp, const float* bp, float* yp, int64_t n) {
  // Threads take contiguous runs of panel pairs; an odd last panel goes alone (never in a gated call).
  const int64_t pairs = (a.NP + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t m0 = 0; m0 < a.M; m0 += kChunkRows) {
      const int64_t rows = std::min(kChunkRows, a.M - m0);
      const XT* x = xp + m0 * a.K;
      float* y = yp + m0 * n;
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t p = 2 * q, c0 = (kGated ? q : p) * kPanel;
        const WT* w = wp + p * a.K * kPanel;
        const float* b = bp ? bp + c0 : nullptr;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        if constexpr (std::is_same_v<WT, bf16_bits>) {
          if (rows >= kWidenOnceRows) {
            std::vector<float>& wide = thread_buffer(2);
            const int np = p + 1 < a.NP ? 2 : 1;
            wide.resize(static_cast<size_t>(2 * a.K * kPanel));
            widen_panels(w, a.K, np, wide.data());
            if (np == 2)
              panels_all_rows<2, kGated, float, kPf, XT>(x, rows, a.K, wide.data(), b, y + c0, n, n - c0);
            else if constexpr (!kGated)
              panels_all_rows<1, false, float, kPf, XT>(x, rows, a.K, wide.data(), b, y + c0, n, n - c0);
            continue;
          }
        }
#endif
        // the thread's next pair, where there is one and this pair takes several passes
        const WT* next = q + 1 < q1 && p + 3 < a.NP && rows > kRowBlock ? w + 2 * a.K * kPanel : nullptr;
        if (p + 1 < a.NP)
          panels_all_rows<2, kGated, WT, kPf, XT>(x, rows, a.K, w, b, y + c0, n, n - c0, next);
        else if constexpr (!kGated)
          panels_all_rows<1, false, WT, kPf, XT>(x, rows, a.K, w, b, y + c0, n, n - c0);
      }
    }
  });
}

#if defined(__AVX512F__)
// The AMX pass over all rows: threads take contiguous runs of panel pairs as run_pairs, and each pair goes through
// panels_amx 32 rows at a time.
template <bool kGated>
void run_pairs_amx(const Args& a, const bf16_bits* wp, const float* bp, float* yp, int64_t n) {
  const int64_t M = a.M, K = a.K;
  // x rows as they are where whole tiles of K can be read from them, else zero-padded to a multiple of 32
  const bf16_bits* x = a.xb;
  int64_t ldx = K;
  if (K % kAmxK != 0) {
    thread_local std::vector<bf16_bits> padded;
    ldx = (K + kAmxK - 1) / kAmxK * kAmxK;
    padded.assign(static_cast<size_t>(M * ldx), 0);
    for (int64_t m = 0; m < M; ++m) std::memcpy(padded.data() + m * ldx, a.xb + m * K, K * sizeof(bf16_bits));
    x = padded.data();
  }
  const int64_t pairs = (a.NP + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t q0, int64_t q1) {
    alignas(64) float start[4 * kTile];  // [block][panel][row][16]: the bias, or zeros
    alignas(64) float out[4 * kTile];
    int64_t tiles_for = -1;  // the pass shape (rows of its two blocks) the tiles are configured for
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t p = 2 * q, c0 = (kGated ? q : p) * kPanel;
      const int np = p + 1 < a.NP ? 2 : 1;
      for (int j = 0; j < 2; ++j)
        for (int64_t r = 0; r < kAmxRows; ++r)
          for (int64_t c = 0; c < kPanel; ++c) {
            const int64_t col = c0 + j * kPanel + c;
            const float b = bp != nullptr && j < np && col < n ? bp[col] : 0.f;
            start[j * kTile + r * kPanel + c] = b;
            start[(2 + j) * kTile + r * kPanel + c] = b;
          }
      for (int64_t m0 = 0; m0 < M; m0 += 2 * kAmxRows) {
        const int64_t r0 = std::min(kAmxRows, M - m0), r1 = std::clamp<int64_t>(M - m0 - kAmxRows, 0, kAmxRows);
        // passes of 32 rows share one configuration; only a shorter last pass needs another
        const int64_t shape = r0 * 32 + r1;
        if (shape != tiles_for) {
          amx_configure(r0, r1);
          tiles_for = shape;
        }
        panels_amx(x + m0 * ldx, ldx, r0, r1, wp + p * K * kPanel, K, np, start, out);
        store_amx_rows<kGated>(out, r0, np, yp + m0 * n + c0, n, n - c0);
        if (r1 > 0) store_amx_rows<kGated>(out + 2 * kTile, r1, np, yp + (m0 + kAmxRows) * n + c0, n, n - c0);
      }
    }
    if (tiles_for >= 0) bucketserve::amx_release_tiles();
  });
}

#endif

// What this build does with fp32 weights: the AVX-512 pass prefetches them everywhere but on AMD CPUs (measured in
// panel_rows), the AVX2 pass always, the portable one never.
bool prefetches_fp32_weights() {
#if defined(__AVX512F__)
  return !bucketserve::cpu_is_amd();
#elif defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

template <bool kGated>
at::Tensor run(const Args& a, const at::Tensor& x_in, const at::Tensor& panels, const float* bp, int64_t n) {
  const bool f32 = x_in.scalar_type() == at::kFloat;
  at::Tensor y = at::empty({a.M, n}, x_in.options());  // [M, n] in x's dtype
  float* yp = nullptr;
  if (f32) {
    yp = y.data_ptr<float>();
  } else {
    std::vector<float>& buf = thread_buffer(1);
    buf.resize(static_cast<size_t>(a.M * n));
    yp = buf.data();
  }
  if (a.M > 0) {
    const auto* wb = a.bf16 ? reinterpret_cast<const bf16_bits*>(panels.const_data_ptr<at::BFloat16>()) : nullptr;
    if (a.xb != nullptr) {
#if defined(__AVX512F__)
      if (a.path == kAmx)
        run_pairs_amx<kGated>(a, wb, bp, yp, n);
      else
        run_pairs<kGated, bf16_bits, true>(a, a.xb, wb, bp, yp, n);
#endif
    } else if (a.bf16) {
      run_pairs<kGated, bf16_bits, true>(a, a.x, wb, bp, yp, n);
    } else if (prefetches_fp32_weights()) {
      run_pairs<kGated, float, true>(a, a.x, panels.const_data_ptr<float>(), bp, yp, n);
    } else {
      run_pairs<kGated, float, false>(a, a.x, panels.const_data_ptr<float>(), bp, yp, n);
    }
  }
  // Rounded as Tensor.to(bfloat16) rounds (ATen's vectorised conversion of this build's capability), rows on
  // every thread.
  if (!f32) {
    at::BFloat16* out = y.data_ptr<at::BFloat16>();
    at::parallel_for(0, a.M, conversion_grain(n), [&](int64_t m0, int64_t m1) {
      at::vec::convert(yp + m0 * n, out + m0 * n, (m1 - m0) * n);
    });
  }
  return y;
}

at::Tensor skinny_linear(const at::Tensor& x_in, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t n) {
  const Args a = check("skinny_linear", x_in, panels);
  TORCH_CHECK(n > (a.NP - 1) * kPanel && n <= a.NP * kPanel, "skinny_linear: ", a.NP, " panels cannot hold n = ", n);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n, "skinny_linear: bias must be [n]");
    b = bias->to(at::kFloat).contiguous();
  }
  return run<false>(a, x_in, panels, b.defined() ? b.const_data_ptr<float>() : nullptr, n);
}

// A gated MLP's first half, fused: silu(x . Wg^T) * (x . Wu^T), from panels laid out gate 0, up 0, gate 1, up 1,
// ... ([2 * ceil(n / 16), K, 16]): one pass per pair reads both, and the [M, 2n] intermediate never exists.
at::Tensor skinny_silu_mul(const at::Tensor& x_in, const at::Tensor& panels, int64_t n) {
  const Args a = check("skinny_silu_mul", x_in, panels);
  const int64_t pairs = a.NP / 2;
  TORCH_CHECK(a.NP % 2 == 0 && n > (pairs - 1) * kPanel && n <= pairs * kPanel, "skinny_silu_mul: ", a.NP,
              " panels cannot hold gate and up of n = ", n);
  return run<true>(a, x_in, panels, nullptr, n);
}

// ---------------------------------------------------------------- one entry point per prepacked linear
// Many rows go to oneDNN with the weight prepacked in its blocked layout. That opaque tensor cannot be an input
// of a compiled graph, so it stays here, under the index its layer was given at load; a layer's operator call
// carries its panels (a plain tensor), its bias and that index, and the row count picks the kernel at run time:
// one compiled graph serves every token count, and the choice costs no Python per call.
std::mutex g_packed_mutex;
std::unordered_map<int64_t, at::Tensor> g_packed;

void remember_packed(int64_t index, const at::Tensor& packed) {
  std::lock_guard<std::mutex> lock(g_packed_mutex);
  g_packed[index] = packed;
}

void forget_packed(int64_t index) {
  std::lock_guard<std::mutex> lock(g_packed_mutex);
  g_packed.erase(index);
}

at::Tensor packed_of(int64_t index) {
  std::lock_guard<std::mutex> lock(g_packed_mutex);
  const auto it = g_packed.find(index);
  TORCH_CHECK(it != g_packed.end(), "packed linear: no prepacked weight under index ", index);
  return it->second;
}

// oneDNN's linear with an optional fused epilogue: attr "none" or "swish" (unary), or a binary "mul" with other.
at::Tensor onednn_linear(const at::Tensor& x, int64_t index, const std::optional<at::Tensor>& bias,
                         const char* attr, const at::Tensor* other = nullptr) {
  static const c10::OperatorHandle unary =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  static const c10::OperatorHandle binary =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "binary");
  torch::jit::Stack stack;
  stack.emplace_back(x);
  if (other != nullptr) stack.emplace_back(*other);
  stack.emplace_back(packed_of(index));
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string(attr));
  if (other == nullptr) {
    stack.emplace_back(c10::List<std::optional<at::Scalar>>());
    stack.emplace_back(std::string(""));
    unary.callBoxed(&stack);
  } else {
    binary.callBoxed(&stack);
  }
  return stack[0].toTensor();
}

at::Tensor packed_linear(const at::Tensor& x, const std::optional<at::Tensor>& panels,
                         const std::optional<at::Tensor>& bias, int64_t n, int64_t index, int64_t max_rows) {
  if (panels.has_value() && panels->defined() && x.size(0) <= max_rows) return skinny_linear(x, *panels, bias, n);
  return onednn_linear(x, index, bias, "none");
}

// silu(x . Wg^T) * (x . Wu^T): the skinny pass over interleaved panels for few rows, else oneDNN with SiLU fused
// into the gate GEMM and the product into the up GEMM.
at::Tensor gated_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, int64_t gate_index,
                        int64_t up_index, int64_t max_rows) {
  if (x.size(0) <= max_rows) return skinny_silu_mul(x, panels, n);
  const at::Tensor gate = onednn_linear(x, gate_index, std::nullopt, "swish");
  return onednn_linear(x, up_index, std::nullopt, "mul", &gate);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(bucketserve_cpu, m) {
  m.def("skinny_linear(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor");
  m.def("skinny_silu_mul(Tensor x, Tensor panels, int n) -> Tensor");
  m.def("remember_packed(int index, Tensor packed) -> ()");
  m.def("forget_packed(int index) -> ()");
  m.def("prefetches_fp32_weights() -> bool");
  m.def("linear_bf16_path(bool default_only=False) -> int");
  m.def("set_linear_bf16_path(int mode) -> ()");
  m.def("packed_linear(Tensor x, Tensor? panels, Tensor? bias, int n, int index, int max_rows) -> Tensor");
  m.def("gated_linear(Tensor x, Tensor panels, int n, int gate_index, int up_index, int max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(bucketserve_cpu, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("skinny_silu_mul", &skinny_silu_mul);
  m.impl("packed_linear", &packed_linear);
  m.impl("gated_linear", &gated_linear);
}

// Registry calls carry no CPU tensor argument to dispatch on.
TORCH_LIBRARY_IMPL(bucketserve_cpu, CatchAll, m) {
  m.impl("remember_packed", &remember_packed);
  m.impl("forget_packed", &forget_packed);
  m.impl("prefetches_fp32_weights", &prefetches_fp32_weights);
  m.impl("linear_bf16_path", &linear_bf16_path);
  m.impl("set_linear_bf16_path", &set_linear_bf16_path);
}
