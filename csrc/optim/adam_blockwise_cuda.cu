// Adam over blockwise compact state (scaled_fp16, int8) on CUDA tensors (docs/kernels.md "Compact
// state kernels"). The lists are packed into launches as cuda_apply.cuh does (for_each_launch), but
// the grid is persistent: as many thread blocks as fit on the SMs, whose warps take the launch's
// 256-element blocks in turn (warp w of the grid: blocks w, w + warps, ...), so int8's search
// tables are built once per thread block and no SM idles while a thread block drains. One warp per
// block: lane l holds elements [8l, 8l + 8) in registers, loaded and stored as 16-byte accesses
// (8 bytes for int8 codes) when the tensors are aligned. The block's amax is a warp max of the bits
// (no shared memory, no atomics: deterministic) and lane 0 writes the scales.
//
// The Adam math is adam_math.h's (moments, direction, apply_step) with the divisions and the square
// root of the direction evaluated, where every operand is in a range that keeps them exact
// (FastDirection), by the instruction sequences nvcc emits for `/` and sqrt on their fast path,
// with the reciprocals of the bias corrections computed once: the same bits, without the branch
// around each division that kept the 8 elements of a lane from overlapping. Elsewhere the plain
// expression.
//
// int8 codes: one shared-memory word per bucket of |xn| (state_codec.h, int8_code_search): one
// lookup and one comparison per code; decoding reads the maps from shared memory.
#include <c10/cuda/CUDAException.h>

#include <array>
#include <atomic>

#include "../kernels.h"
#include "../multi_tensor/cuda_elementwise.cuh"
#include "../multi_tensor/dispatch.h"
#include "adam_blockwise_math.h"

namespace shardopt {
namespace {

using codec::kBlock;
constexpr int kPerLane = kBlock / 32;
static_assert(kPerLane == 8, "a warp holds one block, 8 elements per lane");
static_assert(cuda::kChunkSize % kBlock == 0, "chunks must start on a block");
constexpr int kBlocksPerChunk = static_cast<int>(cuda::kChunkSize / kBlock);
static_assert(kBlocksPerChunk == 256, "a launch's block index is chunk * 256 + block");

__constant__ uint32_t kSignedMapBits[256] = {SHARDOPT_SIGNED_MAP_BITS};
__constant__ uint32_t kUnsignedMapBits[256] = {SHARDOPT_UNSIGNED_MAP_BITS};

// Launch shape: kThreads and kMinCtas go to __launch_bounds__ (the register cap is
// 65536 / (kThreads * kMinCtas)). Measured on an H200 (docs/benchmarks.md, "Compact state
// formats"): 512 x 2 (64 registers, 32 warps per SM) beat 256 x 3, 256 x 5 (spills) and a 512 x 1
// variant that kept a second register set with the next block's loads in flight.
template <int Threads, int MinCtas>
struct Config {
  static constexpr int kThreads = Threads;
  static constexpr int kMinCtas = MinCtas;
};
// The build's configuration; a build may name another to tune:
// -DSHARDOPT_BLOCKWISE_CONFIG='Config<256, 3>'.
#ifndef SHARDOPT_BLOCKWISE_CONFIG
#define SHARDOPT_BLOCKWISE_CONFIG Config<512, 2>
#endif
using DefaultConfig = SHARDOPT_BLOCKWISE_CONFIG;

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

// ---- the direction (m / bc1) / (sqrt(v / bc2) + eps) without the division subroutines ----------
//
// nvcc's `a / b` (div.rn.f32) on sm_90 is y0 = rcp.approx(b), y = fma(y0, fma(y0, -b, 1), y0),
// q = fma(y, a, 0), r = fma(q, -b, a), fma(y, r, q), taken when a range check (FCHK) passes, else a
// subroutine; its sqrt(x) (sqrt.rn.f32) is r = rsqrt.approx(x), s = x * r, h = r * 0.5,
// fma(fma(-s, s, x), h, s) for x in [2^-101, FLT_MAX], else a subroutine. Both give the correctly
// rounded result. FastDirection evaluates the same sequences when every operand, intermediate and
// result is a normal number far from the ends of the range: bc1, bc2 in [2^-20, 1] and eps in
// [0, 2^40] (per thread block), |m| in [2^-60, 2^40) and v in [2^-100, 2^60) (per lane, all 8
// elements); then m / bc1 is in [2^-60, 2^60], v / bc2 in [2^-100, 2^80] (the sqrt sequence's own
// range), the denominator in [2^-50, 2^41] and the quotient in [2^-101, 2^110], far from
// subnormals and overflow, so the sequences give the correctly rounded results, the bits of the
// plain expression; the y of a bias correction is computed once. Outside these ranges (zeros, tiny
// or huge moments, odd hyperparameters) the plain expression runs. On an H200 the sequences matched
// `/` and sqrt on every fp32 of these ranges (sqrt; division by 18 bias corrections) and on 2^36
// random operand sets; tests/test_adam_compact.py checks the kernel against correctly rounded fp32
// operations bit for bit.
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rsqrt_approx(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float div_rcp(float b) {
  const float y0 = rcp_approx(b);
  return __fmaf_rn(y0, __fmaf_rn(y0, -b, 1.f), y0);
}

// a / b given y = div_rcp(b), for a != 0 (fma(y, a, 0) is then y * a).
__device__ __forceinline__ float div_fast(float a, float b, float y) {
  const float q = __fmul_rn(y, a);
  return __fmaf_rn(y, __fmaf_rn(q, -b, a), q);
}

__device__ __forceinline__ float sqrt_fast(float x) {
  const float r = rsqrt_approx(x);
  const float s = __fmul_rn(x, r);
  const float h = __fmul_rn(r, 0.5f);
  return __fmaf_rn(__fmaf_rn(-s, s, x), h, s);
}

struct FastDirection {
  float y1, y2;  // div_rcp(bc1), div_rcp(bc2)
  bool ok;       // bc1, bc2, eps in range

  __device__ explicit FastDirection(const adam::Hyper<float>& h)
      : y1(div_rcp(h.bc1)), y2(div_rcp(h.bc2)), ok(in(h.bc1) && in(h.bc2) && h.eps >= 0.f &&
                                                   h.eps <= 0x1p40f) {}

  static __device__ __forceinline__ bool in(float bc) { return bc >= 0x1p-20f && bc <= 1.f; }

  // Whether m, v (after adam::moments) are in range: |m| in [2^-60, 2^40), v in [2^-100, 2^60).
  static __device__ __forceinline__ bool operands(float m, float v) {
    return fabsf(m) >= 0x1p-60f && fabsf(m) < 0x1p40f && v >= 0x1p-100f && v < 0x1p60f;
  }

  __device__ __forceinline__ float operator()(float m, float v, const adam::Hyper<float>& h) const {
    const float d = sqrt_fast(div_fast(v, h.bc2, y2)) + h.eps;
    return div_fast(div_fast(m, h.bc1, y1), d, div_rcp(d));
  }
};

// ---- int8 tables in shared memory --------------------------------------------------------------

struct Int8Smem {
  uint32_t words_m[2 * codec::kSearchWords];  // the signed map's search, sides 0 and 1
  uint32_t words_v[codec::kSearchWords];      // the unsigned map's, side 0
  float map_m[256];
  float map_v[256];

  __device__ void build() {
    const int t = threadIdx.x;
    const int n = blockDim.x;
    for (int i = t; i < 256; i += n) {
      map_m[i] = codec::float_of(kSignedMapBits[i]);
      map_v[i] = codec::float_of(kUnsignedMapBits[i]);
    }
    __syncthreads();
    constexpr int W = codec::kSearchWords;
    for (int i = t; i < 3 * W; i += n) {
      if (i < 2 * W) {
        const int side = i / W;
        words_m[i] = codec::search_word(map_m, 127, side, side ? 127 : 128, i - side * W);
      } else {
        words_v[i - 2 * W] = codec::search_word(map_v, 0, 0, 255, i - 2 * W);
      }
    }
    __syncthreads();
  }
};
static_assert(sizeof(Int8Smem) <= 48 * 1024, "int8 tables: within the default shared memory limit");

// ---- the op -------------------------------------------------------------------------------------

// A warp's block: its launch entry (tensor), first element, and elements (0: none).
struct Item {
  int local;
  int64_t start;
  int count;
};

template <typename Ty, typename Fmt, typename Cfg>
struct BlockwiseAdam : cuda::OpBase {
  static constexpr bool kRem = Ty::remainder;
  static constexpr bool kInt8 = Fmt::kTables;
  using G = typename Ty::grad_t;
  using P = std::conditional_t<kRem, uint16_t, typename Ty::param_t>;  // bf16 bits with a rem
  using C = typename Fmt::code_t;
  using Tables = Int8Smem;
  // Slots of the traversal's lists: the compact lists without an empty remainders list.
  static constexpr int kG = 0, kP = 1, kR = 2, kM = kRem ? kR + 1 : kR, kV = kM + 1, kMs = kV + 1,
                       kVs = kMs + 1, kDepth = kVs + 1;
  static constexpr int kWarps = Cfg::kThreads / 32;
  static constexpr size_t kSmemBytes = kInt8 ? sizeof(Tables) : 0;
  using Meta = cuda::ChunkMeta<kDepth>;
  adam::Hyper<float> h;  // host values; the device scalars replace them per thread block
  BiasCorrection bias;

  // The loaded operands of one lane.
  struct Raw {
    G g[kPerLane];
    P p[kPerLane];
    int16_t r[kPerLane];
    C m[kPerLane];
    C v[kPerLane];
    float ms, vs;
  };

  // Per thread block.
  struct Ctx {
    adam::Hyper<float> h;
    float gs;
    FastDirection fast;
    const Tables* tables;
    int lane;
  };

  template <typename T>
  static __device__ __forceinline__ T* slot(const Meta& meta, int s, const Item& it) {
    return static_cast<T*>(meta.addresses[s][it.local]) + it.start;
  }

  static __device__ __forceinline__ Item locate(const Meta& meta, int64_t i, int64_t total) {
    Item it{0, 0, 0};
    if (i >= total) return it;
    const int b = static_cast<int>(i / kBlocksPerChunk);
    it.local = cuda::find_entry(meta, b);
    it.start = cuda::chunk_of(meta, it.local, b) * cuda::kChunkSize +
               static_cast<int64_t>(i % kBlocksPerChunk) * kBlock;
    const int64_t left = meta.numel[it.local] - it.start;
    it.count = left <= 0 ? 0 : static_cast<int>(left < kBlock ? left : kBlock);
    return it;
  }

  static __device__ __forceinline__ bool aligned(const Meta& meta, int local) {
    return aligned8<G>(meta.addresses[kG][local]) && aligned8<P>(meta.addresses[kP][local]) &&
           (!kRem || aligned8<int16_t>(meta.addresses[kR][local])) &&
           aligned8<C>(meta.addresses[kM][local]) && aligned8<C>(meta.addresses[kV][local]);
  }

  static __device__ __forceinline__ void load(const Meta& meta, const Item& it, int lane, Raw& x) {
    if (it.count == 0) return;
    const int first = lane * kPerLane;
    const int n = min(max(it.count - first, 0), kPerLane);
    const bool vec = n == kPerLane && aligned(meta, it.local);
    load_lane(slot<const G>(meta, kG, it) + first, x.g, n, vec);
    load_lane(slot<const P>(meta, kP, it) + first, x.p, n, vec);
    if constexpr (kRem) load_lane(slot<const int16_t>(meta, kR, it) + first, x.r, n, vec);
    load_lane(slot<const C>(meta, kM, it) + first, x.m, n, vec);
    load_lane(slot<const C>(meta, kV, it) + first, x.v, n, vec);
    x.ms = *(static_cast<const float*>(meta.addresses[kMs][it.local]) + it.start / kBlock);
    x.vs = *(static_cast<const float*>(meta.addresses[kVs][it.local]) + it.start / kBlock);
  }

  __device__ __forceinline__ float decode(C c, float s, bool is_signed, const Ctx& ctx) const {
    if constexpr (kInt8) {
      return (is_signed ? ctx.tables->map_m[c] : ctx.tables->map_v[c]) * s;
    } else {
      return static_cast<float>(c) * s;
    }
  }

  __device__ __forceinline__ void process(const Meta& meta, const Item& it, Raw& x,
                                          const Ctx& ctx) const {
    if (it.count == 0) return;
    const int first = ctx.lane * kPerLane;
    const int n = min(max(it.count - first, 0), kPerLane);
    const bool vec = n == kPerLane && aligned(meta, it.local);
    const adam::Hyper<float>& hl = ctx.h;
    float master[kPerLane];
    float mf[kPerLane];
    float vf[kPerLane];
    bool fast = ctx.fast.ok;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      if constexpr (kRem) {
        master[e] = codec::join_master(x.p[e], x.r[e]);
      } else {
        master[e] = static_cast<float>(x.p[e]);
      }
      mf[e] = decode(x.m[e], x.ms, true, ctx);
      vf[e] = decode(x.v[e], x.vs, false, ctx);
      adam::moments<float>(master[e], static_cast<float>(x.g[e]) * ctx.gs, mf[e], vf[e], hl);
      fast = fast && FastDirection::operands(mf[e], vf[e]);
    }
    float u[kPerLane];
    if (fast) {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) u[e] = ctx.fast(mf[e], vf[e], hl);
    } else {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) u[e] = adam::direction<float>(mf[e], vf[e], hl);
    }
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      adam::apply_step<float>(master[e], u[e], hl);
      if constexpr (kRem) {
        codec::split_master(master[e], x.p[e], x.r[e]);
      } else {
        x.p[e] = static_cast<P>(master[e]);
      }
    }
    store_lane(slot<P>(meta, kP, it) + first, x.p, n, vec);  // early: frees registers
    if constexpr (kRem) store_lane(slot<int16_t>(meta, kR, it) + first, x.r, n, vec);
    uint32_t m_amax = 0;
    uint32_t v_amax = 0;
    if (n == kPerLane) {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        m_amax = max(m_amax, codec::abs_bits(mf[e]));
        v_amax = max(v_amax, codec::abs_bits(vf[e]));
      }
    } else {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        if (e < n) {
          m_amax = max(m_amax, codec::abs_bits(mf[e]));
          v_amax = max(v_amax, codec::abs_bits(vf[e]));
        }
      }
    }
    const codec::Scale mc = Fmt::scale(warp_max(m_amax));
    const codec::Scale vc = Fmt::scale(warp_max(v_amax));
    if constexpr (kInt8) {
      // A block holding inf or NaN: every code the zero code (a warp-uniform branch).
      if (mc.finite) {
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          x.m[e] = codec::int8_code_search(mf[e] * mc.inv, ctx.tables->words_m, true);
        }
      } else {
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) x.m[e] = 127;
      }
      if (vc.finite) {
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          x.v[e] = codec::int8_code_search(vf[e] * vc.inv, ctx.tables->words_v, false);
        }
      } else {
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) x.v[e] = 0;
      }
    } else {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        x.m[e] = Fmt::encode(mf[e], mc, nullptr);
        x.v[e] = Fmt::encode(vf[e], vc, nullptr);
      }
    }
    store_lane(slot<C>(meta, kM, it) + first, x.m, n, vec);
    store_lane(slot<C>(meta, kV, it) + first, x.v, n, vec);
    if (ctx.lane == 0) {
      static_cast<float*>(meta.addresses[kMs][it.local])[it.start / kBlock] = mc.scale;
      static_cast<float*>(meta.addresses[kVs][it.local])[it.start / kBlock] = vc.scale;
    }
  }

  __device__ __forceinline__ void run(const Meta& meta, unsigned char* smem) const {
    if (skip()) return;
    const Tables* tables = nullptr;
    if constexpr (kInt8) {
      Tables* t = reinterpret_cast<Tables*>(smem);
      t->build();
      tables = t;
    }
    adam::Hyper<float> hl = h;
    device_lr(hl);
    device_step(hl, bias);
    const Ctx ctx{hl, static_cast<float>(cuda::value_or(grad_scale_t, 1.0)), FastDirection(hl),
                  tables, static_cast<int>(threadIdx.x % 32)};
    const int64_t total = static_cast<int64_t>(meta.block_end[meta.tensors - 1]) * kBlocksPerChunk;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
    int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
    for (; i < total; i += stride) {
      const Item it = locate(meta, i, total);
      Raw x;
      load(meta, it, ctx.lane, x);
      process(meta, it, x, ctx);
    }
  }
};

template <typename Op, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinCtas)
    blockwise_kernel(const __grid_constant__ typename Op::Meta meta, const Op op) {
  extern __shared__ __align__(16) unsigned char smem[];
  op.run(meta, smem);
}

// Thread blocks per SM that fit (occupancy), per device, computed at the first launch.
template <typename Op, typename Cfg>
int ctas_per_sm(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device < 0 || device >= static_cast<int>(cache.size())) device = 0;
  int n = cache[device].load(std::memory_order_relaxed);
  if (n > 0) return n;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, blockwise_kernel<Op, Cfg>,
                                                               Cfg::kThreads, Op::kSmemBytes));
  TORCH_CHECK(n > 0, "adam_blockwise: the kernel does not fit on this GPU");
  cache[device].store(n, std::memory_order_relaxed);
  return n;
}

int sm_count(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device < 0 || device >= static_cast<int>(cache.size())) device = 0;
  int n = cache[device].load(std::memory_order_relaxed);
  if (n > 0) return n;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  cache[device].store(n, std::memory_order_relaxed);
  return n;
}

// The search tables' assumptions (state_codec.h) hold for the compiled-in maps.
void check_search_maps() {
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

template <typename Cfg>
void adam_blockwise_cuda_impl(const TensorLists& lists, double lr, double beta1, double beta2,
                              double eps, int64_t step, bool adam_w_mode, bool bias_correction,
                              double weight_decay, const OptTensor& lr_t, const OptTensor& step_t,
                              const OptTensor& grad_scale_t, const OptTensor& found_inf_t) {
  using namespace adam_compact;
  const bool remainder = check_compact_lists(lists, true, c10::DeviceType::CUDA,
                                             "adam_blockwise", {at::kHalf, at::kByte});
  if (lists[0].empty()) return;
  const at::Device device = lists[0][0].device();
  const c10::cuda::CUDAGuard guard(device);
  TensorLists slots = {lists[kGrad], lists[kParam]};
  if (remainder) slots.push_back(lists[kRemainder]);
  for (int k : {kExpAvg, kExpAvgSq, kExpAvgScale, kExpAvgSqScale}) slots.push_back(lists[k]);
  const bool int8 = lists[kExpAvg][0].scalar_type() == at::kByte;
  if (int8) check_search_maps();
  std::vector<int64_t> order(slots[0].size());
  std::iota(order.begin(), order.end(), int64_t{0});
  dispatch_master(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), remainder, "adam_blockwise",
      [&](auto types) {
        using Ty = decltype(types);
        auto launch = [&](auto format) {
          using Op = BlockwiseAdam<Ty, decltype(format), Cfg>;
          static_assert(sizeof(typename Op::Meta) + sizeof(Op) + alignof(Op) <= cuda::kParamBytes,
                        "kernel arguments (ChunkMeta + op) exceed the kernel parameter limit");
          Op op;
          op.set_scalars(device, "adam_blockwise", lr_t, step_t, grad_scale_t, found_inf_t);
          op.h = adam::make_hyper<float>(lr, beta1, beta2, eps, static_cast<double>(step),
                                         adam_w_mode, bias_correction, weight_decay);
          op.bias = {beta1, beta2, bias_correction};
          const int index = device.index();
          const int64_t resident = int64_t{sm_count(index)} * ctas_per_sm<Op, Cfg>(index);
          cuda::for_each_launch<Op::kDepth>(
              slots, order, 0,
              [&](const typename Op::Meta& meta, int64_t chunks, cudaStream_t stream) {
                const int64_t blocks = chunks * kBlocksPerChunk;
                const int64_t ctas =
                    std::min(resident, (blocks + Op::kWarps - 1) / Op::kWarps);
                blockwise_kernel<Op, Cfg><<<static_cast<unsigned>(ctas), Cfg::kThreads,
                                            Op::kSmemBytes, stream>>>(meta, op);
                C10_CUDA_KERNEL_LAUNCH_CHECK();
              });
        };
        if (int8) return launch(adam_blockwise::Int8{});
        launch(adam_blockwise::ScaledFp16{});
      });
}

}  // namespace

void adam_blockwise_cuda(const TensorLists& lists, double lr, double beta1, double beta2,
                         double eps, int64_t step, bool adam_w_mode, bool bias_correction,
                         double weight_decay, const OptTensor& lr_t, const OptTensor& step_t,
                         const OptTensor& grad_scale_t, const OptTensor& found_inf_t) {
  adam_blockwise_cuda_impl<DefaultConfig>(lists, lr, beta1, beta2, eps, step, adam_w_mode,
                                          bias_correction, weight_decay, lr_t, step_t,
                                          grad_scale_t, found_inf_t);
}

}  // namespace shardopt
