// Muon's elementwise parts on CPU tensors: the cpu traversal over muon_math.h.
#include "../kernels.h"
#include "../multi_tensor/cpu_apply.h"
#include "muon_dispatch.h"
#include "muon_math.h"

namespace shardopt {

void muon_momentum_cpu(const TensorLists& lists, double momentum, bool nesterov) {
  using namespace muon;
  const char* name = "muon_momentum";
  check_tensor_lists_no_out(lists, kMomentumDepth, c10::DeviceType::CPU, name, false,
                            " [grads, bufs, mixes]");
  if (lists[0].empty()) return;
  dispatch_momentum(
      lists[kGrad][0].scalar_type(), lists[kBuf][0].scalar_type(), lists[kMix][0].scalar_type(),
      name, [&](auto g_t, auto b_t, auto n_t) {
        using G = typename decltype(g_t)::type;
        using B = typename decltype(b_t)::type;
        using N = typename decltype(n_t)::type;
        using T = acc_of<B>;
        const MomentumHyper<T> h = make_momentum_hyper<T>(momentum, nesterov);
        auto g = cpu::pointers<G>(lists[kGrad]);
        auto b = cpu::pointers<B>(lists[kBuf]);
        auto m = cpu::pointers<N>(lists[kMix]);
        // the flags as constants of the loop (see Note: vectorised CPU loops)
        cpu::with_flag(nesterov, [&](auto nesterov_c) {
          cpu::apply(lists[0], [&](int64_t k, int64_t s, int64_t e) {
            auto hl = h;
            hl.nesterov = decltype(nesterov_c)::value;
            const auto* __restrict gk = g[k];
            auto* __restrict bk = b[k];
            auto* __restrict mk = m[k];
            for (int64_t i = s; i < e; ++i) {
              T bi = static_cast<T>(bk[i]);
              T mi;
              muon::momentum<B>(static_cast<T>(gk[i]), bi, mi, hl);
              bk[i] = static_cast<B>(bi);
              mk[i] = static_cast<N>(mi);
            }
          });
        });
      });
}

void muon_apply_cpu(const TensorLists& lists, double lr, double weight_decay, double lr_ratio,
                    const OptTensor& lr_t) {
  using namespace muon;
  const char* name = "muon_apply";
  check_tensor_lists(lists, kApplyDepth, c10::DeviceType::CPU, name);
  if (lists[0].empty()) return;
  dispatch_apply(
      lists[kParam][0].scalar_type(), lists[kUpdate][0].scalar_type(),
      out_dtype(lists, kApplyDepth), name, [&](auto p_t, auto n_t, auto o_t, auto has_out) {
        using P = typename decltype(p_t)::type;
        using N = typename decltype(n_t)::type;
        using O = typename decltype(o_t)::type;
        constexpr bool kHasOut = decltype(has_out)::value;
        using T = acc_of<P, N>;
        ApplyHyper<T> h = make_apply_hyper<T>(cpu::scalar_or(lr_t, lr), weight_decay, lr_ratio);
        // ATen's CPU add of two fp16/bf16 tensors of one dtype takes alpha in that dtype
        if constexpr (std::is_same_v<P, N> && !std::is_same_v<P, T>) h.alpha = round_to<P>(h.alpha);
        auto p = cpu::pointers<P>(lists[kParam]);
        auto u = cpu::pointers<N>(lists[kUpdate]);
        std::vector<O*> o;
        if constexpr (kHasOut) o = cpu::pointers<O>(lists[kOut]);
        cpu::apply(lists[0], [&](int64_t k, int64_t s, int64_t e) {
          const ApplyHyper<T> hl = h;
          auto* __restrict pk = p[k];
          const auto* __restrict uk = u[k];
          O* __restrict ok = kHasOut ? o[k] : nullptr;
          for (int64_t i = s; i < e; ++i) {
            T pi = static_cast<T>(pk[i]);
            muon::apply<P>(pi, static_cast<T>(uk[i]), hl);
            pk[i] = static_cast<P>(pi);
            if constexpr (kHasOut) ok[i] = static_cast<O>(pi);
          }
        });
      });
}

}  // namespace shardopt
