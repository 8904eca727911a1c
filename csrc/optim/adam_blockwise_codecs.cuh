// The format codecs of adam_blockwise_cuda.cu: the int8 maps and search words in shared memory
// (built per thread block from state_codec.h's definitions), their host-side check, and a lane's
// decode and encode of each format. Included by adam_blockwise_cuda.cu only.
#pragma once

#include <c10/util/Exception.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "adam_blockwise_lanes.cuh"
#include "adam_blockwise_math.h"
#include "quantization_map.h"
#include "state_codec.h"

namespace shardopt {
namespace blockwise_cuda {

__constant__ uint32_t kSignedMapBits[256] = {SHARDOPT_SIGNED_MAP_BITS};
__constant__ uint32_t kUnsignedMapBits[256] = {SHARDOPT_UNSIGNED_MAP_BITS};

// ---- int8 tables in shared memory --------------------------------------------------------------

struct Int8Smem {
  float map_m[256];
  float map_v[256];
  uint32_t words_m[codec::kSignedWords];    // the signed map's search (state_codec.h)
  uint32_t words_v[codec::kUnsignedWords];  // the unsigned map's

  __device__ void build() {
    const int t = threadIdx.x;
    const int n = blockDim.x;
    for (int i = t; i < 256; i += n) {
      map_m[i] = codec::float_of(kSignedMapBits[i]);
      map_v[i] = codec::float_of(kUnsignedMapBits[i]);
    }
    __syncthreads();
    for (int i = t; i < codec::kSignedWords + codec::kUnsignedWords; i += n) {
      if (i < codec::kSignedWords) {
        words_m[i] = codec::search_word(map_m, 127, true, i);
      } else {
        words_v[i - codec::kSignedWords] =
            codec::search_word(map_v, 0, false, i - codec::kSignedWords);
      }
    }
    __syncthreads();
  }
};

constexpr size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// The kernel's dynamic shared memory (the int8 tables first, at a constant address: their
// lookups take it as an immediate).
extern __shared__ __align__(128) unsigned char g_smem[];

// The search tables' assumptions (state_codec.h) hold for the compiled-in maps.
inline void check_search_maps() {
  static const bool ok = [] {
    float map[256];
    const uint32_t s[256] = {SHARDOPT_SIGNED_MAP_BITS};
    const uint32_t u[256] = {SHARDOPT_UNSIGNED_MAP_BITS};
    for (int i = 0; i < 256; ++i) map[i] = codec::float_of(s[i]);
    const bool signed_ok = codec::search_check(map, 127);
    for (int i = 0; i < 256; ++i) map[i] = codec::float_of(u[i]);
    return signed_ok && codec::search_check(map, 0);
  }();
  TORCH_CHECK(ok, "adam_blockwise: the int8 maps break the code search's assumptions");
}

// A lane's 8 codes of format Fmt (adam_blockwise_math.h): decoded from packed words, encoded
// with their block's scale (v's roots raised by codec::floor_positive); int8 through the search
// words and maps of the shared-memory tables.
template <typename Fmt>
struct LaneCodec {
  using C = typename Fmt::code_t;
  static constexpr bool kInt8 = Fmt::kTables;

  static __device__ __forceinline__ const Int8Smem& tables() {
    return *reinterpret_cast<const Int8Smem*>(g_smem);
  }

  static __device__ __forceinline__ float decode(const uint32_t (&w)[kWords<C>], int e, float s,
                                                 bool is_signed) {
    if constexpr (kInt8) {
      const uint32_t c = word_byte(w, e);
      return (is_signed ? tables().map_m[c] : tables().map_v[c]) * s;
    } else {
      return word_float<C>(w, e) * s;
    }
  }

  // int8: the code (low byte) of xn from a map's search table (state_codec.h).
  static __device__ __forceinline__ uint32_t int8_code(float xn, const uint32_t* words,
                                                       bool is_signed) {
    const uint32_t x = is_signed ? codec::search_bits(xn) : __float_as_uint(xn);
    const uint32_t w =
        words[codec::search_index(x, is_signed ? codec::kSignedWords : codec::kUnsignedWords)];
    // search_code's w + ((x << 16) > w) as the borrow of a 64-bit difference: a shift-and-subtract
    // with carry out and two integer multiply-adds
    const uint64_t d = static_cast<uint64_t>(w) - static_cast<uint64_t>(x << 16);
    return w - static_cast<uint32_t>(d >> 32);
  }

  static __device__ __forceinline__ uint32_t pack_bytes(uint32_t a, uint32_t b, uint32_t c,
                                                        uint32_t d) {
    return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
  }

  // A value scaled for its code: m's, or a root of v's raised to the smallest positive code value
  // where it is positive (codec::floor_positive; map_v[1]: the unsigned map's).
  template <bool kSigned>
  static __device__ __forceinline__ float scaled(float x, const codec::Scale& sc) {
    if constexpr (kSigned) {
      return x * sc.inv;
    } else if constexpr (kInt8) {
      return codec::floor_positive(x, x * sc.inv, tables().map_v[1]);
    } else {
      return codec::floor_positive(x, x * sc.inv, codec::kHalfTiny);
    }
  }

  // The codes of 8 values with their block's scale (v's: its roots).
  template <bool kSigned>
  static __device__ __forceinline__ void encode(const float (&x)[kPerLane],
                                                const codec::Scale& sc, uint32_t (&w)[kWords<C>]) {
    if constexpr (kInt8) {
      if (sc.finite) {
        const uint32_t* words = kSigned ? tables().words_m : tables().words_v;
        uint32_t c[kPerLane];
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          c[e] = int8_code(scaled<kSigned>(x[e], sc), words, kSigned);
        }
        w[0] = pack_bytes(c[0], c[1], c[2], c[3]);
        w[1] = pack_bytes(c[4], c[5], c[6], c[7]);
      } else {  // a block holding inf or NaN: every code the zero code (a warp-uniform branch)
        w[0] = w[1] = kSigned ? 0x7F7F7F7Fu : 0u;
      }
    } else {
      // fp16 codes two at a time (cvt.rn.f16x2.f32: two cvt.rn.f16.f32, as c10::Half's).
#pragma unroll
      for (int e = 0; e < kPerLane; e += 2) {
        const __half2 h2 =
            __floats2half2_rn(scaled<kSigned>(x[e], sc), scaled<kSigned>(x[e + 1], sc));
        memcpy(&w[e / 2], &h2, 4);
      }
    }
  }
};

}  // namespace blockwise_cuda
}  // namespace shardopt
