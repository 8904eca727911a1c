// The per-block loop of the CUDA traversal (cuda_apply.cuh) and the Op interface it calls: every
// optimizer, scale and norm run over it.
//
// Elementwise<Op>: slots are loaded into acc_t registers, Op updates one element, written slots
// are stored back. Vector path: groups of G elements (16 bytes of the widest slot, so fp16 grads
// next to fp32 state move as 8 + 16 bytes), several groups per thread in flight (coalesced across
// threads; adjacent in a thread for the one-slot reductions); taken when peeling the same few head
// elements aligns every slot. Scalar, coalesced path for the peeled head, the tail and pointers
// that cannot be aligned. Offsets inside a chunk are 32-bit; tensor and chunk offsets are 64-bit.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../optim/math_common.h"
#include "checks.h"
#include "cuda_apply.cuh"

namespace shardopt {
namespace cuda {

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

  // Host: checks a call's optional device scalars (checks.h) and keeps their pointers.
  void set_scalars(const at::Device& device, const char* name, const std::optional<at::Tensor>& lr,
                   const std::optional<at::Tensor>& step,
                   const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf) {
    lr_t = device_scalar(lr, device, name, "lr_t");
    step_t = device_scalar(step, device, name, "step_t");
    grad_scale_t = device_scalar(grad_scale, device, name, "grad_scale_t");
    found_inf_t = device_scalar(found_inf, device, name, "found_inf_t");
  }

  __device__ bool skip() const { return found_inf_t != nullptr && *found_inf_t != 0.f; }

  // In begin(): the device lr replaces h.lr, the bias corrections of the device step replace the
  // host step's (through the math header's set_step, as its make_hyper does on the host).
  template <typename H>
  __device__ void device_lr(H& h) const {
    if (lr_t != nullptr) h.lr = static_cast<decltype(h.lr)>(*lr_t);
  }
  template <typename H>
  __device__ void device_step(H& h, const BiasCorrection& bias) const {
    if (step_t != nullptr) set_step(h, bias, static_cast<double>(*step_t));
  }

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

}  // namespace cuda
}  // namespace shardopt
