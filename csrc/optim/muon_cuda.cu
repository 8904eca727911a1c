// Muon's elementwise parts on CUDA tensors: the cuda traversal (cuda_elementwise.cuh) over
// muon_math.h. A device lr is read inside the kernel so a capturable step never syncs with the host.
#include "../kernels.h"
#include "../multi_tensor/cuda_elementwise.cuh"
#include "muon_dispatch.h"
#include "muon_math.h"

namespace shardopt {
namespace {

template <typename G, typename B, typename N>
struct MomentumOp : cuda::OpBase {
  using acc_t = muon::acc_of<B>;
  using Slots = cuda::Slots<G, B, N>;
  muon::MomentumHyper<acc_t> h;

  __device__ bool reads(int k) const { return k != muon::kMix; }
  __device__ bool writes(int k) const { return k != muon::kGrad; }
  template <typename C>
  __device__ int begin(const C&) const {
    return 0;
  }
  __device__ void operator()(acc_t (&x)[Slots::kDepth], const int&) const {
    muon::momentum<B>(x[muon::kGrad], x[muon::kBuf], x[muon::kMix], h);
  }
};

template <typename P, typename N, typename O, bool HasOut>
struct ApplyOp : cuda::OpBase {
  using acc_t = muon::acc_of<P, N>;
  using Slots = std::conditional_t<HasOut, cuda::Slots<P, N, O>, cuda::Slots<P, N>>;
  muon::ApplyHyper<acc_t> h;
  double weight_decay, lr_ratio;

  __device__ bool reads(int k) const { return k != muon::kOut; }
  __device__ bool writes(int k) const { return k != muon::kUpdate; }
  template <typename C>
  __device__ muon::ApplyHyper<acc_t> begin(const C&) const {
    if (lr_t == nullptr) return h;
    return muon::make_apply_hyper<acc_t>(static_cast<double>(*lr_t), weight_decay, lr_ratio);
  }
  __device__ void operator()(acc_t (&x)[Slots::kDepth], const muon::ApplyHyper<acc_t>& ctx) const {
    muon::apply<P>(x[muon::kParam], x[muon::kUpdate], ctx);
    if constexpr (HasOut) x[muon::kOut] = x[muon::kParam];
  }
};

}  // namespace

void muon_momentum_cuda(const TensorLists& lists, double momentum, bool nesterov) {
  using namespace muon;
  const char* name = "muon_momentum";
  check_tensor_lists_no_out(lists, kMomentumDepth, c10::DeviceType::CUDA, name, false,
                            " [grads, bufs, mixes]");
  if (lists[0].empty()) return;
  dispatch_momentum(
      lists[kGrad][0].scalar_type(), lists[kBuf][0].scalar_type(), lists[kMix][0].scalar_type(),
      name, [&](auto g_t, auto b_t, auto n_t) {
        using G = typename decltype(g_t)::type;
        using B = typename decltype(b_t)::type;
        using N = typename decltype(n_t)::type;
        MomentumOp<G, B, N> op;
        op.h = make_momentum_hyper<acc_of<B>>(momentum, nesterov);
        cuda::apply_elementwise(lists, op);
      });
}

void muon_apply_cuda(const TensorLists& lists, double lr, double weight_decay, double lr_ratio,
                     const OptTensor& lr_t) {
  using namespace muon;
  const char* name = "muon_apply";
  check_tensor_lists(lists, kApplyDepth, c10::DeviceType::CUDA, name);
  if (lists[0].empty()) return;
  const at::Device device = lists[0][0].device();
  dispatch_apply(
      lists[kParam][0].scalar_type(), lists[kUpdate][0].scalar_type(),
      out_dtype(lists, kApplyDepth), name, [&](auto p_t, auto n_t, auto o_t, auto has_out) {
        using P = typename decltype(p_t)::type;
        using N = typename decltype(n_t)::type;
        using O = typename decltype(o_t)::type;
        ApplyOp<P, N, O, decltype(has_out)::value> op;
        op.set_scalars(device, name, lr_t, std::nullopt, std::nullopt, std::nullopt);
        op.h = make_apply_hyper<acc_of<P, N>>(lr, weight_decay, lr_ratio);
        op.weight_decay = weight_decay;
        op.lr_ratio = lr_ratio;
        cuda::apply_elementwise(lists, op);
      });
}

}  // namespace shardopt
