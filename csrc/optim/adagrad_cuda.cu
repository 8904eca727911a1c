// Adagrad on CUDA tensors: the cuda traversal (cuda_apply.cuh) over adagrad_math.h. Device scalars
// are read inside the kernel so a capturable step never syncs with the host.
#include "../kernels.h"
#include "../multi_tensor/cuda_elementwise.cuh"
#include "../multi_tensor/dispatch.h"
#include "adagrad_math.h"

namespace shardopt {
namespace {

template <typename Ty>
struct AdagradOp : cuda::OpBase {
  using acc_t = typename Ty::acc_t;
  using G = typename Ty::grad_t;
  using P = typename Ty::param_t;
  using Slots = std::conditional_t<Ty::has_out, cuda::Slots<G, P, acc_t, typename Ty::out_t>,
                                   cuda::Slots<G, P, acc_t>>;
  adagrad::Hyper<acc_t> h;

  struct Ctx {
    adagrad::Hyper<acc_t> h;
    acc_t grad_scale;
  };

  __device__ bool reads(int k) const { return k != adagrad::kOut; }
  __device__ bool writes(int k) const { return k != adagrad::kGrad; }

  template <typename C>
  __device__ Ctx begin(const C&) const {
    Ctx ctx{h, static_cast<acc_t>(cuda::value_or(grad_scale_t, 1.0))};
    device_lr(ctx.h);
    return ctx;
  }

  __device__ void operator()(acc_t (&x)[Slots::kDepth], const Ctx& ctx) const {
    adagrad::update<acc_t>(x[adagrad::kParam], x[adagrad::kGrad] * ctx.grad_scale,
                           x[adagrad::kSum], ctx.h);
    if constexpr (Ty::has_out) x[adagrad::kOut] = x[adagrad::kParam];
  }
};

}  // namespace

void adagrad_cuda(const TensorLists& lists, double lr, double eps, double weight_decay,
                  bool adagrad_w_mode, const OptTensor& lr_t, const OptTensor& grad_scale_t,
                  const OptTensor& found_inf_t) {
  using namespace adagrad;
  check_tensor_lists(lists, kDepth, c10::DeviceType::CUDA, "adagrad");
  if (lists[0].empty()) return;
  const at::Device device = lists[0][0].device();
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), out_dtype(lists, kDepth),
      "adagrad", [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        check_state_dtype<acc_t>(lists[kSum], "adagrad", "sum");
        AdagradOp<Ty> op;
        op.set_scalars(device, "adagrad", lr_t, std::nullopt, grad_scale_t, found_inf_t);
        op.h = make_hyper<acc_t>(lr, eps, weight_decay, adagrad_w_mode);
        cuda::apply_elementwise(lists, op);
      });
}

}  // namespace shardopt
