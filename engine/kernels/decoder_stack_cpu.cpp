// An eager step's walk through the decoder layers, in one operator call: the same kernels, in the same order, as
// the Python walk of engine/decoder_stack.py, called through the dispatcher instead of from Python.
//
//   bucketserve_cpu::decoder_layers(h[T,hidden], cos[T,D], sin[T,D], kv_data[L,2,NB+1,BS,KVH,D],
//                                   slot_mapping[T], block_table[B,W], seq_lens[B], query_start_loc[B+1],
//                                   Tensor?[] tensors, int[] ints, float[] floats, int max_rows) -> h[T,hidden]
//
// Per layer:  h += o_proj(paged_attention(rope_write_kv(qkv(rms_norm(h)))));  h += down(gated(rms_norm(h))).
// Why: once every part of a layer is one fused operator, what is left of an eager step on a few rows is the
// interpreter between them, about 3 us of Python and dispatch per operator call and ten calls a layer. Measured on
// a 2-core AMD EPYC (Zen 5), `small` (8 layers), context 512, paired decode steps against the Python walk: about
// 0.6 ms less a step at batch 1 and 8, 7-13% (figures in engine/decoder_stack.py).
//
// The operators are found by name once (they live in the other kernel libraries, loaded before this one is
// used), and each layer's arguments come in three flat lists, kLayerTensors / kLayerInts / kLayerFloats per layer:
//   tensors: input norm weight, QKV panels, QKV bias?, O panels?, O bias?, post-attention norm weight,
//            gate/up panels, down panels?, down bias?
//   ints:    QKV width, QKV packed index, query heads, KV heads, O width, O packed index, MLP width,
//            gate packed index, up packed index, down width, down packed index
//   floats:  input norm eps, post-attention norm eps, attention scale
// The Python side builds them from the model's own modules and checks on a probe that this walk returns the
// model's forward bit for bit before it is ever used.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;
using Tensor = at::Tensor;

constexpr int64_t kLayerTensors = 9, kLayerInts = 11, kLayerFloats = 3;

// The schemas as registered by rms_norm_cpu.cpp, skinny_linear_cpu.cpp, rotary_cpu.cpp and paged_attention_cpu.cpp.
using RmsNorm = Tensor(const Tensor&, const Tensor&, double);
using PackedLinear = Tensor(const Tensor&, const OptTensor&, const OptTensor&, int64_t, int64_t, int64_t);
using GatedLinear = Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t, int64_t);
using RopeWriteKv =
    Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor, Tensor, const Tensor&, int64_t, int64_t);
using PagedAttention = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, double);

struct Ops {
  c10::TypedOperatorHandle<RmsNorm> rms_norm;
  c10::TypedOperatorHandle<PackedLinear> linear;
  c10::TypedOperatorHandle<GatedLinear> gated;
  c10::TypedOperatorHandle<RopeWriteKv> rope;
  c10::TypedOperatorHandle<PagedAttention> attention;
};

const Ops& ops() {
  static const Ops found = [] {
    auto& d = c10::Dispatcher::singleton();
    return Ops{
        d.findSchemaOrThrow("bucketserve_cpu::rms_norm", "").typed<RmsNorm>(),
        d.findSchemaOrThrow("bucketserve_cpu::packed_linear", "").typed<PackedLinear>(),
        d.findSchemaOrThrow("bucketserve_cpu::gated_linear", "").typed<GatedLinear>(),
        d.findSchemaOrThrow("bucketserve_cpu::rope_write_kv", "").typed<RopeWriteKv>(),
        d.findSchemaOrThrow("bucketserve_cpu::paged_attention", "").typed<PagedAttention>(),
    };
  }();
  return found;
}

Tensor decoder_layers(const Tensor& hidden, const Tensor& cos, const Tensor& sin, const Tensor& kv_data,
                      const Tensor& slot_mapping, const Tensor& block_table, const Tensor& seq_lens,
                      const Tensor& query_start_loc, const std::vector<OptTensor>& tensors, at::IntArrayRef ints,
                      at::ArrayRef<double> floats, int64_t max_rows) {
  const int64_t L = static_cast<int64_t>(tensors.size()) / kLayerTensors;
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == L * kLayerTensors &&
                  static_cast<int64_t>(ints.size()) == L * kLayerInts &&
                  static_cast<int64_t>(floats.size()) == L * kLayerFloats,
              "decoder_layers: ", tensors.size(), " tensors, ", ints.size(), " ints and ", floats.size(),
              " floats do not make whole layers");
  TORCH_CHECK(hidden.dim() == 2 && kv_data.dim() == 6 && kv_data.size(0) >= L,
              "decoder_layers: hidden [T, hidden] and kv_data [L, 2, NB + 1, BS, KVH, D] with L >= ", L);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t j : {0, 1, 5, 6})  // the parts every layer must have
      TORCH_CHECK(tensors[l * kLayerTensors + j].has_value(), "decoder_layers: layer ", l, " lacks tensor ", j);
  const Ops& op = ops();
  const int64_t T = hidden.size(0);
  Tensor h = hidden;  // [T, hidden]
  for (int64_t l = 0; l < L; ++l) {
    const OptTensor* t = tensors.data() + l * kLayerTensors;
    const int64_t* i = ints.data() + l * kLayerInts;
    const double* f = floats.data() + l * kLayerFloats;
    const Tensor layer_kv = kv_data.select(0, l);
    const Tensor k_cache = layer_kv.select(0, 0), v_cache = layer_kv.select(0, 1);  // [NB + 1, BS, KVH, D] each
    Tensor x = op.rms_norm.call(h, *t[0], f[0]);  // [T, hidden]
    const Tensor qkv = op.linear.call(x, t[1], t[2], i[0], i[1], max_rows);  // [T, (H + 2 KVH) D]
    const Tensor q = op.rope.call(qkv, cos, sin, k_cache, v_cache, slot_mapping, i[2], i[3]);  // [T, H, D]
    const Tensor attn = at::empty_like(q);  // [T, H, D]
    op.attention.call(attn, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, f[2]);
    h = at::add(h, op.linear.call(attn.view({T, -1}), t[3], t[4], i[4], i[5], max_rows));
    x = op.rms_norm.call(h, *t[5], f[1]);
    const Tensor gated = op.gated.call(x, *t[6], i[6], i[7], i[8], max_rows);  // [T, intermediate]
    h = at::add(h, op.linear.call(gated, t[7], t[8], i[9], i[10], max_rows));
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(bucketserve_cpu, m) {
  m.def(
      "decoder_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor kv_data, Tensor slot_mapping, "
      "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, Tensor?[] tensors, int[] ints, float[] floats, "
      "int max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(bucketserve_cpu, CPU, m) { m.impl("decoder_layers", &decoder_layers); }
