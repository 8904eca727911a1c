// dst = src * scale on CUDA tensors over the cuda traversal (cuda_apply.cuh), flagging inf/nan in
// src on the device: GradScaler's unscale + overflow check in one pass, with no host sync. The
// scale may live on the device (scale_t); found_inf is only ever set to 1, never reset, so one flag
// can collect several calls. The lists may mix dtypes: one traversal per (src, dst) dtype pair.
#include "../kernels.h"
#include "../multi_tensor/cuda_elementwise.cuh"
#include "../multi_tensor/dispatch.h"

namespace shardopt {
namespace {

constexpr int kSrc = 0;
constexpr int kDst = 1;
constexpr int kDepth = 2;

template <typename Src, typename Dst>
struct ScaleOp {
  using acc_t = float;
  using Slots = cuda::Slots<Src, Dst>;
  float scale;
  const float* scale_t;
  float* found_inf;

  __device__ bool skip() const { return false; }
  __device__ bool reads(int k) const { return k == kSrc; }
  __device__ bool writes(int k) const { return k == kDst; }

  struct Ctx {
    float scale;
    bool non_finite;  // stored once per thread, in end()
  };

  template <typename C>
  __device__ Ctx begin(const C&) const {
    return {scale_t != nullptr ? *scale_t : scale, false};
  }

  // dst may alias src: the element is in registers before it is stored.
  __device__ void operator()(float (&x)[kDepth], Ctx& ctx) const {
    ctx.non_finite = ctx.non_finite || !isfinite(x[kSrc]);
    x[kDst] = x[kSrc] * ctx.scale;
  }

  template <typename C>
  __device__ void end(const C&, const Ctx& ctx) const {
    if (ctx.non_finite) *found_inf = 1.f;
  }
};

// Calls f(T{}) for T in {float, Half, BFloat16}, the storage types scale supports.
template <typename F>
void dispatch_storage(at::ScalarType dtype, F&& f) {
  dispatch_float(dtype, "scale", [&](auto t) {
    if constexpr (!std::is_same_v<decltype(t), double>) f(t);
  });
}

}  // namespace

void scale_cuda(const TensorLists& lists, double scale, const OptTensor& scale_t,
                const at::Tensor& found_inf) {
  // one traversal per (src, dst) dtype pair below, so the lists may mix dtypes (as on the CPU)
  check_tensor_lists_no_out(lists, kDepth, c10::DeviceType::CUDA, "scale", /*mixed_dtypes=*/true,
                            " [src, dst]");
  if (lists[0].empty()) return;
  const at::Device device = lists[0][0].device();
  const float* scale_ptr = device_scalar(scale_t, device, "scale", "scale_t");
  float* found_inf_ptr = device_scalar(found_inf, device, "scale", "found_inf");
  using Pair = std::pair<at::ScalarType, at::ScalarType>;
  std::vector<Pair> pairs;  // in order of first appearance
  const int64_t n = static_cast<int64_t>(lists[kSrc].size());
  for (int64_t i = 0; i < n; ++i) {
    for (const int k : {kSrc, kDst}) {
      const at::ScalarType dtype = lists[k][i].scalar_type();
      TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                  "scale: ", describe(lists, k, i), " has an unsupported dtype (float32, float16, "
                  "bfloat16)");
    }
    const Pair pair{lists[kSrc][i].scalar_type(), lists[kDst][i].scalar_type()};
    if (std::find(pairs.begin(), pairs.end(), pair) == pairs.end()) pairs.push_back(pair);
  }
  for (const Pair& pair : pairs) {
    std::vector<int64_t> order;
    for (int64_t i = 0; i < n; ++i) {
      if (lists[kSrc][i].scalar_type() == pair.first &&
          lists[kDst][i].scalar_type() == pair.second) {
        order.push_back(i);
      }
    }
    dispatch_storage(pair.first, [&](auto src) {
      dispatch_storage(pair.second, [&](auto dst) {
        using Op = ScaleOp<decltype(src), decltype(dst)>;
        const Op op{static_cast<float>(scale), scale_ptr, found_inf_ptr};
        cuda::apply_chunks<kDepth>(lists, order, cuda::Elementwise<Op>{op});
      });
    });
  }
}

}  // namespace shardopt
