// LAMB on CPU tensors over lamb_math.h, in two passes. Stage 1 updates the moments and returns the
// per-tensor sums of squares of the param (before the update) and of the update term u, taken in
// the same pass and deterministically as norm_cpu does: each work item's partials go to its own
// slot and are combined per tensor in item order, so the sums do not depend on the thread count.
// Stage 2 recomputes u from p, m, v and applies the trust ratio; u is never stored. Stage 1 can
// take the clip factor from the grads' sum of squares, stage 2 the sums of squares themselves.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "../kernels.h"
#include "../multi_tensor/cpu_apply.h"
#include "../multi_tensor/dispatch.h"
#include "lamb_math.h"

namespace shardopt {

namespace {

// The grad multiplier of stage 1: grad_scale_t (1 if absent), or with grad_norm_sq_t and
// max_grad_norm > 0 the clip factor times it (lamb::clip_scale, in the dtype of the sum).
double clipped_grad_scale(const OptTensor& grad_scale_t, const OptTensor& grad_norm_sq_t,
                          double max_grad_norm) {
  if (!grad_norm_sq_t.has_value() || max_grad_norm <= 0) {
    return cpu::scalar_or(grad_scale_t, 1.0);
  }
  const bool inv = grad_scale_t.has_value();
  if (grad_norm_sq_t->scalar_type() == at::kDouble) {
    return lamb::clip_scale<double>(grad_norm_sq_t->item<double>(), max_grad_norm, inv,
                                    inv ? grad_scale_t->item<double>() : 1.0);
  }
  return static_cast<double>(lamb::clip_scale<float>(
      grad_norm_sq_t->item<float>(), static_cast<float>(max_grad_norm), inv,
      inv ? grad_scale_t->item<float>() : 1.0f));
}

// A per-tensor vector of norms as a contiguous fp64 copy; with `squared` it holds sums of squares,
// whose square roots are taken in the vector's own precision (fp32 sums: an fp32 sqrt).
at::Tensor norms_in_double(const at::Tensor& t, bool squared) {
  at::Tensor out = t.to(at::kDouble, /*non_blocking=*/false, /*copy=*/squared).contiguous();
  if (!squared) return out;
  double* d = out.data_ptr<double>();
  const bool fp32 = t.scalar_type() != at::kDouble;
  for (int64_t i = 0; i < out.numel(); ++i) {
    d[i] = fp32 ? static_cast<double>(sqrt_of(static_cast<float>(d[i]))) : sqrt_of(d[i]);
  }
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> lamb_stage1_cpu(
    const TensorLists& lists, double beta1, double beta2, double eps, int64_t step,
    bool bias_correction, double weight_decay, bool grad_averaging, bool adam_w_mode,
    const OptTensor& step_t, const OptTensor& grad_scale_t, const OptTensor& found_inf_t,
    const OptTensor& grad_norm_sq_t, double max_grad_norm) {
  using namespace lamb;
  check_tensor_lists_no_out(lists, kStage1Depth, c10::DeviceType::CPU, "lamb_stage1");
  const int64_t n = static_cast<int64_t>(lists[0].size());
  // fp64 sums for fp64 params, else fp32 (as norm_cpu)
  const bool fp64 = n > 0 && lists[kParam][0].scalar_type() == at::kDouble;
  const auto opts = at::TensorOptions().dtype(fp64 ? at::kDouble : at::kFloat);
  if (n == 0 || cpu::skip_step(found_inf_t)) return {at::zeros({n}, opts), at::zeros({n}, opts)};
  const auto items = cpu::work_items(lists[0]);
  std::vector<double> w_part(items.size(), 0.0);
  std::vector<double> u_part(items.size(), 0.0);
  const double t = cpu::scalar_or(step_t, static_cast<double>(step));
  const double grad_scale = clipped_grad_scale(grad_scale_t, grad_norm_sq_t, max_grad_norm);
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), std::nullopt, "lamb_stage1",
      [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        check_state_dtype<acc_t>(lists[kExpAvg], "lamb_stage1", "exp_avg");
        check_state_dtype<acc_t>(lists[kExpAvgSq], "lamb_stage1", "exp_avg_sq");
        const Hyper<acc_t> h = make_hyper<acc_t>(beta1, beta2, eps, t, bias_correction,
                                                 weight_decay, grad_averaging, adam_w_mode);
        const acc_t gs = static_cast<acc_t>(grad_scale);
        auto g = cpu::pointers<typename Ty::grad_t>(lists[kGrad]);
        auto p = cpu::pointers<typename Ty::param_t>(lists[kParam]);
        auto m = cpu::pointers<acc_t>(lists[kExpAvg]);
        auto v = cpu::pointers<acc_t>(lists[kExpAvgSq]);
        cpu::apply(items, [&](int64_t item, int64_t k, int64_t s, int64_t e) {
          // local copies: stores through the data pointers cannot alias them, so the loop
          // vectorises
          const auto hl = h;
          const acc_t gsl = gs;
          const auto* gk = g[k];
          const auto* pk = p[k];
          acc_t* mk = m[k];
          acc_t* vk = v[k];
          acc_t w_sq = 0;
          acc_t u_sq = 0;
#pragma omp simd reduction(+ : w_sq, u_sq)
          for (int64_t i = s; i < e; ++i) {
            const acc_t pi = static_cast<acc_t>(pk[i]);
            const acc_t ui = stage1<acc_t>(pi, static_cast<acc_t>(gk[i]) * gsl, mk[i], vk[i], hl);
            w_sq += pi * pi;
            u_sq += ui * ui;
          }
          w_part[item] = static_cast<double>(w_sq);
          u_part[item] = static_cast<double>(u_sq);
        });
      });
  std::vector<double> w(n, 0.0);
  std::vector<double> u(n, 0.0);
  for (size_t i = 0; i < items.size(); ++i) {  // item order: fixed, whatever the scheduling
    w[items[i].tensor] += w_part[i];
    u[items[i].tensor] += u_part[i];
  }
  at::Tensor w_sq = at::empty({n}, opts.dtype(at::kDouble));
  at::Tensor u_sq = at::empty({n}, opts.dtype(at::kDouble));
  std::copy(w.begin(), w.end(), w_sq.data_ptr<double>());
  std::copy(u.begin(), u.end(), u_sq.data_ptr<double>());
  return {w_sq.to(opts.dtype()), u_sq.to(opts.dtype())};
}

void lamb_stage2_cpu(const TensorLists& lists, const at::Tensor& w_norm, const at::Tensor& u_norm,
                     double lr, double beta1, double beta2, double eps, int64_t step,
                     bool bias_correction, double weight_decay, bool adam_w_mode,
                     bool use_nvlamb, const OptTensor& lr_t, const OptTensor& step_t,
                     const OptTensor& found_inf_t, bool squared) {
  using namespace lamb;
  check_tensor_lists(lists, kStage2Depth, c10::DeviceType::CPU, "lamb_stage2");
  const int64_t n = static_cast<int64_t>(lists[0].size());
  check_per_tensor(w_norm, lists[0].size(), "lamb_stage2", "w_norm");
  check_per_tensor(u_norm, lists[0].size(), "lamb_stage2", "u_norm");
  if (n == 0 || cpu::skip_step(found_inf_t)) return;
  const at::Tensor wn = norms_in_double(w_norm, squared);
  const at::Tensor un = norms_in_double(u_norm, squared);
  const double* wnp = wn.data_ptr<double>();
  const double* unp = un.data_ptr<double>();
  const double lr_v = cpu::scalar_or(lr_t, lr);
  const double t = cpu::scalar_or(step_t, static_cast<double>(step));
  dispatch_types(
      lists[kStage2Param][0].scalar_type(), lists[kStage2Param][0].scalar_type(),
      out_dtype(lists, kStage2Depth), "lamb_stage2", [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        check_state_dtype<acc_t>(lists[kStage2ExpAvg], "lamb_stage2", "exp_avg");
        check_state_dtype<acc_t>(lists[kStage2ExpAvgSq], "lamb_stage2", "exp_avg_sq");
        // grad_averaging only sets beta3, which stage 2 does not use
        const Hyper<acc_t> h = make_hyper<acc_t>(beta1, beta2, eps, t, bias_correction,
                                                 weight_decay, true, adam_w_mode);
        auto p = cpu::pointers<typename Ty::param_t>(lists[kStage2Param]);
        auto m = cpu::pointers<acc_t>(lists[kStage2ExpAvg]);
        auto v = cpu::pointers<acc_t>(lists[kStage2ExpAvgSq]);
        std::vector<typename Ty::out_t*> o;
        if constexpr (Ty::has_out) o = cpu::pointers<typename Ty::out_t>(lists[kStage2Out]);
        cpu::with_flag(h.adam_w_mode, [&](auto adam_w) {
          cpu::apply(lists[0], [&](int64_t k, int64_t s, int64_t e) {
            // local copies, the flag a constant (see Note: vectorised CPU loops)
            auto hl = h;
            hl.adam_w_mode = decltype(adam_w)::value;
            const acc_t ratio = trust_ratio_lr<acc_t>(
                static_cast<acc_t>(lr_v), static_cast<acc_t>(wnp[k]), static_cast<acc_t>(unp[k]),
                static_cast<acc_t>(weight_decay), use_nvlamb);
            auto* __restrict pk = p[k];
            const acc_t* __restrict mk = m[k];
            const acc_t* __restrict vk = v[k];
            typename Ty::out_t* __restrict ok = Ty::has_out ? o[k] : nullptr;
            for (int64_t i = s; i < e; ++i) {
              const acc_t pi = static_cast<acc_t>(pk[i]);
              const acc_t pn = pi - ratio * update_term<acc_t>(pi, mk[i], vk[i], hl);
              pk[i] = static_cast<typename Ty::param_t>(pn);
              if constexpr (Ty::has_out) ok[i] = static_cast<typename Ty::out_t>(pn);
            }
          });
        });
      });
}

}  // namespace shardopt
