// Adam over blockwise compact state (scaled_fp16, int8) on CUDA tensors (docs/kernels.md "Compact
// state kernels"). The lists are packed into launches as cuda_apply.cuh does (for_each_launch), but
// the grid is persistent: one thread block per SM, so int8's search tables are built once per SM.
// Work comes in superblocks of kBlocks consecutive 256-element blocks (one set of copies); warp w of
// the grid takes superblocks w, w + warps, ... (Config: or contiguous ranges per thread block),
// walking the launch's tensors with a warp-uniform cursor. One warp per block: lane l holds
// elements [8l, 8l + 8) of each block in registers, as packed words. A block's amax is a warp max
// of the bits (no shared memory, no atomics: deterministic) and lane 0 writes the scales.
//
// Loads are asynchronous: each warp owns kStages shared-memory stages, each with an mbarrier. Lane
// 0 starts a superblock's bulk copies (cp.async.bulk: its grads, params, remainders and codes, one
// copy per array) and cp.async copies of its scales into a stage; the warp waits on the stage's
// barrier, moves the stage into registers (16-byte shared loads), and lane 0 refills the stage with
// the superblock kStages turns ahead before the warp computes, so each warp keeps kStages
// superblocks of loads in flight without holding registers for them. The blocks of a superblock are
// updated together (more independent work per lane). Stores go from registers (16-byte accesses).
// Partial superblocks and tensors not 16-byte aligned are read from global memory instead, a block
// at a time (their stage carries only the scales).
//
// The Adam math is adam_math.h's (moments, direction, apply_step) with the divisions and the square
// root of the direction evaluated, where every operand is in a range that keeps them exact
// (FastDirection), by the instruction sequences nvcc emits for `/` and sqrt on their fast path,
// with the reciprocals of the bias corrections computed once: the same bits, without the branch
// around each division that kept the 8 elements of a lane from overlapping. Elsewhere the plain
// expression. The range check is an integer min and max of the bits of |m| and v per lane, which
// the block amax needs anyway. v is stored as its root (state_codec.h): decoded as r * r, and
// after the update rooted by the same sqrt sequence where the lane's v are in range (else the
// correctly rounded sqrt); a block's v scale is that of its roots.
//
// int8 codes: one shared-memory word per bucket of the sign-folded xn (state_codec.h,
// int8_code_search): one lookup and one comparison (a borrow) per code; decoding reads the maps
// from shared memory.
//
// Beside this file: adam_blockwise_lanes.cuh (a lane's registers and packed words),
// adam_blockwise_codecs.cuh (the int8 tables and each format's lane decode and encode) and
// adam_blockwise_launch.cuh (the tuning, Config and DefaultConfig, and the occupancy the grid is
// sized from). This file: the copies, the Adam math and the op that walks the superblocks.
#include <c10/cuda/CUDAException.h>
#include <cuda_fp16.h>

#include "../kernels.h"
#include "../multi_tensor/cuda_elementwise.cuh"
#include "../multi_tensor/dispatch.h"
#include "adam_blockwise_codecs.cuh"
#include "adam_blockwise_lanes.cuh"
#include "adam_blockwise_launch.cuh"
#include "adam_blockwise_math.h"

namespace shardopt {
namespace {

using namespace blockwise_cuda;  // this file's headers beside it: lanes, codecs, launch

// ---- asynchronous copies and mbarriers (sm_90) ---------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrives once, expecting `bytes` more of transactions in the phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// Global -> shared bulk copy (16-byte aligned, a multiple of 16 bytes), completing on bar.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

template <int Bytes>
__device__ __forceinline__ void copy_small(uint32_t dst, const void* src) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(src), "n"(Bytes)
               : "memory");
}

// One arrival on bar once this thread's cp.async copies so far have landed (counted at init).
__device__ __forceinline__ void copies_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
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
// random operand sets; tests/kernels/test_adam_compact.py checks the kernel against correctly rounded fp32
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

  // The operand ranges as bits: |m| in [2^-60, 2^40), v in [2^-100, 2^60) (an integer compare of
  // the bits of non-negative floats is the float compare; a NaN or negative v is out of range).
  static constexpr uint32_t kMLo = 0x21800000u;  // 2^-60
  static constexpr uint32_t kMHi = 0x53800000u;  // 2^40
  static constexpr uint32_t kVLo = 0x0D800000u;  // 2^-100
  static constexpr uint32_t kVHi = 0x5D800000u;  // 2^60

  __device__ explicit FastDirection(const adam::Hyper<float>& h)
      : y1(div_rcp(h.bc1)), y2(div_rcp(h.bc2)), ok(in(h.bc1) && in(h.bc2) && h.eps >= 0.f &&
                                                   h.eps <= 0x1p40f) {}

  static __device__ __forceinline__ bool in(float bc) { return bc >= 0x1p-20f && bc <= 1.f; }

  // Whether a lane's m, v (after adam::moments) are in range, from the min and max of abs_bits(m)
  // and of bits(v) over its elements.
  static __device__ __forceinline__ bool operands(uint32_t m_lo, uint32_t m_hi, uint32_t v_lo,
                                                  uint32_t v_hi) {
    return m_lo >= kMLo && m_hi < kMHi && v_lo >= kVLo && v_hi < kVHi;
  }

  __device__ __forceinline__ float operator()(float m, float v, const adam::Hyper<float>& h) const {
    const float d = sqrt_fast(div_fast(v, h.bc2, y2)) + h.eps;
    return div_fast(div_fast(m, h.bc1, y1), d, div_rcp(d));
  }
};
static_assert(FastDirection::kMLo == ((127u - 60u) << 23) && FastDirection::kMHi == ((127u + 40u) << 23) &&
                  FastDirection::kVLo == ((127u - 100u) << 23) &&
                  FastDirection::kVHi == ((127u + 60u) << 23),
              "the range bits are powers of two");

// ---- the op -------------------------------------------------------------------------------------

// A superblock of a warp: its launch entry (tensor), first element, elements (0: none; up to
// kBlocks * 256), and whether its arrays come by bulk copy into the stage.
struct Item {
  int local;
  int64_t blk;  // its first block in the tensor (element blk * 256)
  int count;
  bool bulk;
};

// One block of a superblock.
struct Part {
  int local;
  int64_t blk;  // the block in the tensor (element blk * 256)
  int count;    // 0 to 256
};

template <typename Ty, typename Fmt, typename Cfg>
struct BlockwiseAdam : cuda::OpBase {
  static constexpr bool kRem = Ty::remainder;
  static constexpr bool kInt8 = Fmt::kTables;
  using G = typename Ty::grad_t;
  using P = std::conditional_t<kRem, uint16_t, typename Ty::param_t>;  // bf16 bits with a rem
  using C = typename Fmt::code_t;
  using Tables = Int8Smem;
  using Codec = LaneCodec<Fmt>;
  // Slots of the traversal's lists: the compact lists without an empty remainders list.
  static constexpr int kG = 0, kP = 1, kR = 2, kM = kRem ? kR + 1 : kR, kV = kM + 1, kMs = kV + 1,
                       kVs = kMs + 1, kDepth = kVs + 1;
  static constexpr int kWarps = Cfg::kThreads / 32;
  static constexpr int kK = Cfg::kBlocks;
  static constexpr int kStages = Cfg::kStages;
  static_assert(kBlocksPerChunk % kK == 0, "superblocks must not straddle chunks (tensors)");
  static constexpr int kSuper = kK * kBlock;  // elements per superblock
  // A stage: the superblock's arrays one after another (each kSuper elements, a multiple of 256
  // bytes), then its scales (kK of m, kK of v).
  static constexpr int kOffG = 0;
  static constexpr int kOffP = kOffG + kSuper * static_cast<int>(sizeof(G));
  static constexpr int kOffR = kOffP + kSuper * static_cast<int>(sizeof(P));
  static constexpr int kOffM = kOffR + (kRem ? kSuper * 2 : 0);
  static constexpr int kOffV = kOffM + kSuper * static_cast<int>(sizeof(C));
  static constexpr int kArrayBytes = kOffV + kSuper * static_cast<int>(sizeof(C));
  static constexpr int kOffMs = kArrayBytes;
  static constexpr int kOffVs = kOffMs + 4 * kK;
  static constexpr int kStageBytes = kArrayBytes + 128;  // (the scales, padded)
  static_assert(8 * kK <= 128, "the scales fit the stage's padding");
  // Shared memory: the int8 tables, the stages, their barriers.
  static constexpr size_t kTablesBytes = kInt8 ? round_up(sizeof(Tables), 128) : 0;
  static constexpr size_t kStagesOff = kTablesBytes;
  static constexpr size_t kBarsOff =
      kStagesOff + size_t{kWarps} * kStages * static_cast<size_t>(kStageBytes);
  static constexpr size_t kSmemBytes = kBarsOff + size_t{kWarps} * kStages * 8;
  using Meta = cuda::ChunkMeta<kDepth>;
  adam::Hyper<float> h;  // host values; the device scalars replace them per thread block
  BiasCorrection bias;

  // The loaded operands of one lane, as packed words.
  struct Raw {
    uint32_t g[kWords<G>];
    uint32_t p[kWords<P>];
    uint32_t r[kRem ? kWords<int16_t> : 1];
    uint32_t m[kWords<C>];
    uint32_t v[kWords<C>];
    float ms, vs;
  };

  // Per thread block.
  struct Ctx {
    adam::Hyper<float> h;
    float gs;
    FastDirection fast;
    int lane;
  };

  template <typename T, typename I>
  static __device__ __forceinline__ T* slot(const Meta& meta, int s, const I& it) {
    return static_cast<T*>(meta.addresses[s][it.local]) + it.blk * kBlock;
  }

  // A warp's walk over the launch's superblocks: sb, sb + step, ... below end (warp-uniform).
  // The launch's blocks run tensor by tensor: entry t holds blocks [first[t], block_end[t] * 256)
  // and its block b is element (b - first[t] + skip[t]) * 256 of the tensor, skip[t] the blocks of
  // a tensor continued from a previous launch (entry 0 only).
  struct Cursor {
    int64_t sb, end, step;
    int local;
    int64_t entry_end;  // superblocks below the end of entry `local`
    int64_t offset;     // first[local] - skip[local], in blocks
    bool aligned;       // bulk_aligned(local)

    __device__ __forceinline__ void enter(const Meta& meta) {
      for (;;) {
        entry_end = static_cast<int64_t>(meta.block_end[local]) * (kBlocksPerChunk / kK);
        if (sb < entry_end || local + 1 >= meta.tensors) break;
        ++local;
      }
      offset = local == 0 ? -meta.first_chunk * kBlocksPerChunk
                          : static_cast<int64_t>(meta.block_end[local - 1]) * kBlocksPerChunk;
      aligned = bulk_aligned(meta, local);
    }

    __device__ __forceinline__ Item item(const Meta& meta) const {
      Item it{local, 0, 0, false};
      if (sb >= end) return it;
      it.blk = sb * kK - offset;
      const int64_t left = meta.numel[local] - it.blk * kBlock;
      it.count = left <= 0 ? 0 : static_cast<int>(left < kSuper ? left : kSuper);
      it.bulk = aligned && it.count == kSuper;
      return it;
    }

    __device__ __forceinline__ void next(const Meta& meta) {
      sb += step;
      if (sb >= entry_end && sb < end) enter(meta);
    }
  };

  static __device__ __forceinline__ bool aligned(const Meta& meta, int local) {
    return aligned8<G>(meta.addresses[kG][local]) && aligned8<P>(meta.addresses[kP][local]) &&
           (!kRem || aligned8<int16_t>(meta.addresses[kR][local])) &&
           aligned8<C>(meta.addresses[kM][local]) && aligned8<C>(meta.addresses[kV][local]);
  }

  // Whether a tensor's whole superblocks can come by bulk and 4k-byte copies: every array
  // 16-byte aligned (a superblock starts a multiple of 256 bytes into each) and the scales
  // 4 * kK-byte aligned (a superblock's first block is a multiple of kK).
  static __device__ __forceinline__ bool bulk_aligned(const Meta& meta, int local) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(meta.addresses[kG][local]) |
                        reinterpret_cast<uintptr_t>(meta.addresses[kP][local]) |
                        (kRem ? reinterpret_cast<uintptr_t>(meta.addresses[kR][local]) : 0) |
                        reinterpret_cast<uintptr_t>(meta.addresses[kM][local]) |
                        reinterpret_cast<uintptr_t>(meta.addresses[kV][local]);
    const uintptr_t s = reinterpret_cast<uintptr_t>(meta.addresses[kMs][local]) |
                        reinterpret_cast<uintptr_t>(meta.addresses[kVs][local]);
    return a % 16 == 0 && s % (4 * kK) == 0;
  }

  // Fills a stage with superblock `it` (lane 0; every operand is warp-uniform): its scales by
  // cp.async and, for a bulk superblock, its arrays by bulk copies. Every call completes one phase
  // of the stage's barrier: 2 arrivals (lane 0's and its cp.async copies') and the bulk bytes.
  static __device__ __forceinline__ void produce(const Meta& meta, const Item& it,
                                                 unsigned char* stage, uint32_t bar, int lane) {
    if (lane != 0) return;
    if (it.count == 0) {
      mbar_arrive(bar, 2);
      return;
    }
    const uint32_t s = smem_addr(stage);
    const float* ms = static_cast<const float*>(meta.addresses[kMs][it.local]) + it.blk;
    const float* vs = static_cast<const float*>(meta.addresses[kVs][it.local]) + it.blk;
    if (it.bulk) {
      copy_small<4 * kK>(s + kOffMs, ms);
      copy_small<4 * kK>(s + kOffVs, vs);
      copies_arrive(bar);
      mbar_arrive_expect_tx(bar, kArrayBytes);
      bulk_copy(s + kOffG, slot<const G>(meta, kG, it), kSuper * sizeof(G), bar);
      bulk_copy(s + kOffP, slot<const P>(meta, kP, it), kSuper * sizeof(P), bar);
      if constexpr (kRem) bulk_copy(s + kOffR, slot<const int16_t>(meta, kR, it), kSuper * 2, bar);
      bulk_copy(s + kOffM, slot<const C>(meta, kM, it), kSuper * sizeof(C), bar);
      bulk_copy(s + kOffV, slot<const C>(meta, kV, it), kSuper * sizeof(C), bar);
    } else {  // the scales of its blocks that hold elements, one at a time
      for (int k = 0; k * kBlock < it.count; ++k) {
        copy_small<4>(s + kOffMs + 4 * k, ms + k);
        copy_small<4>(s + kOffVs + 4 * k, vs + k);
      }
      copies_arrive(bar);
      mbar_arrive(bar, 1);
    }
  }

  // Block k of a stage, a lane's 8 elements.
  static __device__ __forceinline__ void load_stage(const unsigned char* stage, int k, int lane,
                                                    Raw& x) {
    const int e = k * kBlock + lane * kPerLane;
    load_words(stage + kOffG + e * sizeof(G), x.g);
    load_words(stage + kOffP + e * sizeof(P), x.p);
    if constexpr (kRem) load_words(stage + kOffR + e * 2, x.r);
    load_words(stage + kOffM + e * sizeof(C), x.m);
    load_words(stage + kOffV + e * sizeof(C), x.v);
  }

  // A partial or unaligned block: guarded element or 8-byte accesses from global memory.
  static __device__ __forceinline__ void load_global(const Meta& meta, const Part& it, int lane,
                                                  Raw& x) {
    const int first = lane * kPerLane;
    const int n = min(max(it.count - first, 0), kPerLane);
    const bool vec = n == kPerLane && aligned(meta, it.local);
    G g[kPerLane];
    P p[kPerLane];
    C m[kPerLane];
    C v[kPerLane];
    load_lane(slot<const G>(meta, kG, it) + first, g, n, vec);
    load_lane(slot<const P>(meta, kP, it) + first, p, n, vec);
    if constexpr (kRem) {
      int16_t r[kPerLane];
      load_lane(slot<const int16_t>(meta, kR, it) + first, r, n, vec);
      to_words(r, x.r);
    }
    load_lane(slot<const C>(meta, kM, it) + first, m, n, vec);
    load_lane(slot<const C>(meta, kV, it) + first, v, n, vec);
    to_words(g, x.g);
    to_words(p, x.p);
    to_words(m, x.m);
    to_words(v, x.v);
  }

  template <typename T, int N>
  static __device__ __forceinline__ void store(const Meta& meta, int s, const Part& it, int first,
                                               const uint32_t (&w)[N], int n, bool whole,
                                               bool vec) {
    T* p = slot<T>(meta, s, it) + first;
    if (whole) {
      store_words(p, w);
    } else {
      T v[kPerLane];
      from_words(w, v);
      store_lane(p, v, n, vec);
    }
  }

  // The fp32 master of element e.
  static __device__ __forceinline__ float master_of(const Raw& x, int e) {
    if constexpr (kRem) {  // join_master: (hi << 16) + the sign-extended lo
      const uint32_t hi = e % 2 ? x.p[e / 2] & 0xFFFF0000u : x.p[e / 2] << 16;
      const int32_t lo = e % 2 ? static_cast<int32_t>(x.r[e / 2]) >> 16
                               : static_cast<int32_t>(x.r[e / 2] << 16) >> 16;
      return __uint_as_float(hi + static_cast<uint32_t>(lo));
    } else {
      return word_float<P>(x.p, e);
    }
  }

  // The stored master of 8 elements: P words, and (with a remainder) the remainder words.
  static __device__ __forceinline__ void master_words(const float (&master)[kPerLane],
                                                      uint32_t (&pw)[kWords<P>],
                                                      uint32_t (&rw)[kRem ? 4 : 1]) {
    if constexpr (kRem) {
      // split_master two at a time: hi = (u + 0x8000) >> 16, lo = u & 0xFFFF; a NaN (rare)
      // takes split_master itself.
      bool nan = false;
#pragma unroll
      for (int e = 0; e < kPerLane; e += 2) {
        const uint32_t u0 = __float_as_uint(master[e]);
        const uint32_t u1 = __float_as_uint(master[e + 1]);
        pw[e / 2] = __byte_perm(u0 + 0x8000u, u1 + 0x8000u, 0x7632);
        rw[e / 2] = __byte_perm(u0, u1, 0x5410);
        nan = nan || isnan(master[e]) || isnan(master[e + 1]);
      }
      if (nan) {
        uint16_t hi[kPerLane];
        int16_t lo[kPerLane];
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) codec::split_master(master[e], hi[e], lo[e]);
        to_words(hi, pw);
        to_words(lo, rw);
      }
    } else if constexpr (std::is_same_v<P, float>) {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) pw[e] = __float_as_uint(master[e]);
    } else {
      P c[kPerLane];
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) c[e] = static_cast<P>(master[e]);
      to_words(c, pw);
    }
  }

  // N blocks from x, together (their elements interleave: more independent work per lane).
  // kFull: whole blocks whose arrays are 16-byte aligned (every lane holds 8 elements of each
  // and stores them as vectors); else one block (N = 1), partial or unaligned.
  template <int N, bool kFull>
  __device__ __forceinline__ void process(const Meta& meta, const Part (&parts)[N],
                                          const Raw (&x)[N], const Ctx& ctx) const {
    static_assert(kFull || N == 1, "partial blocks one at a time");
    const int first = ctx.lane * kPerLane;
    const int n = kFull ? kPerLane : min(max(parts[0].count - first, 0), kPerLane);
    const bool whole = kFull || n == kPerLane;
    const bool vec = kFull || (n == kPerLane && aligned(meta, parts[0].local));
    const adam::Hyper<float>& hl = ctx.h;
    float master[N][kPerLane];
    float mf[N][kPerLane];
    float vf[N][kPerLane];
#pragma unroll
    for (int k = 0; k < N; ++k) {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        master[k][e] = master_of(x[k], e);
        mf[k][e] = Codec::decode(x[k].m, e, x[k].ms, true);
        vf[k][e] = codec::v_of_root(Codec::decode(x[k].v, e, x[k].vs, false));
        adam::moments<float>(master[k][e], word_float<G>(x[k].g, e) * ctx.gs, mf[k][e], vf[k][e],
                             hl);
      }
    }
    // Per block, the lane's max of |m| as bits (the block amax); over all, the mins and maxes of
    // |m| and v (the range check).
    uint32_t m_hi[N];
    uint32_t m_lo = 0xFFFFFFFFu, v_lo = 0xFFFFFFFFu, m_top = 0, v_top = 0;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      m_hi[k] = 0;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        if (kFull || e < n) {
          const uint32_t a = codec::abs_bits(mf[k][e]);
          const uint32_t b = codec::bits_of(vf[k][e]);
          m_lo = min(m_lo, a);
          m_hi[k] = max(m_hi[k], a);
          v_lo = min(v_lo, b);
          v_top = max(v_top, b);
        }
      }
      m_top = max(m_top, m_hi[k]);
    }
    // v is stored as its root (state_codec.h): sqrt_fast where every v of the lane is in
    // FastDirection's range (inside that of the sqrt.rn sequence), else the correctly rounded
    // sqrt; per block, the lane's max of |root| as bits (a negative v has a NaN root).
    const bool root_fast = v_lo >= FastDirection::kVLo && v_top < FastDirection::kVHi;
    float rf[N][kPerLane];
    uint32_t r_hi[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      r_hi[k] = 0;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        rf[k][e] = root_fast ? sqrt_fast(vf[k][e]) : codec::v_root(vf[k][e]);
        if (kFull || e < n) r_hi[k] = max(r_hi[k], codec::abs_bits(rf[k][e]));
      }
    }
    float u[N][kPerLane];
    if (ctx.fast.ok && FastDirection::operands(m_lo, m_top, v_lo, v_top)) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) u[k][e] = ctx.fast(mf[k][e], vf[k][e], hl);
      }
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) {
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) u[k][e] = adam::direction<float>(mf[k][e], vf[k][e], hl);
      }
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) adam::apply_step<float>(master[k][e], u[k][e], hl);
      uint32_t pw[kWords<P>];
      uint32_t rw[kRem ? 4 : 1];
      master_words(master[k], pw, rw);
      store<P>(meta, kP, parts[k], first, pw, n, whole && vec, vec);
      if constexpr (kRem) store<int16_t>(meta, kR, parts[k], first, rw, n, whole && vec, vec);
    }
    uint32_t m_amax[N], v_amax[N];  // v_amax: of the roots
#pragma unroll
    for (int k = 0; k < N; ++k) {
      m_amax[k] = warp_max(m_hi[k]);
      v_amax[k] = warp_max(r_hi[k]);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const codec::Scale mc = Fmt::scale(m_amax[k]);
      const codec::Scale vc = Fmt::scale(v_amax[k]);
      uint32_t mw[kWords<C>];
      uint32_t vw[kWords<C>];
      Codec::template encode<true>(mf[k], mc, mw);
      Codec::template encode<false>(rf[k], vc, vw);
      store<C>(meta, kM, parts[k], first, mw, n, whole && vec, vec);
      store<C>(meta, kV, parts[k], first, vw, n, whole && vec, vec);
      if (ctx.lane == 0) {
        static_cast<float*>(meta.addresses[kMs][parts[k].local])[parts[k].blk] = mc.scale;
        static_cast<float*>(meta.addresses[kVs][parts[k].local])[parts[k].blk] = vc.scale;
      }
    }
  }

  // The launch's superblocks, dealt as Config says.
  __device__ __forceinline__ void run(const Meta& meta, unsigned char* smem) const {
    if (skip()) return;
    // The warp index through a shuffle: warp-uniform for the compiler, so that the cursor, the
    // pointers and the copies' operands stay in uniform registers.
    const int warp = __shfl_sync(0xFFFFFFFFu, static_cast<int>(threadIdx.x / 32), 0);
    const int lane = static_cast<int>(threadIdx.x % 32);
    unsigned char* stages = smem + kStagesOff + static_cast<size_t>(warp) * kStages * kStageBytes;
    const uint32_t bars = smem_addr(smem + kBarsOff) + static_cast<uint32_t>(warp * kStages * 8);
    const int64_t supers =
        static_cast<int64_t>(meta.block_end[meta.tensors - 1]) * (kBlocksPerChunk / kK);
    Cursor cur;
    if constexpr (Cfg::kInterleave) {
      cur.sb = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
      cur.end = supers;
      cur.step = static_cast<int64_t>(gridDim.x) * kWarps;
    } else {
      const int64_t per_cta = (supers + gridDim.x - 1) / gridDim.x;
      cur.sb = static_cast<int64_t>(blockIdx.x) * per_cta + warp;
      cur.end = min(supers, static_cast<int64_t>(blockIdx.x + 1) * per_cta);
      cur.step = kWarps;
    }
    cur.local = 0;
    cur.enter(meta);
    if (lane == 0) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) mbar_init(bars + 8 * s, 2);
      fence_mbar_init();
    }
    __syncwarp();
    // items[q]: the warp's superblock q turns ahead (its stage filled or being filled).
    Item items[kStages];
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      items[s] = cur.item(meta);
      if (cur.sb < cur.end) produce(meta, items[s], stages + s * kStageBytes, bars + 8 * s, lane);
      cur.next(meta);
    }
    if constexpr (kInt8) reinterpret_cast<Tables*>(smem)->build();  // while the first copies fly
    adam::Hyper<float> hl = h;
    device_lr(hl);
    device_step(hl, bias);
    const Ctx ctx{hl, static_cast<float>(cuda::value_or(grad_scale_t, 1.0)), FastDirection(hl),
                  lane};
    int s = 0;
    uint32_t parity = 0;
    for (int64_t sb = cur.sb - kStages * cur.step; sb < cur.end; sb += cur.step) {
      const Item it = items[0];
#pragma unroll
      for (int q = 0; q + 1 < kStages; ++q) items[q] = items[q + 1];
      items[kStages - 1] = cur.item(meta);
      unsigned char* stage = stages + s * kStageBytes;
      mbar_wait(bars + 8 * s, parity);
      Raw x[kK];
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        const Part part{it.local, it.blk + k, min(max(it.count - k * kBlock, 0), kBlock)};
        if (it.bulk) {
          load_stage(stage, k, lane, x[k]);
        } else if (part.count > 0) {
          load_global(meta, part, lane, x[k]);
        }
        x[k].ms = reinterpret_cast<const float*>(stage + kOffMs)[k];
        x[k].vs = reinterpret_cast<const float*>(stage + kOffVs)[k];
      }
      __syncwarp();  // the stage is in registers: refill it
      if (cur.sb < cur.end) {
        produce(meta, items[kStages - 1], stage, bars + 8 * s, lane);
      }
      cur.next(meta);
      if (it.bulk) {
        Part parts[kK];
#pragma unroll
        for (int k = 0; k < kK; ++k) parts[k] = Part{it.local, it.blk + k, kBlock};
        process<kK, true>(meta, parts, x, ctx);
      } else {
#pragma unroll
        for (int k = 0; k < kK; ++k) {
          const Part part[1] = {{it.local, it.blk + k, min(max(it.count - k * kBlock, 0), kBlock)}};
          const Raw xk[1] = {x[k]};
          if (part[0].count > 0) process<1, false>(meta, part, xk, ctx);
        }
      }
      if (++s == kStages) {
        s = 0;
        parity ^= 1;
      }
    }
  }
};

template <typename Op, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    blockwise_kernel(const __grid_constant__ typename Op::Meta meta, const Op op) {
  op.run(meta, g_smem);
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
  auto run_types = [&](auto types, auto config) {
    using Ty = decltype(types);
    using C = decltype(config);
    auto launch = [&](auto format) {
      using Op = BlockwiseAdam<Ty, decltype(format), C>;
      static_assert(sizeof(typename Op::Meta) + sizeof(Op) + alignof(Op) <= cuda::kParamBytes,
                    "kernel arguments (ChunkMeta + op) exceed the kernel parameter limit");
      static_assert(Op::kSmemBytes <= 227 * 1024, "shared memory: within an H100/H200's SM");
      Op op;
      op.set_scalars(device, "adam_blockwise", lr_t, step_t, grad_scale_t, found_inf_t);
      op.h = adam::make_hyper<float>(lr, beta1, beta2, eps, static_cast<double>(step), adam_w_mode,
                                     bias_correction, weight_decay);
      op.bias = {beta1, beta2, bias_correction};
      const int index = device.index();
      const int64_t resident =
          int64_t{sm_count(index)} * ctas_per_sm<Op, C>(index, blockwise_kernel<Op, C>);
      cuda::for_each_launch<Op::kDepth>(
          slots, order, 0, [&](const typename Op::Meta& meta, int64_t chunks, cudaStream_t stream) {
            const int64_t supers = chunks * (kBlocksPerChunk / C::kBlocks);
            const int64_t ctas = std::min(resident, (supers + Op::kWarps - 1) / Op::kWarps);
            blockwise_kernel<Op, C>
                <<<static_cast<unsigned>(ctas), C::kThreads, Op::kSmemBytes, stream>>>(meta, op);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
    };
    if (int8) return launch(adam_blockwise::Int8{});
    launch(adam_blockwise::ScaledFp16{});
  };
  dispatch_master(lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), remainder,
                  "adam_blockwise", [&](auto types) { run_types(types, Cfg{}); });
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
