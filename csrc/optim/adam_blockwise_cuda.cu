// Adam over blockwise compact state (scaled_fp16, int8) on CUDA tensors. The chunk traversal of
// cuda_apply.cuh (one thread block per 65536-element chunk, which starts on a block boundary) with
// one warp per 256-element block: lane l holds elements [8l, 8l + 8) in registers, loaded and
// stored as 16-byte accesses (8 bytes for int8 codes) when the tensors are aligned; the block's
// amax is a warp max of the bits (no shared memory, no atomics: deterministic), and lane 0 writes
// the scales. int8 builds its code search tables (state_codec.h) in shared memory per thread block.
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

__constant__ uint32_t kSignedMapBits[256] = {SHARDOPT_SIGNED_MAP_BITS};
__constant__ uint32_t kUnsignedMapBits[256] = {SHARDOPT_UNSIGNED_MAP_BITS};

// 8 consecutive elements as 16-byte (or, for 1-byte codes, 8-byte) accesses.
template <typename T>
constexpr int kAccess = 16 / sizeof(T) < kPerLane ? 16 / sizeof(T) : kPerLane;

template <typename T>
__device__ __forceinline__ void load8(const T* p, T (&v)[kPerLane]) {
#pragma unroll
  for (int q = 0; q < kPerLane; q += kAccess<T>) {
    T w[kAccess<T>];
    cuda::load_group<T, kAccess<T>>(p + q, w);
#pragma unroll
    for (int e = 0; e < kAccess<T>; ++e) v[q + e] = w[e];
  }
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const T (&v)[kPerLane]) {
#pragma unroll
  for (int q = 0; q < kPerLane; q += kAccess<T>) {
    T w[kAccess<T>];
#pragma unroll
    for (int e = 0; e < kAccess<T>; ++e) w[e] = v[q + e];
    cuda::store_group<T, kAccess<T>>(p + q, w);
  }
}

template <typename T>
__device__ __forceinline__ bool aligned8(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kAccess<T>) == 0;
}

// Lane e of 8: the vector access for a whole, aligned lane, else guarded scalar accesses.
template <typename T>
__device__ __forceinline__ void load_lane(const T* p, T (&v)[kPerLane], int count, bool vec) {
  if (vec) return load8(p, v);
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) v[e] = e < count ? p[e] : T{};
}

template <typename T>
__device__ __forceinline__ void store_lane(T* p, const T (&v)[kPerLane], int count, bool vec) {
  if (vec) return store8(p, v);
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

template <typename Ty, typename Fmt>
struct BlockwiseAdam : cuda::OpBase {
  static constexpr bool kRem = Ty::remainder;
  using G = typename Ty::grad_t;
  using P = std::conditional_t<kRem, uint16_t, typename Ty::param_t>;  // bf16 bits with a rem
  using C = typename Fmt::code_t;
  // Slots of the traversal's lists: the compact lists without an empty remainders list.
  static constexpr int kG = 0, kP = 1, kR = 2, kM = kRem ? kR + 1 : kR, kV = kM + 1, kMs = kV + 1,
                       kVs = kMs + 1, kDepth = kVs + 1;
  adam::Hyper<float> h;  // host values; the device scalars replace them per thread block
  BiasCorrection bias;

  __device__ void operator()(const cuda::Chunk<kDepth>& c) const {
    if (skip()) return;
    if constexpr (Fmt::kTables) {
      __shared__ codec::Int8Tables tables[2];  // m: signed map, v: unsigned map
      const int t = threadIdx.x;
      const int n = blockDim.x;
      codec::tables_fill_map(tables[0], kSignedMapBits, true, t, n);
      codec::tables_fill_map(tables[1], kUnsignedMapBits, false, t, n);
      __syncthreads();
      codec::tables_fill_entries(tables[0], t, n);
      codec::tables_fill_entries(tables[1], t, n);
      __syncthreads();
      codec::tables_fill_buckets(tables[0], t, n);
      codec::tables_fill_buckets(tables[1], t, n);
      __syncthreads();
      run(c, &tables[0], &tables[1]);
    } else {
      run(c, nullptr, nullptr);
    }
  }

  __device__ __forceinline__ void run(const cuda::Chunk<kDepth>& c, const codec::Int8Tables* tm,
                                      const codec::Int8Tables* tv) const {
    adam::Hyper<float> hl = h;
    device_lr(hl);
    device_step(hl, bias);
    const float gs = static_cast<float>(cuda::value_or(grad_scale_t, 1.0));
    const G* g = static_cast<const G*>(c.base[kG]) + c.start;
    P* p = static_cast<P*>(c.base[kP]) + c.start;
    int16_t* r = kRem ? static_cast<int16_t*>(c.base[kR]) + c.start : nullptr;
    C* m = static_cast<C*>(c.base[kM]) + c.start;
    C* v = static_cast<C*>(c.base[kV]) + c.start;
    float* ms = static_cast<float*>(c.base[kMs]) + c.start / kBlock;
    float* vs = static_cast<float*>(c.base[kVs]) + c.start / kBlock;
    const bool aligned = aligned8<G>(g) && aligned8<P>(p) && (!kRem || aligned8<int16_t>(r)) &&
                         aligned8<C>(m) && aligned8<C>(v);
    const int n = static_cast<int>(c.n);
    const int lane = threadIdx.x % 32;
    const int blocks = (n + kBlock - 1) / kBlock;
    for (int b = threadIdx.x / 32; b < blocks; b += blockDim.x / 32) {
      const int first = b * kBlock + lane * kPerLane;
      const int count = min(max(n - first, 0), kPerLane);
      const bool vec = aligned && count == kPerLane;
      G gv[kPerLane];
      P pv[kPerLane];
      int16_t rv[kPerLane];
      C mv[kPerLane];
      C vv[kPerLane];
      load_lane(g + first, gv, count, vec);
      load_lane(p + first, pv, count, vec);
      if constexpr (kRem) load_lane(r + first, rv, count, vec);
      load_lane(m + first, mv, count, vec);
      load_lane(v + first, vv, count, vec);
      const float m_scale = ms[b];
      const float v_scale = vs[b];
      float mf[kPerLane];
      float vf[kPerLane];
      uint32_t m_amax = 0;
      uint32_t v_amax = 0;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        float master;
        if constexpr (kRem) {
          master = codec::join_master(pv[e], rv[e]);
        } else {
          master = static_cast<float>(pv[e]);
        }
        mf[e] = Fmt::decode(mv[e], m_scale, tm);
        vf[e] = Fmt::decode(vv[e], v_scale, tv);
        adam::update<float>(master, static_cast<float>(gv[e]) * gs, mf[e], vf[e], hl);
        if constexpr (kRem) {
          codec::split_master(master, pv[e], rv[e]);
        } else {
          pv[e] = static_cast<P>(master);
        }
        if (e < count) {
          m_amax = max(m_amax, codec::abs_bits(mf[e]));
          v_amax = max(v_amax, codec::abs_bits(vf[e]));
        }
      }
      store_lane(p + first, pv, count, vec);  // early: frees registers before the encode
      if constexpr (kRem) store_lane(r + first, rv, count, vec);
      const codec::Scale mc = Fmt::scale(warp_max(m_amax));
      const codec::Scale vc = Fmt::scale(warp_max(v_amax));
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        mv[e] = Fmt::encode(mf[e], mc, tm);
        vv[e] = Fmt::encode(vf[e], vc, tv);
      }
      store_lane(m + first, mv, count, vec);
      store_lane(v + first, vv, count, vec);
      if (lane == 0) {
        ms[b] = mc.scale;
        vs[b] = vc.scale;
      }
    }
  }
};

}  // namespace

void adam_blockwise_cuda(const TensorLists& lists, double lr, double beta1, double beta2,
                         double eps, int64_t step, bool adam_w_mode, bool bias_correction,
                         double weight_decay, const OptTensor& lr_t, const OptTensor& step_t,
                         const OptTensor& grad_scale_t, const OptTensor& found_inf_t) {
  using namespace adam_compact;
  const bool remainder = check_compact_lists(lists, true, c10::DeviceType::CUDA,
                                             "adam_blockwise", {at::kHalf, at::kByte});
  if (lists[0].empty()) return;
  const at::Device device = lists[0][0].device();
  TensorLists slots = {lists[kGrad], lists[kParam]};
  if (remainder) slots.push_back(lists[kRemainder]);
  for (int k : {kExpAvg, kExpAvgSq, kExpAvgScale, kExpAvgSqScale}) slots.push_back(lists[k]);
  const bool int8 = lists[kExpAvg][0].scalar_type() == at::kByte;
  dispatch_master(lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), remainder,
                  "adam_blockwise", [&](auto types) {
                    using Ty = decltype(types);
                    auto launch = [&](auto format) {
                      using Op = BlockwiseAdam<Ty, decltype(format)>;
                      Op op;
                      op.set_scalars(device, "adam_blockwise", lr_t, step_t, grad_scale_t,
                                     found_inf_t);
                      op.h = adam::make_hyper<float>(lr, beta1, beta2, eps,
                                                     static_cast<double>(step), adam_w_mode,
                                                     bias_correction, weight_decay);
                      op.bias = {beta1, beta2, bias_correction};
                      cuda::apply_chunks<Op::kDepth>(slots, op);
                    };
                    if (int8) return launch(adam_blockwise::Int8{});
                    launch(adam_blockwise::ScaledFp16{});
                  });
}

}  // namespace shardopt
