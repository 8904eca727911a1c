// NovoGrad on CUDA tensors: the cuda traversal (cuda_apply.cuh) over novograd_math.h. The
// per-tensor second moment arrives already updated (a small vector the caller maintains); each
// block turns its tensor's entry into the denominator once. Device scalars are read inside the
// kernel.
#include "../kernels.h"
#include "../multi_tensor/cuda_elementwise.cuh"
#include "../multi_tensor/dispatch.h"
#include "novograd_math.h"

namespace shardopt {
namespace {

template <typename Ty>
struct NovoGradOp : cuda::OpBase {
  using acc_t = typename Ty::acc_t;
  using G = typename Ty::grad_t;
  using P = typename Ty::param_t;
  using Slots = std::conditional_t<Ty::has_out, cuda::Slots<G, P, acc_t, typename Ty::out_t>,
                                   cuda::Slots<G, P, acc_t>>;
  novograd::Hyper<acc_t> h;
  const float* v_norm;
  BiasCorrection bias;

  struct Ctx {
    novograd::Hyper<acc_t> h;
    acc_t grad_scale;
    acc_t denom;
  };

  __device__ bool reads(int k) const { return k != novograd::kOut; }
  __device__ bool writes(int k) const { return k != novograd::kGrad; }

  template <typename C>
  __device__ Ctx begin(const C& c) const {
    Ctx ctx{h, static_cast<acc_t>(cuda::value_or(grad_scale_t, 1.0)), acc_t(0)};
    device_lr(ctx.h);
    device_step(ctx.h, bias);
    ctx.denom = static_cast<acc_t>(v_norm[c.tensor]) / ctx.h.bc2_sqrt + ctx.h.eps;
    return ctx;
  }

  __device__ void operator()(acc_t (&x)[Slots::kDepth], const Ctx& ctx) const {
    novograd::update<acc_t>(x[novograd::kParam], x[novograd::kGrad] * ctx.grad_scale,
                            x[novograd::kExpAvg], ctx.denom, ctx.h);
    if constexpr (Ty::has_out) x[novograd::kOut] = x[novograd::kParam];
  }
};

}  // namespace

void novograd_cuda(const TensorLists& lists, const at::Tensor& v_norm, double lr, double beta1,
                   double beta2, double eps, int64_t step, bool bias_correction,
                   double weight_decay, bool grad_averaging, int64_t moment_mode,
                   const OptTensor& lr_t, const OptTensor& step_t, const OptTensor& grad_scale_t,
                   const OptTensor& found_inf_t) {
  using namespace novograd;
  check_tensor_lists(lists, kDepth, c10::DeviceType::CUDA, "novograd");
  check_moment_mode(moment_mode);
  if (lists[0].empty()) return;
  const at::Device device = lists[0][0].device();
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), out_dtype(lists, kDepth),
      "novograd", [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        check_state_dtype<acc_t>(lists[kExpAvg], "novograd", "exp_avg");
        NovoGradOp<Ty> op;
        op.set_scalars(device, "novograd", lr_t, step_t, grad_scale_t, found_inf_t);
        op.v_norm = per_tensor_vector(v_norm, lists[0].size(), device, "novograd", "v_norm");
        op.h = make_hyper<acc_t>(lr, beta1, beta2, eps, static_cast<double>(step),
                                 bias_correction, weight_decay, grad_averaging, moment_mode);
        op.bias = {beta1, beta2, bias_correction};
        cuda::apply_elementwise(lists, op);
      });
}

}  // namespace shardopt
