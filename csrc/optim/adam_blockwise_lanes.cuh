// adam_blockwise_cuda.cu's geometry and a lane's registers: one warp per 256-element block, lane l
// holding elements [8l, 8l + 8), loaded and stored as vectors, packed into 32-bit words. Included
// by adam_blockwise_cuda.cu only.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../multi_tensor/cuda_elementwise.cuh"
#include "state_codec.h"

namespace shardopt {
namespace blockwise_cuda {

using codec::kBlock;
constexpr int kPerLane = kBlock / 32;
static_assert(kPerLane == 8, "a warp holds one block, 8 elements per lane");
static_assert(cuda::kChunkSize % kBlock == 0, "chunks must start on a block");
constexpr int kBlocksPerChunk = static_cast<int>(cuda::kChunkSize / kBlock);
static_assert(kBlocksPerChunk == 256, "a launch's block index is chunk * 256 + block");

// ---- 8 elements of a lane ----------------------------------------------------------------------

// 8 consecutive elements as 16-byte (or, for 1-byte codes, 8-byte) accesses.
template <typename T>
constexpr int kAccess = 16 / sizeof(T) < kPerLane ? 16 / sizeof(T) : kPerLane;

template <typename T>
__device__ __forceinline__ bool aligned8(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kAccess<T>) == 0;
}

// The vector accesses for a whole, aligned lane, else guarded scalar accesses.
template <typename T>
__device__ __forceinline__ void load_lane(const T* p, T (&v)[kPerLane], int count, bool vec) {
  if (vec) {
#pragma unroll
    for (int q = 0; q < kPerLane; q += kAccess<T>) {
      T w[kAccess<T>];
      cuda::load_group<T, kAccess<T>>(p + q, w);
#pragma unroll
      for (int e = 0; e < kAccess<T>; ++e) v[q + e] = w[e];
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) v[e] = e < count ? p[e] : T{};
}

template <typename T>
__device__ __forceinline__ void store_lane(T* p, const T (&v)[kPerLane], int count, bool vec) {
  if (vec) {
#pragma unroll
    for (int q = 0; q < kPerLane; q += kAccess<T>) {
      T w[kAccess<T>];
#pragma unroll
      for (int e = 0; e < kAccess<T>; ++e) w[e] = v[q + e];
      cuda::store_group<T, kAccess<T>>(p + q, w);
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    if (e < count) p[e] = v[e];
  }
}

__device__ __forceinline__ uint32_t warp_max(uint32_t x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xFFFFFFFFu, x);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = max(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
  return x;
#endif
}

// ---- a lane's 8 elements as packed 32-bit words -------------------------------------------------

template <typename T>
constexpr int kWords = kPerLane * static_cast<int>(sizeof(T)) / 4;  // 2 (1-byte) to 8 (4-byte)

template <typename T, int N>
__device__ __forceinline__ void to_words(const T (&v)[kPerLane], uint32_t (&w)[N]) {
  static_assert(N == kWords<T>, "8 elements");
  memcpy(&w, &v, sizeof(w));
}

template <typename T, int N>
__device__ __forceinline__ void from_words(const uint32_t (&w)[N], T (&v)[kPerLane]) {
  static_assert(N == kWords<T>, "8 elements");
  memcpy(&v, &w, sizeof(w));
}

// Element e (a compile-time index after unrolling) of 8 packed values of T, as float.
template <typename T, int N>
__device__ __forceinline__ float word_float(const uint32_t (&w)[N], int e) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(w[e]);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    const uint32_t x = w[e / 2];
    return __half2float(__ushort_as_half(static_cast<unsigned short>(e % 2 ? x >> 16 : x)));
  } else {  // bf16 (or its bits)
    const uint32_t x = w[e / 2];
    return __uint_as_float(e % 2 ? x & 0xFFFF0000u : x << 16);
  }
}

// Byte e of 8 packed bytes (one byte permute).
__device__ __forceinline__ uint32_t word_byte(const uint32_t (&w)[2], int e) {
  return __byte_perm(w[e / 4], 0u, 0x4440u | static_cast<uint32_t>(e % 4));
}

// 16-byte (8-byte for two words) shared or global accesses of a lane's words.
template <int N>
__device__ __forceinline__ void load_words(const void* p, uint32_t (&w)[N]) {
  static_assert(N == 2 || N % 4 == 0, "8 or 16-byte accesses");
  if constexpr (N == 2) {
    const uint2 a = *reinterpret_cast<const uint2*>(p);
    w[0] = a.x;
    w[1] = a.y;
  } else {
#pragma unroll
    for (int q = 0; q < N; q += 4) {
      const uint4 a = reinterpret_cast<const uint4*>(p)[q / 4];
      w[q] = a.x;
      w[q + 1] = a.y;
      w[q + 2] = a.z;
      w[q + 3] = a.w;
    }
  }
}

template <int N>
__device__ __forceinline__ void store_words(void* p, const uint32_t (&w)[N]) {
  static_assert(N == 2 || N % 4 == 0, "8 or 16-byte accesses");
  if constexpr (N == 2) {
    cuda::store_group<uint32_t, 2>(static_cast<uint32_t*>(p), w);
  } else {
#pragma unroll
    for (int q = 0; q < N; q += 4) {
      const uint32_t a[4] = {w[q], w[q + 1], w[q + 2], w[q + 3]};
      cuda::store_group<uint32_t, 4>(static_cast<uint32_t*>(p) + q, a);
    }
  }
}

}  // namespace blockwise_cuda
}  // namespace shardopt
