// LAMB on CUDA tensors, two passes over the cuda traversal (cuda_apply.cuh) with lamb_math.h:
// stage 1 updates the moments and writes the update term; the caller reduces the per-tensor norms
// of param and update (norm_cuda, possibly across shards); stage 2 applies the trust ratio. Device
// scalars are read inside the kernels so a step never syncs with the host.
#include "../kernels.h"
#include "../multi_tensor/cuda_apply.cuh"
#include "../multi_tensor/dispatch.h"
#include "lamb_math.h"

namespace shardopt {
namespace {

template <typename Ty>
struct Stage1Op : cuda::OpBase {
  using acc_t = typename Ty::acc_t;
  using Slots = cuda::Slots<typename Ty::grad_t, typename Ty::param_t, acc_t, acc_t, acc_t>;
  lamb::Hyper<acc_t> h;
  double beta1, beta2;
  bool bias_correction;

  struct Ctx {
    lamb::Hyper<acc_t> h;
    acc_t grad_scale;
  };

  __device__ bool reads(int k) const { return k != lamb::kUpdate; }
  __device__ bool writes(int k) const {
    return k == lamb::kExpAvg || k == lamb::kExpAvgSq || k == lamb::kUpdate;
  }

  template <typename C>
  __device__ Ctx begin(const C&) const {
    Ctx ctx{h, static_cast<acc_t>(cuda::value_or(grad_scale_t, 1.0))};
    if (step_t != nullptr) {
      const double t = *step_t;
      ctx.h.bc1 = static_cast<acc_t>(shardopt::bias_correction(beta1, t, bias_correction));
      ctx.h.bc2 = static_cast<acc_t>(shardopt::bias_correction(beta2, t, bias_correction));
    }
    return ctx;
  }

  // The update slot may alias the grad slot: g is already in registers when u is stored.
  __device__ void operator()(acc_t (&x)[Slots::kDepth], const Ctx& ctx) const {
    x[lamb::kUpdate] = lamb::stage1<acc_t>(x[lamb::kParam], x[lamb::kGrad] * ctx.grad_scale,
                                           x[lamb::kExpAvg], x[lamb::kExpAvgSq], ctx.h);
  }
};

template <typename Ty>
struct Stage2Op : cuda::OpBase {
  using acc_t = typename Ty::acc_t;
  using P = typename Ty::param_t;
  using Slots = std::conditional_t<Ty::has_out, cuda::Slots<P, acc_t, typename Ty::out_t>,
                                   cuda::Slots<P, acc_t>>;
  const float* w_norm;
  const float* u_norm;
  acc_t lr, weight_decay;
  bool use_nvlamb;

  __device__ bool reads(int k) const { return k != lamb::kStage2Out; }
  __device__ bool writes(int k) const { return k != lamb::kStage2Update; }

  template <typename C>
  __device__ acc_t begin(const C& c) const {  // the tensor's step size
    const acc_t step_lr = lr_t != nullptr ? static_cast<acc_t>(*lr_t) : lr;
    return lamb::trust_ratio_lr<acc_t>(step_lr, w_norm[c.tensor], u_norm[c.tensor], weight_decay,
                                       use_nvlamb);
  }

  __device__ void operator()(acc_t (&x)[Slots::kDepth], const acc_t& ratio) const {
    x[lamb::kStage2Param] -= ratio * x[lamb::kStage2Update];
    if constexpr (Ty::has_out) x[lamb::kStage2Out] = x[lamb::kStage2Param];
  }
};

}  // namespace

void lamb_stage1_cuda(const TensorLists& lists, double beta1, double beta2, double eps,
                      int64_t step, bool bias_correction, double weight_decay,
                      bool grad_averaging, bool adam_w_mode, const OptTensor& step_t,
                      const OptTensor& grad_scale_t, const OptTensor& found_inf_t) {
  using namespace lamb;
  const bool has_out =
      check_tensor_lists(lists, kStage1Depth, c10::DeviceType::CUDA, "lamb_stage1");
  TORCH_CHECK(!has_out, "lamb_stage1: expected ", kStage1Depth, " tensor lists, got ",
              lists.size());
  if (lists[0].empty()) return;
  const at::Device device = lists[0][0].device();
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), std::nullopt, "lamb_stage1",
      [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        cuda::check_state_dtype<acc_t>(lists[kExpAvg], "lamb_stage1", "exp_avg");
        cuda::check_state_dtype<acc_t>(lists[kExpAvgSq], "lamb_stage1", "exp_avg_sq");
        cuda::check_state_dtype<acc_t>(lists[kUpdate], "lamb_stage1", "update");
        const double t = static_cast<double>(step);
        Stage1Op<Ty> op;
        op.step_t = cuda::device_scalar(step_t, device, "lamb_stage1", "step_t");
        op.grad_scale_t = cuda::device_scalar(grad_scale_t, device, "lamb_stage1", "grad_scale_t");
        op.found_inf_t = cuda::device_scalar(found_inf_t, device, "lamb_stage1", "found_inf_t");
        op.h = {static_cast<acc_t>(beta1),
                static_cast<acc_t>(beta2),
                static_cast<acc_t>(grad_averaging ? 1.0 - beta1 : 1.0),
                static_cast<acc_t>(eps),
                static_cast<acc_t>(weight_decay),
                static_cast<acc_t>(shardopt::bias_correction(beta1, t, bias_correction)),
                static_cast<acc_t>(shardopt::bias_correction(beta2, t, bias_correction)),
                adam_w_mode};
        op.beta1 = beta1;
        op.beta2 = beta2;
        op.bias_correction = bias_correction;
        cuda::apply_elementwise(lists, op);
      });
}

void lamb_stage2_cuda(const TensorLists& lists, const at::Tensor& w_norm,
                      const at::Tensor& u_norm, double lr, double weight_decay, bool use_nvlamb,
                      const OptTensor& lr_t, const OptTensor& found_inf_t) {
  using namespace lamb;
  check_tensor_lists(lists, kStage2Depth, c10::DeviceType::CUDA, "lamb_stage2");
  if (lists[0].empty()) return;
  const at::Device device = lists[0][0].device();
  const size_t n = lists[0].size();
  const at::ScalarType param = lists[kStage2Param][0].scalar_type();
  dispatch_types(param, param, out_dtype(lists, kStage2Depth), "lamb_stage2", [&](auto types) {
    using Ty = decltype(types);
    using acc_t = typename Ty::acc_t;
    cuda::check_state_dtype<acc_t>(lists[kStage2Update], "lamb_stage2", "update");
    Stage2Op<Ty> op;
    op.lr_t = cuda::device_scalar(lr_t, device, "lamb_stage2", "lr_t");
    op.found_inf_t = cuda::device_scalar(found_inf_t, device, "lamb_stage2", "found_inf_t");
    op.w_norm = cuda::per_tensor_vector(w_norm, n, device, "lamb_stage2", "w_norm");
    op.u_norm = cuda::per_tensor_vector(u_norm, n, device, "lamb_stage2", "u_norm");
    op.lr = static_cast<acc_t>(lr);
    op.weight_decay = static_cast<acc_t>(weight_decay);
    op.use_nvlamb = use_nvlamb;
    cuda::apply_elementwise(lists, op);
  });
}

}  // namespace shardopt
