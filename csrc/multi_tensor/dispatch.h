// dtype dispatch shared by the CPU and CUDA traversals.
//
// A kernel call sees up to three storage dtypes: the grad (G), the param or fp32 master (P) and an
// optional low-precision "out" copy of the param (O). Math runs in acc_t: double for fp64 params,
// float otherwise; optimizer state is stored in acc_t (except SGD's momentum buffer, stored in P, as
// torch.optim.SGD's: sgd_math.h). Supported combinations:
//   without out: (G, P) in {(f32,f32), (f16,f16), (bf16,bf16), (f64,f64), (f16,f32), (bf16,f32)}
//   with out:    P = f32, G in {f32, f16, bf16}, O in {f32, f16, bf16}
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <optional>
#include <type_traits>

namespace shardopt {

template <typename G, typename P, typename O, bool HasOut>
struct Types {
  using grad_t = G;
  using param_t = P;
  using out_t = O;
  using acc_t = std::conditional_t<std::is_same_v<P, double>, double, float>;
  static constexpr bool has_out = HasOut;
};

namespace detail {

template <typename G, typename P, typename F>
void dispatch_out(std::optional<at::ScalarType> out, const char* name, F&& f) {
  if (!out.has_value()) return f(Types<G, P, P, false>{});
  TORCH_CHECK((std::is_same_v<P, float>), name, ": a low-precision out slot needs an fp32 master");
  if constexpr (std::is_same_v<P, float>) {
    switch (*out) {
      case at::kFloat: return f(Types<G, float, float, true>{});
      case at::kHalf: return f(Types<G, float, c10::Half, true>{});
      case at::kBFloat16: return f(Types<G, float, c10::BFloat16, true>{});
      default: break;
    }
  }
  TORCH_CHECK(false, name, ": unsupported out dtype ", *out);
}

}  // namespace detail

// Calls f(Types<...>{}) for the (grad, param, out) dtype combination, or raises a clear error.
template <typename F>
void dispatch_types(at::ScalarType grad, at::ScalarType param, std::optional<at::ScalarType> out,
                    const char* name, F&& f) {
  using detail::dispatch_out;
  if (param == at::kFloat) {
    switch (grad) {
      case at::kFloat: return dispatch_out<float, float>(out, name, f);
      case at::kHalf: return dispatch_out<c10::Half, float>(out, name, f);
      case at::kBFloat16: return dispatch_out<c10::BFloat16, float>(out, name, f);
      default: break;
    }
  } else if (!out.has_value() && grad == param) {
    switch (param) {
      case at::kHalf: return f(Types<c10::Half, c10::Half, c10::Half, false>{});
      case at::kBFloat16: return f(Types<c10::BFloat16, c10::BFloat16, c10::BFloat16, false>{});
      case at::kDouble: return f(Types<double, double, double, false>{});
      default: break;
    }
  }
  TORCH_CHECK(false, name, ": unsupported dtype combination grad=", grad, " param=", param,
              out.has_value() ? " out=" : "", out.has_value() ? c10::toString(*out) : "");
}

// The compact Adam kernels (adam_compact, adam_blockwise): grad G in {f32, f16, bf16} and the
// master stored as P = f32, or P = bf16 with an int16 remainder (Rem), or P in {bf16, f16} alone.
template <typename G, typename P, bool Rem>
struct MasterTypes {
  using grad_t = G;
  using param_t = P;
  static constexpr bool remainder = Rem;
};

// Calls f(MasterTypes<...>{}) for the (grad, param, remainder) combination, or raises.
template <typename F>
void dispatch_master(at::ScalarType grad, at::ScalarType param, bool remainder, const char* name,
                     F&& f) {
  auto with_grad = [&](auto param_tag, auto rem_tag) {
    using P = decltype(param_tag);
    constexpr bool kRem = decltype(rem_tag)::value;
    switch (grad) {
      case at::kFloat: return f(MasterTypes<float, P, kRem>{});
      case at::kHalf: return f(MasterTypes<c10::Half, P, kRem>{});
      case at::kBFloat16: return f(MasterTypes<c10::BFloat16, P, kRem>{});
      default: TORCH_CHECK(false, name, ": grads must be Float, Half or BFloat16, got ", grad);
    }
  };
  TORCH_CHECK(!remainder || param == at::kBFloat16, name,
              ": remainders go with bf16 params (the master's upper half), got params of dtype ",
              param);
  switch (param) {
    case at::kFloat: return with_grad(float{}, std::false_type{});
    case at::kHalf: return with_grad(c10::Half{}, std::false_type{});
    case at::kBFloat16:
      return remainder ? with_grad(c10::BFloat16{}, std::true_type{})
                       : with_grad(c10::BFloat16{}, std::false_type{});
    default:
      TORCH_CHECK(false, name, ": params must be Float (a master), BFloat16 or Half, got ", param);
  }
}

// Calls f(T{}) with T the storage type of a single-dtype list (norm, scale).
template <typename F>
void dispatch_float(at::ScalarType dtype, const char* name, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(c10::Half{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kDouble: return f(double{});
    default: TORCH_CHECK(false, name, ": unsupported dtype ", dtype);
  }
}

}  // namespace shardopt
