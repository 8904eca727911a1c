// Argument validation shared by every kernel entry point, CPU and CUDA (host code only): the tensor
// lists, state dtypes, per-tensor vectors and device scalars. Messages start with the kernel name.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <vector>

namespace shardopt {

// Checks that lists has `depth` or `depth + 1` (with an out slot) slots of equal length, every
// tensor contiguous, dense, on `device_type`, one dtype per slot (unless mixed_dtypes), and
// matching numel per position. Returns whether the optional out slot is present.
inline bool check_tensor_lists(const std::vector<std::vector<at::Tensor>>& lists, size_t depth,
                               c10::DeviceType device_type, const char* name,
                               bool mixed_dtypes = false) {
  TORCH_CHECK(lists.size() == depth || lists.size() == depth + 1, name, ": expected ", depth,
              " or ", depth + 1, " tensor lists, got ", lists.size());
  const size_t n = lists[0].size();
  for (size_t k = 0; k < lists.size(); ++k) {
    const auto& list = lists[k];
    TORCH_CHECK(list.size() == n, name, ": tensor list ", k, " has ", list.size(),
                " tensors, list 0 has ", n);
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& t = list[i];
      TORCH_CHECK(t.device().type() == device_type, name, ": tensor ", i, " of list ", k,
                  " is on ", t.device(), ", expected a ", device_type, " tensor");
      TORCH_CHECK(t.layout() == at::kStrided, name, ": sparse tensors are not supported");
      TORCH_CHECK(t.is_contiguous(), name, ": tensor ", i, " of list ", k, " is not contiguous");
      TORCH_CHECK(mixed_dtypes || t.scalar_type() == list[0].scalar_type(), name, ": tensor ", i,
                  " of list ", k, " has dtype ", t.scalar_type(), ", tensor 0 has ",
                  list[0].scalar_type());
      TORCH_CHECK(t.numel() == lists[0][i].numel(), name, ": tensor ", i, " of list ", k,
                  " has ", t.numel(), " elements, list 0 has ", lists[0][i].numel());
      TORCH_CHECK(t.device() == lists[0][0].device(), name, ": all tensors must be on one device");
    }
  }
  return lists.size() == depth + 1;
}

// check_tensor_lists for a kernel without an out slot: exactly `depth` lists (`slots` names them
// in the message, e.g. " [src, dst]").
inline void check_tensor_lists_no_out(const std::vector<std::vector<at::Tensor>>& lists,
                                      size_t depth, c10::DeviceType device_type, const char* name,
                                      bool mixed_dtypes = false, const char* slots = "") {
  const bool has_out = check_tensor_lists(lists, depth, device_type, name, mixed_dtypes);
  TORCH_CHECK(!has_out, name, ": expected ", depth, " tensor lists", slots, ", got ",
              lists.size());
}

// The out slot's dtype if present.
inline std::optional<at::ScalarType> out_dtype(const std::vector<std::vector<at::Tensor>>& lists,
                                               size_t depth) {
  if (lists.size() == depth + 1 && !lists[depth].empty()) return lists[depth][0].scalar_type();
  return std::nullopt;
}

// State slots hold acc_t (fp32, or fp64 for fp64 params).
template <typename T>
void check_state_dtype(const std::vector<at::Tensor>& list, const char* name, const char* slot) {
  if (list.empty()) return;
  TORCH_CHECK(list[0].scalar_type() == c10::CppTypeToScalarType<T>::value, name, ": ", slot,
              " must be ", c10::CppTypeToScalarType<T>::value, ", got ", list[0].scalar_type());
}

// A per-tensor vector (norms) has one entry per tensor. The CPU kernels take any floating dtype.
inline void check_per_tensor(const at::Tensor& t, size_t n, const char* name, const char* what) {
  TORCH_CHECK(t.numel() == static_cast<int64_t>(n), name, ": ", what, " needs ", n,
              " entries, got ", t.numel());
}

// The CUDA kernels read per-tensor vectors in place: a contiguous float32 vector on `device`.
inline const float* per_tensor_vector(const at::Tensor& t, size_t n, const at::Device& device,
                                      const char* name, const char* what) {
  TORCH_CHECK(t.device() == device && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.numel() == static_cast<int64_t>(n),
              name, ": ", what, " must be a contiguous float32 tensor of ", n, " elements on ",
              device, ", got ", t.scalar_type(), " with ", t.numel(), " elements on ", t.device());
  return static_cast<const float*>(t.data_ptr());
}

// A flag or value the kernel reads in place (found_inf): a 1-element float32 tensor on `device`.
inline float* device_scalar(const at::Tensor& t, const at::Device& device, const char* name,
                            const char* what) {
  TORCH_CHECK(t.device() == device && t.scalar_type() == at::kFloat && t.numel() == 1, name, ": ",
              what, " must be a 1-element float32 tensor on ", device, ", got ", t.scalar_type(),
              " with ", t.numel(), " elements on ", t.device());
  return static_cast<float*>(t.data_ptr());
}

// The data pointer of an optional device scalar (lr_t, step_t, ...), or nullptr when absent.
inline const float* device_scalar(const std::optional<at::Tensor>& t, const at::Device& device,
                                  const char* name, const char* what) {
  return t.has_value() ? device_scalar(*t, device, name, what) : nullptr;
}

}  // namespace shardopt
