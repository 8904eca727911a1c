// Adagrad per-element update (docs/spec.md "FusedAdagrad"); used by adagrad_{cpu.cpp,cuda.cu}.
#pragma once

#include "math_common.h"

namespace shardopt {
namespace adagrad {

constexpr int kGrad = 0;
constexpr int kParam = 1;
constexpr int kSum = 2;
constexpr int kOut = 3;
constexpr int kDepth = 3;

template <typename T>
struct Hyper {
  T lr, eps, weight_decay;
  bool adagrad_w_mode;
};

// The hyperparameters of one call from the host arguments (in the kernel's order).
template <typename T>
Hyper<T> make_hyper(double lr, double eps, double weight_decay, bool adagrad_w_mode) {
  return {static_cast<T>(lr), static_cast<T>(eps), static_cast<T>(weight_decay), adagrad_w_mode};
}

template <typename T>
SHARDOPT_HD void update(T& p, T g, T& h_sum, const Hyper<T>& h) {
  if (!h.adagrad_w_mode) g += h.weight_decay * p;
  h_sum += g * g;
  T u = g / (sqrt_of(h_sum) + h.eps);
  if (h.adagrad_w_mode) u += h.weight_decay * p;
  p -= h.lr * u;
}

}  // namespace adagrad
}  // namespace shardopt
