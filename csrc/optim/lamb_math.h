// LAMB per-element math (SPEC.md "FusedLAMB"), in two stages so per-tensor norms of the param and
// of the update can be reduced (across shards, if need be) in between. Shared by lamb_cpu.cpp and
// lamb_cuda.cu.
#pragma once

#include "math_common.h"

namespace shardopt {
namespace lamb {

// Stage 1 slots: grad (already multiplied by the clip/unscale factor), param, moments, update out.
constexpr int kGrad = 0;
constexpr int kParam = 1;
constexpr int kExpAvg = 2;
constexpr int kExpAvgSq = 3;
constexpr int kUpdate = 4;
constexpr int kStage1Depth = 5;
// Stage 2 slots.
constexpr int kStage2Param = 0;
constexpr int kStage2Update = 1;
constexpr int kStage2Out = 2;
constexpr int kStage2Depth = 2;

template <typename T>
struct Hyper {
  T beta1, beta2, beta3, eps, weight_decay;
  T bc1, bc2;
  bool adam_w_mode;
};

// Returns the update term u; m and v are updated in place.
template <typename T>
SHARDOPT_HD T stage1(T p, T g, T& m, T& v, const Hyper<T>& h) {
  if (!h.adam_w_mode) g += h.weight_decay * p;
  m = h.beta1 * m + h.beta3 * g;
  v = h.beta2 * v + (T(1) - h.beta2) * g * g;
  T u = (m / h.bc1) / (sqrt_of(v / h.bc2) + h.eps);
  if (h.adam_w_mode) u += h.weight_decay * p;
  return u;
}

// The per-tensor step size: lr * ||w|| / ||u|| when the trust ratio applies, else lr.
template <typename T>
SHARDOPT_HD T trust_ratio_lr(T lr, T w_norm, T u_norm, T weight_decay, bool use_nvlamb) {
  bool apply = (use_nvlamb || weight_decay != T(0)) && w_norm != T(0) && u_norm != T(0);
  return apply ? lr * (w_norm / u_norm) : lr;
}

}  // namespace lamb
}  // namespace shardopt
