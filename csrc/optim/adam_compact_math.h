// Adam over compact state (docs/spec.md "Compact state formats"): the slots of the adam_compact
// and adam_blockwise kernels and how their master is read and written. The update is
// adam::update<float> (adam_math.h), unchanged; the codec is state_codec.h.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "adam_math.h"
#include "state_codec.h"

namespace shardopt {
namespace adam_compact {

// Tensor-list slots, the same 7 for both kernels (shardopt._ops.adam_compact). kRemainder is
// empty or one int16 tensor per param; the scale lists are empty (adam_compact) or hold one fp32
// tensor of num_blocks(numel) elements per param (adam_blockwise).
constexpr int kGrad = 0;
constexpr int kParam = 1;
constexpr int kRemainder = 2;
constexpr int kExpAvg = 3;
constexpr int kExpAvgSq = 4;
constexpr int kExpAvgScale = 5;
constexpr int kExpAvgSqScale = 6;
constexpr int kLists = 7;

// How the fp32 master of element i is stored: P itself (fp32 master, or a bf16/fp16 param that is
// the master, rounded to nearest even), or with Rem a bf16 param and an int16 remainder joined
// exactly (state_codec.h). Host code (the CPU loops); the CUDA traversals carry the same values in
// registers.
template <typename P, bool Rem>
struct Master {
  static_assert(!Rem || std::is_same_v<P, c10::BFloat16>, "remainders go with bf16 params");

  static inline float load(const P* p, const int16_t* r, int64_t i) {
    if constexpr (Rem) {
      return codec::join_master(p[i].x, r[i]);
    } else {
      return codec::to_float(p[i]);
    }
  }

  static inline void store(P* p, int16_t* r, int64_t i, float master) {
    if constexpr (Rem) {
      codec::split_master(master, p[i].x, r[i]);
    } else {
      p[i] = codec::from_float<P>(master);
    }
  }
};

// ---- CPU: tiles ---------------------------------------------------------------------------------
// adam_blockwise's CPU kernel works through a tensor in tiles of one block: each loads into float
// buffers, runs the update over them, then stores, max-reduces and encodes (the block's scale
// needs every element's new value before the first code). Every phase is a plain loop over one or
// two buffers, which GCC vectorises. adam_compact's CPU kernel needs no tiles: one fused loop
// (adam_compact_cpu.cpp). update_tile's expression is adam_cpu.cpp's, the same bits.
template <int N>
struct Tile {
  static constexpr int kSize = N;
  float g[N];
  float p[N];
  float m[N];
  float v[N];
};

template <typename M, typename T, typename G, typename P>
inline void load_tile(T& t, const G* g, const P* p, const int16_t* r, int64_t i0, int n) {
#pragma omp simd
  for (int j = 0; j < n; ++j) t.g[j] = codec::to_float(g[i0 + j]);
#pragma omp simd
  for (int j = 0; j < n; ++j) t.p[j] = M::load(p, r, i0 + j);
}

template <typename T>
inline void update_tile(T& t, int n, float gs, const adam::Hyper<float>& h) {
  const auto hl = h;  // local copies: stores through the buffers cannot alias them
  const float gsl = gs;
#pragma omp simd
  for (int j = 0; j < n; ++j) {
    float pi = t.p[j];
    adam::update<float>(pi, t.g[j] * gsl, t.m[j], t.v[j], hl);
    t.p[j] = pi;
  }
}

template <typename M, typename T, typename P>
inline void store_master(const T& t, P* p, int16_t* r, int64_t i0, int n) {
#pragma omp simd
  for (int j = 0; j < n; ++j) M::store(p, r, i0 + j, t.p[j]);
}

}  // namespace adam_compact
}  // namespace shardopt
