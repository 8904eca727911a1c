// LAMB on CUDA tensors, two passes over the cuda traversal (cuda_apply.cuh) with lamb_math.h.
// Stage 1 updates the moments and, in the same pass, reduces the per-tensor sums of squares of the
// param (before the update) and of the update term u: each (tensor, chunk) block reduces its chunk
// in a fixed order and stores its partials at its work-unit ordinal, then reduce_kernel sums each
// tensor's partials in order (block_reduce.cuh, as norm_cuda.cu): deterministic, no atomics. The
// sums go to stage 2 as they are (all-reduced across shards, if need be), which takes their square
// roots per block; stage 2 recomputes u from p, m, v and applies the trust ratio, so u never goes
// to memory. Device scalars, and the clip factor stage 1 derives from the grads' sum of squares,
// are read and computed inside the kernels so a step never syncs with the host.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "../kernels.h"
#include "../multi_tensor/cuda_elementwise.cuh"
#include "../multi_tensor/dispatch.h"
#include "../norm/norm_op.cuh"
#include "lamb_math.h"

namespace shardopt {
namespace {

// The hyperparameters both stages share, with the bias corrections of the device step if any.
template <typename acc_t>
struct LambOpBase : cuda::OpBase {
  lamb::Hyper<acc_t> h;  // bias corrections of the host step
  BiasCorrection bias;

  void set_hyper(double beta1, double beta2, double eps, int64_t step, bool bias_correction,
                 double weight_decay, bool grad_averaging, bool adam_w_mode) {
    h = lamb::make_hyper<acc_t>(beta1, beta2, eps, static_cast<double>(step), bias_correction,
                                weight_decay, grad_averaging, adam_w_mode);
    bias = {beta1, beta2, bias_correction};
  }

  __device__ lamb::Hyper<acc_t> hyper() const {
    lamb::Hyper<acc_t> out = h;
    this->device_step(out, bias);
    return out;
  }
};

template <typename Ty>
struct Stage1Op : LambOpBase<typename Ty::acc_t> {
  using acc_t = typename Ty::acc_t;
  using Slots = cuda::Slots<typename Ty::grad_t, typename Ty::param_t, acc_t, acc_t>;
  acc_t* w_partial;  // one per work unit
  acc_t* u_partial;
  int64_t* first;  // per tensor: [first unit, number of chunks]
  const float* grad_norm_sq_t = nullptr;  // clipping: the grads' sum of squares
  float max_grad_norm = 0.f;

  struct Ctx {
    lamb::Hyper<acc_t> h;
    acc_t grad_scale;
    acc_t w_sq, u_sq;  // this thread's share of the chunk
  };

  __device__ bool reads(int) const { return true; }
  __device__ bool writes(int k) const { return k == lamb::kExpAvg || k == lamb::kExpAvgSq; }

  // grad_scale_t (1 if absent), or with clipping the clip factor times it (lamb::clip_scale in
  // fp32, the dtype of the sum)
  __device__ acc_t grad_scale() const {
    if (grad_norm_sq_t == nullptr) {
      return static_cast<acc_t>(cuda::value_or(this->grad_scale_t, 1.0));
    }
    const bool inv = this->grad_scale_t != nullptr;
    return static_cast<acc_t>(lamb::clip_scale<float>(*grad_norm_sq_t, max_grad_norm, inv,
                                                      inv ? *this->grad_scale_t : 1.f));
  }

  template <typename C>
  __device__ Ctx begin(const C&) const {
    return {this->hyper(), grad_scale(), acc_t(0), acc_t(0)};
  }

  __device__ void operator()(acc_t (&x)[Slots::kDepth], Ctx& ctx) const {
    const acc_t p = x[lamb::kParam];
    const acc_t u = lamb::stage1<acc_t>(p, x[lamb::kGrad] * ctx.grad_scale, x[lamb::kExpAvg],
                                        x[lamb::kExpAvgSq], ctx.h);
    ctx.w_sq += p * p;
    ctx.u_sq += u * u;
  }

  template <typename C>
  __device__ void end(const C& c, Ctx& ctx) const {
    const acc_t w_sq = cuda::block_reduce(ctx.w_sq, false);
    __syncthreads();  // the second reduction reuses block_reduce's shared array
    const acc_t u_sq = cuda::block_reduce(ctx.u_sq, false);
    if (threadIdx.x != 0) return;
    w_partial[c.unit] = w_sq;
    u_partial[c.unit] = u_sq;
    cuda::record_first(c, first);
  }
};

template <typename Ty>
struct Stage2Op : LambOpBase<typename Ty::acc_t> {
  using acc_t = typename Ty::acc_t;
  using P = typename Ty::param_t;
  using Slots = std::conditional_t<Ty::has_out, cuda::Slots<P, acc_t, acc_t, typename Ty::out_t>,
                                   cuda::Slots<P, acc_t, acc_t>>;
  const float* w_norm;
  const float* u_norm;
  acc_t lr;
  bool use_nvlamb;
  bool squared;  // w_norm and u_norm hold sums of squares

  struct Ctx {
    lamb::Hyper<acc_t> h;
    acc_t ratio;  // the tensor's step size
  };

  __device__ bool reads(int k) const { return k != lamb::kStage2Out; }
  __device__ bool writes(int k) const {
    return k == lamb::kStage2Param || k == lamb::kStage2Out;
  }

  template <typename C>
  __device__ Ctx begin(const C& c) const {
    const acc_t step_lr = this->lr_t != nullptr ? static_cast<acc_t>(*this->lr_t) : lr;
    const lamb::Hyper<acc_t> h = this->hyper();
    float w = w_norm[c.tensor];
    float u = u_norm[c.tensor];
    if (squared) {  // in fp32, as torch's sqrt of the fp32 sums
      w = sqrt_of(w);
      u = sqrt_of(u);
    }
    return {h, lamb::trust_ratio_lr<acc_t>(step_lr, w, u, h.weight_decay, use_nvlamb)};
  }

  __device__ void operator()(acc_t (&x)[Slots::kDepth], const Ctx& ctx) const {
    const acc_t u = lamb::update_term<acc_t>(x[lamb::kStage2Param], x[lamb::kStage2ExpAvg],
                                             x[lamb::kStage2ExpAvgSq], ctx.h);
    x[lamb::kStage2Param] -= ctx.ratio * u;
    if constexpr (Ty::has_out) x[lamb::kStage2Out] = x[lamb::kStage2Param];
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> lamb_stage1_cuda(
    const TensorLists& lists, double beta1, double beta2, double eps, int64_t step,
    bool bias_correction, double weight_decay, bool grad_averaging, bool adam_w_mode,
    const OptTensor& step_t, const OptTensor& grad_scale_t, const OptTensor& found_inf_t,
    const OptTensor& grad_norm_sq_t, double max_grad_norm, bool /*cuda_order: its own*/) {
  using namespace lamb;
  check_tensor_lists_no_out(lists, kStage1Depth, c10::DeviceType::CUDA, "lamb_stage1");
  const int64_t n = static_cast<int64_t>(lists[0].size());
  if (n == 0) {
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
    return {at::zeros({0}, opts), at::zeros({0}, opts)};
  }
  const at::Device device = lists[0][0].device();
  const c10::cuda::OptionalCUDAGuard guard(device);
  int64_t units = 0;
  for (const at::Tensor& t : lists[0]) {
    units += (t.numel() + cuda::kChunkSize - 1) / cuda::kChunkSize;
  }
  at::Tensor w_sq, u_sq;
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), std::nullopt, "lamb_stage1",
      [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        check_state_dtype<acc_t>(lists[kExpAvg], "lamb_stage1", "exp_avg");
        check_state_dtype<acc_t>(lists[kExpAvgSq], "lamb_stage1", "exp_avg_sq");
        const auto opts = at::TensorOptions().device(device).dtype(
            c10::CppTypeToScalarType<acc_t>::value);
        const int64_t stride = std::max<int64_t>(units, 1);
        at::Tensor partial = at::empty({2, stride}, opts);
        Stage1Op<Ty> op;
        op.set_scalars(device, "lamb_stage1", std::nullopt, step_t, grad_scale_t, found_inf_t);
        if (max_grad_norm > 0) {
          op.grad_norm_sq_t =
              device_scalar(grad_norm_sq_t, device, "lamb_stage1", "grad_norm_sq_t");
          op.max_grad_norm = static_cast<float>(max_grad_norm);
        }
        at::Tensor first = cuda::first_table(n, device);  // 0 chunks until written
        at::Tensor sums = at::empty({2, n}, opts);
        op.set_hyper(beta1, beta2, eps, step, bias_correction, weight_decay, grad_averaging,
                     adam_w_mode);
        op.w_partial = partial.data_ptr<acc_t>();
        op.u_partial = op.w_partial + stride;
        op.first = first.data_ptr<int64_t>();
        cuda::apply_elementwise(lists, op);
        const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
        for (int s = 0; s < 2; ++s) {  // per-tensor sums of w, then of u
          cuda::reduce_kernel<acc_t><<<static_cast<unsigned>(n), cuda::kBlockSize, 0, stream>>>(
              op.w_partial + s * stride, op.first, 0, sums.data_ptr<acc_t>() + s * n, false);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        sums = sums.to(at::kFloat);  // stage 2 and the shard all-reduce take fp32
        w_sq = sums[0];
        u_sq = sums[1];
      });
  return {w_sq, u_sq};
}

void lamb_stage2_cuda(const TensorLists& lists, const at::Tensor& w_norm,
                      const at::Tensor& u_norm, double lr, double beta1, double beta2, double eps,
                      int64_t step, bool bias_correction, double weight_decay, bool adam_w_mode,
                      bool use_nvlamb, const OptTensor& lr_t, const OptTensor& step_t,
                      const OptTensor& found_inf_t, bool squared) {
  using namespace lamb;
  check_tensor_lists(lists, kStage2Depth, c10::DeviceType::CUDA, "lamb_stage2");
  if (lists[0].empty()) return;
  const at::Device device = lists[0][0].device();
  const size_t n = lists[0].size();
  const at::ScalarType param = lists[kStage2Param][0].scalar_type();
  dispatch_types(param, param, out_dtype(lists, kStage2Depth), "lamb_stage2", [&](auto types) {
    using Ty = decltype(types);
    using acc_t = typename Ty::acc_t;
    check_state_dtype<acc_t>(lists[kStage2ExpAvg], "lamb_stage2", "exp_avg");
    check_state_dtype<acc_t>(lists[kStage2ExpAvgSq], "lamb_stage2", "exp_avg_sq");
    Stage2Op<Ty> op;
    op.set_scalars(device, "lamb_stage2", lr_t, step_t, std::nullopt, found_inf_t);
    // grad_averaging only sets beta3, which stage 2 does not use
    op.set_hyper(beta1, beta2, eps, step, bias_correction, weight_decay, true, adam_w_mode);
    op.w_norm = per_tensor_vector(w_norm, n, device, "lamb_stage2", "w_norm");
    op.u_norm = per_tensor_vector(u_norm, n, device, "lamb_stage2", "u_norm");
    op.lr = static_cast<acc_t>(lr);
    op.use_nvlamb = use_nvlamb;
    op.squared = squared;
    cuda::apply_elementwise(lists, op);
  });
}

}  // namespace shardopt
