// The CUDA multi-tensor traversal, the counterpart of cpu_apply.h (Apex's multi_tensor_apply with
// 64-bit sizes).
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
// - Elementwise<Op> is the per-block loop every optimizer shares: slots are loaded into acc_t
//   registers, Op updates one element, written slots are stored back. Vector path: groups of G
//   elements (16 bytes of the widest slot, so fp16 grads next to fp32 state move as 8 + 16 bytes),
//   several groups per thread in flight (coalesced across threads; adjacent in a thread for the
//   one-slot reductions); taken when peeling the same few head elements aligns every slot.
//   Scalar, coalesced path for the peeled head, the tail and pointers that cannot be aligned.
//   Offsets inside a chunk are 32-bit; tensor and chunk offsets are 64-bit.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda_chunk.h"
#include "tensor_lists.h"

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
  static_assert(Depth >= 1 && Depth <= 5, "ChunkMeta supports 1 to 5 slots");
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
                  sizeof(ChunkMeta<5>) <= kMetaBytes,
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

template <int Depth, typename F>
__global__ void __launch_bounds__(kBlockSize, kMinBlocksPerSm)
    chunk_kernel(const __grid_constant__ ChunkMeta<Depth> meta, const F f) {
  const int b = static_cast<int>(blockIdx.x);
  // The first entry whose block_end exceeds b, i.e. the number of entries ending at or before b
  // (block_end is increasing and its last entry is the grid, so the answer is below tensors).
  // Branch-free binary search; b is uniform, so these are broadcast constant-bank loads.
  int lo = 0;
  for (int step = 1 << (31 - __clz(meta.tensors)); step > 0; step >>= 1) {
    if (lo + step < meta.tensors && meta.block_end[lo + step - 1] <= b) lo += step;
  }
  const int local = lo;
  const int first_block = local == 0 ? 0 : meta.block_end[local - 1];
  Chunk<Depth> c;
#pragma unroll
  for (int s = 0; s < Depth; ++s) c.base[s] = meta.addresses[s][local];
  c.chunk = (local == 0 ? meta.first_chunk : int64_t{0}) + (b - first_block);
  c.start = c.chunk * kChunkSize;
  c.numel = meta.numel[local];
  c.n = c.numel - c.start < kChunkSize ? c.numel - c.start : kChunkSize;
  c.unit = meta.first_unit + b;
  c.tensor = meta.index[local];
  f(c);
}

// Runs f(Chunk) once per (tensor, chunk) of the tensors lists[*][i], i in `order` (empty tensors
// are skipped). Units are numbered from first_unit in order, each tensor's chunks consecutively;
// returns the next free ordinal. A launch takes tensors until kMaxTensors or kMaxGrid blocks; a
// tensor that does not fit in the blocks left continues as entry 0 of the next launch.
template <int Depth, typename F>
int64_t apply_chunks(const std::vector<std::vector<at::Tensor>>& lists,
                     const std::vector<int64_t>& order, const F& f, int64_t first_unit = 0) {
  using Meta = ChunkMeta<Depth>;
  static_assert(sizeof(Meta) + sizeof(F) + alignof(F) <= kParamBytes,
                "kernel arguments (ChunkMeta + functor) exceed the kernel parameter limit");
  TORCH_CHECK(lists.size() == static_cast<size_t>(Depth), "apply_chunks: expected ", Depth,
              " lists, got ", lists.size());
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
    chunk_kernel<Depth, F><<<static_cast<unsigned>(blocks), kBlockSize, 0, stream>>>(meta, f);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
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

template <int Depth, typename F>
int64_t apply_chunks(const std::vector<std::vector<at::Tensor>>& lists, const F& f) {
  std::vector<int64_t> order(lists.empty() ? 0 : lists[0].size());
  std::iota(order.begin(), order.end(), int64_t{0});
  return apply_chunks<Depth>(lists, order, f);
}

// ---- elementwise traversal ----------------------------------------------------------------------

// The storage type of each slot of an Op.
template <typename... Ts>
struct Slots {
  static constexpr int kDepth = sizeof...(Ts);
  static constexpr int kMaxBytes = std::max({static_cast<int>(sizeof(Ts))...});
  template <int S>
  using type = std::tuple_element_t<S, std::tuple<Ts...>>;
};

template <typename F, int... I>
__device__ __forceinline__ void static_for_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
__device__ __forceinline__ void static_for(F&& f) {
  static_for_impl(f, std::make_integer_sequence<int, N>{});
}

// One group: G contiguous elements of T, loaded and stored as a single 4/8/16-byte access.
template <int Bytes>
using word_t =
    std::conditional_t<Bytes == 16, uint4, std::conditional_t<Bytes == 8, uint2, uint32_t>>;

template <typename T, int G>
__device__ __forceinline__ void load_group(const T* p, T (&v)[G]) {
  constexpr int kBytes = sizeof(T) * G;
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "a group is one 4/8/16-byte access");
  const word_t<kBytes> w = *reinterpret_cast<const word_t<kBytes>*>(p);
  memcpy(&v, &w, kBytes);
}

// Inline PTX: nvcc would otherwise split stores of c10::Half/BFloat16 groups into 32-bit pieces.
template <typename T, int G>
__device__ __forceinline__ void store_group(T* p, const T (&v)[G]) {
  constexpr int kBytes = sizeof(T) * G;
  uint32_t u[kBytes / 4];
  memcpy(&u, &v, kBytes);
  if constexpr (kBytes == 16) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(u[0]), "r"(u[1]),
                 "r"(u[2]), "r"(u[3])
                 : "memory");
  } else if constexpr (kBytes == 8) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(u[0]), "r"(u[1]) : "memory");
  } else {
    asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(u[0]) : "memory");
  }
}

// Device scalars shared by the optimizer ops (nullptr when absent) and the default hooks.
struct OpBase {
  const float* lr_t = nullptr;
  const float* step_t = nullptr;
  const float* grad_scale_t = nullptr;
  const float* found_inf_t = nullptr;
  __device__ bool skip() const { return found_inf_t != nullptr && *found_inf_t != 0.f; }
  template <typename C, typename Ctx>
  __device__ void end(const C&, Ctx&) const {}
};

__device__ __forceinline__ double value_or(const float* p, double fallback) {
  return p != nullptr ? static_cast<double>(*p) : fallback;
}

// Op interface: acc_t; Slots; skip(); reads(s)/writes(s); begin(chunk) -> Ctx (per-block values,
// e.g. device scalars); op(acc_t (&x)[kDepth], Ctx&) updates one element; end(chunk, Ctx&).
template <typename Op>
struct Elementwise {
  Op op;
  using acc_t = typename Op::acc_t;
  using S = typename Op::Slots;
  static constexpr int D = S::kDepth;
  static constexpr int G = 16 / S::kMaxBytes;  // elements per vector access
  // Vector accesses per slot per step (ILP): 8 elements per thread (2 for fp64, whose registers
  // are double width), more when there are only one or two slots (norm, scale), at most 16
  // elements; this keeps every kernel within 64 registers.
  static constexpr int NG = std::min(std::max(std::max((sizeof(acc_t) == 8 ? 2 : 8) / G, 1), 4 / D),
                                     std::max(16 / G, 1));
  static constexpr int E = NG * G;  // elements per thread per step
  template <int K>
  using slot_t = typename S::template type<K>;
  static_assert(kChunkSize <= (int64_t{1} << 30), "offsets within a chunk are int");

  __device__ void operator()(const Chunk<D>& c) const {
    if (op.skip()) return;
    auto ctx = op.begin(c);
    void* ptr[D];  // chunk base per slot: offsets below stay 32-bit
    static_for<D>([&](auto k) {
      ptr[k] = static_cast<slot_t<decltype(k)::value>*>(c.base[k]) + c.start;
    });
    const int n = static_cast<int>(c.n);
    int head = -1;  // elements to peel until every slot is aligned for a group access
    for (int h = 0; h < G && head < 0; ++h) {
      bool ok = true;
      static_for<D>([&](auto k) {
        constexpr int K = decltype(k)::value;
        const auto* p = static_cast<const slot_t<K>*>(ptr[K]) + h;
        ok = ok && (reinterpret_cast<uintptr_t>(p) % (sizeof(*p) * G) == 0 ||
                    !(op.reads(K) || op.writes(K)));
      });
      if (ok) head = h;
    }
    if (head < 0 || head >= n) {
      scalar(ptr, ctx, 0, n);
    } else {
      const int groups = (n - head) / G;
      scalar(ptr, ctx, 0, head);
      vector(ptr, ctx, head, groups);
      scalar(ptr, ctx, head + groups * G, n);
    }
    op.end(c, ctx);
  }

  // Elements [head, head + groups * G) in groups of G, each group 16 bytes of the widest slot.
  // Several slots: thread t takes groups t, t + kBlockSize, ... (each instruction coalesced).
  // One read-only slot (a reduction): thread t takes NG adjacent groups, measured faster there.
  static constexpr bool kAdjacent = D == 1;
  static constexpr int kThreadStride = kAdjacent ? NG : 1;
  static constexpr int kGroupStride = kAdjacent ? 1 : kBlockSize;
  template <typename Ctx>
  __device__ __forceinline__ void vector(void* const (&ptr)[D], Ctx& ctx, int head,
                                         int groups) const {
    for (int g0 = threadIdx.x * kThreadStride; g0 < groups; g0 += kBlockSize * NG) {
      acc_t r[E][D];
#pragma unroll
      for (int q = 0; q < NG; ++q) {
        const int gi = g0 + q * kGroupStride;
        static_for<D>([&](auto k) {
          constexpr int K = decltype(k)::value;
          using T = slot_t<K>;
          T v[G];
          const bool load = gi < groups && op.reads(K);
          if (load) load_group<T, G>(static_cast<const T*>(ptr[K]) + head + gi * G, v);
#pragma unroll
          for (int e = 0; e < G; ++e) r[q * G + e][K] = load ? static_cast<acc_t>(v[e]) : acc_t(0);
        });
      }
#pragma unroll
      for (int j = 0; j < E; ++j) {
        if (g0 + (j / G) * kGroupStride < groups) op(r[j], ctx);
      }
#pragma unroll
      for (int q = 0; q < NG; ++q) {
        const int gi = g0 + q * kGroupStride;
        if (gi >= groups) continue;
        static_for<D>([&](auto k) {
          constexpr int K = decltype(k)::value;
          using T = slot_t<K>;
          if (!op.writes(K)) return;
          T v[G];
#pragma unroll
          for (int e = 0; e < G; ++e) v[e] = static_cast<T>(r[q * G + e][K]);
          store_group<T, G>(static_cast<T*>(ptr[K]) + head + gi * G, v);
        });
      }
    }
  }

  // Elements [begin, end) of the chunk, coalesced: thread t handles base + t + j * kBlockSize.
  template <typename Ctx>
  __device__ __forceinline__ void scalar(void* const (&ptr)[D], Ctx& ctx, int begin,
                                         int end) const {
    for (int base = begin + threadIdx.x; base - threadIdx.x < end; base += kBlockSize * E) {
      acc_t r[E][D];
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const int i = base + j * kBlockSize;
        static_for<D>([&](auto k) {
          constexpr int K = decltype(k)::value;
          r[j][K] = i < end && op.reads(K)
                        ? static_cast<acc_t>(static_cast<const slot_t<K>*>(ptr[K])[i])
                        : acc_t(0);
        });
      }
#pragma unroll
      for (int j = 0; j < E; ++j) {
        if (base + j * kBlockSize < end) op(r[j], ctx);
      }
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const int i = base + j * kBlockSize;
        if (i >= end) continue;
        static_for<D>([&](auto k) {
          constexpr int K = decltype(k)::value;
          using T = slot_t<K>;
          if (op.writes(K)) static_cast<T*>(ptr[K])[i] = static_cast<T>(r[j][K]);
        });
      }
    }
  }
};

// Runs op over every element of lists (one slot per list, as Op::Slots says).
template <typename Op>
void apply_elementwise(const std::vector<std::vector<at::Tensor>>& lists, const Op& op) {
  apply_chunks<Op::Slots::kDepth>(lists, Elementwise<Op>{op});
}

// ---- host-side checks ---------------------------------------------------------------------------

// State slots hold acc_t (fp32, or fp64 for fp64 params).
template <typename T>
void check_state_dtype(const std::vector<at::Tensor>& list, const char* name, const char* slot) {
  if (list.empty()) return;
  TORCH_CHECK(list[0].scalar_type() == c10::CppTypeToScalarType<T>::value, name, ": ", slot,
              " must be ", c10::CppTypeToScalarType<T>::value, ", got ", list[0].scalar_type());
}

// The data pointer of an optional 1-element float32 device scalar on `device`, or nullptr.
inline const float* device_scalar(const std::optional<at::Tensor>& t, const at::Device& device,
                                  const char* name, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->device() == device && t->scalar_type() == at::kFloat && t->numel() == 1, name,
              ": ", what, " must be a 1-element float32 tensor on ", device, ", got ",
              t->scalar_type(), " with ", t->numel(), " elements on ", t->device());
  return static_cast<const float*>(t->data_ptr());
}

// A float32 vector with one entry per tensor (per-tensor norms), on `device`.
inline const float* per_tensor_vector(const at::Tensor& t, size_t n, const at::Device& device,
                                      const char* name, const char* what) {
  TORCH_CHECK(t.device() == device && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.numel() == static_cast<int64_t>(n),
              name, ": ", what, " must be a contiguous float32 tensor of ", n, " elements on ",
              device, ", got ", t.scalar_type(), " with ", t.numel(), " elements on ", t.device());
  return static_cast<const float*>(t.data_ptr());
}

}  // namespace cuda
}  // namespace shardopt
