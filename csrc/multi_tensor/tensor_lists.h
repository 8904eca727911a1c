// Validation of the tensor lists every kernel receives; shared by the CPU and CUDA traversals.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <vector>

namespace shardopt {

// Checks that lists has `depth` or `depth + 1` (with an out slot) slots of equal length, every
// tensor contiguous, dense, on `device_type`, one dtype per slot, and matching numel per position.
// Returns whether the optional out slot is present.
inline bool check_tensor_lists(const std::vector<std::vector<at::Tensor>>& lists, size_t depth,
                               c10::DeviceType device_type, const char* name) {
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
      TORCH_CHECK(t.scalar_type() == list[0].scalar_type(), name, ": tensor ", i, " of list ", k,
                  " has dtype ", t.scalar_type(), ", tensor 0 has ", list[0].scalar_type());
      TORCH_CHECK(t.numel() == lists[0][i].numel(), name, ": tensor ", i, " of list ", k,
                  " has ", t.numel(), " elements, list 0 has ", lists[0][i].numel());
      TORCH_CHECK(t.device() == lists[0][0].device(), name, ": all tensors must be on one device");
    }
  }
  return lists.size() == depth + 1;
}

// The out slot's dtype if present.
inline std::optional<at::ScalarType> out_dtype(const std::vector<std::vector<at::Tensor>>& lists,
                                               size_t depth) {
  if (lists.size() == depth + 1 && !lists[depth].empty()) return lists[depth][0].scalar_type();
  return std::nullopt;
}

}  // namespace shardopt
