// SGD on CUDA tensors: the cuda traversal (cuda_apply.cuh) over sgd_math.h. Device scalars are read
// inside the kernel so a capturable step never syncs with the host.
#include "../kernels.h"
#include "../multi_tensor/cuda_elementwise.cuh"
#include "../multi_tensor/dispatch.h"
#include "sgd_math.h"

namespace shardopt {
namespace {

template <typename Ty>
struct SgdOp : cuda::OpBase {
  using acc_t = typename Ty::acc_t;
  using G = typename Ty::grad_t;
  using P = typename Ty::param_t;
  // fp16/bf16 params without masters: torch.optim.SGD's param-dtype buffer and roundings
  static constexpr bool kRounded = !std::is_same_v<P, acc_t>;
  using Buf = std::conditional_t<kRounded, P, acc_t>;
  using Slots = std::conditional_t<Ty::has_out, cuda::Slots<G, P, Buf, typename Ty::out_t>,
                                   cuda::Slots<G, P, Buf>>;
  sgd::Hyper<acc_t> h;
  double scale;                        // host grad multiplier (inverse loss scale)
  const float* first_run_t = nullptr;  // device first_run flag (replaces h.first_run)

  struct Ctx {
    sgd::Hyper<acc_t> h;
    acc_t grad_scale;
  };

  // Without momentum the buffer slot exists but is neither read nor written.
  __device__ bool reads(int k) const {
    return k == sgd::kGrad || k == sgd::kParam || (k == sgd::kMomentum && h.momentum != acc_t(0));
  }
  __device__ bool writes(int k) const {
    return k == sgd::kParam || k == sgd::kOut || (k == sgd::kMomentum && h.momentum != acc_t(0));
  }

  template <typename C>
  __device__ Ctx begin(const C&) const {
    Ctx ctx{h, static_cast<acc_t>(scale * cuda::value_or(grad_scale_t, 1.0))};
    device_lr(ctx.h);
    if (first_run_t != nullptr) ctx.h.first_run = *first_run_t != 0.f;
    return ctx;
  }

  __device__ void operator()(acc_t (&x)[Slots::kDepth], const Ctx& ctx) const {
    if constexpr (kRounded) {
      sgd::update_rounded<P>(x[sgd::kParam], x[sgd::kGrad] * ctx.grad_scale, x[sgd::kMomentum],
                             ctx.h);
    } else {
      sgd::update<acc_t>(x[sgd::kParam], x[sgd::kGrad] * ctx.grad_scale, x[sgd::kMomentum],
                         ctx.h);
    }
    if constexpr (Ty::has_out) x[sgd::kOut] = x[sgd::kParam];
  }
};

}  // namespace

void sgd_cuda(const TensorLists& lists, double lr, double momentum, double dampening,
              double weight_decay, bool nesterov, bool first_run, bool wd_after_momentum,
              double scale, const OptTensor& lr_t, const OptTensor& grad_scale_t,
              const OptTensor& found_inf_t, const OptTensor& first_run_t) {
  using namespace sgd;
  check_tensor_lists(lists, kDepth, c10::DeviceType::CUDA, "sgd");
  if (lists[0].empty()) return;
  const at::Device device = lists[0][0].device();
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), out_dtype(lists, kDepth),
      "sgd", [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        if (momentum != 0.0) {
          check_state_dtype<typename SgdOp<Ty>::Buf>(lists[kMomentum], "sgd", "momentum_buffer");
        }
        SgdOp<Ty> op;
        op.set_scalars(device, "sgd", lr_t, std::nullopt, grad_scale_t, found_inf_t);
        op.first_run_t = device_scalar(first_run_t, device, "sgd", "first_run_t");
        op.h = make_hyper<acc_t>(lr, momentum, dampening, weight_decay, nesterov, first_run,
                                 wd_after_momentum);
        op.scale = scale;
        cuda::apply_elementwise(lists, op);
      });
}

}  // namespace shardopt
