// RMSNorm for CPU in one pass per row, computed as transformers' Llama-family norm computes it:
//
//   bucketserve_cpu::rms_norm(x[..., N], weight[N], eps) -> out[..., N]
//   out = weight * to_dtype(float(x) * rsqrt(mean(float(x)^2) + eps))
//
// x and weight are both float32 or both bfloat16; the arithmetic is fp32, the product with the weight is
// rounded to the dtype, as the eager formula rounds it. Only the order of the sum of squares differs from
// ATen's reduction, so results may differ from the eager module's in the last bit.
//
// Why: ATen runs the formula (or F.rms_norm) as five to seven elementwise kernels with temporaries. Measured
// on a 2-core Xeon (AVX-512), F.rms_norm took 11 us on [8, 512] fp32 (a decode step runs 2 per layer + 1),
// 573 us on [2048, 512] fp32 and 2.5 ms on [2048, 512] bf16 (a prefill step's), where one pass reads and
// writes the rows once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VS = Vec::size();
// Rows per task: below about 16K elements a row range is not worth waking a second thread for.
constexpr int64_t kGrainElems = 16384;

template <typename T>
void norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, n));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * n;
      T* o = out + r * n;
      if constexpr (std::is_same_v<T, float>) {
        Vec acc0(0.f), acc1(0.f);
        int64_t d = 0;
        for (; d + 2 * VS <= n; d += 2 * VS) {
          const Vec a = Vec::loadu(xr + d), b = Vec::loadu(xr + d + VS);
          acc0 = at::vec::fmadd(a, a, acc0);
          acc1 = at::vec::fmadd(b, b, acc1);
        }
        for (; d + VS <= n; d += VS) {
          const Vec a = Vec::loadu(xr + d);
          acc0 = at::vec::fmadd(a, a, acc0);
        }
        float ss = at::vec::vec_reduce_all<float>([](Vec p, Vec q) { return p + q; }, acc0 + acc1);
        for (; d < n; ++d) ss += xr[d] * xr[d];
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
        const Vec vinv(inv);
        d = 0;
        for (; d + VS <= n; d += VS) (Vec::loadu(w + d) * (Vec::loadu(xr + d) * vinv)).store(o + d);
        for (; d < n; ++d) o[d] = w[d] * (xr[d] * inv);
      } else {
        using VT = at::vec::Vectorized<T>;  // 2 * VS lanes
        Vec acc0(0.f), acc1(0.f);
        int64_t d = 0;
        for (; d + 2 * VS <= n; d += 2 * VS) {
          auto [a, b] = at::vec::convert_to_float<T>(VT::loadu(xr + d));
          acc0 = at::vec::fmadd(a, a, acc0);
          acc1 = at::vec::fmadd(b, b, acc1);
        }
        float ss = at::vec::vec_reduce_all<float>([](Vec p, Vec q) { return p + q; }, acc0 + acc1);
        for (; d < n; ++d) {
          const float v = static_cast<float>(xr[d]);
          ss += v * v;
        }
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
        const Vec vinv(inv);
        d = 0;
        for (; d + 2 * VS <= n; d += 2 * VS) {
          auto [a, b] = at::vec::convert_to_float<T>(VT::loadu(xr + d));
          // the normalised row rounded to the dtype, as the eager module's .to(input_dtype) does
          auto [ra, rb] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a * vinv, b * vinv));
          auto [wa, wb] = at::vec::convert_to_float<T>(VT::loadu(w + d));
          at::vec::convert_from_float<T>(wa * ra, wb * rb).store(o + d);
        }
        for (; d < n; ++d) {
          const float y = static_cast<float>(static_cast<T>(static_cast<float>(xr[d]) * inv));
          o[d] = static_cast<T>(static_cast<float>(w[d]) * y);
        }
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == weight.size(0),
              "rms_norm: weight must be [N] and x [..., N]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  const int64_t n = weight.size(0), rows = n ? xc.numel() / n : 0;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat)
    norm_rows<float>(xc.const_data_ptr<float>(), wc.const_data_ptr<float>(), out.data_ptr<float>(), rows, n, e);
  else if (x.scalar_type() == at::kBFloat16)
    norm_rows<c10::BFloat16>(xc.const_data_ptr<c10::BFloat16>(), wc.const_data_ptr<c10::BFloat16>(),
                             out.data_ptr<c10::BFloat16>(), rows, n, e);
  else
    TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(bucketserve_cpu, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(bucketserve_cpu, CPU, m) { m.impl("rms_norm", &rms_norm); }
