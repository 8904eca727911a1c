// The chunk pass of the deterministic CUDA norms (norm_cuda.cu), shared with the kernels that take
// a grad norm in the same call (novograd_step in novograd_cuda.cu): over the cuda traversal, each
// (tensor, chunk) block reduces its chunk in a fixed order and stores the partial at its work-unit
// ordinal, and the tensor's chunk-0 block records where its partials start (first_table); then
// reduce_kernel (block_reduce.cuh) sums each tensor's partials in order.
#pragma once

#include <ATen/ops/empty.h>

#include "../multi_tensor/cuda_elementwise.cuh"
#include "block_reduce.cuh"

namespace shardopt {
namespace cuda {

// Pass 1 op over one slot of storage type T; partials are out_t.
template <typename T, typename out_t>
struct NormOp {
  using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
  using Slots = cuda::Slots<T>;
  out_t* partial;  // one per work unit
  int64_t* first;  // per tensor: [first unit, number of chunks]
  bool max_norm;

  __device__ bool skip() const { return false; }
  __device__ bool reads(int) const { return true; }
  __device__ bool writes(int) const { return false; }

  template <typename C>
  __device__ acc_t begin(const C&) const {
    return acc_t(0);
  }

  __device__ void operator()(acc_t (&x)[1], acc_t& acc) const {
    acc = max_norm ? nan_max(acc, acc_t(fabs(x[0]))) : acc + x[0] * x[0];
  }

  template <typename C>
  __device__ void end(const C& c, acc_t& acc) const {
    acc = block_reduce(acc, max_norm);
    if (threadIdx.x != 0) return;
    partial[c.unit] = static_cast<out_t>(acc);
    record_first(c, first);
  }
};

// The per-tensor [first unit, number of chunks] table record_first fills, zeroed on the current
// stream by one memset (a tensor that records nothing, being empty or skipped, keeps 0 chunks).
inline at::Tensor first_table(int64_t n, const at::Device& device) {
  at::Tensor first = at::empty({n, 2}, at::TensorOptions().device(device).dtype(at::kLong));
  C10_CUDA_CHECK(cudaMemsetAsync(first.data_ptr(), 0, first.nbytes(),
                                 c10::cuda::getCurrentCUDAStream()));
  return first;
}

}  // namespace cuda
}  // namespace shardopt
