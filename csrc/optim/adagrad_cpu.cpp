// Adagrad on CPU tensors: the cpu traversal over adagrad_math.h.
#include "../kernels.h"
#include "../multi_tensor/cpu_apply.h"
#include "../multi_tensor/dispatch.h"
#include "adagrad_math.h"

namespace shardopt {

void adagrad_cpu(const TensorLists& lists, double lr, double eps, double weight_decay,
                 bool adagrad_w_mode, const OptTensor& lr_t, const OptTensor& grad_scale_t,
                 const OptTensor& found_inf_t) {
  using namespace adagrad;
  check_tensor_lists(lists, kDepth, c10::DeviceType::CPU, "adagrad");
  if (lists[0].empty() || cpu::skip_step(found_inf_t)) return;
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), out_dtype(lists, kDepth),
      "adagrad", [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        check_state_dtype<acc_t>(lists[kSum], "adagrad", "sum");
        const Hyper<acc_t> h =
            make_hyper<acc_t>(cpu::scalar_or(lr_t, lr), eps, weight_decay, adagrad_w_mode);
        const acc_t gs = static_cast<acc_t>(cpu::scalar_or(grad_scale_t, 1.0));
        auto g = cpu::pointers<typename Ty::grad_t>(lists[kGrad]);
        auto p = cpu::pointers<typename Ty::param_t>(lists[kParam]);
        auto hs = cpu::pointers<acc_t>(lists[kSum]);
        std::vector<typename Ty::out_t*> o;
        if constexpr (Ty::has_out) o = cpu::pointers<typename Ty::out_t>(lists[kOut]);
        cpu::with_flag(h.adagrad_w_mode, [&](auto w_mode) {
          cpu::apply(lists[0], [&](int64_t k, int64_t s, int64_t e) {
            // local copies, the flag a constant (see Note: vectorised CPU loops)
            auto hl = h;
            hl.adagrad_w_mode = decltype(w_mode)::value;
            const acc_t gsl = gs;
            const auto* __restrict gk = g[k];
            auto* __restrict pk = p[k];
            acc_t* __restrict hk = hs[k];
            typename Ty::out_t* __restrict ok = Ty::has_out ? o[k] : nullptr;
            for (int64_t i = s; i < e; ++i) {
              acc_t pi = static_cast<acc_t>(pk[i]);
              update<acc_t>(pi, static_cast<acc_t>(gk[i]) * gsl, hk[i], hl);
              pk[i] = static_cast<typename Ty::param_t>(pi);
              if constexpr (Ty::has_out) ok[i] = static_cast<typename Ty::out_t>(pi);
            }
          });
        });
      });
}

}  // namespace shardopt
