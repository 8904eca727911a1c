// NovoGrad on CPU tensors: the cpu traversal over novograd_math.h. The per-tensor second moment
// (already blended, in norm form) arrives as v_norm, one entry per tensor.
#include "../kernels.h"
#include "../multi_tensor/cpu_apply.h"
#include "../multi_tensor/dispatch.h"
#include "novograd_math.h"

namespace shardopt {

void novograd_cpu(const TensorLists& lists, const at::Tensor& v_norm, double lr, double beta1,
                  double beta2, double eps, int64_t step, bool bias_correction,
                  double weight_decay, bool grad_averaging, int64_t moment_mode,
                  const OptTensor& lr_t, const OptTensor& step_t, const OptTensor& grad_scale_t,
                  const OptTensor& found_inf_t) {
  using namespace novograd;
  check_tensor_lists(lists, kDepth, c10::DeviceType::CPU, "novograd");
  const int64_t n = static_cast<int64_t>(lists[0].size());
  check_per_tensor(v_norm, lists[0].size(), "novograd", "v_norm");
  check_moment_mode(moment_mode);
  if (n == 0 || cpu::skip_step(found_inf_t)) return;
  const double t = cpu::scalar_or(step_t, static_cast<double>(step));
  const at::Tensor vn = v_norm.to(at::kDouble).contiguous();
  const double* vnp = vn.data_ptr<double>();
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), out_dtype(lists, kDepth),
      "novograd", [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        check_state_dtype<acc_t>(lists[kExpAvg], "novograd", "exp_avg");
        const Hyper<acc_t> h =
            make_hyper<acc_t>(cpu::scalar_or(lr_t, lr), beta1, beta2, eps, t, bias_correction,
                              weight_decay, grad_averaging, moment_mode);
        const acc_t gs = static_cast<acc_t>(cpu::scalar_or(grad_scale_t, 1.0));
        auto g = cpu::pointers<typename Ty::grad_t>(lists[kGrad]);
        auto p = cpu::pointers<typename Ty::param_t>(lists[kParam]);
        auto m = cpu::pointers<acc_t>(lists[kExpAvg]);
        std::vector<typename Ty::out_t*> o;
        if constexpr (Ty::has_out) o = cpu::pointers<typename Ty::out_t>(lists[kOut]);
        cpu::apply(lists[0], [&](int64_t k, int64_t s, int64_t e) {
          // local copies: stores through the data pointers cannot alias them, so the loop
          // vectorises
          const auto hl = h;
          const acc_t gsl = gs;
          (void)gsl;
          const acc_t denom = static_cast<acc_t>(vnp[k]) / h.bc2_sqrt + h.eps;
          auto* gk = g[k];
          auto* pk = p[k];
          acc_t* mk = m[k];
          typename Ty::out_t* ok = Ty::has_out ? o[k] : nullptr;
#pragma omp simd
          for (int64_t i = s; i < e; ++i) {
            acc_t pi = static_cast<acc_t>(pk[i]);
            update<acc_t>(pi, static_cast<acc_t>(gk[i]) * gsl, mk[i], denom, hl);
            pk[i] = static_cast<typename Ty::param_t>(pi);
            if constexpr (Ty::has_out) ok[i] = static_cast<typename Ty::out_t>(pi);
          }
        });
      });
}

}  // namespace shardopt
