// Deterministic multi-tensor norms on CPU: each (tensor, chunk) work item writes its partial into
// a fixed slot, and partials are combined in a fixed order, so the result does not depend on the
// thread count or scheduling. per_tensor_sums (norm_cpu.h) also serves novograd_step.
#include "norm_cpu.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <limits>

#include "../kernels.h"
#include "../multi_tensor/cpu_apply.h"
#include "../multi_tensor/dispatch.h"

namespace shardopt {

namespace {

// Partial of one work item: sum of squares, or max |x| (nan wins).
template <typename T, typename Acc>
Acc chunk_partial(const T* x, int64_t s, int64_t e, bool max_norm) {
  if (max_norm) {
    Acc m = 0;
    bool nan_seen = false;
    for (int64_t i = s; i < e; ++i) {
      const Acc a = std::abs(static_cast<Acc>(x[i]));
      nan_seen |= std::isnan(a);
      m = a > m ? a : m;
    }
    return nan_seen ? std::numeric_limits<Acc>::quiet_NaN() : m;
  }
  Acc acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = s; i < e; ++i) {
    const Acc a = static_cast<Acc>(x[i]);
    acc += a * a;
  }
  return acc;
}

}  // namespace

namespace cpu {

double combine_partials(double a, double b, bool max_norm) {
  if (!max_norm) return a + b;
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  return a > b ? a : b;
}

std::vector<double> per_tensor_sums(const std::vector<at::Tensor>& tensors, bool max_norm) {
  const auto items = work_items(tensors);
  std::vector<double> partials(items.size(), 0.0);
  apply(items, [&](int64_t idx, int64_t k, int64_t s, int64_t e) {
    dispatch_float(tensors[k].scalar_type(), "norm", [&](auto tag) {
      using T = decltype(tag);
      using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
      partials[idx] = static_cast<double>(
          chunk_partial<T, Acc>(static_cast<const T*>(tensors[k].data_ptr()), s, e, max_norm));
    });
  });
  std::vector<double> per(tensors.size(), 0.0);
  for (size_t i = 0; i < items.size(); ++i) {
    per[items[i].tensor] = combine_partials(per[items[i].tensor], partials[i], max_norm);
  }
  return per;
}

}  // namespace cpu

std::tuple<at::Tensor, at::Tensor> norm_cpu(const TensorList& tensors, bool max_norm) {
  check_tensor_lists_no_out({tensors}, 1, c10::DeviceType::CPU, "norm", /*mixed_dtypes=*/true);
  bool all_double = !tensors.empty();
  for (const at::Tensor& t : tensors) all_double &= t.scalar_type() == at::kDouble;
  const auto out_dtype = all_double ? at::kDouble : at::kFloat;
  const int64_t n = static_cast<int64_t>(tensors.size());
  const std::vector<double> per = cpu::per_tensor_sums(tensors, max_norm);
  double total = 0.0;
  for (int64_t k = 0; k < n; ++k) total = cpu::combine_partials(total, per[k], max_norm);
  at::Tensor per_t = at::empty({n}, at::TensorOptions().dtype(at::kDouble));
  double* pp = per_t.data_ptr<double>();
  for (int64_t k = 0; k < n; ++k) pp[k] = per[k];
  at::Tensor total_t = at::zeros({}, at::TensorOptions().dtype(at::kDouble));
  total_t.fill_(total);
  return {total_t.to(out_dtype), per_t.to(out_dtype)};
}

}  // namespace shardopt
