// Shared by every <name>_math.h: the host/device qualifier, the acc-type helpers and the bias
// corrections.
#pragma once

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define SHARDOPT_HD __host__ __device__ __forceinline__
#else
#define SHARDOPT_HD inline
#endif

namespace shardopt {

// sqrt in T's own precision on host and device (an unqualified host sqrt(float) would be the
// double ::sqrt, which neither vectorises nor matches the device).
template <typename T>
SHARDOPT_HD T sqrt_of(T x) {
#if defined(__CUDA_ARCH__)
  return ::sqrt(x);
#else
  return std::sqrt(x);
#endif
}

// 1 - beta^t, or 1 when bias correction is off. Host and device (step may live on the device).
template <typename T>
SHARDOPT_HD T bias_correction(T beta, T step, bool enabled) {
  return enabled ? T(1) - pow(beta, step) : T(1);
}

// The step-dependent part of the Adam-style optimizers (Adam, LAMB, NovoGrad): the bias corrections
// of step t, in double. Each such math header has a set_step(Hyper<T>&, const BiasCorrection&,
// double t) that stores them in its Hyper; its make_hyper calls it for the host step, and the CUDA
// ops call it again per block when the step is a device scalar (cuda::OpBase::device_step).
struct BiasCorrection {
  double beta1, beta2;
  bool enabled;

  SHARDOPT_HD double bc1(double t) const { return bias_correction(beta1, t, enabled); }
  SHARDOPT_HD double bc2(double t) const { return bias_correction(beta2, t, enabled); }
};

}  // namespace shardopt
