// Rotary embedding of a fused QKV projection, with the new keys and values written into the paged cache:
//
//   bucketserve_cpu::rope_write_kv(qkv[T, (H + 2 * KVH) * D], cos[T, D], sin[T, D],
//                                  k_cache[NB, BS, KVH, D], v_cache[NB, BS, KVH, D], slot_mapping[T] int64,
//                                  num_heads, num_kv_heads) -> q[T, H, D]
//
// Each token's row holds its H query heads, then KVH key heads, then KVH value heads (the order of the fused
// projection's output columns). Queries and keys are rotated as transformers' Llama-family models rotate them,
//   out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[D/2:], x[:D/2]),
// each product and the sum rounded to the dtype as the eager ops round them (no fused multiply-add: the two
// products are rounded before they are added), so fp32 and bf16 results equal the eager formula's bit for
// bit. The rotated keys and the values go straight to their cache slots; the rotated queries are returned.
//
// Why: in eager mode the projection's split, the rotation (two slices, a negation, a concatenation, four
// multiplies and two adds per layer), the transposes to token-major rows and the two cache writes are about
// twenty ATen calls per layer, each costing more in dispatch than in arithmetic on a decode step's few rows.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VS = Vec::size();
// Tokens per task: below about 8K elements a range is not worth waking a second thread for.
constexpr int64_t kGrainElems = 8192;

// The dtype's rounding of an fp32 value (identity for fp32).
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
inline Vec round_to(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    auto [r, unused] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v));
    return r;
  }
}

template <typename T>
inline Vec load_vec(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    auto [lo, unused] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, VS));
    return lo;
  }
}

template <typename T>
inline void store_vec(const Vec& v, T* p) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, VS);
  }
}

// One head: out[:half] = x1 * c1 - x2 * s1, out[half:] = x2 * c2 + x1 * s2 (x1 = x[:half], x2 = x[half:]).
// (-x2) * s1 is -(x2 * s1) exactly, and a + (-b) is a - b, so this is the eager formula's arithmetic.
template <typename T>
inline void rotate_head(const T* x, const T* c, const T* s, T* out, int64_t half) {
  int64_t d = 0;
  for (; d + VS <= half; d += VS) {
    const Vec x1 = load_vec(x + d), x2 = load_vec(x + half + d);
    const Vec lo = round_to<T>(round_to<T>(x1 * load_vec(c + d)) - round_to<T>(x2 * load_vec(s + d)));
    const Vec hi = round_to<T>(round_to<T>(x2 * load_vec(c + half + d)) + round_to<T>(x1 * load_vec(s + half + d)));
    store_vec(lo, out + d);
    store_vec(hi, out + half + d);
  }
  for (; d < half; ++d) {
    const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[half + d]);
    const float c1 = static_cast<float>(c[d]), c2 = static_cast<float>(c[half + d]);
    const float s1 = static_cast<float>(s[d]), s2 = static_cast<float>(s[half + d]);
    out[d] = static_cast<T>(round_to<T>(x1 * c1) - round_to<T>(x2 * s1));
    out[half + d] = static_cast<T>(round_to<T>(x2 * c2) + round_to<T>(x1 * s2));
  }
}

template <typename T>
void rope_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
               at::Tensor& v_cache, const int64_t* slots, at::Tensor& q, int64_t H, int64_t KVH, int64_t D) {
  const int64_t tokens = qkv.size(0), half = D / 2;
  const int64_t x_t = qkv.stride(0), c_t = cos.stride(0), s_t = sin.stride(0);
  const T* x = qkv.const_data_ptr<T>();
  const T* cs = cos.const_data_ptr<T>();
  const T* sn = sin.const_data_ptr<T>();
  T* qo = q.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t slot_elems = KVH * D;  // one cache slot: [KVH, D], contiguous
  const int64_t grain = std::max<int64_t>(1, kGrainElems / ((H + 2 * KVH) * D));
  at::parallel_for(0, tokens, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* row = x + t * x_t;
      const T* c = cs + t * c_t;
      const T* s = sn + t * s_t;
      for (int64_t h = 0; h < H; ++h) rotate_head(row + h * D, c, s, qo + (t * H + h) * D, half);
      T* k_slot = kc + slots[t] * slot_elems;
      for (int64_t h = 0; h < KVH; ++h) rotate_head(row + (H + h) * D, c, s, k_slot + h * D, half);
      std::memcpy(vc + slots[t] * slot_elems, row + (H + KVH) * D, slot_elems * sizeof(T));
    }
  });
}

at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                         int64_t num_kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu(), "rope_write_kv: CPU tensors only");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_write_kv: qkv must be [T, (H + 2 * KVH) * D], rows dense");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "rope_write_kv: k_cache and v_cache must be contiguous [NB, BS, KVH, D] of one shape");
  const int64_t T = qkv.size(0), H = num_heads, KVH = num_kv_heads, D = k_cache.size(3);
  TORCH_CHECK(k_cache.size(2) == KVH, "rope_write_kv: the cache holds ", k_cache.size(2), " KV heads, not ", KVH);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (H + 2 * KVH) * D, "rope_write_kv: qkv rows of ", qkv.size(1),
              " do not hold ", H, " + 2 x ", KVH, " heads of ", D);
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == T && sin.size(0) == T && cos.size(1) == D &&
                  sin.size(1) == D && cos.stride(1) == 1 && sin.stride(1) == 1,
              "rope_write_kv: cos and sin must be [T, D] with dense rows");
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && k_cache.scalar_type() == dtype &&
                  v_cache.scalar_type() == dtype,
              "rope_write_kv: qkv, cos, sin and the cache must share one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == T,
              "rope_write_kv: slot_mapping must be [T] int64");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "rope_write_kv: slot ", sp[t], " outside the cache's ", num_slots);
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  if (dtype == at::kFloat)
    rope_rows<float>(qkv, cos, sin, k_cache, v_cache, sp, q, H, KVH, D);
  else if (dtype == at::kBFloat16)
    rope_rows<c10::BFloat16>(qkv, cos, sin, k_cache, v_cache, sp, q, H, KVH, D);
  else
    TORCH_CHECK(false, "rope_write_kv: float32 or bfloat16 only");
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(bucketserve_cpu, m) {
  m.def(
      "rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, int num_heads, int num_kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(bucketserve_cpu, CPU, m) { m.impl("rope_write_kv", &rope_write_kv); }
