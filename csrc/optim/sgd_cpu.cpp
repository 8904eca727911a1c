// SGD on CPU tensors: the cpu traversal over sgd_math.h.
#include "../kernels.h"
#include "../multi_tensor/cpu_apply.h"
#include "../multi_tensor/dispatch.h"
#include "sgd_math.h"

namespace shardopt {

void sgd_cpu(const TensorLists& lists, double lr, double momentum, double dampening,
             double weight_decay, bool nesterov, bool first_run, bool wd_after_momentum,
             double scale, const OptTensor& lr_t, const OptTensor& grad_scale_t,
             const OptTensor& found_inf_t, const OptTensor& first_run_t) {
  using namespace sgd;
  check_tensor_lists(lists, kDepth, c10::DeviceType::CPU, "sgd");
  if (lists[0].empty() || cpu::skip_step(found_inf_t)) return;
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), out_dtype(lists, kDepth),
      "sgd", [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        using param_t = typename Ty::param_t;
        // fp16/bf16 params without masters: torch.optim.SGD's param-dtype buffer and roundings
        constexpr bool kRounded = !std::is_same_v<param_t, acc_t>;
        using buf_t = std::conditional_t<kRounded, param_t, acc_t>;
        if (momentum != 0.0) check_state_dtype<buf_t>(lists[kMomentum], "sgd", "momentum_buffer");
        Hyper<acc_t> h = make_hyper<acc_t>(
            cpu::scalar_or(lr_t, lr), momentum, dampening, weight_decay, nesterov,
            cpu::scalar_or(first_run_t, first_run ? 1.0 : 0.0) != 0.0, wd_after_momentum);
        if constexpr (kRounded) round_alphas<param_t>(h);
        const acc_t gs = static_cast<acc_t>(scale * cpu::scalar_or(grad_scale_t, 1.0));
        auto g = cpu::pointers<typename Ty::grad_t>(lists[kGrad]);
        auto p = cpu::pointers<param_t>(lists[kParam]);
        std::vector<buf_t*> b(lists[0].size(), nullptr);
        if (momentum != 0.0) b = cpu::pointers<buf_t>(lists[kMomentum]);
        std::vector<typename Ty::out_t*> o;
        if constexpr (Ty::has_out) o = cpu::pointers<typename Ty::out_t>(lists[kOut]);
        auto step = [](acc_t& pi, acc_t gi, acc_t& bi, const Hyper<acc_t>& hl) {
          if constexpr (kRounded) {
            update_rounded<param_t>(pi, gi, bi, hl);
          } else {
            update<acc_t>(pi, gi, bi, hl);
          }
        };
        // the flags as constants of the loops (see Note: vectorised CPU loops)
        cpu::with_flag(h.nesterov, [&](auto nesterov_c) {
          cpu::with_flag(h.first_run, [&](auto first_run_c) {
            cpu::with_flag(h.wd_after_momentum, [&](auto wd_after_c) {
              cpu::apply(lists[0], [&](int64_t k, int64_t s, int64_t e) {
                auto hl = h;
                hl.nesterov = decltype(nesterov_c)::value;
                hl.first_run = decltype(first_run_c)::value;
                hl.wd_after_momentum = decltype(wd_after_c)::value;
                const acc_t gsl = gs;
                const auto* __restrict gk = g[k];
                auto* __restrict pk = p[k];
                buf_t* __restrict bk = b[k];
                typename Ty::out_t* __restrict ok = Ty::has_out ? o[k] : nullptr;
                if (bk == nullptr) {  // momentum 0: no buffer to read or write
                  for (int64_t i = s; i < e; ++i) {
                    acc_t pi = static_cast<acc_t>(pk[i]);
                    acc_t unused = 0;
                    step(pi, static_cast<acc_t>(gk[i]) * gsl, unused, hl);
                    pk[i] = static_cast<param_t>(pi);
                    if constexpr (Ty::has_out) ok[i] = static_cast<typename Ty::out_t>(pi);
                  }
                  return;
                }
                for (int64_t i = s; i < e; ++i) {
                  acc_t pi = static_cast<acc_t>(pk[i]);
                  acc_t bi = static_cast<acc_t>(bk[i]);
                  step(pi, static_cast<acc_t>(gk[i]) * gsl, bi, hl);
                  bk[i] = static_cast<buf_t>(bi);
                  pk[i] = static_cast<param_t>(pi);
                  if constexpr (Ty::has_out) ok[i] = static_cast<typename Ty::out_t>(pi);
                }
              });
            });
          });
        });
      });
}

}  // namespace shardopt
