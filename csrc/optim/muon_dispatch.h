// The dtype combinations of the Muon kernels (muon_math.h), shared by muon_cpu.cpp and
// muon_cuda.cu: muon_momentum takes (grad, buf) as the other optimizers' (grad, param) and the
// mix in any float dtype (ns_dtype); muon_apply takes the param (or fp32 master), the update in any
// float dtype and an optional out copy beside an fp32 master.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <optional>
#include <type_traits>

namespace shardopt {
namespace muon {

template <typename T>
struct Is {
  using type = T;
};

// fp32 math, fp64 when any operand is fp64 (torch's promotion of the add)
template <typename... Ts>
using acc_of = std::conditional_t<(std::is_same_v<Ts, double> || ...), double, float>;

template <typename F>
void dispatch_float(at::ScalarType t, const char* name, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: return f(Is<float>{});
    case at::kDouble: return f(Is<double>{});
    case at::kHalf: return f(Is<c10::Half>{});
    case at::kBFloat16: return f(Is<c10::BFloat16>{});
    default: TORCH_CHECK(false, name, ": unsupported ", what, " dtype ", t);
  }
}

// f(Is<G>, Is<B>, Is<N>) for muon_momentum's grads, bufs and mixes.
template <typename F>
void dispatch_momentum(at::ScalarType grad, at::ScalarType buf, at::ScalarType mix,
                       const char* name, F&& f) {
  TORCH_CHECK(grad == buf || (buf == at::kFloat && (grad == at::kHalf || grad == at::kBFloat16)),
              name, ": unsupported dtype combination grad=", grad, " buf=", buf);
  dispatch_float(buf, name, "buf", [&](auto b) {
    using B = typename decltype(b)::type;
    dispatch_float(mix, name, "mix", [&](auto n) {
      if (grad == buf) return f(Is<B>{}, b, n);
      if constexpr (std::is_same_v<B, float>) {
        if (grad == at::kHalf) return f(Is<c10::Half>{}, b, n);
        return f(Is<c10::BFloat16>{}, b, n);
      }
    });
  });
}

// f(Is<P>, Is<N>, Is<O>, has_out) for muon_apply's params, updates and outs (O = P without outs).
template <typename F>
void dispatch_apply(at::ScalarType param, at::ScalarType update, std::optional<at::ScalarType> out,
                    const char* name, F&& f) {
  TORCH_CHECK(!out.has_value() || param == at::kFloat, name,
              ": a low-precision out slot needs an fp32 master");
  dispatch_float(param, name, "param", [&](auto p) {
    using P = typename decltype(p)::type;
    dispatch_float(update, name, "update", [&](auto n) {
      if (!out.has_value()) return f(p, n, p, std::false_type{});
      if constexpr (std::is_same_v<P, float>) {
        switch (*out) {
          case at::kFloat: return f(p, n, Is<float>{}, std::true_type{});
          case at::kHalf: return f(p, n, Is<c10::Half>{}, std::true_type{});
          case at::kBFloat16: return f(p, n, Is<c10::BFloat16>{}, std::true_type{});
          default: TORCH_CHECK(false, name, ": unsupported out dtype ", *out);
        }
      }
    });
  });
}

}  // namespace muon
}  // namespace shardopt
