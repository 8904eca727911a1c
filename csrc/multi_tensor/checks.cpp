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

namespace {

constexpr const char* kCompactSlots[7] = {"grads",      "params",         "remainders",
                                          "exp_avg",    "exp_avg_sq",     "exp_avg_scales",
                                          "exp_avg_sq_scales"};
constexpr int64_t kCodecBlock = 256;  // codec::kBlock (state_codec.h)

std::string describe_slot(const at::Tensor& t, size_t k, size_t i) {
  return "tensor " + std::to_string(i) + " of " + kCompactSlots[k] + " (" +
         c10::toString(t.scalar_type()) + ", shape " + join_ints(t.sizes()) + ", strides " +
         join_ints(t.strides()) + ")";
}

std::string dtype_names(std::initializer_list<at::ScalarType> dtypes) {
  std::string out;
  for (const auto d : dtypes) out += (out.empty() ? "" : " or ") + std::string(c10::toString(d));
  return out;
}

}  // namespace

bool check_compact_lists(const std::vector<std::vector<at::Tensor>>& lists, bool blockwise,
                         c10::DeviceType device_type, const char* name,
                         std::initializer_list<at::ScalarType> state_dtypes) {
  TORCH_CHECK(lists.size() == 7, name,
              ": expected 7 tensor lists [grads, params, remainders, exp_avg, exp_avg_sq, "
              "exp_avg_scales, exp_avg_sq_scales], got ",
              num(lists.size()));
  const size_t n = lists[0].size();
  const bool remainder = !lists[2].empty();
  for (size_t k = 1; k < 7; ++k) {
    const size_t got = lists[k].size();
    if (k == 2) {
      TORCH_CHECK(got == 0 || got == n, name, ": remainders has ", num(got),
                  " tensors: expected none, or one per param (", num(n), ")");
    } else if (k >= 5) {
      TORCH_CHECK(got == (blockwise ? n : 0), name, ": ", kCompactSlots[k], " has ", num(got),
                  blockwise ? " tensors, expected one per param (" + num(n) + ")"
                            : std::string(" tensors: fp32, bf16 and fp16 states have no scales "
                                          "(scaled_fp16 and int8 states go through "
                                          "adam_blockwise)"));
    } else {
      TORCH_CHECK(got == n, name, ": ", kCompactSlots[k], " has ", num(got), " tensors, grads has ",
                  num(n));
    }
  }
  if (n == 0) return remainder;
  const at::Device device = lists[0][0].device();
  for (size_t k = 0; k < 7; ++k) {
    for (size_t i = 0; i < lists[k].size(); ++i) {
      const at::Tensor& t = lists[k][i];
      TORCH_CHECK(t.defined(), name, ": tensor ", num(i), " of ", kCompactSlots[k],
                  " is undefined (None)");
      TORCH_CHECK(t.device().type() == device_type && t.device() == device, name, ": ",
                  describe_slot(t, k, i), " is on ", t.device().str(), ", expected ",
                  device.str(), " (the device of tensor 0 of grads)");
      TORCH_CHECK(t.layout() == at::kStrided, name, ": ", describe_slot(t, k, i),
                  " is sparse; sparse tensors are not supported");
      TORCH_CHECK(t.scalar_type() == lists[k][0].scalar_type(), name, ": ",
                  describe_slot(t, k, i), " has another dtype than tensor 0 of ",
                  kCompactSlots[k], " (", lists[k][0].scalar_type(), "): one dtype per list");
      const int64_t numel = lists[0][i].numel();
      if (k >= 5) {
        const int64_t blocks = (numel + kCodecBlock - 1) / kCodecBlock;
        TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == blocks,
                    name, ": ", describe_slot(t, k, i), " must be a contiguous float32 tensor of ",
                    num(blocks), " elements (one scale per 256 elements of its param, ",
                    num(numel), " elements)");
        continue;
      }
      TORCH_CHECK(t.numel() == numel, name, ": ", describe_slot(t, k, i), " has ",
                  num(t.numel()), " elements, tensor ", num(i), " of grads has ", num(numel));
      if (numel == 0) continue;
      if (blockwise) {
        TORCH_CHECK(t.is_contiguous(), name, ": ", describe_slot(t, k, i),
                    " is not contiguous: blockwise state follows the flat element order");
      } else {
        TORCH_CHECK(t.is_non_overlapping_and_dense(), name, ": ", describe_slot(t, k, i),
                    " is not dense (a strided slice or an expanded view): the kernels read flat "
                    "storage");
        TORCH_CHECK(same_layout(t, lists[1][i]), name, ": ", describe_slot(t, k, i),
                    " orders its elements unlike tensor ", num(i),
                    " of params: the tensors at one position need one memory layout");
      }
    }
  }
  TORCH_CHECK(!remainder || lists[2][0].scalar_type() == at::kShort, name,
              ": remainders must be Short (int16), got ", lists[2][0].scalar_type());
  const at::ScalarType state = lists[3][0].scalar_type();
  bool allowed = false;
  for (const auto d : state_dtypes) allowed = allowed || d == state;
  TORCH_CHECK(allowed, name, ": exp_avg must be ", dtype_names(state_dtypes), ", got ", state);
  TORCH_CHECK(lists[4][0].scalar_type() == state, name,
              ": exp_avg_sq must have exp_avg's dtype (", state, "), got ",
              lists[4][0].scalar_type());
  return remainder;
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
