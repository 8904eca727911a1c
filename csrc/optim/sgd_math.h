// SGD with momentum per-element update (docs/spec.md "FusedSGD"); used by sgd_cpu.cpp, sgd_cuda.cu.
#pragma once

#include "math_common.h"

namespace shardopt {
namespace sgd {

constexpr int kGrad = 0;
constexpr int kParam = 1;
constexpr int kMomentum = 2;
constexpr int kOut = 3;
constexpr int kDepth = 3;

template <typename T>
struct Hyper {
  T lr, momentum, dampening, weight_decay;
  bool nesterov, first_run, wd_after_momentum;
};

// The hyperparameters of one call from the host arguments (in the kernel's order).
template <typename T>
Hyper<T> make_hyper(double lr, double momentum, double dampening, double weight_decay,
                    bool nesterov, bool first_run, bool wd_after_momentum) {
  return {static_cast<T>(lr),           static_cast<T>(momentum),
          static_cast<T>(dampening),    static_cast<T>(weight_decay),
          nesterov,                     first_run,
          wd_after_momentum};
}

// g already carries the inverse loss scale.
template <typename T>
SHARDOPT_HD void update(T& p, T g, T& buf, const Hyper<T>& h) {
  if (h.weight_decay != T(0) && !h.wd_after_momentum) g += h.weight_decay * p;
  if (h.momentum != T(0)) {
    buf = h.first_run ? g : h.momentum * buf + (T(1) - h.dampening) * g;
    g = h.nesterov ? g + h.momentum * buf : buf;
  }
  if (h.weight_decay != T(0) && h.wd_after_momentum) g += h.weight_decay * p;
  p -= h.lr * g;
}

}  // namespace sgd
}  // namespace shardopt
