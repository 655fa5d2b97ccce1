// Vector building blocks of the paged attention kernel (fp32 compute on ATen's Vectorized<float>):
// widening loads, a register-blocked mini GEMM, 4-way dots and AXPYs, and the two online-softmax updates.
// Included by paged_attention_cpu.cpp only.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu_features.h"

namespace bucketserve_kernels {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VS = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// dst[0..n) = float(src[0..n)) * mul
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n, float mul = 1.f) {
  int64_t d = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; d + VS <= n; d += VS) (Vec::loadu(src + d) * Vec(mul)).store(dst + d);
  } else {
    for (; d + VS <= n; d += VS) {
      Vec v;
      at::vec::load_to_float<T>(src + d, v);
      (v * Vec(mul)).store(dst + d);
    }
  }
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]) * mul;
}

// C[R, N] (+)= A[R, K] . B[K, N], fp32, on operands in scratch (with ``cscale``, C's row r is first multiplied by
// cscale[r], rounded as a separate multiply would be): A(r, k) = A[r * ars + k * acs] and
// B(k, n) = B[k * ldb + n]. R <= 8 rows x 2 column vectors of C stay in registers (16 of AVX-512's 32); A's
// elements are broadcast, so each pair of B loads feeds 2R FMAs. ARS, A's row stride, is a template argument
// where the caller knows it (0: the runtime ``ars``), so the R broadcasts of one k are constant offsets from one
// pointer: with a pointer per row (K/V rows read in place, anywhere in the cache) the eight pointers spilled to
// vector registers and each broadcast cost a move on an FMA port (a 1024-token prompt's attention ran at ~120
// GFLOP/s on a 2-core AVX-512 host whose matmul runs at ~320).
template <int R, int64_t ARS>
inline void panel_rows(const float* A, int64_t ars_rt, int64_t acs, const float* B, int64_t ldb, float* C,
                       int64_t ldc, int64_t K, int64_t N, bool accumulate, const float* cscale = nullptr) {
  const int64_t ars = ARS ? ARS : ars_rt;
  int64_t n0 = 0;
  for (; n0 + 2 * VS <= N; n0 += 2 * VS) {
    Vec acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = accumulate ? Vec::loadu(C + r * ldc + n0) : Vec(0.f);
      acc[r][1] = accumulate ? Vec::loadu(C + r * ldc + n0 + VS) : Vec(0.f);
      if (cscale != nullptr) {
        acc[r][0] = acc[r][0] * Vec(cscale[r]);
        acc[r][1] = acc[r][1] * Vec(cscale[r]);
      }
    }
    const float* a = A;
    const float* b = B + n0;
    for (int64_t k = 0; k < K; ++k, a += acs, b += ldb) {
      const Vec b0 = Vec::loadu(b);
      const Vec b1 = Vec::loadu(b + VS);
      for (int r = 0; r < R; ++r) {
        const Vec x(a[r * ars]);
        acc[r][0] = at::vec::fmadd(x, b0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(x, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r][0].store(C + r * ldc + n0);
      acc[r][1].store(C + r * ldc + n0 + VS);
    }
  }
  for (; n0 < N; n0 += VS) {  // the last one or two vectors of columns, the last one maybe partial
    const int64_t c = std::min(VS, N - n0);
    Vec acc[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = accumulate ? Vec::loadu(C + r * ldc + n0, c) : Vec(0.f);
      if (cscale != nullptr) acc[r] = acc[r] * Vec(cscale[r]);
    }
    const float* a = A;
    const float* b = B + n0;
    for (int64_t k = 0; k < K; ++k, a += acs, b += ldb) {
      const Vec b0 = Vec::loadu(b, c);
      for (int r = 0; r < R; ++r) acc[r] = at::vec::fmadd(Vec(a[r * ars]), b0, acc[r]);
    }
    for (int r = 0; r < R; ++r) acc[r].store(C + r * ldc + n0, c);
  }
}

// C[M, N] (+)= A[M, K] . B[K, N] in blocks of 8 rows (see panel_rows).
template <int64_t ARS>
inline void panel_gemm(const float* A, int64_t ars_rt, int64_t acs, const float* B, int64_t ldb, float* C,
                       int64_t ldc, int64_t M, int64_t K, int64_t N, bool accumulate, const float* cscale = nullptr) {
  const int64_t ars = ARS ? ARS : ars_rt;
  int64_t r = 0;
  for (; r + 8 <= M; r += 8)
    panel_rows<8, ARS>(A + r * ars, ars, acs, B, ldb, C + r * ldc, ldc, K, N, accumulate,
                       cscale ? cscale + r : nullptr);
  const float* a = A + r * ars;
  float* c = C + r * ldc;
  const float* cs = cscale ? cscale + r : nullptr;
  switch (M - r) {
    case 7: panel_rows<7, ARS>(a, ars, acs, B, ldb, c, ldc, K, N, accumulate, cs); break;
    case 6: panel_rows<6, ARS>(a, ars, acs, B, ldb, c, ldc, K, N, accumulate, cs); break;
    case 5: panel_rows<5, ARS>(a, ars, acs, B, ldb, c, ldc, K, N, accumulate, cs); break;
    case 4: panel_rows<4, ARS>(a, ars, acs, B, ldb, c, ldc, K, N, accumulate, cs); break;
    case 3: panel_rows<3, ARS>(a, ars, acs, B, ldb, c, ldc, K, N, accumulate, cs); break;
    case 2: panel_rows<2, ARS>(a, ars, acs, B, ldb, c, ldc, K, N, accumulate, cs); break;
    case 1: panel_rows<1, ARS>(a, ars, acs, B, ldb, c, ldc, K, N, accumulate, cs); break;
    default: break;
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// C[R, N] = scale * A[R, 2 KP] . B[2 KP, N] for bf16 A and B, two k steps per VDPBF16PS (each product exact in fp32,
// added in turn with round-to-nearest-even; denormal inputs and results flushed to zero): A's pair p of row r is the
// 32-bit word at A + r * ars + 2p, broadcast; B is laid out [KP][ldb][2], one column's pair per 32-bit lane. R <= 8
// rows x 2 column vectors of C in registers, as panel_rows. Callers check the CPU has the instruction.
template <int R, int64_t ARS>
BUCKETSERVE_BF16_DOT inline void panel_rows_dot(const uint16_t* A, int64_t ars_rt, const uint16_t* B, int64_t ldb,
                                                float* C, int64_t ldc, int64_t KP, int64_t N, float scale) {
  const int64_t ars = ARS ? ARS : ars_rt;
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t n0 = 0; n0 < N; n0 += 2 * VS) {
    const int64_t c = std::min<int64_t>(2 * VS, N - n0);
    const __mmask16 m0 = c >= VS ? 0xFFFF : static_cast<__mmask16>((1u << c) - 1);
    const __mmask16 m1 = c >= 2 * VS ? 0xFFFF : c > VS ? static_cast<__mmask16>((1u << (c - VS)) - 1) : 0;
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint16_t* b = B + 2 * n0;
    for (int64_t p = 0; p < KP; ++p, b += 2 * ldb) {
      const __m512i b0 = _mm512_maskz_loadu_epi32(m0, b);
      const __m512i b1 = _mm512_maskz_loadu_epi32(m1, b + 2 * VS);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, A + r * ars + 2 * p, sizeof pair);
        const __m512i x = _mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)x, (__m512bh)b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)x, (__m512bh)b1);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_mask_storeu_ps(C + r * ldc + n0, m0, _mm512_mul_ps(acc[r][0], vs));
      _mm512_mask_storeu_ps(C + r * ldc + n0 + VS, m1, _mm512_mul_ps(acc[r][1], vs));
    }
  }
}

// panel_rows_dot over M <= 8 rows; A's row stride ``ars`` a compile-time constant where it is a packed_stride.
template <int64_t ARS>
BUCKETSERVE_BF16_DOT inline void panel_gemm_dot_m(const uint16_t* A, int64_t ars, const uint16_t* B, int64_t ldb,
                                                  float* C, int64_t ldc, int64_t M, int64_t KP, int64_t N,
                                                  float scale) {
  switch (M) {
    case 8: panel_rows_dot<8, ARS>(A, ars, B, ldb, C, ldc, KP, N, scale); break;
    case 7: panel_rows_dot<7, ARS>(A, ars, B, ldb, C, ldc, KP, N, scale); break;
    case 6: panel_rows_dot<6, ARS>(A, ars, B, ldb, C, ldc, KP, N, scale); break;
    case 5: panel_rows_dot<5, ARS>(A, ars, B, ldb, C, ldc, KP, N, scale); break;
    case 4: panel_rows_dot<4, ARS>(A, ars, B, ldb, C, ldc, KP, N, scale); break;
    case 3: panel_rows_dot<3, ARS>(A, ars, B, ldb, C, ldc, KP, N, scale); break;
    case 2: panel_rows_dot<2, ARS>(A, ars, B, ldb, C, ldc, KP, N, scale); break;
    case 1: panel_rows_dot<1, ARS>(A, ars, B, ldb, C, ldc, KP, N, scale); break;
    default: break;
  }
}

BUCKETSERVE_BF16_DOT inline void panel_gemm_dot(const uint16_t* A, int64_t ars, const uint16_t* B, int64_t ldb,
                                                float* C, int64_t ldc, int64_t M, int64_t KP, int64_t N,
                                                float scale) {
  switch (ars) {
    case 64: panel_gemm_dot_m<64>(A, ars, B, ldb, C, ldc, M, KP, N, scale); break;
    case 128: panel_gemm_dot_m<128>(A, ars, B, ldb, C, ldc, M, KP, N, scale); break;
    case 256: panel_gemm_dot_m<256>(A, ars, B, ldb, C, ldc, M, KP, N, scale); break;
    default: panel_gemm_dot_m<0>(A, ars, B, ldb, C, ldc, M, KP, N, scale); break;
  }
}
#endif

// The row stride of packed K rows in scratch: the head dim rounded up to one of the strides panel_gemm is
// compiled for, or the head dim itself (a runtime stride) above them.
inline int64_t packed_stride(int64_t D) {
  for (int64_t s : {64, 128, 256})
    if (D <= s) return s;
  return D;
}

// panel_gemm with A's row stride ``ars`` (a packed_stride) as a compile-time constant where it is one.
inline void panel_gemm_rows_strided(const float* A, int64_t ars, const float* B, int64_t ldb, float* C, int64_t ldc,
                                    int64_t M, int64_t K, int64_t N) {
  switch (ars) {
    case 64: panel_gemm<64>(A, ars, 1, B, ldb, C, ldc, M, K, N, false); break;
    case 128: panel_gemm<128>(A, ars, 1, B, ldb, C, ldc, M, K, N, false); break;
    case 256: panel_gemm<256>(A, ars, 1, B, ldb, C, ldc, M, K, N, false); break;
    default: panel_gemm<0>(A, ars, 1, B, ldb, C, ldc, M, K, N, false); break;
  }
}

// out[j] = the sum of acc[j]'s lanes, for 4 vectors.
inline void hsum4(const Vec* acc, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  // Four horizontal sums at once: interleave pairs, then add the four 128-bit lanes.
  const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]), _mm512_unpackhi_ps(acc[0], acc[1]));
  const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]), _mm512_unpackhi_ps(acc[2], acc[3]));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x01, x23, 0x44), _mm512_shuffle_ps(x01, x23, 0xEE));
  const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(y), _mm512_extractf32x8_ps(y, 1));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
  for (int j = 0; j < 4; ++j) out[j] = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, acc[j]);
#endif
}

// out[j] = a . b[j] for 4 rows b[j] of n floats.
inline void dot4(const float* a, const float* const* b, int64_t n, float* out) {
  Vec acc[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
  int64_t d = 0;
  for (; d + VS <= n; d += VS) {
    const Vec va = Vec::loadu(a + d);
    for (int j = 0; j < 4; ++j) acc[j] = at::vec::fmadd(va, Vec::loadu(b[j] + d), acc[j]);
  }
  if (d < n) {
    const Vec va = Vec::loadu(a + d, n - d);
    for (int j = 0; j < 4; ++j) acc[j] = at::vec::fmadd(va, Vec::loadu(b[j] + d, n - d), acc[j]);
  }
  hsum4(acc, out);
}

// acc[0..n) += sum_j p[j] * v[j][0..n) over 4 rows v[j].
inline void axpy4(const float* p, const float* const* v, float* acc, int64_t n) {
  const Vec p0(p[0]), p1(p[1]), p2(p[2]), p3(p[3]);
  int64_t d = 0;
  for (; d + VS <= n; d += VS) {
    Vec a = at::vec::fmadd(p0, Vec::loadu(v[0] + d), Vec::loadu(acc + d));
    a = at::vec::fmadd(p1, Vec::loadu(v[1] + d), a);
    a = at::vec::fmadd(p2, Vec::loadu(v[2] + d), a);
    at::vec::fmadd(p3, Vec::loadu(v[3] + d), a).store(acc + d);
  }
  for (; d < n; ++d) acc[d] += p[0] * v[0][d] + p[1] * v[1][d] + p[2] * v[2][d] + p[3] * v[3][d];
}

// Online softmax over one chunk: S[r, :n] (scores) becomes P, each row's running max/sum/acc rescaled.
// Row r sees nr = clamp(last_pos(r) - p0 + 1, 0, n) slots of the chunk; the rest of its P is 0.
inline void softmax_chunk(float* S, int64_t np, float* acc, float* mx, float* sum, int64_t M, int64_t D,
                          int64_t n, int64_t first_last_pos, int64_t G, int64_t p0) {
  const auto vsum_all = [](Vec x, Vec y) { return x + y; };
  const auto vmax_all = [](Vec x, Vec y) { return at::vec::maximum(x, y); };
  for (int64_t r = 0; r < M; ++r) {
    float* srow = S + r * np;
    const int64_t nr = std::clamp<int64_t>(first_last_pos + r / G - p0 + 1, 0, n);
    if (nr == 0) {  // every slot of this chunk is in the row's future
      std::fill(srow, srow + np, 0.f);
      continue;
    }
    std::fill(srow + nr, srow + np, kNegInf);
    Vec vmax(kNegInf);
    for (int64_t s = 0; s < np; s += VS) vmax = at::vec::maximum(vmax, Vec::loadu(srow + s));
    const float new_max = std::max(mx[r], at::vec::vec_reduce_all<float>(vmax_all, vmax));
    const float alpha = std::exp(mx[r] - new_max);  // exp(-inf) = 0 on the first chunk
    const Vec vm(new_max);
    for (int64_t s = 0; s < np; s += VS) (Vec::loadu(srow + s) - vm).exp_u20().store(srow + s);
    std::fill(srow + nr, srow + np, 0.f);  // masked slots: exact zeros, whatever exp gave for -inf
    Vec vsum(0.f);
    for (int64_t s = 0; s < np; s += VS) vsum = vsum + Vec::loadu(srow + s);
    sum[r] = sum[r] * alpha + at::vec::vec_reduce_all<float>(vsum_all, vsum);
    mx[r] = new_max;
    if (alpha != 1.f) {
      float* arow = acc + r * D;
      int64_t d = 0;
      for (; d + VS <= D; d += VS) (Vec::loadu(arow + d) * Vec(alpha)).store(arow + d);
      for (; d < D; ++d) arow[d] *= alpha;
    }
  }
}

// The same update on S^T ([n][ld], slot-major), vectorised over the M query rows, except the accumulator's
// rescale: each row's factor is left in ``alpha`` for the P V product, which applies it as it loads the rows
// (panel_gemm's ``cscale``) instead of in a pass of its own: slot s is seen by
// rows r >= G * (p0 + s - first_last_pos), a suffix, so its masked rows are a prefix of its row of S^T. Rows go
// in blocks of up to kSoftmaxVecs vectors, each pass over the slots carrying one max or sum per vector in
// registers: one chain per vector of rows over all n slots ran at the latency of vmaxps / vaddps, and a pass
// of its own for the masks, the exps and the sums each read S^T again (a sixth of a 1024-token prompt's
// attention). Same arithmetic as before, in the same order: the results are bit for bit the same.
constexpr int64_t kSoftmaxVecs = 8;

// max(a, b) lane by lane, without at::vec::maximum's NaN propagation (three more instructions per call): a
// NaN score still makes its row's exps, sum and output NaN.
inline Vec max_lanes(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_max_ps(a, b));
#else
  return at::vec::maximum(a, b);
#endif
}

// softmax_chunk_t's two passes over one block of NV vectors of rows starting at row b0 (NV a template
// argument, so the running maxima and sums stay in registers).
template <int NV>
inline void softmax_block_max(const float* St, int64_t ld, const float* mx, float* mnew, int64_t M, int64_t n,
                              int64_t b0, int64_t rmin0, int64_t G) {
  int64_t cnt[NV];
  Vec vmax[NV];
  for (int v = 0; v < NV; ++v) {
    cnt[v] = std::min(VS, M - b0 - v * VS);
    vmax[v] = Vec::loadu(mx + b0 + v * VS, cnt[v]);
  }
  const Vec neg_inf(kNegInf);
  for (int64_t s = 0; s < n; ++s) {
    const float* row = St + s * ld + b0;
    const int64_t masked = std::clamp<int64_t>(rmin0 + G * s, 0, M) - b0;  // rows here not seeing slot s yet
    for (int v = 0; v < NV; ++v) {
      if ((v + 1) * VS <= masked) continue;
      Vec x = Vec::loadu(row + v * VS, cnt[v]);
      if (v * VS < masked) x = Vec::set(x, neg_inf, masked - v * VS);
      vmax[v] = max_lanes(vmax[v], x);
    }
  }
  for (int v = 0; v < NV; ++v) vmax[v].store(mnew + b0 + v * VS, cnt[v]);
}

template <int NV>
inline void softmax_block_exp(float* St, int64_t ld, const float* mnew, const float* alpha, float* sum, int64_t M,
                              int64_t n, int64_t b0, int64_t rmin0, int64_t G) {
  int64_t cnt[NV];
  Vec vm[NV], vsum[NV];
  const Vec zero(0.f);
  for (int v = 0; v < NV; ++v) {
    cnt[v] = std::min(VS, M - b0 - v * VS);
    vm[v] = Vec::loadu(mnew + b0 + v * VS, cnt[v]);
    vsum[v] = zero;
  }
  for (int64_t s = 0; s < n; ++s) {
    float* row = St + s * ld + b0;
    const int64_t masked = std::clamp<int64_t>(rmin0 + G * s, 0, M) - b0;
    for (int v = 0; v < NV; ++v) {
      if ((v + 1) * VS <= masked) {  // masked slots: exact zeros, whatever exp gives for -inf
        zero.store(row + v * VS, cnt[v]);
        continue;
      }
      Vec e = (Vec::loadu(row + v * VS, cnt[v]) - vm[v]).exp_u20();
      if (v * VS < masked) e = Vec::set(e, zero, masked - v * VS);
      e.store(row + v * VS, cnt[v]);
      vsum[v] = vsum[v] + e;
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t r0 = b0 + v * VS;
    (Vec::loadu(sum + r0, cnt[v]) * Vec::loadu(alpha + r0, cnt[v]) + vsum[v]).store(sum + r0, cnt[v]);
  }
}

#define BUCKETSERVE_SOFTMAX_BLOCKS(fn, nv, ...)          \
  switch (nv) {                                          \
    case 8: fn<8>(__VA_ARGS__); break;                   \
    case 7: fn<7>(__VA_ARGS__); break;                   \
    case 6: fn<6>(__VA_ARGS__); break;                   \
    case 5: fn<5>(__VA_ARGS__); break;                   \
    case 4: fn<4>(__VA_ARGS__); break;                   \
    case 3: fn<3>(__VA_ARGS__); break;                   \
    case 2: fn<2>(__VA_ARGS__); break;                   \
    default: fn<1>(__VA_ARGS__); break;                  \
  }

inline void softmax_chunk_t(float* St, int64_t ld, float* mx, float* sum, float* mnew, float* alpha, int64_t M,
                            int64_t n, int64_t first_last_pos, int64_t G, int64_t p0) {
  const int64_t rmin0 = G * (p0 - first_last_pos);  // slot s is masked for rows below rmin0 + G * s
  for (int64_t b0 = 0; b0 < M; b0 += kSoftmaxVecs * VS) {
    const int64_t nv = std::min(kSoftmaxVecs, (M - b0 + VS - 1) / VS);
    BUCKETSERVE_SOFTMAX_BLOCKS(softmax_block_max, nv, St, ld, mx, mnew, M, n, b0, rmin0, G)
  }
  for (int64_t r = 0; r < M; ++r) {
    // exp(-inf) = 0 when the row had no slot before; alpha 1 (nothing to rescale) while it has none yet.
    alpha[r] = mnew[r] == kNegInf ? 1.f : std::exp(mx[r] - mnew[r]);
    mx[r] = mnew[r];
  }
  for (int64_t b0 = 0; b0 < M; b0 += kSoftmaxVecs * VS) {
    const int64_t nv = std::min(kSoftmaxVecs, (M - b0 + VS - 1) / VS);
    BUCKETSERVE_SOFTMAX_BLOCKS(softmax_block_exp, nv, St, ld, mnew, alpha, sum, M, n, b0, rmin0, G)
  }
}
#undef BUCKETSERVE_SOFTMAX_BLOCKS

}  // namespace bucketserve_kernels
