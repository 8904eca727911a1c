// The compact state codec of shardopt/state_codec.py, bit for bit, host and device (see Note:
// compact state formats there): the fp32 master split into a bf16 param and an int16 remainder,
// the block amax, the scales of the blockwise formats and the int8 code search. Used by
// adam_compact_{cpu,cuda} and adam_blockwise_{cpu,cuda}; fp32 and integer arithmetic only, no
// math library call, so both backends and torch give the same bits.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "math_common.h"
#include "quantization_map.h"

namespace shardopt {
namespace codec {

constexpr int kBlock = 256;  // elements per block of the blockwise formats (state_codec.BLOCK)
constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kNanBits = 0x7FC00000u;
constexpr uint32_t kMinNormalBits = 0x00800000u;  // 2^-126

SHARDOPT_HD uint32_t bits_of(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

SHARDOPT_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

// fp16 <-> fp32 on the host: the branch-free conversions of Marat Dukhan's FP16 library
// (c10::Half's own path without F16C), which the CPU loops vectorise; c10::Half uses scalar F16C
// intrinsics where it can, and those keep a loop from vectorising. Exact, rounding to nearest
// even like the hardware (NaN payloads aside). The device uses c10::Half.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = float_of((two_w >> 4) + (0xE0u << 23)) * float_of(0x07800000u);
  const float denormalized = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
  return float_of(sign | (two_w < (1u << 27) ? bits_of(denormalized) : bits_of(normalized)));
}

inline uint16_t float_to_half_bits(float f) {
  float base = (float_of(bits_of(f) & kAbsMask) * float_of(239u << 23)) * float_of(17u << 23);
  const uint32_t w = bits_of(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = float_of((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = bits_of(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// Element conversions to and from the float registers: static_cast, except fp16 on the host.
template <typename T>
SHARDOPT_HD float to_float(T x) {
#if !defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, c10::Half>) return half_bits_to_float(x.x);
#endif
  return static_cast<float>(x);
}

template <typename T>
SHARDOPT_HD T from_float(float x) {
#if !defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, c10::Half>) {
    return c10::Half(float_to_half_bits(x), c10::Half::from_bits());
  }
#endif
  return static_cast<T>(x);
}

// ---- the master: bf16 param bits (hi) + int16 remainder (lo) -----------------------------------

// bits(master) = (hi << 16) + lo (mod 2^32): exact for every pattern.
SHARDOPT_HD float join_master(uint16_t hi, int16_t lo) {
  return float_of((static_cast<uint32_t>(hi) << 16) +
                  static_cast<uint32_t>(static_cast<int32_t>(lo)));
}

// hi rounded half away from zero (in magnitude), lo the signed rest; a NaN gives a quiet NaN with
// its sign and lo = 0. NaN is tested on the bits (immune to -ffast-math style assumptions).
SHARDOPT_HD void split_master(float master, uint16_t& hi, int16_t& lo) {
  const uint32_t u = bits_of(master);
  const bool nan = (u & kAbsMask) > kInfBits;
  hi = nan ? static_cast<uint16_t>(0x7FC0u | ((u >> 16) & 0x8000u))
           : static_cast<uint16_t>((u + 0x8000u) >> 16);
  lo = nan ? int16_t{0} : static_cast<int16_t>(static_cast<uint16_t>(u & 0xFFFFu));
}

// ---- blocks ------------------------------------------------------------------------------------

// |x| as bits: an integer max of these is the block amax, with NaN above inf above any finite.
SHARDOPT_HD uint32_t abs_bits(float x) { return bits_of(x) & kAbsMask; }

// A block's scale and its exact (power of two) or fp32-rounded inverse.
struct Scale {
  float scale;
  float inv;
  bool finite;  // int8: false for a block holding inf/NaN (every code is then the zero code)
};

// scaled_fp16: s = 2^max(E - 15, -126) for amax = f * 2^E, f in [0.5, 1); 1 for amax 0 or not
// finite. As biased exponents: e(s) = max(e(amax), 15) - 14, and 1 / s has 254 - e(s).
SHARDOPT_HD Scale fp16_scale(uint32_t amax) {
  const uint32_t biased = amax >> 23;
  const uint32_t e = (amax == 0u || amax >= kInfBits) ? 127u : (biased > 15u ? biased : 15u) - 14u;
  return {float_of(e << 23), float_of((254u - e) << 23), true};
}

// int8: scale = amax and inv = 1.0f / amax; scale 0 (codes of 0.0) below 2^-126; +inf or NaN for a
// block holding inf or NaN.
SHARDOPT_HD Scale int8_scale(uint32_t amax) {
  if (amax < kMinNormalBits) return {0.f, 0.f, true};
  if (amax >= kInfBits) return {float_of(amax > kInfBits ? kNanBits : kInfBits), 0.f, false};
  const float a = float_of(amax);
  return {a, 1.0f / a, true};
}

// ---- the second moment v ------------------------------------------------------------------------
//
// fp16, scaled_fp16 and int8 keep v as its root r = sqrt(v), correctly rounded, and decode
// v = r * r: r has m's dynamic range, where v's own (fp16's; relative to the block amax in the
// blockwise formats) underflowed where m did not, and the update became m / eps. A block's scale
// is that of its roots. A positive stored value (v in bf16, r elsewhere) never takes a zero code:
// below the smallest positive code value it takes that value (floor_positive; state_codec.py's
// Note: compact state formats). fp32 and bf16 keep v.
constexpr float kHalfTiny = 0x1p-24f;   // the smallest positive fp16 (fp16 and scaled_fp16 codes)
constexpr float kBf16Tiny = 0x1p-133f;  // the smallest positive bf16

SHARDOPT_HD float v_root(float v) { return sqrt_of(v); }
SHARDOPT_HD float v_of_root(float r) { return r * r; }

// x (the stored value q, scaled) raised to tiny where q is positive (a NaN q is not).
SHARDOPT_HD float floor_positive(float q, float x, float tiny) {
  return q > 0.f && x < tiny ? tiny : x;
}

// The elementwise formats (code type S): v from the value of its code, and the value whose
// rounding to S is v's code (fp32: v itself both ways).
template <typename S>
SHARDOPT_HD float v_from_code_value(float x) {
  if constexpr (std::is_same_v<S, c10::Half>) return v_of_root(x);
  return x;
}

template <typename S>
SHARDOPT_HD float v_code_value(float v) {
  if constexpr (std::is_same_v<S, float>) {
    return v;
  } else if constexpr (std::is_same_v<S, c10::Half>) {
    const float r = v_root(v);
    return floor_positive(r, r, kHalfTiny);
  } else {  // bf16
    return floor_positive(v, v, kBf16Tiny);
  }
}

template <typename S>
SHARDOPT_HD float decode_v(S code) {
  return v_from_code_value<S>(to_float(code));
}

template <typename S>
SHARDOPT_HD S encode_v(float v) {
  return from_float<S>(v_code_value<S>(v));
}

// ---- the int8 code search ----------------------------------------------------------------------
//
// code(xn) = #{j < 255 : mid[j] < xn}, mid[j] = (map[j] + map[j + 1]) * 0.5f. With z the code of
// 0.0 (mid[j] < 0 exactly for j < z): for xn >= 0, code = z + #{positive mids < xn}; for xn < 0,
// code = z - #{negative mids with |mid| <= |xn|} = z - #{nextdown(|mid|) < |xn|}. So both signs
// count table entries below |xn| (side 0: the positive mids; side 1: nextdown of the negative
// mids' magnitudes), each a lookup by the bits of |xn| (its exponent and 6 mantissa bits: 1537
// buckets from 2^-24 to 1; every smaller |xn| is in bucket 0, which no entry reaches) giving the
// entries below the bucket, plus kProbe comparisons with those inside it (at most 2 per bucket in
// both maps; tests/kernels/test_adam_compact.py checks). Branch-free: the sign picks the side.

constexpr int kProbe = 2;
constexpr uint32_t kBucketFirst = 103u << 6;  // (bits >> 17) of 2^-24
constexpr int kBuckets = (127 << 6) - (103 << 6) + 1;

SHARDOPT_HD int bucket_of(uint32_t abs) {
  const uint32_t k = abs >> 17;
  const uint32_t b = k < kBucketFirst ? 0u : k - kBucketFirst;
  return b < static_cast<uint32_t>(kBuckets - 1) ? static_cast<int>(b) : kBuckets - 1;
}

// The smallest |x| of bucket b (0 for bucket 0, which holds everything below bucket 1).
SHARDOPT_HD float bucket_floor(int b) {
  return b == 0 ? 0.f : float_of((static_cast<uint32_t>(b) + kBucketFirst) << 17);
}

// The tables of one map for the CPU kernels, built once (the CUDA kernel uses the search words
// below). Flat, 32-bit and indexed by int, so that the CPU loops gather them.
constexpr int kSide = 256 + kProbe;
struct Int8Tables {
  float map[256];
  float entries[2 * kSide];     // side s at [s * kSide, ...): ascending, then +inf
  int32_t base[2 * kBuckets];  // side s at [s * kBuckets, ...): the entries below the bucket
  int32_t count[2];             // entries per side
  int32_t zero;                 // the code of 0.0
};

// Number of a[0..n) (ascending) below x.
SHARDOPT_HD int count_below(const float* a, int n, float x) {
  int lo = 0;
  for (int step = 256; step > 0; step >>= 1) {
    const int k = lo + step - 1;
    if (k < n && a[k] < x) lo += step;
  }
  return lo;
}

// Building a table in three phases, each over indices i = first, first + stride, ... (host: 0, 1;
// device: the threads of a block, synchronised between phases).
SHARDOPT_HD void tables_fill_map(Int8Tables& t, const uint32_t* map_bits, bool is_signed, int first,
                                 int stride) {
  for (int i = first; i < 256; i += stride) t.map[i] = float_of(map_bits[i]);
  if (first == 0) {
    t.zero = is_signed ? 127 : 0;  // the negative values of the map
    t.count[0] = 255 - t.zero;
    t.count[1] = t.zero;
  }
}

// Entry k (ascending) of a side: side 0 the positive mids mid[zero + k]; side 1 nextdown(|mid|) of
// the negative mids, mid[zero - 1 - k].
SHARDOPT_HD float side_entry(const float* map, int zero, int side, int k) {
  const int j = side ? zero - 1 - k : zero + k;
  const float mid = (map[j] + map[j + 1]) * 0.5f;
  return side ? float_of(abs_bits(mid) - 1u) : mid;
}

SHARDOPT_HD void tables_fill_entries(Int8Tables& t, int first, int stride) {
  for (int j = first; j < 255 + 2 * kProbe; j += stride) {
    if (j < 255) {
      if (j < t.zero) {
        t.entries[kSide + t.zero - 1 - j] = side_entry(t.map, t.zero, 1, t.zero - 1 - j);
      } else {
        t.entries[j - t.zero] = side_entry(t.map, t.zero, 0, j - t.zero);
      }
    } else {
      const int side = (j - 255) / kProbe;  // kProbe pads after each side's entries
      t.entries[side * kSide + t.count[side] + (j - 255) % kProbe] = float_of(kInfBits);
    }
  }
}

SHARDOPT_HD void tables_fill_buckets(Int8Tables& t, int first, int stride) {
  for (int i = first; i < 2 * kBuckets; i += stride) {
    const int side = i / kBuckets;
    const int b = i % kBuckets;
    t.base[i] = count_below(t.entries + side * kSide, t.count[side], bucket_floor(b));
  }
}

SHARDOPT_HD uint8_t int8_code(float xn, const Int8Tables& t) {
  const uint32_t u = bits_of(xn);
  const uint32_t abs = u & kAbsMask;
  const float ax = float_of(abs);
  const int side = static_cast<int>(u >> 31);
  const int k = t.base[side * kBuckets + bucket_of(abs)];
  const int e = side * kSide + k;
  const int c = k + (t.entries[e] < ax) + (t.entries[e + 1] < ax);
  return static_cast<uint8_t>(side ? t.zero - c : t.zero + c);
}

// ---- the int8 code search of the CUDA kernel: one word per bucket ------------------------------
//
// Buckets of |xn| by its exponent and 7 mantissa bits (bits >> 16) from 2^-24 up to 2 hold at most
// one entry of a side in both maps (search_check; tests/kernels/test_state_codec_kernels.py), so
// the count of a side's entries below |xn| is the count below the bucket plus one comparison with
// the bucket's entry, if any, on the low 16 bits. The kernel looks up x = bits(xn) with the sign
// folded into the other bits (x = u ^ (u >> 31), arithmetic shift: a negative xn has its magnitude
// bits inverted), so that x >> 16 runs over side 0's buckets (xn > 0) and then side 1's in reverse
// (xn < 0) in one table of 2 * kSearchBuckets words, with the sentinel after them; the unsigned map
// has side 0 and the sentinel. Index: min((x >> 16) - kSearchFirst, sentinel), unsigned (|xn|
// below 2^-24 either side wraps or runs past the end: the sentinel; |xn| <= 1 + 2^-23 is never 2
// or more in a finite block; a negative xn of the unsigned map lands on the sentinel: code 0).
// A word is thr << 16 | base, and code = the low byte of word + ((x << 16) > word), i.e. base + 1
// when the low 16 bits of x exceed thr (thr 0xFFFF: never): for side 0, thr is the low bits of the
// bucket's entry and base the code below it; for side 1, where x's low bits are those of |xn|
// inverted, "|xn|'s low bits > thr" is "x's low bits <= 0xFFFF - thr - 1", so the word holds
// thr' = 0xFFFE - thr and the code one below (zero - below - 1), and x's low bits > thr' adds the
// one back. An entry whose low bits are 0xFFFF is never exceeded within its bucket: no entry there.
constexpr uint32_t kSearchFirst = 0x3380u;                                // (bits >> 16) of 2^-24
constexpr int kSearchBuckets = static_cast<int>(0x4000u - kSearchFirst);  // |xn| in [2^-24, 2)
constexpr int kSignedWords = 2 * kSearchBuckets + 1;    // side 0, side 1 reversed, sentinel
constexpr int kUnsignedWords = kSearchBuckets + 1;      // side 0, sentinel

// The sign-folded bits of xn.
SHARDOPT_HD uint32_t search_bits(float xn) {
  const uint32_t u = bits_of(xn);
  return u ^ static_cast<uint32_t>(static_cast<int32_t>(u) >> 31);
}

// The word index of sign-folded bits x in a table of `words` words (the last: the sentinel).
SHARDOPT_HD uint32_t search_index(uint32_t x, int words) {
  const uint32_t k = (x >> 16) - kSearchFirst;
  const uint32_t last = static_cast<uint32_t>(words - 1);
  return k < last ? k : last;
}

// The code from a bucket's word: its low byte, plus one if x's low 16 bits exceed its thr.
SHARDOPT_HD uint8_t search_code(uint32_t word, uint32_t x) {
  return static_cast<uint8_t>(word + ((x << 16) > word ? 1u : 0u));
}

// Word i of a table of a map (zero: the code of 0.0; is_signed: the signed map, two sides).
SHARDOPT_HD uint32_t search_word(const float* map, int zero, bool is_signed, int i) {
  const int words = is_signed ? kSignedWords : kUnsignedWords;
  if (i >= words - 1) return 0xFFFF0000u | static_cast<uint32_t>(zero);
  const int side = i >= kSearchBuckets ? 1 : 0;
  const uint32_t bucket =
      kSearchFirst + static_cast<uint32_t>(side ? 2 * kSearchBuckets - 1 - i : i);
  const int count = side ? zero : 255 - zero;
  int below = 0;  // the side's entries below the bucket
  for (int step = 256; step > 0; step >>= 1) {
    const int k = below + step - 1;
    if (k < count && (bits_of(side_entry(map, zero, side, k)) >> 16) < bucket) below += step;
  }
  const uint32_t e = below < count ? bits_of(side_entry(map, zero, side, below)) : 0u;
  const uint32_t thr = below < count && (e >> 16) == bucket ? (e & 0xFFFFu) : 0xFFFFu;
  if (side == 0) return (thr << 16) | static_cast<uint32_t>(zero + below);
  if (thr == 0xFFFFu) return 0xFFFF0000u | static_cast<uint32_t>(zero - below);
  return ((0xFFFEu - thr) << 16) | static_cast<uint32_t>(zero - below - 1);
}

// Whether the search's assumptions hold for a map: every entry of both sides at least 2^-24 and
// below 2, and no two in one bucket.
inline bool search_check(const float* map, int zero) {
  for (int side = 0; side < 2; ++side) {
    const int count = side ? zero : 255 - zero;
    for (int k = 0; k < count; ++k) {
      const uint32_t e = bits_of(side_entry(map, zero, side, k));
      if (e < (kSearchFirst << 16) || e >= 0x40000000u) return false;
      if (k > 0 && (bits_of(side_entry(map, zero, side, k - 1)) >> 16) == (e >> 16)) return false;
    }
  }
  return true;
}

// The code of xn from a map's table (the signed map: both sides; unsigned: side 0).
SHARDOPT_HD uint8_t int8_code_search(float xn, const uint32_t* words, bool is_signed) {
  const uint32_t x = is_signed ? search_bits(xn) : bits_of(xn);
  return search_code(words[search_index(x, is_signed ? kSignedWords : kUnsignedWords)], x);
}

}  // namespace codec
}  // namespace shardopt
