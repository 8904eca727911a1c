// The CUDA multi-tensor traversal, the counterpart of cpu_apply.h (Apex's multi_tensor_apply with
// 64-bit sizes): how (tensor, chunk) work units are packed into launches. The per-block loop the
// optimizers share, and its Op interface, are in cuda_elementwise.cuh.
//
// Launch scheme. The work is one (tensor, chunk) unit of kChunkSize elements per thread block. A
// launch describes up to ChunkMeta::kMaxTensors tensors in its kernel ARGUMENTS (by value,
// __grid_constant__): per tensor its slot pointers, numel, index in the caller's lists and the
// running total of blocks through it (block_end, an int32 prefix sum over the launch's tensors).
// The grid is exactly one block per chunk, with no per-block table, so a launch holds any number
// of chunks (up to kMaxGrid); block b finds its tensor by a binary search of block_end (a few
// uniform constant-bank loads, log2 of the tensors in the launch) and its chunk as b minus the
// tensor's first block (plus first_chunk for entry 0, the only one that can continue a tensor
// split by a previous launch). With nvcc >= 12.1 the arguments may take 32764 bytes (CUDA 12.1's
// large kernel parameters; sm_70+), so a launch packs several hundred tensors (671 at depth 4,
// 575 at depth 5): a GPT-style parameter set of a few hundred tensors is ONE launch filling the
// GPU, with a single tail. Older nvcc falls back to the 4 KB limit (~70 tensors per launch).
// - No host->device copy: launches are CUDA-graph safe and never sync.
// - Every work unit has an ordinal (Chunk::unit = first_unit + blockIdx.x), assigned in traversal
//   order with each tensor's chunks consecutive, so a reduction can write per-chunk partials to
//   fixed slots and stay deterministic (norm_cuda.cu): the ordinal is a fixed function of
//   (tensor, chunk) and of the order, whatever the packing.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "cuda_chunk.h"

namespace shardopt {
namespace cuda {

constexpr int kBlockSize = 512;
constexpr int kMinBlocksPerSm = 2;         // caps registers at 64 so two blocks fit on an SM
constexpr int64_t kMaxGrid = 1 << 30;      // blocks per launch (block_end is int32)

// Bytes of kernel arguments: CUDA 12.1+ takes 32764 (sm_70+, which every nvcc 12.1+ target is).
#if defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 1))
constexpr int kParamBytes = 32764;
#else
constexpr int kParamBytes = 4096;
#endif
constexpr int kFunctorBytes = 512;  // kept free for the functor (checked in apply_chunks)
constexpr int kMetaBytes = kParamBytes - kFunctorBytes;

// Tensors per launch by list depth: per tensor 8 bytes per slot + numel + block_end + index.
constexpr int max_tensors(int depth) { return (kMetaBytes - 32) / (8 * depth + 16); }

template <int Depth>
struct ChunkMeta {
  static_assert(Depth >= 1 && Depth <= 7, "ChunkMeta supports 1 to 7 slots");
  static constexpr int kMaxTensors = max_tensors(Depth);
  void* addresses[Depth][kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t block_end[kMaxTensors];  // blocks of tensors 0..t (prefix sum): t owns [end[t-1], end[t])
  int32_t index[kMaxTensors];      // the tensor's position in the caller's lists
  int64_t first_chunk;             // chunk of tensor 0 done by block 0 (> 0: a continued tensor)
  int64_t first_unit;              // ordinal of block 0's work unit
  int32_t tensors;                 // entries used
};
static_assert(sizeof(ChunkMeta<1>) <= kMetaBytes && sizeof(ChunkMeta<2>) <= kMetaBytes &&
                  sizeof(ChunkMeta<3>) <= kMetaBytes && sizeof(ChunkMeta<4>) <= kMetaBytes &&
                  sizeof(ChunkMeta<5>) <= kMetaBytes && sizeof(ChunkMeta<6>) <= kMetaBytes &&
                  sizeof(ChunkMeta<7>) <= kMetaBytes,
              "kernel arguments must leave room for the functor");

// What one block works on.
template <int Depth>
struct Chunk {
  void* base[Depth];  // tensor base pointers, one per slot
  int64_t start;      // first element of the chunk
  int64_t n;          // elements in the chunk
  int64_t numel;      // elements in the tensor
  int64_t chunk;      // chunk index within the tensor
  int64_t unit;       // ordinal of this work unit in the traversal
  int tensor;         // index in the caller's lists
};

// The entry of meta whose chunks hold the launch's chunk b: the first entry whose block_end
// exceeds b, i.e. the number of entries ending at or before b (block_end is increasing and its last
// entry is the grid, so the answer is below tensors). Branch-free binary search; b is uniform, so
// these are broadcast constant-bank loads.
template <int Depth>
__device__ __forceinline__ int find_entry(const ChunkMeta<Depth>& meta, int b) {
  int lo = 0;
  for (int step = 1 << (31 - __clz(meta.tensors)); step > 0; step >>= 1) {
    if (lo + step < meta.tensors && meta.block_end[lo + step - 1] <= b) lo += step;
  }
  return lo;
}

// The chunk index within its tensor of the launch's chunk b, which entry `local` holds.
template <int Depth>
__device__ __forceinline__ int64_t chunk_of(const ChunkMeta<Depth>& meta, int local, int b) {
  const int first_block = local == 0 ? 0 : meta.block_end[local - 1];
  return (local == 0 ? meta.first_chunk : int64_t{0}) + (b - first_block);
}

template <int Depth, typename F>
__global__ void __launch_bounds__(kBlockSize, kMinBlocksPerSm)
    chunk_kernel(const __grid_constant__ ChunkMeta<Depth> meta, const F f) {
  const int b = static_cast<int>(blockIdx.x);
  const int local = find_entry(meta, b);
  const int first_block = local == 0 ? 0 : meta.block_end[local - 1];
  Chunk<Depth> c;
#pragma unroll
  for (int s = 0; s < Depth; ++s) c.base[s] = meta.addresses[s][local];
  c.chunk = (local == 0 ? meta.first_chunk : int64_t{0}) + (b - first_block);  // chunk_of
  c.start = c.chunk * kChunkSize;
  c.numel = meta.numel[local];
  c.n = c.numel - c.start < kChunkSize ? c.numel - c.start : kChunkSize;
  c.unit = meta.first_unit + b;
  c.tensor = meta.index[local];
  f(c);
}

// Packs the (tensor, chunk) units of the tensors lists[*][i], i in `order` (empty tensors are
// skipped), into launches: calls launch(meta, blocks, stream) once per launch, blocks being its
// chunks (ChunkMeta: block_end, first_chunk, first_unit). Units are numbered from first_unit in
// order, each tensor's chunks consecutively; returns the next free ordinal. A launch takes tensors
// until kMaxTensors or kMaxGrid chunks; a tensor that does not fit in the chunks left continues as
// entry 0 of the next launch. apply_chunks launches chunk_kernel (one thread block per chunk);
// kernels with their own grid (adam_blockwise_cuda.cu) pass their own launch.
template <int Depth, typename Launch>
int64_t for_each_launch(const std::vector<std::vector<at::Tensor>>& lists,
                        const std::vector<int64_t>& order, int64_t first_unit, Launch&& launch_fn) {
  using Meta = ChunkMeta<Depth>;
  TORCH_CHECK(lists.size() == static_cast<size_t>(Depth), "apply_chunks: expected ",
              std::to_string(Depth), " lists, got ", std::to_string(lists.size()));
  if (order.empty()) return first_unit;
  const c10::cuda::OptionalCUDAGuard guard(lists[0][order[0]].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int64_t unit = first_unit;
  Meta meta;  // only entries [0, tensors) are read; the rest may hold anything
  std::memset(&meta, 0, sizeof(meta));
  int tensors = 0;
  int64_t blocks = 0;
  auto launch = [&]() {
    if (blocks == 0) return;
    meta.tensors = tensors;
    meta.first_unit = unit;
    launch_fn(static_cast<const Meta&>(meta), blocks, stream);
    unit += blocks;
    tensors = 0;
    blocks = 0;
    meta.first_chunk = 0;
  };

  for (const int64_t i : order) {
    const int64_t numel = lists[0][i].numel();
    if (numel == 0) continue;
    const int64_t chunks = (numel + kChunkSize - 1) / kChunkSize;
    for (int64_t c = 0; c < chunks;) {
      if (tensors == Meta::kMaxTensors) launch();
      const int64_t take = std::min(chunks - c, kMaxGrid - blocks);
      TORCH_INTERNAL_ASSERT(take > 0 && (c == 0 || tensors == 0),
                            "apply_chunks: only entry 0 may continue a tensor");
      if (tensors == 0) meta.first_chunk = c;
      for (int s = 0; s < Depth; ++s) meta.addresses[s][tensors] = lists[s][i].data_ptr();
      meta.numel[tensors] = numel;
      meta.index[tensors] = static_cast<int32_t>(i);
      blocks += take;
      meta.block_end[tensors] = static_cast<int32_t>(blocks);
      ++tensors;
      c += take;
      if (blocks == kMaxGrid) launch();
    }
  }
  launch();
  return unit;
}

// Runs f(Chunk) once per (tensor, chunk) of the tensors lists[*][i], i in `order`, one thread block
// per chunk (for_each_launch says how they are packed); returns the next free unit ordinal.
template <int Depth, typename F>
int64_t apply_chunks(const std::vector<std::vector<at::Tensor>>& lists,
                     const std::vector<int64_t>& order, const F& f, int64_t first_unit = 0) {
  static_assert(sizeof(ChunkMeta<Depth>) + sizeof(F) + alignof(F) <= kParamBytes,
                "kernel arguments (ChunkMeta + functor) exceed the kernel parameter limit");
  return for_each_launch<Depth>(
      lists, order, first_unit,
      [&](const ChunkMeta<Depth>& meta, int64_t blocks, cudaStream_t stream) {
        chunk_kernel<Depth, F><<<static_cast<unsigned>(blocks), kBlockSize, 0, stream>>>(meta, f);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

template <int Depth, typename F>
int64_t apply_chunks(const std::vector<std::vector<at::Tensor>>& lists, const F& f) {
  std::vector<int64_t> order(lists.empty() ? 0 : lists[0].size());
  std::iota(order.begin(), order.end(), int64_t{0});
  return apply_chunks<Depth>(lists, order, f);
}

}  // namespace cuda
}  // namespace shardopt
