// Adam / AdamW per-element update (docs/spec.md "FusedAdam"); used by adam_cpu.cpp, adam_cuda.cu.
#pragma once

#include "math_common.h"

namespace shardopt {
namespace adam {

// Tensor-list slots of the adam kernel.
constexpr int kGrad = 0;
constexpr int kParam = 1;
constexpr int kExpAvg = 2;
constexpr int kExpAvgSq = 3;
constexpr int kOut = 4;  // optional low-precision copy of the updated param
constexpr int kDepth = 4;

template <typename T>
struct Hyper {
  T lr, beta1, beta2, eps, weight_decay;
  T bc1, bc2;  // 1 - beta^t (1 when bias correction is off)
  bool adam_w_mode;
};

template <typename T>
SHARDOPT_HD void update(T& p, T g, T& m, T& v, const Hyper<T>& h) {
  if (!h.adam_w_mode) g += h.weight_decay * p;
  m = h.beta1 * m + (T(1) - h.beta1) * g;
  v = h.beta2 * v + (T(1) - h.beta2) * g * g;
  T u = (m / h.bc1) / (sqrt_of(v / h.bc2) + h.eps);
  if (h.adam_w_mode) u += h.weight_decay * p;
  p -= h.lr * u;
}

}  // namespace adam
}  // namespace shardopt
