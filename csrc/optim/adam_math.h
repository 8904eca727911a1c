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

// Stores the bias corrections of step t (host step: make_hyper; device step: the CUDA op).
template <typename T>
SHARDOPT_HD void set_step(Hyper<T>& h, const BiasCorrection& bias, double t) {
  h.bc1 = static_cast<T>(bias.bc1(t));
  h.bc2 = static_cast<T>(bias.bc2(t));
}

// The hyperparameters of one call from the host arguments (in the kernel's order), with the bias
// corrections of step t.
template <typename T>
Hyper<T> make_hyper(double lr, double beta1, double beta2, double eps, double t, bool adam_w_mode,
                    bool bias_correction, double weight_decay) {
  Hyper<T> h{static_cast<T>(lr),
             static_cast<T>(beta1),
             static_cast<T>(beta2),
             static_cast<T>(eps),
             static_cast<T>(weight_decay),
             T(1),
             T(1),
             adam_w_mode};
  set_step(h, BiasCorrection{beta1, beta2, bias_correction}, t);
  return h;
}

// update() in three stages, for kernels that evaluate the divisions their own way
// (adam_blockwise_cuda.cu: the same operations, bit for bit): the moments, the direction
// (m / bc1) / (sqrt(v / bc2) + eps), and the step of p along it.
template <typename T>
SHARDOPT_HD void moments(T p, T g, T& m, T& v, const Hyper<T>& h) {
  if (!h.adam_w_mode) g += h.weight_decay * p;
  m = h.beta1 * m + (T(1) - h.beta1) * g;
  v = h.beta2 * v + (T(1) - h.beta2) * g * g;
}

template <typename T>
SHARDOPT_HD T direction(T m, T v, const Hyper<T>& h) {
  return (m / h.bc1) / (sqrt_of(v / h.bc2) + h.eps);
}

template <typename T>
SHARDOPT_HD void apply_step(T& p, T u, const Hyper<T>& h) {
  if (h.adam_w_mode) u += h.weight_decay * p;
  p -= h.lr * u;
}

template <typename T>
SHARDOPT_HD void update(T& p, T g, T& m, T& v, const Hyper<T>& h) {
  moments(p, g, m, v, h);
  apply_step(p, direction(m, v, h), h);
}

}  // namespace adam
}  // namespace shardopt
