// LAMB per-element math (docs/spec.md "FusedLAMB"), in two stages so per-tensor norms of param and
// of the update can be reduced (across shards, if need be) in between. Stage 1 updates the moments
// and returns u, which the caller only squares into a per-tensor sum; stage 2 recomputes u from the
// stored p, m, v with the same update_term, so u never goes to memory. Shared by lamb_cpu.cpp and
// lamb_cuda.cu.
#pragma once

#include "math_common.h"

namespace shardopt {
namespace lamb {

// Stage 1 slots: grad (multiplied by the clip/unscale factor in the kernel), param, moments.
constexpr int kGrad = 0;
constexpr int kParam = 1;
constexpr int kExpAvg = 2;
constexpr int kExpAvgSq = 3;
constexpr int kStage1Depth = 4;
// Stage 2 slots: the param, the moments stage 1 stored, and the optional low-precision out copy.
constexpr int kStage2Param = 0;
constexpr int kStage2ExpAvg = 1;
constexpr int kStage2ExpAvgSq = 2;
constexpr int kStage2Out = 3;
constexpr int kStage2Depth = 3;

template <typename T>
struct Hyper {
  T beta1, beta2, beta3, eps, weight_decay;
  T bc1, bc2;
  bool adam_w_mode;
};

// Stores the bias corrections of step t (host step: make_hyper; device step: the CUDA op).
template <typename T>
SHARDOPT_HD void set_step(Hyper<T>& h, const BiasCorrection& bias, double t) {
  h.bc1 = static_cast<T>(bias.bc1(t));
  h.bc2 = static_cast<T>(bias.bc2(t));
}

// The hyperparameters of one call from the host arguments (in lamb_stage1's order), with the bias
// corrections of step t. beta3 (from grad_averaging) only matters to stage 1.
template <typename T>
Hyper<T> make_hyper(double beta1, double beta2, double eps, double t, bool bias_correction,
                    double weight_decay, bool grad_averaging, bool adam_w_mode) {
  Hyper<T> h{static_cast<T>(beta1),
             static_cast<T>(beta2),
             static_cast<T>(grad_averaging ? 1.0 - beta1 : 1.0),
             static_cast<T>(eps),
             static_cast<T>(weight_decay),
             T(1),
             T(1),
             adam_w_mode};
  set_step(h, BiasCorrection{beta1, beta2, bias_correction}, t);
  return h;
}

// The update term u from the param (before the update) and the updated moments. Both stages call
// it, so the u whose norm stage 1 takes is the u stage 2 applies.
template <typename T>
SHARDOPT_HD T update_term(T p, T m, T v, const Hyper<T>& h) {
  T u = (m / h.bc1) / (sqrt_of(v / h.bc2) + h.eps);
  if (h.adam_w_mode) u += h.weight_decay * p;
  return u;
}

// Returns the update term u; m and v are updated in place.
template <typename T>
SHARDOPT_HD T stage1(T p, T g, T& m, T& v, const Hyper<T>& h) {
  if (!h.adam_w_mode) g += h.weight_decay * p;
  m = h.beta1 * m + h.beta3 * g;
  v = h.beta2 * v + (T(1) - h.beta2) * g * g;
  return update_term(p, m, v, h);
}

// The grad multiplier of the built-in clipping (docs/spec.md: no eps), from the sum of squares of
// the grads as the kernel reads them and the optional inverse loss scale, in T (the dtype of the
// sum): N = sqrt(norm_sq) (times inv_scale), factor = N > max_grad_norm ? max_grad_norm / N : 1,
// times inv_scale. Each operation rounds to T in the order of the torch ops that computed it
// before it moved into the kernels (max_grad_norm / N as reciprocal(N) * max_grad_norm), so the
// kernels multiply the grads by the bits those ops gave. nan and inf norms compare false and true.
template <typename T>
SHARDOPT_HD T clip_scale(T norm_sq, T max_grad_norm, bool has_inv_scale, T inv_scale) {
  T norm = sqrt_of(norm_sq);
  if (has_inv_scale) norm = norm * inv_scale;
  const T factor = norm > max_grad_norm ? (T(1) / norm) * max_grad_norm : T(1);
  return has_inv_scale ? factor * inv_scale : factor;
}

// The per-tensor step size: lr * ||w|| / ||u|| when the trust ratio applies, else lr.
template <typename T>
SHARDOPT_HD T trust_ratio_lr(T lr, T w_norm, T u_norm, T weight_decay, bool use_nvlamb) {
  bool apply = (use_nvlamb || weight_decay != T(0)) && w_norm != T(0) && u_norm != T(0);
  return apply ? lr * (w_norm / u_norm) : lr;
}

}  // namespace lamb
}  // namespace shardopt
