// The kernel entry points of shardopt._C, one declaration per (kernel, backend), from the list in
// kernels.def.
//
// Every kernel takes `lists`: a vector of tensor lists ("slots"); slot k holds the k-th operand of
// every tensor being updated (see the kSlot constants in each optimizer's math header). All tensors
// are on one device and dense (any layout, any storage offset: each is read as the flat array of
// its elements), and tensors at the same position in every slot have the same numel and layout
// (multi_tensor/checks.h). A slot has one dtype, except in norm and scale, which dispatch per tensor.
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
// adam_compact and adam_blockwise take 7 lists [grads, params, remainders, exp_avg, exp_avg_sq,
// exp_avg_scales, exp_avg_sq_scales] with compact state (docs/spec.md "Compact state formats";
// adam_compact_math.h): the remainders list may be empty, the scale lists are empty for
// adam_compact and hold ceil(numel / 256) fp32 scales per tensor for adam_blockwise; no out slot.
//
// LAMB is two calls so per-tensor norms can be reduced across shards in between: lamb_stage1
// updates the moments over [grad, param, exp_avg, exp_avg_sq] and returns the per-tensor sums of
// squares (w_sq, u_sq) of the param before the update and of the update term, taken in the same
// pass and deterministically (fp32; fp64 on CPU for fp64 params; zeros for a skipped step);
// lamb_stage2 recomputes the update term from [param, exp_avg, exp_avg_sq(, out)] and applies the
// trust ratio from w_norm = sqrt(w_sq), u_norm = sqrt(u_sq) (or from the sums themselves with
// squared=true). The update term is never stored. The built-in clipping can be left to stage 1:
// given grad_norm_sq_t (the grads' sum of squares, a device scalar) and max_grad_norm > 0, it
// multiplies the grads by the clip factor (times grad_scale_t) it computes on the device.
//
// novograd_step is NovoGrad's whole step in one call: the per-tensor grad norms, the per-tensor
// second moments v blended with them in place, then the element update over [grad, param,
// exp_avg(, out)]. Every argument is checked before anything of the caller's is written.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace shardopt {

using TensorList = std::vector<at::Tensor>;
using TensorLists = std::vector<TensorList>;
using OptTensor = std::optional<at::Tensor>;
using TensorPair = std::tuple<at::Tensor, at::Tensor>;

// <name>_cpu and, with CUDA, <name>_cuda for every kernel of kernels.def.
#define SHARDOPT_KERNEL(name, ret, params, ...) ret name##_cpu params;
#include "kernels.def"
#undef SHARDOPT_KERNEL

#ifdef SHARDOPT_WITH_CUDA
#define SHARDOPT_KERNEL(name, ret, params, ...) ret name##_cuda params;
#include "kernels.def"
#undef SHARDOPT_KERNEL
// Not a multi-tensor kernel (no spec, CUDA only): D = alpha * a @ b + beta * c, batched, with D
// a new tensor (csrc/linalg/bmm_add_cuda.cu; Python: shardopt.kernels.matmul)
at::Tensor bmm_add_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                        double alpha, double beta);
// the same for a product known to be symmetric (n x n): its lower block rows in `blocks` bands,
// then mirrored (Note: symmetric products in csrc/linalg/bmm_add_cuda.cu); symmetric_bmm is
// alpha * a @ b alone
at::Tensor symmetric_bmm_add_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                                  double alpha, double beta, int64_t blocks);
at::Tensor symmetric_bmm_cuda(const at::Tensor& a, const at::Tensor& b, double alpha,
                              int64_t blocks);
#endif

}  // namespace shardopt
