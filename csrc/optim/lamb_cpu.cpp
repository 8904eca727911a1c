// LAMB on CPU tensors over lamb_math.h, in two passes. Stage 1 updates the moments and returns the
// per-tensor sums of squares of the param (before the update) and of the update term u, taken in
// the same pass and deterministically as norm_cpu does: each work item's partials go to its own
// slot and are combined per tensor in item order, so the sums do not depend on the thread count.
// Stage 2 recomputes u from p, m, v and applies the trust ratio; u is never stored. Stage 1 can
// take the clip factor from the grads' sum of squares, stage 2 the sums of squares themselves.
// With cuda_order the sums are taken in the CUDA kernel's order instead (norm/cuda_order_cpu.h):
// one work item per CUDA chunk, whose squares go to a scratch row and are summed as the CUDA
// block does, so a CPU update on a CUDA job (offload) gets the CUDA kernel's bits.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "../kernels.h"
#include "../multi_tensor/cpu_apply.h"
#include "../multi_tensor/dispatch.h"
#include "../norm/cuda_order_cpu.h"
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

// Stage 1's hyperparameters in acc_t, once its moments are checked to be acc_t (both traversals).
template <typename acc_t>
lamb::Hyper<acc_t> stage1_hyper(const TensorLists& lists, double beta1, double beta2, double eps,
                                double t, bool bias_correction, double weight_decay,
                                bool grad_averaging, bool adam_w_mode) {
  check_state_dtype<acc_t>(lists[lamb::kExpAvg], "lamb_stage1", "exp_avg");
  check_state_dtype<acc_t>(lists[lamb::kExpAvgSq], "lamb_stage1", "exp_avg_sq");
  return lamb::make_hyper<acc_t>(beta1, beta2, eps, t, bias_correction, weight_decay,
                                 grad_averaging, adam_w_mode);
}

// lamb_stage1 with the sums in the CUDA kernel's order (see norm/cuda_order_cpu.h): the moments
// as in the default path, each CUDA chunk's squares of p and u into scratch rows (rounded as the
// CUDA kernel rounds them), summed per chunk as its block does, then per tensor as reduce_kernel.
std::tuple<at::Tensor, at::Tensor> stage1_cuda_order(const TensorLists& lists, double beta1,
                                                     double beta2, double eps, double t,
                                                     bool bias_correction, double weight_decay,
                                                     bool grad_averaging, bool adam_w_mode,
                                                     double grad_scale,
                                                     const at::TensorOptions& opts) {
  using namespace lamb;
  const int64_t n = static_cast<int64_t>(lists[0].size());
  std::vector<cpu::WorkItem> items;  // one per CUDA chunk, each tensor's consecutively
  std::vector<int64_t> first(n + 1, 0);
  for (int64_t k = 0; k < n; ++k) {
    first[k] = static_cast<int64_t>(items.size());
    const int64_t numel = lists[0][k].numel();
    for (int64_t s = 0; s < numel; s += cuda_order::kChunk) {
      items.push_back({k, s, std::min(s + cuda_order::kChunk, numel)});
    }
  }
  first[n] = static_cast<int64_t>(items.size());
  // fp32, as the CUDA kernel returns them (fp64 params too)
  at::Tensor w_sq = at::empty({n}, opts.dtype(at::kFloat));
  at::Tensor u_sq = at::empty({n}, opts.dtype(at::kFloat));
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), std::nullopt, "lamb_stage1",
      [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        using grad_t = typename Ty::grad_t;
        using param_t = typename Ty::param_t;
        const Hyper<acc_t> h = stage1_hyper<acc_t>(lists, beta1, beta2, eps, t, bias_correction,
                                                   weight_decay, grad_averaging, adam_w_mode);
        const acc_t gs = static_cast<acc_t>(grad_scale);
        // the CUDA traversal's group: 16 bytes of the widest slot
        const int g = 16 / static_cast<int>(std::max({sizeof(grad_t), sizeof(param_t),
                                                      sizeof(acc_t)}));
        const std::vector<int> sizes{sizeof(grad_t), sizeof(param_t), sizeof(acc_t),
                                     sizeof(acc_t)};
        auto gp = cpu::pointers<grad_t>(lists[kGrad]);
        auto pp = cpu::pointers<param_t>(lists[kParam]);
        auto mp = cpu::pointers<acc_t>(lists[kExpAvg]);
        auto vp = cpu::pointers<acc_t>(lists[kExpAvgSq]);
        std::vector<acc_t> w_part(items.size()), u_part(items.size());
        cpu::apply(items, [&](int64_t item, int64_t k, int64_t s, int64_t e) {
          const auto hl = h;
          const acc_t gsl = gs;
          const grad_t* gk = gp[k] + s;
          const param_t* pk = pp[k] + s;
          acc_t* mk = mp[k] + s;
          acc_t* vk = vp[k] + s;
          const int64_t len = e - s;
          thread_local std::vector<acc_t> w_row, u_row;
          w_row.resize(cuda_order::kChunk);
          u_row.resize(cuda_order::kChunk);
          acc_t* wr = w_row.data();
          acc_t* ur = u_row.data();
          for (int64_t i = 0; i < len; ++i) {
            const acc_t pi = static_cast<acc_t>(pk[i]);
            const acc_t ui = stage1<acc_t>(pi, static_cast<acc_t>(gk[i]) * gsl, mk[i], vk[i], hl);
            wr[i] = pi * pi;
            ur[i] = ui * ui;
          }
          const std::vector<uintptr_t> addr{
              reinterpret_cast<uintptr_t>(gk), reinterpret_cast<uintptr_t>(pk),
              reinterpret_cast<uintptr_t>(mk), reinterpret_cast<uintptr_t>(vk)};
          const int head = cuda_order::aligned_head(addr, sizes, g);
          w_part[item] = cuda_order::chunk_sum(wr, len, head, g);
          u_part[item] = cuda_order::chunk_sum(ur, len, head, g);
        });
        // per tensor as reduce_kernel, in acc_t, then fp32 as the CUDA kernel returns them
        at::Tensor sums = at::empty({2, n}, opts.dtype(c10::CppTypeToScalarType<acc_t>::value));
        acc_t* out = sums.data_ptr<acc_t>();
        for (int64_t k = 0; k < n; ++k) {
          const int64_t count = first[k + 1] - first[k];
          out[k] = cuda_order::partials_sum(w_part.data() + first[k], count);
          out[n + k] = cuda_order::partials_sum(u_part.data() + first[k], count);
        }
        sums = sums.to(at::kFloat);
        w_sq.copy_(sums[0]);
        u_sq.copy_(sums[1]);
      });
  return {w_sq, u_sq};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> lamb_stage1_cpu(
    const TensorLists& lists, double beta1, double beta2, double eps, int64_t step,
    bool bias_correction, double weight_decay, bool grad_averaging, bool adam_w_mode,
    const OptTensor& step_t, const OptTensor& grad_scale_t, const OptTensor& found_inf_t,
    const OptTensor& grad_norm_sq_t, double max_grad_norm, bool cuda_order) {
  using namespace lamb;
  check_tensor_lists_no_out(lists, kStage1Depth, c10::DeviceType::CPU, "lamb_stage1");
  const int64_t n = static_cast<int64_t>(lists[0].size());
  // fp64 sums for fp64 params, else fp32 (as norm_cpu)
  const bool fp64 = n > 0 && lists[kParam][0].scalar_type() == at::kDouble;
  const auto opts = at::TensorOptions().dtype(fp64 ? at::kDouble : at::kFloat);
  if (n == 0 || cpu::skip_step(found_inf_t)) return {at::zeros({n}, opts), at::zeros({n}, opts)};
  const double t = cpu::scalar_or(step_t, static_cast<double>(step));
  const double grad_scale = clipped_grad_scale(grad_scale_t, grad_norm_sq_t, max_grad_norm);
  if (cuda_order) {
    return stage1_cuda_order(lists, beta1, beta2, eps, t, bias_correction, weight_decay,
                             grad_averaging, adam_w_mode, grad_scale, opts);
  }
  const auto items = cpu::work_items(lists[0]);
  std::vector<double> w_part(items.size(), 0.0);
  std::vector<double> u_part(items.size(), 0.0);
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), std::nullopt, "lamb_stage1",
      [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        const Hyper<acc_t> h = stage1_hyper<acc_t>(lists, beta1, beta2, eps, t, bias_correction,
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
