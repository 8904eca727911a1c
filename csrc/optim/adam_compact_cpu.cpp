// Adam over elementwise compact state on CPU tensors: fp32, bf16 or fp16 moments (v through
// codec::decode_v/encode_v: fp16 keeps its root), the master as fp32, bf16 + int16 remainder, or a
// bf16/fp16 param. The cpu traversal over adam::update.
#include <cstdint>

#include "../kernels.h"
#include "../multi_tensor/cpu_apply.h"
#include "../multi_tensor/dispatch.h"
#include "adam_compact_math.h"

namespace shardopt {
namespace {

// One fused loop per chunk for every master mode and format, written as adam_cpu.cpp's (see
// Note: vectorised CPU loops): local copies, the flag a compile-time constant, __restrict
// pointers and no `omp simd`. GCC vectorises it with the remainders and the 16-bit conversions
// (the tiles this kernel ran before, with `omp simd` loops, took 1.7-2x adam's time).
template <typename Ty, typename S>
void run(const TensorLists& lists, const adam::Hyper<float>& h, float gs) {
  using namespace adam_compact;
  using G = typename Ty::grad_t;
  using P = typename Ty::param_t;
  using M = Master<P, Ty::remainder>;
  auto g = cpu::pointers<G>(lists[kGrad]);
  auto p = cpu::pointers<P>(lists[kParam]);
  auto r = cpu::pointers<int16_t>(lists[kRemainder]);
  auto m = cpu::pointers<S>(lists[kExpAvg]);
  auto v = cpu::pointers<S>(lists[kExpAvgSq]);
  cpu::with_flag(h.adam_w_mode, [&](auto adam_w) {
    cpu::apply(lists[kGrad], [&](int64_t k, int64_t s, int64_t e) {
      auto hl = h;
      hl.adam_w_mode = decltype(adam_w)::value;
      const float gsl = gs;
      const G* __restrict gk = g[k];
      P* __restrict pk = p[k];
      int16_t* __restrict rk = Ty::remainder ? r[k] : nullptr;
      S* __restrict mk = m[k];
      S* __restrict vk = v[k];
      for (int64_t i = s; i < e; ++i) {
        float pi = M::load(pk, rk, i);
        float mi = codec::to_float(mk[i]);
        float vi = codec::decode_v(vk[i]);
        adam::update<float>(pi, codec::to_float(gk[i]) * gsl, mi, vi, hl);
        M::store(pk, rk, i, pi);
        mk[i] = codec::from_float<S>(mi);
        vk[i] = codec::encode_v<S>(vi);
      }
    });
  });
}

}  // namespace

void adam_compact_cpu(const TensorLists& lists, double lr, double beta1, double beta2, double eps,
                      int64_t step, bool adam_w_mode, bool bias_correction, double weight_decay,
                      const OptTensor& lr_t, const OptTensor& step_t,
                      const OptTensor& grad_scale_t, const OptTensor& found_inf_t) {
  using namespace adam_compact;
  const bool remainder = check_compact_lists(lists, false, c10::DeviceType::CPU, "adam_compact",
                                             {at::kFloat, at::kBFloat16, at::kHalf});
  if (lists[0].empty() || cpu::skip_step(found_inf_t)) return;
  const double t = cpu::scalar_or(step_t, static_cast<double>(step));
  const adam::Hyper<float> h =
      adam::make_hyper<float>(cpu::scalar_or(lr_t, lr), beta1, beta2, eps, t, adam_w_mode,
                              bias_correction, weight_decay);
  const float gs = static_cast<float>(cpu::scalar_or(grad_scale_t, 1.0));
  dispatch_master(lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), remainder,
                  "adam_compact", [&](auto types) {
                    using Ty = decltype(types);
                    switch (lists[kExpAvg][0].scalar_type()) {
                      case at::kFloat: return run<Ty, float>(lists, h, gs);
                      case at::kBFloat16: return run<Ty, c10::BFloat16>(lists, h, gs);
                      default: return run<Ty, c10::Half>(lists, h, gs);
                    }
                  });
}

}  // namespace shardopt
