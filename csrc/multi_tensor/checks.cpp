// Definitions of checks.h (see there for why they live in a C++ file).
#include "checks.h"

#include <string>

namespace shardopt {

namespace {
// Numbers go into messages as text made here, not through iostreams: on the GPU image (torch
// 2.11, CUDA 13.0) streaming an integer from this module crashed the process instead of raising.
template <typename T>
std::string num(T value) {
  return std::to_string(value);
}
}  // namespace

bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_contiguous() && b.is_contiguous()) return true;
  if (a.sizes() != b.sizes()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

std::string join_ints(c10::IntArrayRef values) {
  std::string out = "[";
  for (size_t j = 0; j < values.size(); ++j) {
    if (j) out += ", ";
    out += std::to_string(values[j]);
  }
  return out + "]";
}

std::string describe(const std::vector<std::vector<at::Tensor>>& lists, size_t k,
                            size_t i) {
  const at::Tensor& t = lists[k][i];
  return "tensor " + std::to_string(i) + " of list " + std::to_string(k) + " (" +
         c10::toString(t.scalar_type()) + ", shape " + join_ints(t.sizes()) + ", strides " +
         join_ints(t.strides()) + ")";
}

bool check_tensor_lists(const std::vector<std::vector<at::Tensor>>& lists, size_t depth,
                               c10::DeviceType device_type, const char* name,
                               bool mixed_dtypes) {
  TORCH_CHECK(lists.size() == depth || lists.size() == depth + 1, name, ": expected ", num(depth),
              " or ", num(depth + 1), " tensor lists, got ", num(lists.size()));
  const size_t n = lists[0].size();
  for (size_t k = 0; k < lists.size(); ++k) {
    const auto& list = lists[k];
    TORCH_CHECK(list.size() == n, name, ": tensor list ", num(k), " has ",
                num(list.size()), " tensors, list 0 has ", num(n));
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& t = list[i];
      TORCH_CHECK(t.defined(), name, ": tensor ", num(i), " of list ", num(k),
                  " is undefined (None)");
      TORCH_CHECK(t.device().type() == device_type, name, ": ", describe(lists, k, i), " is on ",
                  t.device().str(), ", expected a ", c10::DeviceTypeName(device_type), " tensor");
      TORCH_CHECK(t.device() == lists[0][0].device(), name,
                  ": expected all tensors to be on the same device: ", describe(lists, k, i),
                  " is on ", t.device().str(), ", tensor 0 of list 0 on ",
                  lists[0][0].device().str());
      TORCH_CHECK(t.layout() == at::kStrided, name, ": ", describe(lists, k, i),
                  " is sparse; sparse tensors are not supported");
      TORCH_CHECK(mixed_dtypes || t.scalar_type() == list[0].scalar_type(), name, ": ",
                  describe(lists, k, i), " has another dtype than tensor 0 of that list (",
                  list[0].scalar_type(),
                  "): one call takes one dtype per list (shardopt._ops splits mixed lists)");
      TORCH_CHECK(t.numel() == lists[0][i].numel(), name, ": ", describe(lists, k, i), " has ",
                  num(t.numel()), " elements, tensor ", num(i), " of list 0 has ",
                  num(lists[0][i].numel()));
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

void check_tensor_lists_no_out(const std::vector<std::vector<at::Tensor>>& lists,
                                      size_t depth, c10::DeviceType device_type, const char* name,
                                      bool mixed_dtypes, const char* slots) {
  const bool has_out = check_tensor_lists(lists, depth, device_type, name, mixed_dtypes);
  TORCH_CHECK(!has_out, name, ": expected ", num(depth), " tensor lists", slots, ", got ",
              num(lists.size()));
}

std::optional<at::ScalarType> out_dtype(const std::vector<std::vector<at::Tensor>>& lists,
                                               size_t depth) {
  if (lists.size() == depth + 1 && !lists[depth].empty()) return lists[depth][0].scalar_type();
  return std::nullopt;
}

void check_per_tensor(const at::Tensor& t, size_t n, const char* name, const char* what) {
  TORCH_CHECK(t.numel() == static_cast<int64_t>(n), name, ": ", what, " needs ", num(n),
              " entries, got ", num(t.numel()));
}

const float* per_tensor_vector(const at::Tensor& t, size_t n, const at::Device& device,
                                      const char* name, const char* what) {
  TORCH_CHECK(t.device() == device && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.numel() == static_cast<int64_t>(n),
              name, ": ", what, " must be a contiguous float32 tensor of ", num(n), " elements on ",
              device.str(), ", got ", t.scalar_type(), " with ", num(t.numel()), " elements on ",
              t.device().str());
  return static_cast<const float*>(t.data_ptr());
}

float* device_scalar(const at::Tensor& t, const at::Device& device, const char* name,
                            const char* what) {
  TORCH_CHECK(t.device() == device && t.scalar_type() == at::kFloat && t.numel() == 1, name, ": ",
              what, " must be a 1-element float32 tensor on ", device.str(), ", got ",
              t.scalar_type(), " with ", num(t.numel()), " elements on ", t.device().str());
  return static_cast<float*>(t.data_ptr());
}

const float* device_scalar(const std::optional<at::Tensor>& t, const at::Device& device,
                                  const char* name, const char* what) {
  return t.has_value() ? device_scalar(*t, device, name, what) : nullptr;
}

}  // namespace shardopt
