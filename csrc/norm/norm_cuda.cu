// Per-tensor and total sum of squares (or max |x|) of CUDA tensors, deterministically: no float
// atomics. Pass 1 runs over the cuda traversal (cuda_apply.cuh); each (tensor, chunk) block reduces
// its chunk in a fixed order and stores the partial at its work-unit ordinal, and the tensor's
// chunk-0 block records where its partials start. Pass 2 reduces each tensor's partials in order,
// pass 3 the per-tensor values. Same inputs, same bits, every run. nan propagates (through max
// too).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "../kernels.h"
#include "../multi_tensor/cuda_elementwise.cuh"
#include "../multi_tensor/dispatch.h"
#include "norm_op.cuh"

namespace shardopt {

std::tuple<at::Tensor, at::Tensor> norm_cuda(const TensorList& tensors, bool max_norm) {
  if (tensors.empty()) {
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
    return {at::zeros({}, opts), at::zeros({0}, opts)};
  }
  const std::vector<std::vector<at::Tensor>> lists{tensors};
  // one traversal per dtype (below), so the list may mix dtypes
  check_tensor_lists_no_out(lists, 1, c10::DeviceType::CUDA, "norm", /*mixed_dtypes=*/true);
  const at::Device device = tensors[0].device();
  bool all_double = true;
  int64_t units = 0;
  std::vector<at::ScalarType> dtypes;  // in order of first appearance
  for (const at::Tensor& t : tensors) {
    all_double = all_double && t.scalar_type() == at::kDouble;
    units += (t.numel() + cuda::kChunkSize - 1) / cuda::kChunkSize;
    if (std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) == dtypes.end()) {
      dtypes.push_back(t.scalar_type());
    }
  }
  const c10::cuda::OptionalCUDAGuard guard(device);
  const int64_t n = static_cast<int64_t>(tensors.size());
  const auto opts = at::TensorOptions().device(device).dtype(all_double ? at::kDouble : at::kFloat);
  at::Tensor partial = at::empty({std::max<int64_t>(units, 1)}, opts);
  at::Tensor first = cuda::first_table(n, device);  // empty tensors keep 0 chunks
  at::Tensor per_tensor = at::empty({n}, opts);
  at::Tensor total = at::empty({}, opts);

  auto run = [&](auto out) {
    using out_t = decltype(out);
    int64_t unit = 0;
    for (const at::ScalarType dtype : dtypes) {  // one traversal per dtype, units continue
      std::vector<int64_t> order;
      for (int64_t i = 0; i < n; ++i) {
        if (tensors[i].scalar_type() == dtype) order.push_back(i);
      }
      dispatch_float(dtype, "norm", [&](auto storage) {
        using Op = cuda::NormOp<decltype(storage), out_t>;
        const Op op{partial.data_ptr<out_t>(), first.data_ptr<int64_t>(), max_norm};
        unit = cuda::apply_chunks<1>(lists, order, cuda::Elementwise<Op>{op}, unit);
      });
    }
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    cuda::reduce_kernel<out_t><<<static_cast<unsigned>(n), cuda::kBlockSize, 0, stream>>>(
        partial.data_ptr<out_t>(), first.data_ptr<int64_t>(), 0, per_tensor.data_ptr<out_t>(),
        max_norm);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    cuda::reduce_kernel<out_t><<<1, cuda::kBlockSize, 0, stream>>>(
        per_tensor.data_ptr<out_t>(), nullptr, n, total.data_ptr<out_t>(), max_norm);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (all_double) {
    run(double{});
  } else {
    run(float{});
  }
  return {total, per_tensor};
}

}  // namespace shardopt
