// NovoGrad on CPU tensors: the cpu traversal over novograd_math.h. novograd takes the per-tensor
// second moment already blended (in norm form) as v_norm, one entry per tensor; novograd_step
// takes the grads' per-tensor norms itself (norm_cpu.h, as norm_cpu), blends v in place and then
// runs the same update.
#include "../kernels.h"
#include "../multi_tensor/cpu_apply.h"
#include "../multi_tensor/dispatch.h"
#include "../norm/norm_cpu.h"
#include "novograd_math.h"

namespace shardopt {

namespace {

// The update pass: every element of lists with its tensor's second moment vn[k] (a norm).
template <typename Ty>
void update_pass(const TensorLists& lists, const double* vnp,
                 const novograd::Hyper<typename Ty::acc_t>& h, typename Ty::acc_t gs) {
  using namespace novograd;
  using acc_t = typename Ty::acc_t;
  auto g = cpu::pointers<typename Ty::grad_t>(lists[kGrad]);
  auto p = cpu::pointers<typename Ty::param_t>(lists[kParam]);
  auto m = cpu::pointers<acc_t>(lists[kExpAvg]);
  std::vector<typename Ty::out_t*> o;
  if constexpr (Ty::has_out) o = cpu::pointers<typename Ty::out_t>(lists[kOut]);
  cpu::with_flag(h.moment_mode != 0, [&](auto mode_1) {
    cpu::apply(lists[0], [&](int64_t k, int64_t s, int64_t e) {
      // local copies, the mode a constant (see Note: vectorised CPU loops)
      auto hl = h;
      hl.moment_mode = decltype(mode_1)::value ? 1 : 0;
      const acc_t gsl = gs;
      const acc_t denom = static_cast<acc_t>(vnp[k]) / h.bc2_sqrt + h.eps;
      const auto* __restrict gk = g[k];
      auto* __restrict pk = p[k];
      acc_t* __restrict mk = m[k];
      typename Ty::out_t* __restrict ok = Ty::has_out ? o[k] : nullptr;
      for (int64_t i = s; i < e; ++i) {
        acc_t pi = static_cast<acc_t>(pk[i]);
        update<acc_t>(pi, static_cast<acc_t>(gk[i]) * gsl, mk[i], denom, hl);
        pk[i] = static_cast<typename Ty::param_t>(pi);
        if constexpr (Ty::has_out) ok[i] = static_cast<typename Ty::out_t>(pi);
      }
    });
  });
}

// The blend of every tensor's second moment, in T (the dtype of the grads' norms: double for
// double grads, else float, as norm_cpu returns them): v is written in place (in its own dtype),
// and the blended values are returned in double for the update pass.
template <typename T, typename V>
std::vector<double> blend_all(const std::vector<double>& sums, V* v, const at::Tensor* fresh,
                              const novograd::Blend& blend) {
  const bool max_norm = !blend.l2;
  const bool* fp = fresh != nullptr ? fresh->data_ptr<bool>() : nullptr;
  std::vector<double> out(sums.size());
  for (size_t k = 0; k < sums.size(); ++k) {
    const T s = static_cast<T>(sums[k]);
    const T n = max_norm ? s : sqrt_of(s);
    const T b = blend(static_cast<T>(v[k]), n, fp != nullptr && fp[k]);
    v[k] = static_cast<V>(b);
    out[k] = static_cast<double>(b);
  }
  return out;
}

}  // namespace

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
        update_pass<Ty>(lists, vnp, h, gs);
      });
}

void novograd_step_cpu(const TensorLists& lists, const at::Tensor& v, const OptTensor& fresh,
                       double lr, double beta1, double beta2, double eps, int64_t step,
                       bool bias_correction, double weight_decay, bool grad_averaging,
                       int64_t moment_mode, int64_t norm_type, bool init_zero,
                       const OptTensor& lr_t, const OptTensor& step_t) {
  using namespace novograd;
  const char* name = "novograd_step";
  check_tensor_lists(lists, kDepth, c10::DeviceType::CPU, name);
  const size_t n = lists[0].size();
  check_moment_mode(moment_mode);
  check_norm_type(norm_type, name);
  // v is written in place: a contiguous fp32 or fp64 CPU vector, one entry per tensor
  TORCH_CHECK(v.device().is_cpu() && v.is_contiguous() &&
                  (v.scalar_type() == at::kFloat || v.scalar_type() == at::kDouble),
              name, ": v must be a contiguous float32 or float64 CPU tensor, got ",
              v.scalar_type(), " on ", v.device().str());
  check_per_tensor(v, n, name, "v");
  at::Tensor fresh_mask;
  if (fresh.has_value()) {
    TORCH_CHECK(fresh->device().is_cpu(), name, ": fresh must be a CPU tensor, got one on ",
                fresh->device().str());
    check_per_tensor(*fresh, n, name, "fresh");
    fresh_mask = fresh->to(at::kBool).contiguous();
  }
  if (n == 0) return;
  const double t = cpu::scalar_or(step_t, static_cast<double>(step));
  const Blend blend{beta2, norm_type == 2, init_zero};
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), out_dtype(lists, kDepth),
      name, [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        using sum_t = std::conditional_t<std::is_same_v<typename Ty::grad_t, double>, double, float>;
        check_state_dtype<acc_t>(lists[kExpAvg], name, "exp_avg");
        const Hyper<acc_t> h =
            make_hyper<acc_t>(cpu::scalar_or(lr_t, lr), beta1, beta2, eps, t, bias_correction,
                              weight_decay, grad_averaging, moment_mode);
        // every check is behind us: from here on the call writes
        const std::vector<double> sums = cpu::per_tensor_sums(lists[kGrad], !blend.l2);
        const at::Tensor* fm = fresh.has_value() ? &fresh_mask : nullptr;
        const std::vector<double> vn =
            v.scalar_type() == at::kDouble
                ? blend_all<sum_t>(sums, v.data_ptr<double>(), fm, blend)
                : blend_all<sum_t>(sums, v.data_ptr<float>(), fm, blend);
        update_pass<Ty>(lists, vn.data(), h, acc_t(1));
      });
}

}  // namespace shardopt
