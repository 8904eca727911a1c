// The launch configuration of adam_blockwise_cuda.cu: its tuning (Config, the build's
// DefaultConfig) in one place, and the occupancy and SM counts the grid is sized from. Included by
// adam_blockwise_cuda.cu only.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>

namespace shardopt {
namespace blockwise_cuda {

// Launch shape: kThreads threads (one thread block per SM; the register cap is 65536 / kThreads),
// kBlocks 256-element blocks per superblock (one set of copies), kStages stages of loads per warp,
// and how the launch's superblocks are dealt: kInterleave, warp w of the grid takes superblocks w,
// w + warps, ... (the grid works on one region at a time); else each thread block takes a
// contiguous range, its warps interleaved. Measured on an H200 (docs/benchmarks.md, "Compact state
// formats"): 512 x 2 x 2 beat 768 x 1 x 2 and 1024 x 1 x 2 (more warps, one block per superblock),
// and interleaving over the grid beat contiguous ranges by 0.4-2.6% of copy bandwidth.
template <int Threads, int Blocks, int Stages, bool Interleave>
struct Config {
  static constexpr int kThreads = Threads;
  static constexpr int kBlocks = Blocks;
  static constexpr int kStages = Stages;
  static constexpr bool kInterleave = Interleave;
};
// The build's configuration. A build may tune it with -DSHARDOPT_BLOCKWISE_THREADS=... (and
// _BLOCKS, _STAGES, _INTERLEAVE; separate macros: nvcc splits -D values at commas).
#ifndef SHARDOPT_BLOCKWISE_THREADS
#define SHARDOPT_BLOCKWISE_THREADS 512
#endif
#ifndef SHARDOPT_BLOCKWISE_BLOCKS
#define SHARDOPT_BLOCKWISE_BLOCKS 2
#endif
#ifndef SHARDOPT_BLOCKWISE_STAGES
#define SHARDOPT_BLOCKWISE_STAGES 2
#endif
#ifndef SHARDOPT_BLOCKWISE_INTERLEAVE
#define SHARDOPT_BLOCKWISE_INTERLEAVE 1
#endif
using DefaultConfig = Config<SHARDOPT_BLOCKWISE_THREADS, SHARDOPT_BLOCKWISE_BLOCKS,
                             SHARDOPT_BLOCKWISE_STAGES, SHARDOPT_BLOCKWISE_INTERLEAVE != 0>;

// Thread blocks per SM that fit (occupancy), per device, computed at the first launch (which also
// lifts the kernel's dynamic shared memory limit).
template <typename Op, typename Cfg, typename Kernel>
int ctas_per_sm(int device, Kernel kernel) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device < 0 || device >= static_cast<int>(cache.size())) device = 0;
  int n = cache[device].load(std::memory_order_relaxed);
  if (n > 0) return n;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(Op::kSmemBytes)));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Cfg::kThreads,
                                                               Op::kSmemBytes));
  TORCH_CHECK(n > 0, "adam_blockwise: the kernel does not fit on this GPU");
  cache[device].store(n, std::memory_order_relaxed);
  return n;
}

inline int sm_count(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device < 0 || device >= static_cast<int>(cache.size())) device = 0;
  int n = cache[device].load(std::memory_order_relaxed);
  if (n > 0) return n;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  cache[device].store(n, std::memory_order_relaxed);
  return n;
}

}  // namespace blockwise_cuda
}  // namespace shardopt
