// Adam over elementwise compact state on CPU tensors: fp32, bf16 or fp16 moments (v through
// codec::decode_v/encode_v: fp16 keeps its root), the master as fp32, bf16 + int16 remainder, or a
// bf16/fp16 param. The cpu traversal over adam::update.
#include <algorithm>
#include <type_traits>

#include "../kernels.h"
#include "../multi_tensor/cpu_apply.h"
#include "../multi_tensor/dispatch.h"
#include "adam_compact_math.h"

namespace shardopt {
namespace {

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
  cpu::apply(lists[kGrad], [&](int64_t k, int64_t s, int64_t e) {
    S* mk = m[k];
    S* vk = v[k];
    if constexpr (std::is_same_v<G, float> && std::is_same_v<P, float> &&
                  std::is_same_v<S, float>) {
      // all fp32: one fused loop, as adam_cpu.cpp's (local copies: stores cannot alias them)
      const auto hl = h;
      const float gsl = gs;
      const G* gk = g[k];
      P* pk = p[k];
#pragma omp simd
      for (int64_t i = s; i < e; ++i) {
        float pi = codec::to_float(pk[i]);
        float mi = codec::to_float(mk[i]);
        float vi = codec::to_float(vk[i]);
        adam::update<float>(pi, codec::to_float(gk[i]) * gsl, mi, vi, hl);
        pk[i] = codec::from_float<P>(pi);
        mk[i] = codec::from_float<S>(mi);
        vk[i] = codec::from_float<S>(vi);
      }
    } else {
      // tiles: GCC vectorises neither the 16-bit conversions nor the remainders in a fused loop
      Tile<1024> t;
      for (int64_t i0 = s; i0 < e; i0 += t.kSize) {
        const int n = static_cast<int>(std::min<int64_t>(t.kSize, e - i0));
        load_tile<M>(t, g[k], p[k], Ty::remainder ? r[k] : nullptr, i0, n);
#pragma omp simd
        for (int j = 0; j < n; ++j) {
          t.m[j] = codec::to_float(mk[i0 + j]);
          t.v[j] = codec::decode_v(vk[i0 + j]);
        }
        update_tile(t, n, gs, h);
        store_master<M>(t, p[k], Ty::remainder ? r[k] : nullptr, i0, n);
#pragma omp simd
        for (int j = 0; j < n; ++j) {
          mk[i0 + j] = codec::from_float<S>(t.m[j]);
          vk[i0 + j] = codec::encode_v<S>(t.v[j]);
        }
      }
    }
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
