// The kernel entry points of shardopt._C, one declaration per (kernel, backend).
//
// Every kernel takes `lists`: a vector of tensor lists ("slots"); slot k holds the k-th operand of
// every tensor being updated (see the kSlot constants in each optimizer's math header). All tensors
// are contiguous, on one device, and tensors at the same position in every slot have the same numel.
// Optional "device scalars" are 1-element float32 tensors on the same device; when present they
// replace the host value (capturable / no-host-sync paths):
//   lr_t        learning rate
//   step_t      the step count t of this update (already advanced, t >= 1)
//   grad_scale_t multiplier applied to every grad element (inverse loss scale x clip coefficient)
//   found_inf_t  when nonzero the kernel changes nothing (skipped step)
//   first_run_t  (sgd) when present, replaces first_run: nonzero initialises the momentum buffers
// An optional trailing "out" slot receives the updated param cast to its dtype (fp32 master in,
// low-precision param out, same pass).
//
// LAMB is two calls so per-tensor norms can be reduced across shards in between: lamb_stage1
// updates the moments over [grad, param, exp_avg, exp_avg_sq] and returns the per-tensor sums of
// squares (w_sq, u_sq) of the param before the update and of the update term, taken in the same
// pass and deterministically (fp32; fp64 on CPU for fp64 params; zeros for a skipped step);
// lamb_stage2 recomputes the update term from [param, exp_avg, exp_avg_sq(, out)] and applies the
// trust ratio from w_norm = sqrt(w_sq), u_norm = sqrt(u_sq). The update term is never stored.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace shardopt {

using TensorList = std::vector<at::Tensor>;
using TensorLists = std::vector<TensorList>;
using OptTensor = std::optional<at::Tensor>;

#define SHARDOPT_DECLARE_KERNELS(BACKEND)                                                         \
  void adam_##BACKEND(const TensorLists& lists, double lr, double beta1, double beta2, double eps, \
                      int64_t step, bool adam_w_mode, bool bias_correction, double weight_decay,  \
                      const OptTensor& lr_t, const OptTensor& step_t,                             \
                      const OptTensor& grad_scale_t, const OptTensor& found_inf_t);               \
  void sgd_##BACKEND(const TensorLists& lists, double lr, double momentum, double dampening,      \
                     double weight_decay, bool nesterov, bool first_run, bool wd_after_momentum,  \
                     double scale, const OptTensor& lr_t, const OptTensor& grad_scale_t,          \
                     const OptTensor& found_inf_t, const OptTensor& first_run_t);                 \
  void adagrad_##BACKEND(const TensorLists& lists, double lr, double eps, double weight_decay,     \
                         bool adagrad_w_mode, const OptTensor& lr_t,                              \
                         const OptTensor& grad_scale_t, const OptTensor& found_inf_t);            \
  std::tuple<at::Tensor, at::Tensor> lamb_stage1_##BACKEND(                                       \
      const TensorLists& lists, double beta1, double beta2, double eps, int64_t step,             \
      bool bias_correction, double weight_decay, bool grad_averaging, bool adam_w_mode,           \
      const OptTensor& step_t, const OptTensor& grad_scale_t, const OptTensor& found_inf_t);      \
  void lamb_stage2_##BACKEND(const TensorLists& lists, const at::Tensor& w_norm,                  \
                             const at::Tensor& u_norm, double lr, double beta1, double beta2,     \
                             double eps, int64_t step, bool bias_correction, double weight_decay, \
                             bool adam_w_mode, bool use_nvlamb, const OptTensor& lr_t,            \
                             const OptTensor& step_t, const OptTensor& found_inf_t);              \
  void novograd_##BACKEND(const TensorLists& lists, const at::Tensor& v_norm, double lr,          \
                          double beta1, double beta2, double eps, int64_t step,                   \
                          bool bias_correction, double weight_decay, bool grad_averaging,         \
                          int64_t moment_mode, const OptTensor& lr_t, const OptTensor& step_t,    \
                          const OptTensor& grad_scale_t, const OptTensor& found_inf_t);           \
  std::tuple<at::Tensor, at::Tensor> norm_##BACKEND(const TensorList& tensors, bool max_norm);   \
  void scale_##BACKEND(const TensorLists& lists, double scale, const OptTensor& scale_t,          \
                       const at::Tensor& found_inf);

SHARDOPT_DECLARE_KERNELS(cpu)
#ifdef SHARDOPT_WITH_CUDA
SHARDOPT_DECLARE_KERNELS(cuda)
#endif

#undef SHARDOPT_DECLARE_KERNELS

}  // namespace shardopt
