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
  // update_rounded only: the alphas of torch's buf.add_(g, alpha=1 - dampening) and of nesterov's
  // g.add(buf, alpha=momentum) (round_alphas may round them apart from the momentum of buf.mul_)
  T damp_alpha, nesterov_alpha;
  bool nesterov, first_run, wd_after_momentum;
};

// The hyperparameters of one call from the host arguments (in the kernel's order).
template <typename T>
Hyper<T> make_hyper(double lr, double momentum, double dampening, double weight_decay,
                    bool nesterov, bool first_run, bool wd_after_momentum) {
  return {static_cast<T>(lr),
          static_cast<T>(momentum),
          static_cast<T>(dampening),
          static_cast<T>(weight_decay),
          static_cast<T>(1.0 - dampening),
          static_cast<T>(momentum),
          nesterov,
          first_run,
          wd_after_momentum};
}

// g already carries the inverse loss scale. fp32 math (fp64 for fp64 params), rounded to the
// storage types once, when stored.
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

// x rounded to the storage type R, back in T.
template <typename R, typename T>
SHARDOPT_HD T round_to(T x) {
  return static_cast<T>(static_cast<R>(x));
}

// a + alpha * b as torch's add(a, b, alpha=alpha) computes it in fp32: one fma on CUDA (ATen's
// AddFunctor, contracted by nvcc); on the CPU alpha is rounded to the tensor dtype first
// (round_alphas), so alpha * b is exact in fp32 and an fma gives the same bits.
template <typename T>
SHARDOPT_HD T add_scaled(T a, T alpha, T b) {
#if defined(__CUDA_ARCH__)
  return ::fma(alpha, b, a);
#else
  return a + alpha * b;
#endif
}

// torch.optim.SGD (_single_tensor_sgd) on params, grads and momentum buffers of the fp16/bf16
// dtype R: each of its tensor ops computes in fp32 and rounds its result to R, so this rounds at
// the same points: g.add(p, alpha=wd), buf.mul_(momentum), buf.add_(g, alpha=1 - dampening),
// g.add(buf, alpha=momentum) (nesterov) and p.add_(g, alpha=-lr). T is fp32.
template <typename R, typename T>
SHARDOPT_HD void update_rounded(T& p, T g, T& buf, const Hyper<T>& h) {
  g = round_to<R>(g);  // the grad in its own dtype (exact unless unscaled by a non-power of 2)
  if (h.weight_decay != T(0) && !h.wd_after_momentum) {
    g = round_to<R>(add_scaled(g, h.weight_decay, p));
  }
  if (h.momentum != T(0)) {
    buf = h.first_run ? g : round_to<R>(add_scaled(round_to<R>(buf * h.momentum), h.damp_alpha, g));
    g = h.nesterov ? round_to<R>(add_scaled(g, h.nesterov_alpha, buf)) : buf;
  }
  if (h.weight_decay != T(0) && h.wd_after_momentum) {
    g = round_to<R>(add_scaled(g, h.weight_decay, p));
  }
  p = round_to<R>(add_scaled(p, -h.lr, g));
}

// Host, CPU kernel: ATen's CPU add converts its alpha to the tensor dtype R (the CUDA add keeps
// it in fp32), so the alphas update_rounded adds with are rounded to R as torch's CPU ops round
// them. buf.mul_'s momentum stays fp32 on both.
template <typename R, typename T>
void round_alphas(Hyper<T>& h) {
  h.lr = round_to<R>(h.lr);
  h.weight_decay = round_to<R>(h.weight_decay);
  h.damp_alpha = round_to<R>(h.damp_alpha);
  h.nesterov_alpha = round_to<R>(h.nesterov_alpha);
}

}  // namespace sgd
}  // namespace shardopt
