// Deterministic block and per-tensor reductions shared by the CUDA kernels that reduce per-chunk
// partials (norm_cuda.cu, lamb_cuda.cu): fixed-shape trees, no float atomics, so the same inputs
// give the same bits every run. A traversal writes one partial per work unit (cuda_apply.cuh's
// Chunk::unit) and, from each tensor's chunk-0 block, where the tensor's partials start; then
// reduce_kernel sums each tensor's partials in order.
#pragma once

#include "../multi_tensor/cuda_apply.cuh"

namespace shardopt {
namespace cuda {

template <typename T>
__device__ __forceinline__ T nan_max(T a, T b) {
  return (a != a || a > b) ? a : b;
}

template <typename T>
__device__ __forceinline__ T combine(T a, T b, bool max_norm) {
  return max_norm ? nan_max(a, b) : a + b;
}

// Fixed-shape tree over the block; the result is valid in thread 0. It uses one __shared__ array
// per T: a kernel that calls it twice needs a __syncthreads() between the calls.
template <typename T>
__device__ T block_reduce(T v, bool max_norm) {
  __shared__ T warp_values[kBlockSize / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = combine(v, __shfl_down_sync(0xffffffffu, v, offset), max_norm);
  }
  if (threadIdx.x % 32 == 0) warp_values[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < kBlockSize / 32 ? warp_values[threadIdx.x] : T(0);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      v = combine(v, __shfl_down_sync(0xffffffffu, v, offset), max_norm);
    }
  }
  return v;
}

// Called by thread 0 of a (tensor, chunk) block after its partial is stored: the tensor's chunk-0
// block records [first unit, number of chunks] of the tensor's partials.
template <typename C>
__device__ __forceinline__ void record_first(const C& c, int64_t* first) {
  if (c.chunk != 0) return;
  first[2 * c.tensor] = c.unit;
  first[2 * c.tensor + 1] = (c.numel + kChunkSize - 1) / kChunkSize;
}

// Block b reduces in[first[2b] .. first[2b] + first[2b+1]) into out[b]; without `first`, block 0
// reduces in[0 .. count). A tensor whose `first` entry stayed 0 (empty, or a skipped step) gets 0.
// Internal linkage: each .cu file that launches it registers its own instance.
namespace {
template <typename T>
__global__ void __launch_bounds__(kBlockSize)
    reduce_kernel(const T* in, const int64_t* first, int64_t count, T* out, bool max_norm) {
  const int64_t begin = first != nullptr ? first[2 * blockIdx.x] : 0;
  const int64_t n = first != nullptr ? first[2 * blockIdx.x + 1] : count;
  T v = T(0);
  for (int64_t i = threadIdx.x; i < n; i += kBlockSize) {
    v = combine(v, in[begin + i], max_norm);
  }
  v = block_reduce(v, max_norm);
  if (threadIdx.x == 0) out[blockIdx.x] = v;
}
}  // namespace

}  // namespace cuda
}  // namespace shardopt
