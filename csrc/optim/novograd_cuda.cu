// NovoGrad on CUDA tensors: the cuda traversal (cuda_apply.cuh) over novograd_math.h. The
// per-tensor second moment arrives already updated (a small vector the caller maintains); each
// block turns its tensor's entry into the denominator once. Device scalars are read inside the
// kernel.
#include "../kernels.h"
#include "../multi_tensor/cuda_apply.cuh"
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
  double beta1, beta2;
  bool bias_correction;

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
    if (lr_t != nullptr) ctx.h.lr = static_cast<acc_t>(*lr_t);
    if (step_t != nullptr) {
      const double t = *step_t;
      ctx.h.bc1 = static_cast<acc_t>(shardopt::bias_correction(beta1, t, bias_correction));
      ctx.h.bc2_sqrt =
          static_cast<acc_t>(sqrt(shardopt::bias_correction(beta2, t, bias_correction)));
    }
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
  TORCH_CHECK(moment_mode == 0 || moment_mode == 1, "novograd: moment_mode must be 0 or 1, got ",
              moment_mode);
  if (lists[0].empty()) return;
  const at::Device device = lists[0][0].device();
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), out_dtype(lists, kDepth),
      "novograd", [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        cuda::check_state_dtype<acc_t>(lists[kExpAvg], "novograd", "exp_avg");
        const double t = static_cast<double>(step);
        NovoGradOp<Ty> op;
        op.lr_t = cuda::device_scalar(lr_t, device, "novograd", "lr_t");
        op.step_t = cuda::device_scalar(step_t, device, "novograd", "step_t");
        op.grad_scale_t = cuda::device_scalar(grad_scale_t, device, "novograd", "grad_scale_t");
        op.found_inf_t = cuda::device_scalar(found_inf_t, device, "novograd", "found_inf_t");
        op.v_norm = cuda::per_tensor_vector(v_norm, lists[0].size(), device, "novograd", "v_norm");
        op.h = {static_cast<acc_t>(lr),
                static_cast<acc_t>(beta1),
                static_cast<acc_t>(grad_averaging ? 1.0 - beta1 : 1.0),
                static_cast<acc_t>(eps),
                static_cast<acc_t>(weight_decay),
                static_cast<acc_t>(shardopt::bias_correction(beta1, t, bias_correction)),
                static_cast<acc_t>(std::sqrt(shardopt::bias_correction(beta2, t, bias_correction))),
                static_cast<int>(moment_mode)};
        op.beta1 = beta1;
        op.beta2 = beta2;
        op.bias_correction = bias_correction;
        cuda::apply_elementwise(lists, op);
      });
}

}  // namespace shardopt
