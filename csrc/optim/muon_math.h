// Muon's elementwise parts (docs/spec.md "FusedMuon"): the momentum with the Nesterov mix, and
// the decay with the apply. Used by muon_cpu.cpp and muon_cuda.cu. Newton-Schulz between the two
// is a chain of batched matmuls (shardopt/algorithms/muon.py).
#pragma once

#include "math_common.h"

namespace shardopt {
namespace muon {

// muon_momentum's slots
constexpr int kGrad = 0;
constexpr int kBuf = 1;
constexpr int kMix = 2;
constexpr int kMomentumDepth = 3;
// muon_apply's slots
constexpr int kParam = 0;
constexpr int kUpdate = 1;
constexpr int kOut = 2;
constexpr int kApplyDepth = 2;

// x rounded to the storage type R, back in T.
template <typename R, typename T>
SHARDOPT_HD T round_to(T x) {
  return static_cast<T>(static_cast<R>(x));
}

template <typename T>
SHARDOPT_HD T fma_of(T a, T b, T c) {
#if defined(__CUDA_ARCH__)
  return ::fma(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// One lerp(self, end, w) of torch's (ATen/native/Lerp.h): fma(w, end - self, self) for |w| < 0.5,
// else fma(w - 1, end - self, end); `coeff` and `small` are that choice, made on the host.
template <typename T>
SHARDOPT_HD T lerp(T self, T end, T coeff, bool small) {
  return fma_of(coeff, end - self, small ? self : end);
}

template <typename T>
struct MomentumHyper {
  T buf_coeff, mix_coeff;      // the lerp coefficients of buf.lerp_(g, 1 - μ) and g.lerp(buf, μ)
  bool buf_small, mix_small;   // which lerp form each takes
  bool nesterov;
};

template <typename T>
SHARDOPT_HD void lerp_coeff(double w, T& coeff, bool& small) {
  const T wt = static_cast<T>(w);  // torch's opmath weight
  small = (wt < T(0) ? -wt : wt) < T(0.5);
  coeff = small ? wt : wt - T(1);
}

template <typename T>
MomentumHyper<T> make_momentum_hyper(double momentum, bool nesterov) {
  MomentumHyper<T> h{};
  lerp_coeff<T>(1.0 - momentum, h.buf_coeff, h.buf_small);
  lerp_coeff<T>(momentum, h.mix_coeff, h.mix_small);
  h.nesterov = nesterov;
  return h;
}

// torch.optim.Muon's buf.lerp_(g, 1 - μ) and (nesterov) mix = g.lerp(buf, μ), else mix = buf, each
// rounded to the buffer's storage type B as torch's tensors are; the caller stores mix in ns_dtype.
template <typename B, typename T>
SHARDOPT_HD void momentum(T g, T& buf, T& mix, const MomentumHyper<T>& h) {
  g = round_to<B>(g);
  buf = round_to<B>(lerp(buf, g, h.buf_coeff, h.buf_small));
  mix = h.nesterov ? round_to<B>(lerp(g, buf, h.mix_coeff, h.mix_small)) : buf;
}

template <typename T>
struct ApplyHyper {
  T decay;  // 1 - lr * weight_decay (the unadjusted lr)
  T alpha;  // -lr * lr_ratio
};

template <typename T>
SHARDOPT_HD ApplyHyper<T> make_apply_hyper(double lr, double weight_decay, double lr_ratio) {
  return {static_cast<T>(1.0 - lr * weight_decay), static_cast<T>(-(lr * lr_ratio))};
}

// torch.optim.Muon's p.mul_(decay) then p.add_(update, alpha=alpha) on a param stored as P: two
// roundings to P, the add one fma (as ATen's add kernels compute it).
template <typename P, typename T>
SHARDOPT_HD void apply(T& p, T update, const ApplyHyper<T>& h) {
  p = round_to<P>(p * h.decay);
  p = round_to<P>(fma_of(h.alpha, update, p));
}

}  // namespace muon
}  // namespace shardopt
