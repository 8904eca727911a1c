// LAMB on CPU tensors: stage 1 (moments, update term) and stage 2 (trust ratio, apply) over
// lamb_math.h. Per-tensor norms between the stages come from norm_cpu (or across shards).
#include "../kernels.h"
#include "../multi_tensor/cpu_apply.h"
#include "../multi_tensor/dispatch.h"
#include "lamb_math.h"

namespace shardopt {

void lamb_stage1_cpu(const TensorLists& lists, double beta1, double beta2, double eps,
                     int64_t step, bool bias_correction, double weight_decay, bool grad_averaging,
                     bool adam_w_mode, const OptTensor& step_t, const OptTensor& grad_scale_t,
                     const OptTensor& found_inf_t) {
  using namespace lamb;
  TORCH_CHECK(lists.size() == kStage1Depth, "lamb_stage1: expected ", kStage1Depth, " lists");
  check_tensor_lists(lists, kStage1Depth, c10::DeviceType::CPU, "lamb_stage1");
  if (lists[0].empty() || cpu::skip_step(found_inf_t)) return;
  const double t = cpu::scalar_or(step_t, static_cast<double>(step));
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), std::nullopt, "lamb_stage1",
      [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        cpu::check_state_dtype<acc_t>(lists[kExpAvg], "lamb_stage1", "exp_avg");
        cpu::check_state_dtype<acc_t>(lists[kExpAvgSq], "lamb_stage1", "exp_avg_sq");
        cpu::check_state_dtype<acc_t>(lists[kUpdate], "lamb_stage1", "update");
        const Hyper<acc_t> h{static_cast<acc_t>(beta1),
                             static_cast<acc_t>(beta2),
                             static_cast<acc_t>(grad_averaging ? 1.0 - beta1 : 1.0),
                             static_cast<acc_t>(eps),
                             static_cast<acc_t>(weight_decay),
                             static_cast<acc_t>(shardopt::bias_correction(beta1, t, bias_correction)),
                             static_cast<acc_t>(shardopt::bias_correction(beta2, t, bias_correction)),
                             adam_w_mode};
        const acc_t gs = static_cast<acc_t>(cpu::scalar_or(grad_scale_t, 1.0));
        auto g = cpu::pointers<typename Ty::grad_t>(lists[kGrad]);
        auto p = cpu::pointers<typename Ty::param_t>(lists[kParam]);
        auto m = cpu::pointers<acc_t>(lists[kExpAvg]);
        auto v = cpu::pointers<acc_t>(lists[kExpAvgSq]);
        auto u = cpu::pointers<acc_t>(lists[kUpdate]);
        cpu::apply(lists[0], [&](int64_t k, int64_t s, int64_t e) {
          // local copies: stores through the data pointers cannot alias them, so the loop
          // vectorises
          const auto hl = h;
          const acc_t gsl = gs;
          (void)gsl;
          auto* gk = g[k];
          auto* pk = p[k];
          acc_t* mk = m[k];
          acc_t* vk = v[k];
          acc_t* uk = u[k];  // may alias gk (fp32 grads): each element is read before written
          for (int64_t i = s; i < e; ++i) {
            const acc_t gi = static_cast<acc_t>(gk[i]) * gsl;
            uk[i] = stage1<acc_t>(static_cast<acc_t>(pk[i]), gi, mk[i], vk[i], hl);
          }
        });
      });
}

void lamb_stage2_cpu(const TensorLists& lists, const at::Tensor& w_norm, const at::Tensor& u_norm,
                     double lr, double weight_decay, bool use_nvlamb, const OptTensor& lr_t,
                     const OptTensor& found_inf_t) {
  using namespace lamb;
  check_tensor_lists(lists, kStage2Depth, c10::DeviceType::CPU, "lamb_stage2");
  const int64_t n = static_cast<int64_t>(lists[0].size());
  TORCH_CHECK(w_norm.numel() == n && u_norm.numel() == n, "lamb_stage2: w_norm and u_norm need ",
              n, " entries, got ", w_norm.numel(), " and ", u_norm.numel());
  if (n == 0 || cpu::skip_step(found_inf_t)) return;
  const at::Tensor wn = w_norm.to(at::kDouble).contiguous();
  const at::Tensor un = u_norm.to(at::kDouble).contiguous();
  const double* wnp = wn.data_ptr<double>();
  const double* unp = un.data_ptr<double>();
  const double lr_v = cpu::scalar_or(lr_t, lr);
  dispatch_types(
      lists[kStage2Param][0].scalar_type(), lists[kStage2Param][0].scalar_type(),
      out_dtype(lists, kStage2Depth), "lamb_stage2", [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        cpu::check_state_dtype<acc_t>(lists[kStage2Update], "lamb_stage2", "update");
        auto p = cpu::pointers<typename Ty::param_t>(lists[kStage2Param]);
        auto u = cpu::pointers<acc_t>(lists[kStage2Update]);
        std::vector<typename Ty::out_t*> o;
        if constexpr (Ty::has_out) o = cpu::pointers<typename Ty::out_t>(lists[kStage2Out]);
        cpu::apply(lists[0], [&](int64_t k, int64_t s, int64_t e) {
          const acc_t ratio = trust_ratio_lr<acc_t>(
              static_cast<acc_t>(lr_v), static_cast<acc_t>(wnp[k]), static_cast<acc_t>(unp[k]),
              static_cast<acc_t>(weight_decay), use_nvlamb);
          auto* pk = p[k];
          const acc_t* uk = u[k];
          typename Ty::out_t* ok = Ty::has_out ? o[k] : nullptr;
#pragma omp simd
          for (int64_t i = s; i < e; ++i) {
            const acc_t pi = static_cast<acc_t>(pk[i]) - ratio * uk[i];
            pk[i] = static_cast<typename Ty::param_t>(pi);
            if constexpr (Ty::has_out) ok[i] = static_cast<typename Ty::out_t>(pi);
          }
        });
      });
}

}  // namespace shardopt
