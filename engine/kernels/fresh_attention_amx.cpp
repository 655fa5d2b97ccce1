// Causal self-attention of one fresh bf16 prompt on AMX tiles: the prompt's queries over its own keys, which this
// step wrote to the paged cache (engine/kernels/fresh_prefill.py sends long fresh prompts here).
//
//   bucketserve_cpu::fresh_attention_amx(out[T,H,D], q[T,H,D], k_cache[NB,BS,KVH,D], v_cache[NB,BS,KVH,D],
//                                        blocks[W] int32, start, n, scale) -> ()
//
// Rows start .. start + n - 1 of q / out are the prompt's tokens, positions 0 .. n - 1; its keys and values sit in
// the cache at blocks[p / BS], slot p % BS. bf16 in and out, fp32 sums; D a multiple of 32; H a multiple of KVH.
//
// Why: the attention of a 1024-token prompt is ~1.1 GFLOP a layer (`small`: 8 query heads of 64 over 4 KV heads).
// torch's CPU flash kernel (SDPA) ran it at ~340 GFLOP/s on a 2-core Xeon whose bf16 matmul reaches ~2.1 TFLOP/s,
// and our paged kernel widens bf16 to fp32 for the vector units. Here both products run on the matrix unit:
// - Per KV head, once: K as [keys][D] rows (the first operand of S^T = K Q^T) and V transposed, V^T [D][keys] (the
//   first operand of O^T = V^T P^T), zero-padded to a multiple of 32 keys: read once from the cache's blocks.
// - Work item = (query head, block of 16 queries), longest first from an atomic counter. Its queries become the
//   second operand as (d, d + 1) pairs per query; per block of up to 256 keys: S^T [keys][16 queries], four
//   result tiles (64 keys) a round; the online softmax with the 16 queries in the vector lanes (a key's row is one
//   vector: no horizontal max or sum; the causal mask is a lane mask where the block reaches the diagonal); P^T
//   rounded to bf16 as (key, key + 1) pairs per query (the P V product's second operand); O^T [D][16] in scratch,
//   rescaled where a maximum moved, then four tiles of it multiplied into over the block's keys.
// - Arithmetic: S and O sums in fp32 on the tiles (the matrix unit's order), P rounded to bf16 for the product as
//   torch's flash kernel does, the row sums from the fp32 P; each output divided by its sum and rounded once.
// Measured on that Xeon (2 threads, `small`'s heads, 16-slot blocks; SDPA's time including the gather of K/V out
// of the blocks), ours / SDPA, paired: 0.75-0.76 at 128 tokens, 0.77-0.81 at 256, 0.67-0.71 at 512, 0.78-0.79 at
// 1024, 0.89-0.92 at 2048 (one thread: 0.69-0.77 at 128-1024). Blocks of 32 keys with one result tile per slice
// instead: level with SDPA (the tile loads and stores around each softmax, not the exps, set the pace there).
// Measured and not kept: the scale folded into each exponent (0.99-1.01 of the time), V^T stored tile by tile
// (1.00-1.04 at 256-1024 tokens, 0.93 at 2048). What bounds it, measured alone on one core of that host: TDPBF16PS
// runs at 1.3-2.3 TFLOP/s on resident tiles and as fast with four 1 KB tile loads a round (from L1 or an L2
// stream), but at 0.39-0.49 when each round's four results are stored, read back by vector loads and one tile is
// loaded again: the trip S^T and P^T make every block (tiles, vectors for the softmax, tiles). That trip and the
// softmax's ~25 vector instructions a key row hold this kernel near 140 GFLOP/s a core at head dim 64.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "cpu_features.h"

namespace {

using bf16_bits = uint16_t;

#if defined(__AVX512F__)
constexpr int64_t kQ = 16;  // queries per item: the lanes of a vector, the columns of a tile
constexpr int64_t kKeys = 256;  // keys per block (at most): one softmax pass and one P V product each
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Every tile 16 rows of 64 bytes. S^T: 0, 1, 3 K rows (16 keys each), 2 the queries' pairs, 4-7 S^T (16 keys
// each). P V: 0, 1, 3 V^T (16 head dims x 32 keys each), 2 P^T pairs (32 keys), 4-7 slices of O^T.
BUCKETSERVE_AMX_BF16_DOT void configure_tiles() {
  bucketserve::AmxTileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  bucketserve::amx_load_tiles(c);
}

// The packed keys and values of one KV head: K [np][D] and V^T [D][ldv], zero past the prompt's n keys. V^T's rows
// are 64 bytes longer than np keys: at a power-of-two stride a tile's 16 rows would share two of L1's 64 sets.
struct PackedKv {
  std::vector<bf16_bits> k, vt;
  int64_t ldv = 0;
};

// One item's scratch.
struct Scratch {
  std::vector<uint32_t> qt;  // [D / 2][kQ]: query i's (d, d + 1) pair in row d / 2, column i
  alignas(64) float st[kKeys * kQ];  // S^T of a key block
  alignas(64) uint32_t pt[kKeys / 2 * kQ];  // P^T as (key, key + 1) pairs per query
  std::vector<float> ot;  // [D][kQ]
};

// One item: query head qh, queries [i0, i0 + kQ) (those past n padded with zeros, never written out).
BUCKETSERVE_AMX_BF16_DOT __attribute__((noinline)) void attend_block(
    const bf16_bits* q, int64_t q_t, const PackedKv& kv, int64_t np, int64_t D, int64_t n, int64_t i0, float scale,
    bf16_bits* out, int64_t o_t, Scratch& sc) {
  // The queries as pairs per column: the second operand of S^T = K Q^T.
  for (int64_t i = 0; i < kQ; ++i) {
    const bool live = i0 + i < n;
    const auto* row = reinterpret_cast<const uint32_t*>(q + (i0 + i) * q_t);
    for (int64_t r = 0; r < D / 2; ++r) sc.qt[r * kQ + i] = live ? row[r] : 0u;
  }
  std::fill(sc.ot.begin(), sc.ot.end(), 0.f);
  __m512 m = _mm512_set1_ps(kNegInf), l = _mm512_setzero_ps();
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i pair_words = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int64_t last_key = std::min(i0 + kQ, n) - 1;  // the item's last query sees keys up to its own position
  for (int64_t k0 = 0; k0 <= last_key; k0 += kKeys) {
    const int64_t nk = std::min(kKeys, (last_key - k0 + 32) / 32 * 32);  // keys this block: a multiple of 32
    // S^T [nk keys][16 queries] = K rows . Q^T, four result tiles (64 keys) a round, 32 head dims a step
    for (int64_t t0 = 0; t0 < nk; t0 += 64) {
      const bool four = t0 + 64 <= nk;
      const bf16_bits* kr = kv.k.data() + (k0 + t0) * D;
      _tile_zero(4);
      _tile_zero(5);
      if (four) {
        _tile_zero(6);
        _tile_zero(7);
      }
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        _tile_loadd(2, sc.qt.data() + d0 / 2 * kQ, 64);
        _tile_loadd(0, kr + d0, D * 2);
        _tile_loadd(1, kr + 16 * D + d0, D * 2);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 1, 2);
        if (four) {
          _tile_loadd(3, kr + 32 * D + d0, D * 2);
          _tile_loadd(0, kr + 48 * D + d0, D * 2);
          _tile_dpbf16ps(6, 3, 2);
          _tile_dpbf16ps(7, 0, 2);
        }
      }
      float* st = sc.st + t0 * kQ;
      _tile_stored(4, st, 64);
      _tile_stored(5, st + 16 * kQ, 64);
      if (four) {
        _tile_stored(6, st + 32 * kQ, 64);
        _tile_stored(7, st + 48 * kQ, 64);
      }
    }
    // Online softmax, queries in lanes: key k0 + j is seen by queries i0 + lane >= k0 + j. Four maxima and two
    // sums in flight (one chain each would run at the instructions' latency).
    const bool diagonal = k0 + nk - 1 > i0;
    __m512 mxs[4] = {m, m, m, m};
    for (int64_t j = 0; j < nk; ++j) {
      __m512 v = _mm512_mul_ps(_mm512_load_ps(sc.st + j * kQ), _mm512_set1_ps(scale));
      if (diagonal) {
        const __mmask16 sees = _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(static_cast<int32_t>(k0 + j - i0)));
        v = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), sees, v);
      }
      _mm512_store_ps(sc.st + j * kQ, v);
      mxs[j % 4] = _mm512_max_ps(mxs[j % 4], v);
    }
    const __m512 mx = _mm512_max_ps(_mm512_max_ps(mxs[0], mxs[1]), _mm512_max_ps(mxs[2], mxs[3]));
    using Vec = at::vec::Vectorized<float>;
    const __m512 alpha = static_cast<__m512>((Vec(m) - Vec(mx)).exp_u20());
    const bool moved = _mm512_cmp_ps_mask(mx, m, _CMP_NEQ_OQ) != 0;
    m = mx;
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int64_t j = 0; j < nk; j += 4) {
      __m512 p[4];
      for (int e = 0; e < 4; ++e)
        p[e] = static_cast<__m512>((Vec(_mm512_load_ps(sc.st + (j + e) * kQ)) - Vec(mx)).exp_u20());
      sum0 = _mm512_add_ps(sum0, _mm512_add_ps(p[0], p[1]));
      sum1 = _mm512_add_ps(sum1, _mm512_add_ps(p[2], p[3]));
      // bf16 of the odd key in the high 16 words, of the even key in the low: interleaved as pairs per query
      for (int e = 0; e < 4; e += 2) {
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p[e + 1], p[e]);
        _mm512_store_si512(sc.pt + (j + e) / 2 * kQ, _mm512_permutexvar_epi16(pair_words, both));
      }
    }
    l = _mm512_fmadd_ps(l, alpha, _mm512_add_ps(sum0, sum1));
    // O^T = O^T * alpha + V^T . P^T: four slices of 16 head dims a pass (two where D - d0 is 32), 32 keys a step
    if (moved)
      for (float* row = sc.ot.data(); row < sc.ot.data() + D * kQ; row += kQ)
        _mm512_storeu_ps(row, _mm512_mul_ps(_mm512_loadu_ps(row), alpha));
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      float* o = sc.ot.data() + d0 * kQ;
      const bool four = d0 + 64 <= D;
      _tile_loadd(4, o, 64);
      _tile_loadd(5, o + 16 * kQ, 64);
      if (four) {
        _tile_loadd(6, o + 32 * kQ, 64);
        _tile_loadd(7, o + 48 * kQ, 64);
      }
      for (int64_t kk = 0; kk < nk; kk += 32) {
        const bf16_bits* a = kv.vt.data() + d0 * kv.ldv + k0 + kk;
        _tile_loadd(2, sc.pt + kk / 2 * kQ, 64);
        _tile_loadd(0, a, kv.ldv * 2);
        _tile_loadd(1, a + 16 * kv.ldv, kv.ldv * 2);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 1, 2);
        if (four) {
          _tile_loadd(3, a + 32 * kv.ldv, kv.ldv * 2);
          _tile_loadd(0, a + 48 * kv.ldv, kv.ldv * 2);
          _tile_dpbf16ps(6, 3, 2);
          _tile_dpbf16ps(7, 0, 2);
        }
      }
      _tile_stored(4, o, 64);
      _tile_stored(5, o + 16 * kQ, 64);
      if (four) {
        _tile_stored(6, o + 32 * kQ, 64);
        _tile_stored(7, o + 48 * kQ, 64);
      }
    }
  }
  // out[i][d] = O^T[d][i] / l[i], rounded to bf16: O^T scaled in place, then read down its columns
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
  for (float* row = sc.ot.data(); row < sc.ot.data() + D * kQ; row += kQ)
    _mm512_storeu_ps(row, _mm512_mul_ps(_mm512_loadu_ps(row), inv));
  const __m512i column = _mm512_mullo_epi32(lane, _mm512_set1_epi32(kQ));
  for (int64_t i = 0; i < kQ && i0 + i < n; ++i)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      const __m512 v = _mm512_i32gather_ps(column, sc.ot.data() + d0 * kQ + i, 4);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (i0 + i) * o_t + d0), (__m256i)_mm512_cvtneps_pbh(v));
    }
}
#endif

// Whether this build and CPU run the operator (AMX bf16 tiles granted by the OS, AVX512_BF16, an AVX-512 build).
bool fresh_attention_amx_usable() {
#if defined(__AVX512F__)
  return bucketserve::amx_bf16_usable() && bucketserve::cpu_has_avx512_bf16();
#else
  return false;
#endif
}

void fresh_attention_amx(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& blocks, int64_t start, int64_t n, double scale) {
  const char* op = "fresh_attention_amx: ";
  TORCH_CHECK(fresh_attention_amx_usable(), op,
              "needs an AVX-512 build on a CPU with AMX bf16 tiles (granted by the operating system) and AVX512_BF16");
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&out), &q, &k_cache, &v_cache})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16, op, "bfloat16 CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), op, "q and out [T, H, D] of one shape");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), op, "k and v caches [NB, BS, KVH, D]");
  const int64_t H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, op, "the caches' head dim ", k_cache.size(3), " is not q's ", D);
  TORCH_CHECK(D % 32 == 0 && D > 0, op, "the head dim must be a multiple of 32, got ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, op, H, " query heads cannot share ", KVH, " KV heads");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, op, "q and out must hold each head's D values contiguously");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == D && v_cache.stride(3) == 1 && v_cache.stride(2) == D,
              op, "the caches must hold each slot's heads contiguously");
  TORCH_CHECK(n >= 1 && start >= 0 && start + n <= q.size(0), op, "tokens [", start, ", ", start + n,
              ") are not rows of q (", q.size(0), ")");
  TORCH_CHECK(blocks.dim() == 1 && blocks.scalar_type() == at::kInt && blocks.is_contiguous(), op,
              "blocks must be a contiguous int32 vector");
  const int64_t nblocks = (n + BS - 1) / BS;
  TORCH_CHECK(blocks.size(0) >= nblocks, op, n, " tokens need ", nblocks, " blocks, got ", blocks.size(0));
  const int32_t* table = blocks.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < nblocks; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < k_cache.size(0), op, "block id ", table[b], " out of range");
#if defined(__AVX512F__)
  const int64_t G = H / KVH, np = (n + 31) / 32 * 32;  // blocks end at a multiple of 32 keys
  const auto* kc = reinterpret_cast<const bf16_bits*>(k_cache.const_data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const bf16_bits*>(v_cache.const_data_ptr<at::BFloat16>());
  // Pack each KV head once: K rows, V^T.
  std::vector<PackedKv> kv(KVH);
  at::parallel_for(0, KVH, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      PackedKv& p = kv[h];
      p.ldv = np + 32;
      p.k.assign(np * D, 0);
      p.vt.assign(D * p.ldv, 0);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t blk = table[t / BS], slot = t % BS;
        const bf16_bits* kr = kc + blk * k_cache.stride(0) + slot * k_cache.stride(1) + h * D;
        const bf16_bits* vr = vc + blk * v_cache.stride(0) + slot * v_cache.stride(1) + h * D;
        std::memcpy(p.k.data() + t * D, kr, D * sizeof(bf16_bits));
        for (int64_t d = 0; d < D; ++d) p.vt[d * p.ldv + t] = vr[d];
      }
    }
  });
  // Items: (query head, block of kQ queries), the longest (latest queries) first.
  const int64_t qblocks = (n + kQ - 1) / kQ, n_items = H * qblocks;
  const auto* qp = reinterpret_cast<const bf16_bits*>(q.const_data_ptr<at::BFloat16>()) + start * q.stride(0);
  auto* op_ = reinterpret_cast<bf16_bits*>(out.data_ptr<at::BFloat16>()) + start * out.stride(0);
  const int64_t n_threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, n_threads, 1, [&](int64_t, int64_t) {
    Scratch sc;
    sc.qt.resize(D / 2 * kQ);
    sc.ot.resize(D * kQ);
    configure_tiles();
    for (int64_t k = next.fetch_add(1); k < n_items; k = next.fetch_add(1)) {
      const int64_t qb = qblocks - 1 - k / H, qh = k % H;
      attend_block(qp + qh * q.stride(1), q.stride(0), kv[qh / G], np, D, n, qb * kQ, static_cast<float>(scale),
                   op_ + qh * out.stride(1), out.stride(0), sc);
    }
    bucketserve::amx_release_tiles();
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(bucketserve_cpu, m) {
  m.def("fresh_attention_amx_usable() -> bool");
  m.def(
      "fresh_attention_amx(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, int start, "
      "int n, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(bucketserve_cpu, CPU, m) { m.impl("fresh_attention_amx", &fresh_attention_amx); }

// No tensor argument to dispatch on.
TORCH_LIBRARY_IMPL(bucketserve_cpu, CatchAll, m) { m.impl("fresh_attention_amx_usable", &fresh_attention_amx_usable); }
