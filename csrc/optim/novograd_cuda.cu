// NovoGrad on CUDA tensors: the cuda traversal (cuda_apply.cuh) over novograd_math.h. novograd
// takes the per-tensor second moment already updated (a small vector the caller maintains);
// novograd_step updates it itself, in three launches from one host call: the grads' norm chunk
// pass (norm_op.cuh, as norm_cuda), one block per tensor that reduces the tensor's partials in
// order and blends its entry of v in place (blend_kernel), then the update. In the update each
// block turns its tensor's entry into the denominator once. Device scalars are read inside the
// kernels; nothing syncs with the host.
#include <numeric>

#include "../kernels.h"
#include "../multi_tensor/cuda_elementwise.cuh"
#include "../multi_tensor/dispatch.h"
#include "../norm/norm_op.cuh"
#include "novograd_math.h"

namespace shardopt {
namespace {

template <typename Ty>
struct NovoGradOp : cuda::OpBase {
  using acc_t = typename Ty::acc_t;
  using G = typename Ty::grad_t;
  using P = typename Ty::param_t;
  using Slots = std::conditional_t<Ty::has_out, cuda::Slots<G, P, acc_t, typename Ty::out_t>,
                                   cuda::Slots<G, P, acc_t>>;
  novograd::Hyper<acc_t> h;
  const float* v_norm;
  BiasCorrection bias;

  struct Ctx {
    novograd::Hyper<acc_t> h;
    acc_t grad_scale;
    acc_t denom;
  };

  __device__ bool reads(int k) const { return k != novograd::kOut; }
  __device__ bool writes(int k) const { return k != novograd::kGrad; }

  template <typename C>
  __device__ Ctx begin(const C& c) const {
    Ctx ctx{h, static_cast<acc_t>(cuda::value_or(grad_scale_t, 1.0)), acc_t(0)};
    device_lr(ctx.h);
    device_step(ctx.h, bias);
    ctx.denom = static_cast<acc_t>(v_norm[c.tensor]) / ctx.h.bc2_sqrt + ctx.h.eps;
    return ctx;
  }

  __device__ void operator()(acc_t (&x)[Slots::kDepth], const Ctx& ctx) const {
    novograd::update<acc_t>(x[novograd::kParam], x[novograd::kGrad] * ctx.grad_scale,
                            x[novograd::kExpAvg], ctx.denom, ctx.h);
    if constexpr (Ty::has_out) x[novograd::kOut] = x[novograd::kParam];
  }
};

// Block t: the sum of tensor t's partials in order (as cuda::reduce_kernel, so the norm has the
// bits norm_cuda gives), its norm, and the blend of v[t] in place. T: float, double for double
// grads (the dtype of the sums).
template <typename T>
__global__ void __launch_bounds__(cuda::kBlockSize)
    blend_kernel(const T* partial, const int64_t* first, float* v, const float* fresh,
                 const novograd::Blend blend) {
  const bool max_norm = !blend.l2;
  const int64_t begin = first[2 * blockIdx.x];
  const int64_t n = first[2 * blockIdx.x + 1];
  T s = T(0);
  for (int64_t i = threadIdx.x; i < n; i += cuda::kBlockSize) {
    s = cuda::combine(s, partial[begin + i], max_norm);
  }
  s = cuda::block_reduce(s, max_norm);
  if (threadIdx.x != 0) return;
  const T norm = max_norm ? s : sqrt_of(s);
  const bool is_fresh = fresh != nullptr && fresh[blockIdx.x] != 0.f;
  v[blockIdx.x] = static_cast<float>(blend(static_cast<T>(v[blockIdx.x]), norm, is_fresh));
}

}  // namespace

void novograd_cuda(const TensorLists& lists, const at::Tensor& v_norm, double lr, double beta1,
                   double beta2, double eps, int64_t step, bool bias_correction,
                   double weight_decay, bool grad_averaging, int64_t moment_mode,
                   const OptTensor& lr_t, const OptTensor& step_t, const OptTensor& grad_scale_t,
                   const OptTensor& found_inf_t) {
  using namespace novograd;
  check_tensor_lists(lists, kDepth, c10::DeviceType::CUDA, "novograd");
  check_moment_mode(moment_mode);
  if (lists[0].empty()) return;
  const at::Device device = lists[0][0].device();
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), out_dtype(lists, kDepth),
      "novograd", [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        check_state_dtype<acc_t>(lists[kExpAvg], "novograd", "exp_avg");
        NovoGradOp<Ty> op;
        op.set_scalars(device, "novograd", lr_t, step_t, grad_scale_t, found_inf_t);
        op.v_norm = per_tensor_vector(v_norm, lists[0].size(), device, "novograd", "v_norm");
        op.h = make_hyper<acc_t>(lr, beta1, beta2, eps, static_cast<double>(step),
                                 bias_correction, weight_decay, grad_averaging, moment_mode);
        op.bias = {beta1, beta2, bias_correction};
        cuda::apply_elementwise(lists, op);
      });
}

void novograd_step_cuda(const TensorLists& lists, const at::Tensor& v, const OptTensor& fresh,
                        double lr, double beta1, double beta2, double eps, int64_t step,
                        bool bias_correction, double weight_decay, bool grad_averaging,
                        int64_t moment_mode, int64_t norm_type, bool init_zero,
                        const OptTensor& lr_t, const OptTensor& step_t) {
  using namespace novograd;
  const char* name = "novograd_step";
  TORCH_CHECK(lists.size() == size_t{kDepth} || lists.size() == size_t{kDepth} + 1, name,
              ": expected 3 or 4 tensor lists, got ", std::to_string(lists.size()));
  check_norm_type(norm_type, name);
  const Blend blend{beta2, norm_type == 2, init_zero};
  // The grads are checked first and their norm pass is queued at once, so the GPU starts while
  // the other lists are checked: the pass writes only its own scratch, and the call writes
  // nothing of the caller's before every check below has passed.
  const std::vector<std::vector<at::Tensor>> grads{lists[kGrad]};
  check_tensor_lists_no_out(grads, 1, c10::DeviceType::CUDA, name);
  const int64_t n = static_cast<int64_t>(grads[0].size());
  at::Tensor partial, first;
  if (n > 0) {
    const at::Device device = grads[0][0].device();
    const c10::cuda::OptionalCUDAGuard guard(device);
    const at::ScalarType grad_dtype = grads[0][0].scalar_type();
    int64_t units = 0;
    for (const at::Tensor& t : grads[0]) {
      units += (t.numel() + cuda::kChunkSize - 1) / cuda::kChunkSize;
    }
    const auto opts = at::TensorOptions().device(device).dtype(
        grad_dtype == at::kDouble ? at::kDouble : at::kFloat);
    partial = at::empty({std::max<int64_t>(units, 1)}, opts);
    first = cuda::first_table(n, device);
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), int64_t{0});
    dispatch_float(grad_dtype, name, [&](auto storage) {
      using G = decltype(storage);
      using sum_t = std::conditional_t<std::is_same_v<G, double>, double, float>;
      using Op = cuda::NormOp<G, sum_t>;
      const Op op{partial.data_ptr<sum_t>(), first.data_ptr<int64_t>(), !blend.l2};
      cuda::apply_chunks<1>(grads, order, cuda::Elementwise<Op>{op}, 0);
    });
  }
  check_tensor_lists(lists, kDepth, c10::DeviceType::CUDA, name);
  check_moment_mode(moment_mode);
  if (n == 0) return;
  const at::Device device = lists[0][0].device();
  const c10::cuda::OptionalCUDAGuard guard(device);
  // v is read and written in place by blend_kernel, then read by the update
  float* vp = const_cast<float*>(per_tensor_vector(v, n, device, name, "v"));
  const float* fp = fresh.has_value() ? per_tensor_vector(*fresh, n, device, name, "fresh")
                                      : nullptr;
  dispatch_types(
      lists[kGrad][0].scalar_type(), lists[kParam][0].scalar_type(), out_dtype(lists, kDepth),
      name, [&](auto types) {
        using Ty = decltype(types);
        using acc_t = typename Ty::acc_t;
        using sum_t =
            std::conditional_t<std::is_same_v<typename Ty::grad_t, double>, double, float>;
        check_state_dtype<acc_t>(lists[kExpAvg], name, "exp_avg");
        NovoGradOp<Ty> op;
        op.set_scalars(device, name, lr_t, step_t, std::nullopt, std::nullopt);
        op.v_norm = vp;
        op.h = make_hyper<acc_t>(lr, beta1, beta2, eps, static_cast<double>(step),
                                 bias_correction, weight_decay, grad_averaging, moment_mode);
        op.bias = {beta1, beta2, bias_correction};
        // every check is behind us: from here on the call writes
        const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
        blend_kernel<sum_t><<<static_cast<unsigned>(n), cuda::kBlockSize, 0, stream>>>(
            partial.data_ptr<sum_t>(), first.data_ptr<int64_t>(), vp, fp, blend);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        cuda::apply_elementwise(lists, op);
      });
}

}  // namespace shardopt
