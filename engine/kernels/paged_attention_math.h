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
#include <limits>
#include <type_traits>

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

// C[R, N] (+)= A[R, K] . B[K, N], fp32. A(r, k) = A[r][k * acs] and B's rows are given by pointers, since
// rows of K/V blocks lie anywhere in the cache. R <= 8 rows x 2 column vectors of C stay in registers (16 of
// AVX-512's 32); A's elements are broadcast, so each pair of B loads feeds 2R FMAs.
template <int R>
inline void gemm_rows(const float* const* A, int64_t acs, const float* const* B, float* C, int64_t ldc,
                      int64_t K, int64_t N, bool accumulate) {
  for (int64_t n0 = 0; n0 < N; n0 += 2 * VS) {
    const int64_t c0 = std::min(VS, N - n0);
    const int64_t c1 = std::max<int64_t>(0, std::min(VS, N - n0 - VS));
    Vec acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = accumulate ? Vec::loadu(C + r * ldc + n0, c0) : Vec(0.f);
      acc[r][1] = (accumulate && c1 > 0) ? Vec::loadu(C + r * ldc + n0 + VS, c1) : Vec(0.f);
    }
    if (c1 > 0) {
      for (int64_t k = 0; k < K; ++k) {
        const Vec b0 = Vec::loadu(B[k] + n0, c0);
        const Vec b1 = Vec::loadu(B[k] + n0 + VS, c1);
        for (int r = 0; r < R; ++r) {
          const Vec a(A[r][k * acs]);
          acc[r][0] = at::vec::fmadd(a, b0, acc[r][0]);
          acc[r][1] = at::vec::fmadd(a, b1, acc[r][1]);
        }
      }
    } else {
      for (int64_t k = 0; k < K; ++k) {
        const Vec b0 = Vec::loadu(B[k] + n0, c0);
        for (int r = 0; r < R; ++r) acc[r][0] = at::vec::fmadd(Vec(A[r][k * acs]), b0, acc[r][0]);
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r][0].store(C + r * ldc + n0, c0);
      if (c1 > 0) acc[r][1].store(C + r * ldc + n0 + VS, c1);
    }
  }
}

inline void small_gemm(const float* const* A, int64_t acs, const float* const* B, float* C, int64_t ldc, int64_t M,
                int64_t K, int64_t N, bool accumulate) {
  int64_t r = 0;
  for (; r + 8 <= M; r += 8) gemm_rows<8>(A + r, acs, B, C + r * ldc, ldc, K, N, accumulate);
  const float* const* a = A + r;
  float* c = C + r * ldc;
  switch (M - r) {
    case 7: gemm_rows<7>(a, acs, B, c, ldc, K, N, accumulate); break;
    case 6: gemm_rows<6>(a, acs, B, c, ldc, K, N, accumulate); break;
    case 5: gemm_rows<5>(a, acs, B, c, ldc, K, N, accumulate); break;
    case 4: gemm_rows<4>(a, acs, B, c, ldc, K, N, accumulate); break;
    case 3: gemm_rows<3>(a, acs, B, c, ldc, K, N, accumulate); break;
    case 2: gemm_rows<2>(a, acs, B, c, ldc, K, N, accumulate); break;
    case 1: gemm_rows<1>(a, acs, B, c, ldc, K, N, accumulate); break;
    default: break;
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

// The same update on S^T ([n][ld], slot-major), vectorised over the M query rows: slot s is seen by
// rows r >= G * (p0 + s - first_last_pos), a suffix, so masking is one fill per slot.
inline void softmax_chunk_t(float* St, int64_t ld, float* acc, float* mx, float* sum, float* mnew, float* alpha,
                            int64_t M, int64_t D, int64_t n, int64_t first_last_pos, int64_t G, int64_t p0) {
  const auto rmin = [&](int64_t s) { return std::clamp<int64_t>(G * (p0 + s - first_last_pos), 0, M); };
  for (int64_t s = 0; s < n; ++s) std::fill(St + s * ld, St + s * ld + rmin(s), kNegInf);
  for (int64_t r0 = 0; r0 < M; r0 += VS) {
    const int64_t c = std::min(VS, M - r0);
    Vec vmax = Vec::loadu(mx + r0, c);
    for (int64_t s = 0; s < n; ++s) vmax = at::vec::maximum(vmax, Vec::loadu(St + s * ld + r0, c));
    vmax.store(mnew + r0, c);
  }
  for (int64_t r = 0; r < M; ++r) {
    // exp(-inf) = 0 when the row had no slot before; alpha 1 (nothing to rescale) while it has none yet.
    alpha[r] = mnew[r] == kNegInf ? 1.f : std::exp(mx[r] - mnew[r]);
    mx[r] = mnew[r];
  }
  for (int64_t s = 0; s < n; ++s) {
    float* row = St + s * ld;
    for (int64_t r0 = 0; r0 < M; r0 += VS) {
      const int64_t c = std::min(VS, M - r0);
      (Vec::loadu(row + r0, c) - Vec::loadu(mnew + r0, c)).exp_u20().store(row + r0, c);
    }
    std::fill(row, row + rmin(s), 0.f);  // masked slots: exact zeros, whatever exp gave for -inf
  }
  for (int64_t r0 = 0; r0 < M; r0 += VS) {
    const int64_t c = std::min(VS, M - r0);
    Vec vsum(0.f);
    for (int64_t s = 0; s < n; ++s) vsum = vsum + Vec::loadu(St + s * ld + r0, c);
    (Vec::loadu(sum + r0, c) * Vec::loadu(alpha + r0, c) + vsum).store(sum + r0, c);
  }
  for (int64_t r = 0; r < M; ++r) {
    if (alpha[r] == 1.f) continue;
    float* arow = acc + r * D;
    int64_t d = 0;
    for (; d + VS <= D; d += VS) (Vec::loadu(arow + d) * Vec(alpha[r])).store(arow + d);
    for (; d < D; ++d) arow[d] *= alpha[r];
  }
}

}  // namespace bucketserve_kernels
