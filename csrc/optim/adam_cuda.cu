// Adam on CUDA tensors: the cuda traversal (cuda_apply.cuh) over adam_math.h. Device scalars are
// read inside the kernel so a capturable step never syncs with the host.
#include "../kernels.h"
#include "../multi_tensor/cuda_elementwise.cuh"
#include "../multi_tensor/dispatch.h"
#include "adam_math.h"

namespace shardopt {
namespace {

template <typename Ty>
struct AdamOp : cuda::OpBase {
  using acc_t = typename Ty::acc_t;
  using G = typename Ty::grad_t;
  using P = typename Ty::param_t;
  using Slots = std::conditional_t<Ty::has_out,
                                   cuda::Slots<G, P, acc_t, acc_t, typename Ty::out_t>,
                                   cuda::Slots<G, P, acc_t, acc_t>>;
  adam::Hyper<acc_t> h;  // host values; begin() swaps in the device scalars
  BiasCorrection bias;

  struct Ctx {
    adam::Hyper<acc_t> h;
    acc_t grad_scale;
  };

  __device__ bool reads(int k) const { return k != adam::kOut; }
  __device__ bool writes(int k) const { return k != adam::kGrad; }

  template <typename C>
  __device__ Ctx begin(const C&) const {
    Ctx ctx{h, static_cast<acc_t>(cuda::value_or(grad_scale_t, 1.0))};
    device_lr(ctx.h);
    device_step(ctx.h, bias);
    return ctx;
  }

  __device__ void operator()(acc_t (&x)[Slots::kDepth], const Ctx& ctx) const {
    adam::update<acc_t>(x[adam::kParam], x[adam::kGrad] * ctx.grad_scale, x[adam::kExpAvg],
                        x[adam::kExpAvgSq], ctx.h);
    if constexpr (Ty::has_out) x[adam::kOut] = x[adam::kParam];
  }
};

}  // namespace

void adam_cuda(const TensorLists& lists, double lr, double beta1, double beta2, double eps,
               int64_t step, bool adam_w_mode, bool bias_correction, double weight_decay,
               const OptTensor& lr_t, const OptTensor& step_t, const OptTensor& grad_scale_t,
               const OptTensor& found_inf_t) {
  using namespace adam;
  check_tensor_lists(lists, kDepth, c10::DeviceType::CUDA, "adam");
  if (lists[0].empty()) return;
  const at::Device device = lists[0][0].device();
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), out_dtype(lists, kDepth),
      "adam", [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        check_state_dtype<acc_t>(lists[kExpAvg], "adam", "exp_avg");
        check_state_dtype<acc_t>(lists[kExpAvgSq], "adam", "exp_avg_sq");
        AdamOp<Ty> op;
        op.set_scalars(device, "adam", lr_t, step_t, grad_scale_t, found_inf_t);
        op.h = make_hyper<acc_t>(lr, beta1, beta2, eps, static_cast<double>(step), adam_w_mode,
                                 bias_correction, weight_decay);
        op.bias = {beta1, beta2, bias_correction};
        cuda::apply_elementwise(lists, op);
      });
}

}  // namespace shardopt
