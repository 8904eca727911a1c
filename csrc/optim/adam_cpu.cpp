// Adam on CPU tensors: the cpu traversal over adam_math.h.
#include "../kernels.h"
#include "../multi_tensor/cpu_apply.h"
#include "../multi_tensor/cpu_stream.h"
#include "../multi_tensor/dispatch.h"
#include "adam_math.h"

namespace shardopt {

void adam_cpu(const TensorLists& lists, double lr, double beta1, double beta2, double eps,
              int64_t step, bool adam_w_mode, bool bias_correction, double weight_decay,
              const OptTensor& lr_t, const OptTensor& step_t, const OptTensor& grad_scale_t,
              const OptTensor& found_inf_t) {
  using namespace adam;
  check_tensor_lists(lists, kDepth, c10::DeviceType::CPU, "adam");
  if (lists[0].empty() || cpu::skip_step(found_inf_t)) return;
  const double t = cpu::scalar_or(step_t, static_cast<double>(step));
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), out_dtype(lists, kDepth),
      "adam", [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        check_state_dtype<acc_t>(lists[kExpAvg], "adam", "exp_avg");
        check_state_dtype<acc_t>(lists[kExpAvgSq], "adam", "exp_avg_sq");
        const Hyper<acc_t> h = make_hyper<acc_t>(cpu::scalar_or(lr_t, lr), beta1, beta2, eps, t,
                                                 adam_w_mode, bias_correction, weight_decay);
        const acc_t gs = static_cast<acc_t>(cpu::scalar_or(grad_scale_t, 1.0));
        auto g = cpu::pointers<typename Ty::grad_t>(lists[kGrad]);
        auto p = cpu::pointers<typename Ty::param_t>(lists[kParam]);
        auto m = cpu::pointers<acc_t>(lists[kExpAvg]);
        auto v = cpu::pointers<acc_t>(lists[kExpAvgSq]);
        std::vector<typename Ty::out_t*> o;
        if constexpr (Ty::has_out) o = cpu::pointers<typename Ty::out_t>(lists[kOut]);
        cpu::with_flag(h.adam_w_mode, [&](auto adam_w) {
          cpu::apply(lists[0], [&](int64_t k, int64_t s, int64_t e) {
            // local copies, the flag a constant (see Note: vectorised CPU loops)
            auto hl = h;
            hl.adam_w_mode = decltype(adam_w)::value;
            const acc_t gsl = gs;
            const auto* __restrict gk = g[k];
            auto* __restrict pk = p[k];
            acc_t* __restrict mk = m[k];
            acc_t* __restrict vk = v[k];
            typename Ty::out_t* __restrict ok = Ty::has_out ? o[k] : nullptr;
            if constexpr (Ty::has_out) {  // Note: streamed out slots
              using out_t = typename Ty::out_t;
              alignas(64) out_t buf[cpu::kStreamBlock];
              for (int64_t b = s; b < e; b += cpu::kStreamBlock) {
                const int64_t n = std::min(cpu::kStreamBlock, e - b);
                const auto* __restrict gb = gk + b;
                auto* __restrict pb = pk + b;
                acc_t* __restrict mb = mk + b;
                acc_t* __restrict vb = vk + b;
                for (int64_t i = 0; i < n; ++i) {
                  acc_t pi = static_cast<acc_t>(pb[i]);
                  update<acc_t>(pi, static_cast<acc_t>(gb[i]) * gsl, mb[i], vb[i], hl);
                  pb[i] = static_cast<typename Ty::param_t>(pi);
                  buf[i] = static_cast<out_t>(pi);
                }
                cpu::stream_bytes(ok + b, buf, n * sizeof(out_t));
              }
              cpu::stream_fence();
            } else {
              for (int64_t i = s; i < e; ++i) {
                acc_t pi = static_cast<acc_t>(pk[i]);
                update<acc_t>(pi, static_cast<acc_t>(gk[i]) * gsl, mk[i], vk[i], hl);
                pk[i] = static_cast<typename Ty::param_t>(pi);
              }
            }
          });
        });
      });
}

}  // namespace shardopt
