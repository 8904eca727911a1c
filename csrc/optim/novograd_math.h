// NovoGrad (docs/spec.md "FusedNovoGrad"): the per-tensor second-moment blend and the element
// update. The second moment is one number per tensor (a norm), kept on a small vector: novograd
// takes it already blended (the distributed class blends the all-reduced norms itself),
// novograd_step takes the grads' norms in the same call and blends the vector in place before the
// update. Shared by novograd_cpu.cpp and novograd_cuda.cu.
#pragma once

#include <string>

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

// Stores the bias corrections of step t (host step: make_hyper; device step: the CUDA op).
template <typename T>
SHARDOPT_HD void set_step(Hyper<T>& h, const BiasCorrection& bias, double t) {
  h.bc1 = static_cast<T>(bias.bc1(t));
  h.bc2_sqrt = static_cast<T>(sqrt_of(bias.bc2(t)));
}

// Host: moment_mode is 0 or 1.
inline void check_moment_mode(int64_t moment_mode) {
  TORCH_CHECK(moment_mode == 0 || moment_mode == 1, "novograd: moment_mode must be 0 or 1, got ",
              std::to_string(moment_mode));
}

// The hyperparameters of one call from the host arguments (in the kernel's order), with the bias
// corrections of step t.
template <typename T>
Hyper<T> make_hyper(double lr, double beta1, double beta2, double eps, double t,
                    bool bias_correction, double weight_decay, bool grad_averaging,
                    int64_t moment_mode) {
  Hyper<T> h{static_cast<T>(lr),
             static_cast<T>(beta1),
             static_cast<T>(grad_averaging ? 1.0 - beta1 : 1.0),
             static_cast<T>(eps),
             static_cast<T>(weight_decay),
             T(1),
             T(1),
             static_cast<int>(moment_mode)};
  set_step(h, BiasCorrection{beta1, beta2, bias_correction}, t);
  return h;
}

// The second-moment blend of one tensor: its old v, its grad norm n (sqrt of the sum of squares,
// or max |g|) and whether this is the param's first update.
struct Blend {
  double beta2;
  bool l2;         // norm_type 2 (else 0, the infinity norm)
  bool init_zero;  // the first update blends from v = 0 instead of starting at n

  template <typename T>
  SHARDOPT_HD T operator()(T v, T n, bool fresh) const {
    // the constants and each operation round to T in the order of the torch ops this replaced
    // (shardopt.optimizers.novograd.blend_second_moment), so both give the same bits
    const T b2 = static_cast<T>(beta2);
    const T one_minus_b2 = static_cast<T>(1.0 - beta2);
    if (fresh) {
      if (!init_zero) return n;
      return l2 ? static_cast<T>(sqrt_of(1.0 - beta2)) * n : one_minus_b2 * n;
    }
    if (l2) {
      const T old_sq = (b2 * v) * v;
      const T new_sq = (one_minus_b2 * n) * n;
      return sqrt_of(old_sq + new_sq);
    }
    return b2 * v + one_minus_b2 * n;
  }
};

inline void check_norm_type(int64_t norm_type, const char* name) {
  TORCH_CHECK(norm_type == 0 || norm_type == 2, name, ": norm_type must be 2 or 0, got ",
              std::to_string(norm_type));
}

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
