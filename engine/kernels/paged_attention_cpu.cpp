// Paged attention for CPU: one operator for a flat batch of decodes, prefills and prefill chunks.
//
//   bucketserve_cpu::paged_attention(out[T,H,D], q[T,H,D], k_cache[NB,BS,KVH,D], v_cache[NB,BS,KVH,D],
//                                    block_table[B,W] int32, seq_lens[B] int32, query_start_loc[B+1] int32,
//                                    scale) -> ()
//
// Sequence i owns query tokens query_start_loc[i] .. query_start_loc[i+1]-1; its cache already holds
// seq_lens[i] tokens, this step's included, so its query j sits at position seq_lens[i] - q_len + j and
// attends causally to positions 0 .. that position, read in place through block_table[i].
//
// Design (2-core AVX-512 host, memory-bound decode, compute-bound prefill):
// - Work item = (sequence, KV heads, tile of queries). All G = H / KVH query heads of a KV head and all
//   queries of the tile are the rows of one small matrix, so every K/V row is read once per tile. A decode of
//   1024 context slots or more also splits its keys in parts of 512 or more, an item each, whose unnormalised
//   results are merged at the end (flash-decoding), so one or two long decodes still keep every thread reading.
// - K/V rows are read in place through the block table (no gather copy); keys go in chunks of >= 128
//   slots with an online softmax (running max, sum and accumulator per row).
// - Few rows (decodes, short chunks: memory-bound): an item takes several KV heads and walks each chunk
//   in memory order, whole token rows, with 4-slot dots and AXPYs; for 1, 2 or 4 rows per KV head and a
//   head dim of 2, 4 or 8 vectors, a fixed-shape variant with K rows shared across the rows and the
//   V accumulator in registers. Many rows (prefill tiles of ~128 rows:
//   compute-bound): S^T = K Q^T and P V are register-blocked mini GEMMs over each chunk's K/V rows copied
//   into scratch at fixed strides, the softmax vectorised over rows. A 1024-token prompt of 8 query heads
//   over 4 KV heads, head dim 64: 5.3-5.4 ms a layer on a 2-core AVX-512 host (~200 GFLOP/s of useful causal
//   work, the GEMMs at its matmul rate) against 8.7-9.0 ms with per-row pointers into the cache; 4.9-5.0 ms
//   since the tiles skip what the causal mask discards (run_tiled).
// - bf16 K/V/Q are widened to fp32 in per-thread scratch: compute is always fp32. A prefill tile of bf16 queries
//   and keys on an AMD CPU with AVX512_BF16 takes its S^T = K Q^T through VDPBF16PS instead (two head-dim steps an
//   instruction, exact products, fp32 sums, the scale applied to each score): `small` geometry on a 2-core Zen 4,
//   paired in one process, a 1024-token prompt's attention 0.82-0.83 of the time (5.03-5.11 against 6.10-6.16 ms
//   a layer), eight 256-token ones 0.92-0.93; fp32 the same bits and time. P V stays fp32 (P is not rounded). On a
//   2-core Xeon with AMX the same tiles took 1.27-1.34x as long as widened ones (4.54-4.63 against 5.76-6.02 ms a
//   layer at 1024 tokens), so Intel CPUs widen (cpu_features.h, Bf16Dot).
// - Threads pull work items from an atomic counter, longest first: causal tiles differ a lot in cost.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_features.h"
#include "paged_attention_math.h"

namespace {

using namespace bucketserve_kernels;

constexpr int64_t kTileRows = 128;  // rows (queries x heads) per prefill tile: K/V reuse per read
constexpr int64_t kGemmRowsMin = 8;  // from this many rows per KV head, the GEMM path
constexpr int64_t kChunkSlots = 128;
constexpr int64_t kPartSlots = 512;  // a long decode's keys go in parts of this many slots or more (decode_split)

struct Geometry {
  int64_t H, KVH, G, D, BS, NB, W;
  // element strides
  int64_t q_t, q_h, o_t, o_h, k_b, k_s, k_h, v_b, v_s, v_h;
  float scale;
};

struct WorkItem {
  int64_t seq;
  int64_t head_begin, head_end;  // KV heads [head_begin, head_end)
  int64_t q_begin, q_end;  // query tokens [q_begin, q_end) of the sequence
  int64_t kv_begin, kv_end;  // key positions [kv_begin, kv_end): the whole causal context, or a decode's part of it
  int64_t part;  // -1: the item writes the output; else where it leaves its unnormalised part (Partials)
  int64_t cost;
};

// The parts of decodes whose keys were split between items: per part and query head, the running max, the sum
// of exponentials and the unnormalised accumulator [D], merged into the output once every part is done.
struct Partials {
  std::vector<float> m, l, acc;
  int64_t H = 0, D = 0;
  void resize(int64_t parts, int64_t heads, int64_t dim) {
    H = heads, D = dim;
    m.resize(parts * H), l.resize(parts * H), acc.resize(parts * H * D);
  }
};

// Keys are processed in chunks of whole blocks, at least kChunkSlots of them: with 16-slot blocks a
// per-block softmax step and 16-deep GEMMs would cost more than the arithmetic they wrap.
inline int64_t chunk_slots(int64_t BS) { return BS * std::max<int64_t>(1, kChunkSlots / BS); }

// Per-thread scratch, uninitialised, sized for the largest item of the call (``rows``: query rows of all
// its KV heads together). Every buffer starts on a cache line: a vector load that straddles two lines costs two, and with
// the default 16-byte alignment the prefill GEMMs' operands fell either way from one process to the next (a
// 1024-token prompt's attention took 6.2 or 11.5 ms a layer on the same host).
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using Buf = std::unique_ptr<T[], FreeDeleter>;
template <typename T>
Buf<T> aligned_buffer(int64_t n) {
  const size_t bytes = round_up(std::max<int64_t>(n, 1) * static_cast<int64_t>(sizeof(T)), 64);
  T* p = static_cast<T*>(std::aligned_alloc(64, bytes));
  TORCH_CHECK(p != nullptr, "paged_attention: cannot allocate ", bytes, " bytes of scratch");
  return Buf<T>(p);
}

struct Scratch {
  Buf<float> q, s, acc, m, l, mnew, alpha, qt, kf, vf;
  Buf<uint16_t> qtb, kb;  // bf16 tiles' Q^T in k pairs ([D / 2][ldq][2]) and K rows, for the dot-product S^T
  Buf<int64_t> koff, voff;
  int64_t ldq;  // row length of Q^T and S^T: the tile's rows, padded to whole vectors and one more
  int64_t ldk;  // row stride of a prefill tile's K rows packed in kf
  Scratch(int64_t rows, int64_t D, int64_t BS) {
    const int64_t ch = chunk_slots(BS), np = round_up(ch, VS);
    // One vector past the rows: at 128 rows a row of S^T or Q^T was 512 bytes, and the GEMMs' column walks then
    // crowded a few of L1's sets. A 1024-token prompt's attention (`small`, fp32) took 0.96-0.98 of the time padded,
    // eight 256-token ones 0.98 (paired in one process, 2-core Xeon with AVX-512).
    ldq = round_up(rows, VS) + VS;
    ldk = packed_stride(D);
    q = aligned_buffer<float>(rows * D);
    s = aligned_buffer<float>(std::max(rows * np, ch * ldq));
    acc = aligned_buffer<float>(rows * D);
    m = aligned_buffer<float>(rows);
    l = aligned_buffer<float>(rows);
    mnew = aligned_buffer<float>(ldq);
    alpha = aligned_buffer<float>(ldq);
    qt = aligned_buffer<float>(D * ldq);
    kf = aligned_buffer<float>(ch * ldk);
    qtb = aligned_buffer<uint16_t>(D * ldq);
    kb = aligned_buffer<uint16_t>(ch * ldk);
    vf = aligned_buffer<float>(ch * D);
    koff = aligned_buffer<int64_t>(ch);
    voff = aligned_buffer<int64_t>(ch);
  }
};

// Prefetch n elements from p into L2. The streaming passes run on data one pass ahead: V of the chunk
// while its scores are computed, K of the next chunk while V is summed. (Inline asm: GCC 12 drops
// __builtin_prefetch as dead code in these loops.)
template <typename T>
inline void prefetch_l2(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) {
#if defined(__x86_64__)
    asm volatile("prefetcht1 %0" : : "m"(c[off]));
#else
    __builtin_prefetch(c + off, 0, 2);
#endif
  }
}

// Whether bf16 prefill tiles multiply S^T = K Q^T through VDPBF16PS (Item::bf16_dot).
bucketserve::Bf16Dot g_bf16_dot;

// One work item: item-wide view of the call's tensors and the item's place in them.
template <typename QT, typename KT>
struct Item {
  const Geometry& g;
  const WorkItem& w;
  const QT* q;
  QT* out;
  const KT* kc;
  const KT* vc;
  const int32_t* table;  // this sequence's block ids
  int64_t ctx_start;  // position of the sequence's first query token
  int64_t q_token0;  // flat index of the sequence's first query token
  Scratch& sc;
  Partials& parts;

  int64_t heads() const { return w.head_end - w.head_begin; }
  int64_t rows() const { return (w.q_end - w.q_begin) * g.G; }  // per KV head: query r / G, head kv * G + r % G
  int64_t token(int64_t r) const { return q_token0 + w.q_begin + r / g.G; }
  int64_t head(int64_t hh, int64_t r) const { return (w.head_begin + hh) * g.G + r % g.G; }

  // Scaled fp32 queries into sc.q ([heads][rows][D]); running max -inf, sum 0, accumulator 0.
  void begin() {
    const int64_t M = rows(), D = g.D;
    for (int64_t hh = 0; hh < heads(); ++hh)
      for (int64_t r = 0; r < M; ++r) {
        to_float(q + token(r) * g.q_t + head(hh, r) * g.q_h, sc.q.get() + (hh * M + r) * D, D, g.scale);
        sc.m[hh * M + r] = kNegInf;
        sc.l[hh * M + r] = 0.f;
      }
    std::fill(sc.acc.get(), sc.acc.get() + heads() * M * D, 0.f);
  }

  void finish() {
    const int64_t M = rows(), D = g.D;
    if (w.part >= 0) {  // one token's part of the keys: kept unnormalised for the merge
      for (int64_t hh = 0; hh < heads(); ++hh)
        for (int64_t r = 0; r < M; ++r) {
          const int64_t at = w.part * parts.H + head(hh, r);
          parts.m[at] = sc.m[hh * M + r];
          parts.l[at] = sc.l[hh * M + r];
          std::copy_n(sc.acc.get() + (hh * M + r) * D, D, parts.acc.data() + at * D);
        }
      return;
    }
    for (int64_t hh = 0; hh < heads(); ++hh)
      for (int64_t r = 0; r < M; ++r) {
        QT* o = out + token(r) * g.o_t + head(hh, r) * g.o_h;
        const float l = sc.l[hh * M + r], inv = l > 0.f ? 1.f / l : 0.f;
        const float* arow = sc.acc.get() + (hh * M + r) * D;
        if constexpr (std::is_same_v<QT, float>) {
          int64_t d = 0;
          for (; d + VS <= D; d += VS) (Vec::loadu(arow + d) * Vec(inv)).store(o + d);
          for (; d < D; ++d) o[d] = arow[d] * inv;
        } else {
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<QT>(arow[d] * inv);
        }
      }
  }

  // Element offsets of the chunk's slots [p0, p0 + n) (head 0) into sc.koff / sc.voff.
  void locate(int64_t p0, int64_t n) {
    for (int64_t s = 0; s < n; ++s) {
      const int64_t blk = table[(p0 + s) / g.BS], slot = (p0 + s) % g.BS;
      sc.koff[s] = blk * g.k_b + slot * g.k_s;
      sc.voff[s] = blk * g.v_b + slot * g.v_s;
    }
  }

  // An fp32 view of one cached row: in place for fp32, widened into ``tmp`` for bf16.
  static const float* row(const KT* src, float* tmp, int64_t D) {
    if constexpr (std::is_same_v<KT, float>) {
      return src;
    } else {
      to_float(src, tmp, D);
      return tmp;
    }
  }

  // NV vectors of one cached row straight into fp32 registers (bf16 widened in the load, no scratch copy). On a
  // 2-core Xeon with AMX, bf16 `small` decode steps at context 512 against widening through scratch: batch 8
  // 6.59-6.73 ms against 6.95-7.49, batch 128 42.0 against 47.2 (two alternating runs); fp32 takes the same loads.
  template <int NV>
  static void load_row(const KT* src, Vec* dst) {
    for (int v = 0; v < NV; ++v) {
      if constexpr (std::is_same_v<KT, float>)
        dst[v] = Vec::loadu(src + v * VS);
      else
        at::vec::load_to_float<KT>(src + v * VS, dst[v]);
    }
  }

  // Few rows (decodes, short chunks): memory-bound. Every pass walks the chunk in memory order, each
  // token row holding all the item's KV heads, so the hardware prefetchers see long forward streams.
  void run_streaming() {
    const int64_t M = rows(), nh = heads(), D = g.D;
    const int64_t ch = chunk_slots(g.BS), np = round_up(ch, VS);
    const int64_t kv_end = w.kv_end;
    float* S = sc.s.get();  // [heads][rows][np]
    const float* kr[4];
    const float* vr[4];
    float dots[4];
    for (int64_t p0 = w.kv_begin; p0 < kv_end; p0 += ch) {
      const int64_t n = std::min(ch, kv_end - p0);
      locate(p0, n);
      // Slots go 4 at a time: one horizontal sum per 4 dots, one accumulator load/store per 4 FMAs.
      for (int64_t s = 0; s < n; s += 4) {
        const int64_t k = std::min<int64_t>(4, n - s);
        for (int64_t j = 0; j < k; ++j) prefetch_l2(vc + sc.voff[s + j] + w.head_begin * g.v_h, nh * g.v_h);
        for (int64_t hh = 0; hh < nh; ++hh) {
          for (int64_t j = 0; j < 4; ++j)
            kr[j] = row(kc + sc.koff[s + std::min(j, k - 1)] + (w.head_begin + hh) * g.k_h, sc.kf.get() + j * D, D);
          for (int64_t r = 0; r < M; ++r) {
            dot4(sc.q.get() + (hh * M + r) * D, kr, D, dots);
            std::copy(dots, dots + k, S + (hh * M + r) * np + s);
          }
        }
      }
      for (int64_t hh = 0; hh < nh; ++hh)
        softmax_chunk(S + hh * M * np, np, sc.acc.get() + hh * M * D, sc.m.get() + hh * M, sc.l.get() + hh * M,
                      M, D, n, ctx_start + w.q_begin, g.G, p0);
      const int64_t p1 = p0 + ch, n1 = std::clamp<int64_t>(kv_end - p1, 0, ch);
      for (int64_t s = 0; s < n; s += 4) {
        const int64_t k = std::min<int64_t>(4, n - s);
        for (int64_t j = s; j < std::min(s + 4, n1); ++j) {
          const int64_t blk = table[(p1 + j) / g.BS], slot = (p1 + j) % g.BS;
          prefetch_l2(kc + blk * g.k_b + slot * g.k_s + w.head_begin * g.k_h, nh * g.k_h);
        }
        for (int64_t hh = 0; hh < nh; ++hh) {
          for (int64_t j = 0; j < k; ++j)
            vr[j] = row(vc + sc.voff[s + j] + (w.head_begin + hh) * g.v_h, sc.vf.get() + j * D, D);
          for (int64_t r = 0; r < M; ++r) {
            const float* p = S + (hh * M + r) * np + s;
            float* arow = sc.acc.get() + (hh * M + r) * D;
            if (k == 4) {
              axpy4(p, vr, arow, D);
            } else {
              for (int64_t j = 0; j < k; ++j)
                for (int64_t d = 0; d < D; ++d) arow[d] += p[j] * vr[j][d];
            }
          }
        }
      }
    }
  }

  // run_streaming for M rows per KV head of NV whole vectors (a decode's query heads; the common head dims):
  // the same two passes per chunk, with each K row loaded once for all M rows and the V pass accumulating in
  // registers over the whole chunk, one head at a time. About 40% fewer instructions per byte than the
  // general path; from DRAM, 8 decodes at context 512 over 8 layers went from 2.5-2.6 to 1.75-2.3 ms on the
  // 2-core AVX-512 host.
  //
  // The K pass reads four forward streams at once: the chunk's slots in four consecutive quarters, one slot of
  // each quarter per step (the four dots one hsum4 finishes), each slot's row of all the item's heads in memory
  // order. A core's hardware prefetchers follow several forward streams but not the row-strided walk of one head
  // across four adjacent rows that the step took before (1 KiB strides in `small`). No software prefetch: with
  // the four streams it cost more than it brought. On a 2-core AMD EPYC (Zen 5), 64-slot blocks, eight layers'
  // caches at context 512, paired in one process, 2 threads, batch 8 / 32 / 128: 33.0 / 35.9 / 28.1 GB/s of KV
  // before, 34.8 / 37.2 / 27.2 with the four streams and the prefetch (V of the chunk during its K pass, K of the
  // next chunk during its V pass), 37.4 / 45.0 / 34.7 with the four streams alone; the prefetch had been worth
  // 4-9% on a 2-core Xeon with AMX and 40% on a Zen 4 host with the strided walk. The V pass in four streams too
  // (same arithmetic, other order) measured 5-17% slower than one stream per head there; an item of more heads
  // than one sweep holds in registers now takes its V pass in memory order, through scratch (see the V pass).
  template <int M, int NV>
  void run_streaming_fixed() {
    const int64_t nh = heads(), D = g.D;
    const int64_t ch = chunk_slots(g.BS), np = round_up(ch, VS);
    const int64_t kv_end = w.kv_end;
    float* S = sc.s.get();  // [heads][M][np]; the K pass writes slots [0, n), the softmax masks the rest
    for (int64_t p0 = w.kv_begin; p0 < kv_end; p0 += ch) {
      const int64_t n = std::min(ch, kv_end - p0);
      locate(p0, n);
      const int64_t quarter = (n + 3) / 4;
      for (int64_t s = 0; s < quarter; ++s) {
        int64_t t[4];  // this step's slot in each quarter; past n (the last quarter's tail): slot n - 1 again
        for (int j = 0; j < 4; ++j) t[j] = std::min<int64_t>(s + j * quarter, n - 1);
        for (int64_t hh = 0; hh < nh; ++hh) {
          Vec kv[4][NV];
          for (int j = 0; j < 4; ++j) load_row<NV>(kc + sc.koff[t[j]] + (w.head_begin + hh) * g.k_h, kv[j]);
          for (int r = 0; r < M; ++r) {
            const float* qr = sc.q.get() + (hh * M + r) * D;
            Vec acc[4];
            const Vec q0 = Vec::loadu(qr);
            for (int j = 0; j < 4; ++j) acc[j] = q0 * kv[j][0];
            for (int v = 1; v < NV; ++v) {
              const Vec qv = Vec::loadu(qr + v * VS);
              for (int j = 0; j < 4; ++j) acc[j] = at::vec::fmadd(qv, kv[j][v], acc[j]);
            }
            float dots[4];
            hsum4(acc, dots);
            float* srow = S + (hh * M + r) * np;
            for (int j = 0; j < 4; ++j) srow[t[j]] = dots[j];  // a repeated slot n - 1 writes its own score
          }
        }
      }
      for (int64_t hh = 0; hh < nh; ++hh)
        softmax_chunk(S + hh * M * np, np, sc.acc.get() + hh * M * D, sc.m.get() + hh * M, sc.l.get() + hh * M,
                      M, D, n, ctx_start + w.q_begin, g.G, p0);
      if (nh * M * NV > 16) {
        // More heads than one sweep can hold in registers: the V pass walks the chunk as two forward streams, its
        // two halves, one slot of each per step, each slot's row of all the item's heads in memory order; per head,
        // the two slots' contributions go into registers between one load and one store of the (L1-resident)
        // accumulator. Per head over the whole chunk (below), it walked each row in 256-byte pieces at 1 KiB
        // strides, one head after another: in memory order, one slot per step through the accumulator in scratch,
        // it took 0.80-0.85 of that time at batch 4-128 on a 2-core AMD EPYC (Zen 4, eight layers' caches at
        // context 512, paired in one process). On a 2-core Zen 5 EPYC the same pairing then measured the two
        // streams at 0.88-0.94 of the one-slot memory-order walk on 2 threads (batch 4-128) and 0.78-0.92 on one,
        // where one stream with four slots a step in registers lost (1.13 at batch 32: four 1 KiB strides per
        // head), and four or eight streams gained less (0.93-0.99). One or two sequences (one or two heads per
        // item) keep the per-head walk, whose registers win when the cache is warm (batch 1: 1.19x slower in
        // scratch on Zen 4). A slot past the chunk's end (its odd length) is read again at weight zero.
        const int64_t half = (n + 1) / 2;
        for (int64_t s = 0; s < half; ++s) {
          const int64_t t[2] = {s, std::min<int64_t>(s + half, n - 1)};
          const float live[2] = {1.f, s + half < n ? 1.f : 0.f};
          for (int64_t hh = 0; hh < nh; ++hh) {
            float* acc = sc.acc.get() + hh * M * D;
            Vec a[M][NV];
            for (int r = 0; r < M; ++r)
              for (int v = 0; v < NV; ++v) a[r][v] = Vec::loadu(acc + r * D + v * VS);
            for (int j = 0; j < 2; ++j) {
              Vec vv[NV];
              load_row<NV>(vc + sc.voff[t[j]] + (w.head_begin + hh) * g.v_h, vv);
              for (int r = 0; r < M; ++r) {
                const Vec p(S[(hh * M + r) * np + t[j]] * live[j]);
                for (int v = 0; v < NV; ++v) a[r][v] = at::vec::fmadd(p, vv[v], a[r][v]);
              }
            }
            for (int r = 0; r < M; ++r)
              for (int v = 0; v < NV; ++v) a[r][v].store(acc + r * D + v * VS);
          }
        }
      } else {
        // Per head, the accumulators in registers over the whole chunk.
        for (int64_t hh = 0; hh < nh; ++hh) {
          Vec a[M][NV];
          const float* P[M];
          for (int r = 0; r < M; ++r) {
            P[r] = S + (hh * M + r) * np;
            for (int v = 0; v < NV; ++v) a[r][v] = Vec::loadu(sc.acc.get() + (hh * M + r) * D + v * VS);
          }
          for (int64_t s = 0; s < n; ++s) {
            Vec vv[NV];
            load_row<NV>(vc + sc.voff[s] + (w.head_begin + hh) * g.v_h, vv);
            for (int r = 0; r < M; ++r) {
              const Vec p(P[r][s]);
              for (int v = 0; v < NV; ++v) a[r][v] = at::vec::fmadd(p, vv[v], a[r][v]);
            }
          }
          for (int r = 0; r < M; ++r)
            for (int v = 0; v < NV; ++v) a[r][v].store(sc.acc.get() + (hh * M + r) * D + v * VS);
        }
      }
    }
  }

  template <int M>
  bool streaming_fixed_nv() {
    switch (g.D % VS == 0 ? g.D / VS : 0) {
      case 2: run_streaming_fixed<M, 2>(); return true;
      case 4: run_streaming_fixed<M, 4>(); return true;
      case 8: run_streaming_fixed<M, 8>(); return true;
      default: return false;
    }
  }

  // The fixed-shape path where one is compiled for this item's rows and head dim, else the general one.
  void run_streaming_any() {
    bool done = false;
    switch (rows()) {
      case 1: done = streaming_fixed_nv<1>(); break;
      case 2: done = streaming_fixed_nv<2>(); break;
      case 4: done = streaming_fixed_nv<4>(); break;
      default: break;
    }
    if (!done) run_streaming();
  }

  // Many rows (prefill tiles): compute-bound. Per KV head, S^T = K Q^T and acc += P V are register-blocked
  // mini GEMMs (Q^T is built once per tile). Each chunk's K and V rows are first copied (bf16 widened) into
  // scratch at fixed strides, so the GEMMs address them off one pointer: the copy is one vector load and store
  // per D / 16 elements against the tile's M FMAs on each, under 1% at 128 rows; later tiles re-read K/V.
  // The causal mask's share is skipped, not computed and discarded: S^T from each 8 slots' first row vector that
  // sees them, P V per 8 rows over the slots their last row sees; and the online softmax's rescale of acc rides
  // on the P V product's load of acc. Paired in one process against the kernel before (2-core Xeon with AVX-512,
  // `small` geometry, fp32, 64-slot blocks, same bits out): a 1024-token prompt's attention 0.93 of the time
  // (4.86-4.97 against 5.20-5.33 ms a layer), eight 256-token ones 0.87 (3.31-3.45 against 3.81-3.95 ms); the
  // padded row length alone gave 0.98 of each, the skipped mask 0.96 / 0.89 with it.
  // Whether a tile's S^T goes through the bf16 dot product: bf16 queries and keys, an even head dim, an AVX-512 build
  // where Bf16Dot says so (cpu_features.h: by default on AMD CPUs with AVX512_BF16).
  bool bf16_dot() const {
#if defined(CPU_CAPABILITY_AVX512)
    return std::is_same_v<QT, c10::BFloat16> && std::is_same_v<KT, c10::BFloat16> && g.D % 2 == 0 &&
           g_bf16_dot.on();
#else
    return false;
#endif
  }

  void run_tiled() {
    const int64_t M = rows(), D = g.D, ld = sc.ldq;
    const int64_t ch = chunk_slots(g.BS);
    const int64_t kv_end = w.kv_end;
    const int64_t first_last_pos = ctx_start + w.q_begin;  // position of the tile's first query
    float* St = sc.s.get();  // [n][ld]
    const bool dot = bf16_dot();
    for (int64_t hh = 0; hh < heads(); ++hh) {
      const int64_t h = w.head_begin + hh;
      if (dot) {  // the queries as they are, in k pairs per row: qtb[d / 2][r][d % 2]
        for (int64_t r = 0; r < M; ++r) {
          const auto* qr = reinterpret_cast<const uint16_t*>(q + token(r) * g.q_t + head(hh, r) * g.q_h);
          for (int64_t d = 0; d < D; ++d) sc.qtb[(d / 2) * 2 * ld + 2 * r + d % 2] = qr[d];
        }
      } else {
        const float* qh = sc.q.get() + hh * M * D;
        for (int64_t r = 0; r < M; ++r)
          for (int64_t d = 0; d < D; ++d) sc.qt[d * ld + r] = qh[r * D + d];
      }
      float* acc = sc.acc.get() + hh * M * D;
      for (int64_t p0 = w.kv_begin; p0 < kv_end; p0 += ch) {
        const int64_t n = std::min(ch, kv_end - p0);
        locate(p0, n);
        for (int64_t s = 0; s < n; ++s) {
          if (dot)
            std::memcpy(sc.kb.get() + s * sc.ldk, kc + sc.koff[s] + h * g.k_h, D * sizeof(uint16_t));
          else
            to_float(kc + sc.koff[s] + h * g.k_h, sc.kf.get() + s * sc.ldk, D);
          to_float(vc + sc.voff[s] + h * g.v_h, sc.vf.get() + s * D, D);
        }
        // The next chunk's rows of this head into L2 while this one computes (the copies above waited on them).
        for (int64_t s = p0 + ch; s < std::min(p0 + 2 * ch, kv_end); ++s) {
          const int64_t blk = table[s / g.BS], slot = s % g.BS;
          prefetch_l2(kc + blk * g.k_b + slot * g.k_s + h * g.k_h, D);
          prefetch_l2(vc + blk * g.v_b + slot * g.v_s + h * g.v_h, D);
        }
        const int64_t rmin0 = g.G * (p0 - first_last_pos);  // slot s is masked for rows below rmin0 + G * s
        // S^T[n, M] = K Q^T: A(s, d) = kf[s * ldk + d], B(d, r) = qt[d * ld + r]; 8 slots at a time, from the
        // first vector of rows that sees the first of them (the rows before are masked for all 8, and the
        // softmax never reads a wholly masked vector).
        for (int64_t s = 0; s < n; s += 8) {
          const int64_t c0 = std::clamp<int64_t>(rmin0 + g.G * s, 0, M) / VS * VS;
          if (c0 >= M) continue;
#if defined(CPU_CAPABILITY_AVX512)
          if (dot) {
            panel_gemm_dot(sc.kb.get() + s * sc.ldk, sc.ldk, sc.qtb.get() + 2 * c0, ld, St + s * ld + c0, ld,
                           std::min<int64_t>(8, n - s), D / 2, M - c0, g.scale);
            continue;
          }
#endif
          panel_gemm_rows_strided(sc.kf.get() + s * sc.ldk, sc.ldk, sc.qt.get() + c0, ld, St + s * ld + c0, ld,
                                  std::min<int64_t>(8, n - s), D, M - c0);
        }
        softmax_chunk_t(St, ld, sc.m.get() + hh * M, sc.l.get() + hh * M, sc.mnew.get(), sc.alpha.get(), M, n,
                        first_last_pos, g.G, p0);
        // acc[M, D] = alpha * acc + P[M, n] V[n, D]: A(r, s) = St[s * ld + r], B(s, d) = vf[s * D + d]; 8 rows at a
        // time, over the slots their last row sees (P is 0 past them). Rows that see no slot of the chunk have
        // alpha 1 (no new max) and nothing to add.
        for (int64_t r = 0; r < M; r += 8) {
          const int64_t rn = std::min<int64_t>(8, M - r);
          const int64_t live = std::clamp<int64_t>(first_last_pos + (r + rn - 1) / g.G - p0 + 1, 0, n);
          if (live > 0)
            panel_gemm<1>(St + r, 1, ld, sc.vf.get(), D, acc + r * D, D, rn, live, D, true, sc.alpha.get() + r);
        }
      }
    }
  }
};

// How many parts a decode's keys go in: one per kPartSlots slots (rounded down), each a whole number of chunks;
// each part is an item of its own, and the parts' unnormalised results are merged (merge_parts). The split
// depends on the context's length alone, so a sequence gets the same bits in any batch and on any number of
// threads. Why: a decode reads each cached row once, and one or two sequences made too few items, or items of a
// few heads each, to keep both cores streaming. `small` decode steps, 2-core AMD EPYC (Zen 4), parts of 512
// against none, alternating in one process: context 2000, batch 1 / 2 4.94 / 6.62 ms against 5.88 / 8.43, batch
// 4-32 level (within 3%); context 512, batch 1 / 2 4.25 / 4.31 against 4.37 / 4.90 (from the heads rule below);
// parts of 256 were no faster and cost 3% at batch 32.
struct Split {
  int64_t parts, len;  // parts of len slots each (the last one shorter)
};
inline Split decode_split(int64_t seq_len, int64_t ch) {
  const int64_t want = std::max<int64_t>(1, seq_len / round_up(kPartSlots, ch));
  if (want == 1) return {1, seq_len};
  // Whole chunks a part: the last part may be shorter, and one fewer part may then cover the keys.
  const int64_t len = round_up((seq_len + want - 1) / want, ch);
  return {(seq_len + len - 1) / len, len};
}

// The merge of a decode's parts: per query head, the parts' sums and accumulators rescaled to their common max.
// ``acc`` [D] and ``w`` [n] are the caller's scratch.
template <typename QT>
void merge_parts(QT* out, const Geometry& g, int64_t token, const Partials& pt, int64_t first, int64_t n,
                 std::vector<float>& acc, std::vector<float>& w) {
  const int64_t H = pt.H, D = pt.D;
  acc.resize(D), w.resize(n);
  for (int64_t h = 0; h < H; ++h) {
    float mx = kNegInf;
    for (int64_t p = 0; p < n; ++p) mx = std::max(mx, pt.m[(first + p) * H + h]);
    float den = 0.f;
    for (int64_t p = 0; p < n; ++p) {
      const float m = pt.m[(first + p) * H + h];
      w[p] = m == kNegInf ? 0.f : std::exp(m - mx);
      den += w[p] * pt.l[(first + p) * H + h];
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t p = 0; p < n; ++p) {
      const float* a = pt.acc.data() + ((first + p) * H + h) * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += w[p] * a[d];
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    QT* o = out + token * g.o_t + h * g.o_h;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<QT>(acc[d] * inv);
  }
}

template <typename QT, typename KT>
void run_all(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const int32_t* table, const int32_t* seq_lens, const int32_t* qsl, int64_t B, const Geometry& g) {
  // Query tile: enough queries that a tile has about kTileRows rows per KV head; a decode is one tile.
  const int64_t tile_q = std::max<int64_t>(1, kTileRows / g.G);
  const int64_t threads = at::get_num_threads();
  const int64_t ch = chunk_slots(g.BS);
  // Memory-bound items (few rows: decodes, short chunks) take all the KV heads, so they stream whole contiguous
  // token rows of the cache; a decode's keys go in parts (decode_split). Only while that leaves a thread without
  // work, the heads are halved: items of half rows read at a 1 KiB stride (in `small`), which the prefetchers
  // follow worse (2 sequences at context 2048, 8 layers, 2-core Zen 4: 4.0 ms in four half-row items against
  // 1.75-2.45 ms in two whole-row ones).
  std::vector<Split> splits(B);  // each decode's parts (one for every other sequence)
  int64_t small = 0, large = 0;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t ql = qsl[i + 1] - qsl[i];
    splits[i] = ql == 1 ? decode_split(seq_lens[i], ch) : Split{1, 0};
    const int64_t parts = splits[i].parts;
    if (ql > 0 && ql * g.G < kGemmRowsMin) small += parts;
    else large += (ql == 1 ? parts : (ql + tile_q - 1) / tile_q) * g.KVH;
  }
  int64_t group = g.KVH;
  while (group % 2 == 0 && small * (g.KVH / group) + large < threads) group /= 2;
  std::vector<WorkItem> items;
  std::vector<std::array<int64_t, 3>> merges;  // (sequence, first part, parts) of each decode split in parts
  int64_t n_parts = 0;
  int64_t max_rows = 1;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t ql = qsl[i + 1] - qsl[i], ctx_start = seq_lens[i] - ql;
    const int64_t heads = ql * g.G < kGemmRowsMin ? group : 1;
    const int64_t parts = splits[i].parts, len = splits[i].len;
    if (parts > 1) {
      max_rows = std::max(max_rows, heads * g.G);
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t k0 = p * len, k1 = std::min<int64_t>(seq_lens[i], k0 + len);
        const int64_t cost = heads * (g.G + 8) * (k1 - k0);
        for (int64_t h = 0; h < g.KVH; h += heads) items.push_back({i, h, h + heads, 0, 1, k0, k1, n_parts + p, cost});
      }
      merges.push_back({i, n_parts, parts});
      n_parts += parts;
      continue;
    }
    for (int64_t j0 = 0; j0 < ql; j0 += tile_q) {
      const int64_t j1 = std::min(ql, j0 + tile_q);
      const int64_t cost = heads * ((j1 - j0) * g.G * (ctx_start + j1) + 8 * (ctx_start + j1));
      max_rows = std::max(max_rows, heads * (j1 - j0) * g.G);
      for (int64_t h = 0; h < g.KVH; h += heads)
        items.push_back({i, h, h + heads, j0, j1, 0, ctx_start + j1, -1, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  Partials parts;
  parts.resize(n_parts, g.H, g.D);
  const QT* qp = q.const_data_ptr<QT>();
  QT* op = out.data_ptr<QT>();
  const KT* kp = k_cache.const_data_ptr<KT>();
  const KT* vp = v_cache.const_data_ptr<KT>();
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t n_threads = std::max<int64_t>(1, std::min<int64_t>(threads, n_items));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, n_threads, 1, [&](int64_t, int64_t) {
    Scratch sc(max_rows, g.D, g.BS);
    for (int64_t k = next.fetch_add(1); k < n_items; k = next.fetch_add(1)) {
      const WorkItem& w = items[k];
      const int64_t ql = qsl[w.seq + 1] - qsl[w.seq];
      Item<QT, KT> it{g, w, qp, op, kp, vp, table + w.seq * g.W, seq_lens[w.seq] - ql, qsl[w.seq], sc, parts};
      it.begin();
      if (it.rows() < kGemmRowsMin)
        it.run_streaming_any();
      else
        it.run_tiled();
      it.finish();
    }
  });
  at::parallel_for(0, static_cast<int64_t>(merges.size()), 1, [&](int64_t m0, int64_t m1) {
    std::vector<float> acc, w;
    for (int64_t m = m0; m < m1; ++m)
      merge_parts(op, g, qsl[merges[m][0]], parts, merges[m][1], merges[m][2], acc, w);
  });
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "paged_attention: q and out must be [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "paged_attention: caches must be [NB, BS, KVH, D]");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "paged_attention: q and out dtypes differ");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention: k and v cache dtypes differ");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_attention: the head dim must be contiguous");
  for (const auto* t : {&block_table, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "paged_attention: metadata must be contiguous int32");
  const int64_t B = seq_lens.size(0);
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) >= B && query_start_loc.size(0) == B + 1,
              "paged_attention: block_table [B, W], seq_lens [B], query_start_loc [B + 1]");
  Geometry g{};
  g.H = q.size(1), g.D = q.size(2), g.NB = k_cache.size(0), g.BS = k_cache.size(1), g.KVH = k_cache.size(2);
  g.W = block_table.size(1);
  TORCH_CHECK(k_cache.size(3) == g.D && g.KVH > 0 && g.H % g.KVH == 0, "paged_attention: head geometry mismatch");
  g.G = g.H / g.KVH;
  g.q_t = q.stride(0), g.q_h = q.stride(1), g.o_t = out.stride(0), g.o_h = out.stride(1);
  g.k_b = k_cache.stride(0), g.k_s = k_cache.stride(1), g.k_h = k_cache.stride(2);
  g.v_b = v_cache.stride(0), g.v_s = v_cache.stride(1), g.v_h = v_cache.stride(2);
  g.scale = static_cast<float>(scale);
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  // Validate every index the kernel will follow, so bad metadata raises instead of reading stray memory.
  TORCH_CHECK(qsl[0] >= 0 && qsl[B] <= q.size(0), "paged_attention: query_start_loc out of range");
  for (int64_t i = 0; i < B; ++i) {
    const int64_t ql = qsl[i + 1] - qsl[i];
    TORCH_CHECK(ql >= 0 && lens[i] >= ql, "paged_attention: sequence ", i, " has q_len ", ql, " > seq_len ", lens[i]);
    const int64_t nblk = (lens[i] + g.BS - 1) / g.BS;
    TORCH_CHECK(ql == 0 || nblk <= g.W, "paged_attention: sequence ", i, " needs ", nblk, " blocks, table has ", g.W);
    for (int64_t b = 0; ql > 0 && b < nblk; ++b) {
      const int32_t id = table[i * g.W + b];
      TORCH_CHECK(id >= 0 && id < g.NB, "paged_attention: block id ", id, " out of range [0, ", g.NB, ")");
    }
  }
  const auto qt = q.scalar_type(), kt = k_cache.scalar_type();
  TORCH_CHECK((qt == at::kFloat || qt == at::kBFloat16) && (kt == at::kFloat || kt == at::kBFloat16),
              "paged_attention: float32 or bfloat16 only");
  using BF = c10::BFloat16;
  if (qt == at::kFloat && kt == at::kFloat)
    run_all<float, float>(out, q, k_cache, v_cache, table, lens, qsl, B, g);
  else if (qt == at::kFloat)
    run_all<float, BF>(out, q, k_cache, v_cache, table, lens, qsl, B, g);
  else if (kt == at::kFloat)
    run_all<BF, float>(out, q, k_cache, v_cache, table, lens, qsl, B, g);
  else
    run_all<BF, BF>(out, q, k_cache, v_cache, table, lens, qsl, B, g);
}

#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kDotBuild = true;
#else
constexpr bool kDotBuild = false;
#endif

// Whether this build's bf16 prefill tiles take the dot product now (Item::bf16_dot).
bool attention_uses_bf16_dot() { return kDotBuild && g_bf16_dot.on(); }

// Pins that choice for this process (-1 the CPU's default, 0 widen, 1 the dot product).
void set_attention_bf16_dot(int64_t mode) {
  const char* why = g_bf16_dot.set(mode, kDotBuild);
  TORCH_CHECK(why == nullptr, "set_attention_bf16_dot: ", why);
}

}  // namespace

TORCH_LIBRARY(bucketserve_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor seq_lens, Tensor query_start_loc, float scale) -> ()");
  m.def("attention_uses_bf16_dot() -> bool");
  m.def("set_attention_bf16_dot(int mode) -> ()");
}

TORCH_LIBRARY_IMPL(bucketserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }

TORCH_LIBRARY_IMPL(bucketserve_cpu, CatchAll, m) {
  m.impl("attention_uses_bf16_dot", &attention_uses_bf16_dot);
  m.impl("set_attention_bf16_dot", &set_attention_bf16_dot);
}
