// Argument validation shared by every kernel entry point, CPU and CUDA (host code only): the tensor
// lists, state dtypes, per-tensor vectors and device scalars. Messages start with the kernel name.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace shardopt {

// See Note: layouts (shardopt/_ops.py). A kernel reads every tensor as the flat array of its numel
// elements from data_ptr(), so a tensor must be non-overlapping and dense (contiguous,
// channels_last, a permuted view; any storage offset), and the tensors at one position of the
// lists must order their elements alike: all contiguous (their shapes may then differ), or one
// shape with the same stride in every dimension of size > 1.
inline bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_contiguous() && b.is_contiguous()) return true;
  if (a.sizes() != b.sizes()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

// "tensor i of list k (Half, shape [2, 3], strides [3, 1])", for error messages.
inline std::string describe(const std::vector<std::vector<at::Tensor>>& lists, size_t k,
                            size_t i) {
  const at::Tensor& t = lists[k][i];
  std::ostringstream out;
  out << "tensor " << i << " of list " << k << " (" << t.scalar_type() << ", shape " << t.sizes()
      << ", strides " << t.strides() << ")";
  return out.str();
}

// Checks that lists has `depth` or `depth + 1` (with an out slot) slots of equal length, every
// tensor strided, non-overlapping and dense, on one device of `device_type`, one dtype per slot
// (unless mixed_dtypes: the kernel dispatches per tensor), and at each position the same numel and
// layout as list 0's tensor. A list the kernel cannot take raises here, before anything is read.
// Returns whether the optional out slot is present.
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
      TORCH_CHECK(t.defined(), name, ": tensor ", i, " of list ", k, " is undefined (None)");
      TORCH_CHECK(t.device().type() == device_type, name, ": ", describe(lists, k, i), " is on ",
                  t.device(), ", expected a ", device_type, " tensor");
      TORCH_CHECK(t.device() == lists[0][0].device(), name,
                  ": expected all tensors to be on the same device: ", describe(lists, k, i),
                  " is on ", t.device(), ", tensor 0 of list 0 on ", lists[0][0].device());
      TORCH_CHECK(t.layout() == at::kStrided, name, ": ", describe(lists, k, i),
                  " is sparse; sparse tensors are not supported");
      TORCH_CHECK(mixed_dtypes || t.scalar_type() == list[0].scalar_type(), name, ": ",
                  describe(lists, k, i), " has another dtype than tensor 0 of that list (",
                  list[0].scalar_type(),
                  "): one call takes one dtype per list (shardopt._ops splits mixed lists)");
      TORCH_CHECK(t.numel() == lists[0][i].numel(), name, ": ", describe(lists, k, i), " has ",
                  t.numel(), " elements, tensor ", i, " of list 0 has ", lists[0][i].numel());
      if (t.numel() == 0) continue;
      TORCH_CHECK(t.is_non_overlapping_and_dense(), name, ": ", describe(lists, k, i),
                  " is not dense (a strided slice or an expanded view): the kernels read flat "
                  "storage (shardopt._ops passes such tensors through a dense copy)");
      TORCH_CHECK(same_layout(t, lists[0][i]), name, ": ", describe(lists, k, i),
                  " orders its elements unlike ", describe(lists, 0, i),
                  ": the tensors at one position need one memory layout (shardopt._ops copies "
                  "the others into the param's)");
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
