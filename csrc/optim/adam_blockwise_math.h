// Adam over blockwise compact state (docs/spec.md "Compact state formats"): the two formats as
// codec policies over state_codec.h, shared by adam_blockwise_{cpu.cpp,cuda.cu}. Per block of
// codec::kBlock elements both backends decode m and v (v from its root: decode_v), run
// adam::update<float> per element (the master as adam_compact_math.h stores it), take v's root
// (codec::v_root), the new amax of m and of the roots over the block, and encode both with their
// block's new scale (the roots by encode_root: a positive root never takes the zero code).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

#include "adam_compact_math.h"
#include "state_codec.h"

namespace shardopt {
namespace adam_blockwise {

// "scaled_fp16": fp16 codes of x * (1 / s), s a power of two per block.
struct ScaledFp16 {
  using code_t = c10::Half;
  static constexpr bool kTables = false;

  static SHARDOPT_HD codec::Scale scale(uint32_t amax) { return codec::fp16_scale(amax); }
  static SHARDOPT_HD float decode(code_t c, float s, const codec::Int8Tables*) {
    return codec::to_float(c) * s;
  }
  static SHARDOPT_HD code_t encode(float x, const codec::Scale& s, const codec::Int8Tables*) {
    return codec::from_float<code_t>(x * s.inv);
  }
  static SHARDOPT_HD float decode_v(code_t c, float s, const codec::Int8Tables* t) {
    return codec::v_of_root(decode(c, s, t));
  }
  static SHARDOPT_HD code_t encode_root(float r, const codec::Scale& s, const codec::Int8Tables*) {
    return codec::from_float<code_t>(codec::floor_positive(r, r * s.inv, codec::kHalfTiny));
  }
};

// "int8": indices into the dynamic map (m: signed, v: unsigned) of x * (1 / amax).
struct Int8 {
  using code_t = uint8_t;
  static constexpr bool kTables = true;

  static SHARDOPT_HD codec::Scale scale(uint32_t amax) { return codec::int8_scale(amax); }
  static SHARDOPT_HD float decode(code_t c, float s, const codec::Int8Tables* t) {
    return t->map[static_cast<int32_t>(c)] * s;
  }
  // The value whose code is m's (a non-finite block: zero codes), and v's root's with tiny the
  // unsigned map's smallest positive value (tiny(t)). Always finite, |value| <= 1 + 2^-23.
  static SHARDOPT_HD float scaled(float x, const codec::Scale& s) {
    return s.finite ? x * s.inv : 0.f;
  }
  static SHARDOPT_HD float scaled_root(float r, const codec::Scale& s, float tiny) {
    return s.finite ? codec::floor_positive(r, r * s.inv, tiny) : 0.f;
  }
  static SHARDOPT_HD code_t encode(float x, const codec::Scale& s, const codec::Int8Tables* t) {
    return codec::int8_code(scaled(x, s), *t);
  }
  // v: t is the unsigned map's; map[1] is its smallest positive value.
  static SHARDOPT_HD float decode_v(code_t c, float s, const codec::Int8Tables* t) {
    return codec::v_of_root(decode(c, s, t));
  }
  static SHARDOPT_HD code_t encode_root(float r, const codec::Scale& s,
                                        const codec::Int8Tables* t) {
    return encode_root(r, s, tiny(t), t);
  }
  // encode_root with tiny(t) passed in: the CPU loop reads it once per block, since a load of
  // map[1] inside the loop kept GCC from vectorising it (the loop ran scalar, half of the step).
  static SHARDOPT_HD float tiny(const codec::Int8Tables* t) { return t->map[1]; }
  static SHARDOPT_HD code_t encode_root(float r, const codec::Scale& s, float tiny,
                                        const codec::Int8Tables* t) {
    return codec::int8_code(scaled_root(r, s, tiny), *t);
  }
};

}  // namespace adam_blockwise
}  // namespace shardopt
