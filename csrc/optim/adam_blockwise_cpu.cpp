// Adam over blockwise compact state (scaled_fp16, int8) on CPU tensors: cpu::apply over
// (tensor, chunk) work items of whole blocks; per block the tile phases of adam_compact_math.h
// with a decode before the update and, after it, v's root, a max reduction and an encode.
#include <algorithm>
#include <cstring>
#include <memory>

#include "../kernels.h"
#include "../multi_tensor/cpu_apply.h"
#include "../multi_tensor/dispatch.h"
#include "adam_blockwise_math.h"

namespace shardopt {
namespace {

using codec::kBlock;
static_assert(cpu::kChunkSize % kBlock == 0, "work items must start on a block");

std::unique_ptr<codec::Int8Tables> build_tables(const uint32_t* map_bits, bool is_signed) {
  auto t = std::make_unique<codec::Int8Tables>();
  codec::tables_fill_map(*t, map_bits, is_signed, 0, 1);
  codec::tables_fill_entries(*t, 0, 1);
  codec::tables_fill_buckets(*t, 0, 1);
  return t;
}

// The int8 search tables of the signed (m) and unsigned (v) maps, built on first use.
const codec::Int8Tables& int8_tables(bool is_signed) {
  static constexpr uint32_t kSigned[256] = {SHARDOPT_SIGNED_MAP_BITS};
  static constexpr uint32_t kUnsigned[256] = {SHARDOPT_UNSIGNED_MAP_BITS};
  static const auto signed_tables = build_tables(kSigned, true);
  static const auto unsigned_tables = build_tables(kUnsigned, false);
  return is_signed ? *signed_tables : *unsigned_tables;
}

// Note: int8 encode on CPU. The encode loops look codes up in the search words of the CUDA
// kernel (codec::int8_code_search: one gather per code) rather than by codec::int8_code over
// Int8Tables (three gathers: the bucket's base, two entries). The two give the same code for every
// fp32 |xn| < 2 of either map (checked over all 2^32 patterns against int8_code, 2026-12-02), and
// an encoded value is finite with |xn| <= 1 + 2^-23 (Int8::scaled, Int8::scaled_root).
std::unique_ptr<uint32_t[]> build_words(bool is_signed) {
  const codec::Int8Tables& t = int8_tables(is_signed);
  const int words = is_signed ? codec::kSignedWords : codec::kUnsignedWords;
  auto w = std::make_unique<uint32_t[]>(words);
  for (int i = 0; i < words; ++i) w[i] = codec::search_word(t.map, t.zero, is_signed, i);
  return w;
}

// The search words of the signed (m) and unsigned (v) maps, built on first use.
const uint32_t* int8_words(bool is_signed) {
  static const auto signed_words = build_words(true);
  static const auto unsigned_words = build_words(false);
  return is_signed ? signed_words.get() : unsigned_words.get();
}

template <typename Ty, typename Fmt>
void run(const TensorLists& lists, const adam::Hyper<float>& h, float gs) {
  using namespace adam_compact;
  using G = typename Ty::grad_t;
  using P = typename Ty::param_t;
  using C = typename Fmt::code_t;
  using M = Master<P, Ty::remainder>;
  const codec::Int8Tables* tm = Fmt::kTables ? &int8_tables(true) : nullptr;
  const codec::Int8Tables* tv = Fmt::kTables ? &int8_tables(false) : nullptr;
  const uint32_t* wm = Fmt::kTables ? int8_words(true) : nullptr;
  const uint32_t* wv = Fmt::kTables ? int8_words(false) : nullptr;
  auto g = cpu::pointers<G>(lists[kGrad]);
  auto p = cpu::pointers<P>(lists[kParam]);
  auto r = cpu::pointers<int16_t>(lists[kRemainder]);
  auto m = cpu::pointers<C>(lists[kExpAvg]);
  auto v = cpu::pointers<C>(lists[kExpAvgSq]);
  auto ms = cpu::pointers<float>(lists[kExpAvgScale]);
  auto vs = cpu::pointers<float>(lists[kExpAvgSqScale]);
  cpu::apply(lists[kGrad], [&](int64_t k, int64_t s, int64_t e) {
    // local copies: uint8 code stores may alias anything, captures included
    const codec::Int8Tables* const tml = tm;
    const codec::Int8Tables* const tvl = tv;
    const uint32_t* const wml = wm;
    const uint32_t* const wvl = wv;
    int16_t* rk = Ty::remainder ? r[k] : nullptr;
    C* mk = m[k];
    C* vk = v[k];
    Tile<kBlock> t;
    C cm[kBlock];
    C cv[kBlock];
    for (int64_t b0 = s; b0 < e; b0 += kBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kBlock, e - b0));
      const int64_t block = b0 / kBlock;
      const float m_scale = ms[k][block];
      const float v_scale = vs[k][block];
      load_tile<M>(t, g[k], p[k], rk, b0, n);
#pragma omp simd
      for (int j = 0; j < n; ++j) {
        t.m[j] = Fmt::decode(mk[b0 + j], m_scale, tml);
        t.v[j] = Fmt::decode_v(vk[b0 + j], v_scale, tvl);
      }
      update_tile(t, n, gs, h);
      store_master<M>(t, p[k], rk, b0, n);
#pragma omp simd
      for (int j = 0; j < n; ++j) t.v[j] = codec::v_root(t.v[j]);  // v is stored as its root
      uint32_t m_amax = 0;
      uint32_t v_amax = 0;
#pragma omp simd reduction(max : m_amax, v_amax)
      for (int j = 0; j < n; ++j) {
        m_amax = std::max(m_amax, codec::abs_bits(t.m[j]));
        v_amax = std::max(v_amax, codec::abs_bits(t.v[j]));
      }
      const codec::Scale mc = Fmt::scale(m_amax);
      const codec::Scale vc = Fmt::scale(v_amax);
      if constexpr (Fmt::kTables) {
        // The codes go to local buffers first: a store through a uint8 pointer may alias the
        // tables, which kept GCC from vectorising the int8 encode loops (see Note: int8 encode on
        // CPU). scaled_fp16 keeps its loops: restructured, the avx2 build gave some NaN codes
        // another sign.
        const float v_tiny = Fmt::tiny(tvl);
        for (int j = 0; j < n; ++j) {
          cm[j] = codec::int8_code_search(Fmt::scaled(t.m[j], mc), wml, true);
        }
        for (int j = 0; j < n; ++j) {
          cv[j] = codec::int8_code_search(Fmt::scaled_root(t.v[j], vc, v_tiny), wvl, false);
        }
        std::memcpy(mk + b0, cm, n * sizeof(C));
        std::memcpy(vk + b0, cv, n * sizeof(C));
      } else {
#pragma omp simd
        for (int j = 0; j < n; ++j) mk[b0 + j] = Fmt::encode(t.m[j], mc, tml);
#pragma omp simd
        for (int j = 0; j < n; ++j) vk[b0 + j] = Fmt::encode_root(t.v[j], vc, tvl);
      }
      ms[k][block] = mc.scale;
      vs[k][block] = vc.scale;
    }
  });
}

}  // namespace

void adam_blockwise_cpu(const TensorLists& lists, double lr, double beta1, double beta2,
                        double eps, int64_t step, bool adam_w_mode, bool bias_correction,
                        double weight_decay, const OptTensor& lr_t, const OptTensor& step_t,
                        const OptTensor& grad_scale_t, const OptTensor& found_inf_t) {
  using namespace adam_compact;
  const bool remainder = check_compact_lists(lists, true, c10::DeviceType::CPU, "adam_blockwise",
                                             {at::kHalf, at::kByte});
  if (lists[0].empty() || cpu::skip_step(found_inf_t)) return;
  const double t = cpu::scalar_or(step_t, static_cast<double>(step));
  const adam::Hyper<float> h =
      adam::make_hyper<float>(cpu::scalar_or(lr_t, lr), beta1, beta2, eps, t, adam_w_mode,
                              bias_correction, weight_decay);
  const float gs = static_cast<float>(cpu::scalar_or(grad_scale_t, 1.0));
  const bool int8 = lists[kExpAvg][0].scalar_type() == at::kByte;
  dispatch_master(lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), remainder,
                  "adam_blockwise", [&](auto types) {
                    using Ty = decltype(types);
                    if (int8) return run<Ty, adam_blockwise::Int8>(lists, h, gs);
                    run<Ty, adam_blockwise::ScaledFp16>(lists, h, gs);
                  });
}

}  // namespace shardopt
