// Shared by every <name>_math.h: the host/device qualifier and the acc-type helpers.
#pragma once

#include <cmath>

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

}  // namespace shardopt
