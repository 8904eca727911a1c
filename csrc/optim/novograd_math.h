// NovoGrad element update (docs/spec.md "FusedNovoGrad"). The per-tensor second moment (a norm) is
// updated outside the kernel on a small vector; the kernel receives it per tensor. Shared by
// novograd_cpu.cpp and novograd_cuda.cu.
#pragma once

#include "math_common.h"

namespace shardopt {
namespace novograd {

constexpr int kGrad = 0;
constexpr int kParam = 1;
constexpr int kExpAvg = 2;
constexpr int kOut = 3;
constexpr int kDepth = 3;

// moment_mode 0 = reg_inside_moment=True, 1 = reg_inside_moment=False (Apex's numbering).
template <typename T>
struct Hyper {
  T lr, beta1, beta3, eps, weight_decay;
  T bc1, bc2_sqrt;  // 1 - beta1^t and sqrt(1 - beta2^t) (1 without bias correction)
  int moment_mode;
};

// denom = v / bc2_sqrt + eps, computed once per tensor by the caller.
template <typename T>
SHARDOPT_HD void update(T& p, T g, T& m, T denom, const Hyper<T>& h) {
  if (h.moment_mode == 0) {
    g = g / denom + h.weight_decay * p;
    m = h.beta1 * m + h.beta3 * g;
    p -= h.lr * (m / h.bc1);
  } else {
    m = h.beta1 * m + h.beta3 * g;
    p -= h.lr * ((m / h.bc1) / denom + h.weight_decay * p);
  }
}

}  // namespace novograd
}  // namespace shardopt
