// The summation order of the CUDA kernels' deterministic reductions, on the CPU: a sum of squares
// taken here over the same values gives the bits of the CUDA kernel's. Used where the CPU kernels
// replace CUDA ones on a CUDA job (CPU offload) and a per-tensor sum feeds the update: LAMB's
// trust ratios (lamb_cpu.cpp). It follows, for kernels over an Elementwise traversal of several
// slots (cuda_elementwise.cuh, cuda_apply.cuh, block_reduce.cuh):
//   - one (tensor, chunk) block per cuda::kChunkSize elements of each tensor, kBlock threads;
//   - the peeled head (the first h < G elements, until every slot's pointer is aligned for a group
//     of G elements, G = 16 bytes of the widest slot; none aligned: all scalar), the vector part in
//     groups of G, the scalar tail; thread t takes head elements t + kBlock * m, groups
//     t + kBlock * m (each group's G elements in order), tail elements t + kBlock * m, every
//     thread's values summed in that order from 0, product and sum each rounded (no FMA:
//     --fmad=false there, -ffp-contract=off here);
//   - block_reduce: per warp of 32 a shuffle-down tree (offsets 16, 8, 4, 2, 1), then the same
//     tree over the warps' values (zeros past kBlock / 32);
//   - reduce_kernel: per tensor, thread t sums the chunk partials t + kBlock * m from 0, then
//     block_reduce.
// The traversal constants are restated here (this header builds without CUDA); the tests on a
// GPU compare the bits (tests/offload/test_offload_cuda.py).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

namespace shardopt {
namespace cuda_order {

constexpr int kBlock = 512;             // cuda_apply.cuh's kBlockSize
constexpr int64_t kChunk = 65536;       // cuda_chunk.h's kChunkSize
constexpr int kWarps = kBlock / 32;

// One warp's shuffle-down tree; the value lane 0 ends with.
template <typename T>
T warp_tree(std::array<T, 32> v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    std::array<T, 32> next;
    for (int l = 0; l < 32; ++l) next[l] = v[l] + (l + offset < 32 ? v[l + offset] : v[l]);
    v = next;
  }
  return v[0];
}

// block_reduce over the kBlock threads' values.
template <typename T>
T block_tree(const T* thread_values) {
  std::array<T, 32> warps{};
  for (int w = 0; w < kWarps; ++w) {
    std::array<T, 32> lanes;
    for (int l = 0; l < 32; ++l) lanes[l] = thread_values[32 * w + l];
    warps[w] = warp_tree(lanes);
  }
  for (int w = kWarps; w < 32; ++w) warps[w] = T(0);
  return warp_tree(warps);
}

// The element at which every slot is aligned for a group access (`addresses`: each slot's first
// element, `sizes`: its element bytes, `g`: elements per group), or -1 (the traversal's `head`).
inline int aligned_head(const std::vector<uintptr_t>& addresses, const std::vector<int>& sizes,
                        int g) {
  for (int h = 0; h < g; ++h) {
    bool ok = true;
    for (size_t k = 0; k < addresses.size(); ++k) {
      const uintptr_t p = addresses[k] + static_cast<uintptr_t>(h) * sizes[k];
      ok = ok && p % (static_cast<uintptr_t>(sizes[k]) * g) == 0;
    }
    if (ok) return h;
  }
  return -1;
}

// One chunk's partial: the block's sum of `x[0..n)` (each value already rounded to T) with the
// traversal's `head` (aligned_head) and group size `g`.
template <typename T>
T chunk_sum(const T* x, int64_t n, int head, int g) {
  std::vector<T> acc(kBlock, T(0));
  auto scalar = [&](int64_t begin, int64_t end) {
    for (int64_t base = begin; base < end; base += kBlock) {
      const int64_t stop = std::min<int64_t>(end - base, kBlock);
      for (int64_t t = 0; t < stop; ++t) acc[t] = acc[t] + x[base + t];
    }
  };
  if (head < 0 || head >= n) {
    scalar(0, n);
  } else {
    const int64_t groups = (n - head) / g;
    scalar(0, head);
    for (int64_t g0 = 0; g0 < groups; g0 += kBlock) {  // groups g0 + t, t < kBlock
      const int64_t stop = std::min<int64_t>(groups - g0, kBlock);
      const T* row = x + head + g0 * g;
      for (int64_t t = 0; t < stop; ++t) {
        T a = acc[t];
        for (int e = 0; e < g; ++e) a = a + row[t * g + e];
        acc[t] = a;
      }
    }
    scalar(head + groups * g, n);
  }
  return block_tree(acc.data());
}

// reduce_kernel: one tensor's sum of its chunk partials (in chunk order).
template <typename T>
T partials_sum(const T* partials, int64_t n) {
  std::vector<T> acc(kBlock, T(0));
  for (int64_t base = 0; base < n; base += kBlock) {
    const int64_t stop = std::min<int64_t>(n - base, kBlock);
    for (int64_t t = 0; t < stop; ++t) acc[t] = acc[t] + partials[base + t];
  }
  return block_tree(acc.data());
}

}  // namespace cuda_order
}  // namespace shardopt
