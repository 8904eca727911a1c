// Adam over elementwise compact state on CUDA tensors: the elementwise traversal
// (cuda_elementwise.cuh) over [grad, param, (remainder,) exp_avg, exp_avg_sq] and adam::update,
// v through codec::v_from_code_value/v_code_value (fp16 keeps its root).
// A bf16 param with a remainder travels as its raw bits (ParamHi) and the remainder as an int16,
// both exact in float registers; the op joins them into the master and splits it back.
#include "../kernels.h"
#include "../multi_tensor/cuda_elementwise.cuh"
#include "../multi_tensor/dispatch.h"
#include "adam_compact_math.h"

namespace shardopt {
namespace {

// The bits of a bf16 param, carried through a float register unrounded (the upper half of the
// master's bits; NaN payloads and signs included).
struct ParamHi {
  uint16_t bits;
  ParamHi() = default;
  __device__ ParamHi(float f) : bits(static_cast<uint16_t>(codec::bits_of(f) >> 16)) {}
  __device__ operator float() const { return codec::float_of(static_cast<uint32_t>(bits) << 16); }
};
static_assert(sizeof(ParamHi) == 2, "ParamHi is a bf16 in memory");

template <typename Ty, typename S>
struct AdamCompactOp : cuda::OpBase {
  using acc_t = float;
  static constexpr bool kRem = Ty::remainder;
  using G = typename Ty::grad_t;
  using P = std::conditional_t<kRem, ParamHi, typename Ty::param_t>;
  using Slots = std::conditional_t<kRem, cuda::Slots<G, P, int16_t, S, S>, cuda::Slots<G, P, S, S>>;
  // Slots of the traversal's lists: the compact lists without an empty remainders list.
  static constexpr int kG = 0, kP = 1, kR = 2, kM = kRem ? kR + 1 : kR, kV = kM + 1;
  adam::Hyper<float> h;  // host values; begin() swaps in the device scalars
  BiasCorrection bias;

  struct Ctx {
    adam::Hyper<float> h;
    float grad_scale;
  };

  __device__ bool reads(int) const { return true; }
  __device__ bool writes(int k) const { return k != kG; }

  template <typename C>
  __device__ Ctx begin(const C&) const {
    Ctx ctx{h, static_cast<float>(cuda::value_or(grad_scale_t, 1.0))};
    device_lr(ctx.h);
    device_step(ctx.h, bias);
    return ctx;
  }

  __device__ void operator()(float (&x)[Slots::kDepth], const Ctx& ctx) const {
    float master;
    if constexpr (kRem) {
      master = codec::join_master(static_cast<uint16_t>(codec::bits_of(x[kP]) >> 16),
                                  static_cast<int16_t>(x[kR]));
    } else {
      master = x[kP];
    }
    float v = codec::v_from_code_value<S>(x[kV]);  // the traversal converts codes to floats
    adam::update<float>(master, x[kG] * ctx.grad_scale, x[kM], v, ctx.h);
    x[kV] = codec::v_code_value<S>(v);
    if constexpr (kRem) {
      uint16_t hi;
      int16_t lo;
      codec::split_master(master, hi, lo);
      x[kP] = codec::float_of(static_cast<uint32_t>(hi) << 16);
      x[kR] = static_cast<float>(lo);
    } else {
      x[kP] = master;
    }
  }
};

}  // namespace

void adam_compact_cuda(const TensorLists& lists, double lr, double beta1, double beta2,
                       double eps, int64_t step, bool adam_w_mode, bool bias_correction,
                       double weight_decay, const OptTensor& lr_t, const OptTensor& step_t,
                       const OptTensor& grad_scale_t, const OptTensor& found_inf_t) {
  using namespace adam_compact;
  const bool remainder = check_compact_lists(lists, false, c10::DeviceType::CUDA, "adam_compact",
                                             {at::kFloat, at::kBFloat16, at::kHalf});
  if (lists[0].empty()) return;
  const at::Device device = lists[0][0].device();
  TensorLists slots = {lists[kGrad], lists[kParam]};
  if (remainder) slots.push_back(lists[kRemainder]);
  slots.push_back(lists[kExpAvg]);
  slots.push_back(lists[kExpAvgSq]);
  dispatch_master(lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), remainder,
                  "adam_compact", [&](auto types) {
                    using Ty = decltype(types);
                    auto launch = [&](auto state) {
                      AdamCompactOp<Ty, decltype(state)> op;
                      op.set_scalars(device, "adam_compact", lr_t, step_t, grad_scale_t,
                                     found_inf_t);
                      op.h = adam::make_hyper<float>(lr, beta1, beta2, eps,
                                                     static_cast<double>(step), adam_w_mode,
                                                     bias_correction, weight_decay);
                      op.bias = {beta1, beta2, bias_correction};
                      cuda::apply_elementwise(slots, op);
                    };
                    switch (lists[kExpAvg][0].scalar_type()) {
                      case at::kFloat: return launch(float{});
                      case at::kBFloat16: return launch(c10::BFloat16{});
                      default: return launch(c10::Half{});
                    }
                  });
}

}  // namespace shardopt
