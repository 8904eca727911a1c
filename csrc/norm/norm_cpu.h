// Deterministic per-tensor sums of squares (or max |x|) on CPU, defined in norm_cpu.cpp and shared
// with the kernels that take a grad norm in the same call (novograd_step): one compiled copy, so
// every caller gets the bits norm_cpu gives.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace shardopt {
namespace cpu {

// Per-tensor sums of squares (or max |x|, nan wins) of `tensors` (checked by the caller: dense,
// CPU, any floating dtypes), in double: each (tensor, chunk) work item's partial in the tensor's
// acc type, written into a fixed slot, then combined per tensor in item order, so the result does
// not depend on the thread count or scheduling.
std::vector<double> per_tensor_sums(const std::vector<at::Tensor>& tensors, bool max_norm);

// Two partials (or a running total and a partial) combined: a sum, or a max where nan wins.
double combine_partials(double a, double b, bool max_norm);

}  // namespace cpu
}  // namespace shardopt
