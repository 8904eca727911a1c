// Argument validation shared by every kernel entry point, CPU and CUDA (host code only): the tensor
// lists, state dtypes, per-tensor vectors and device scalars. Messages start with the kernel name.
// Defined in checks.cpp, which builds its messages without iostreams (see there).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

namespace shardopt {

// See Note: layouts (shardopt/_layouts.py). A kernel reads every tensor as the flat array of its numel
// elements from data_ptr(), so a tensor must be non-overlapping and dense (contiguous,
// channels_last, a permuted view; any storage offset), and the tensors at one position of the
// lists must order their elements alike: all contiguous (their shapes may then differ), or one
// shape with the same stride in every dimension of size > 1.
bool same_layout(const at::Tensor& a, const at::Tensor& b);

// "tensor i of list k (Half, shape [2, 3], strides [3, 1])", for error messages.
// "[2, 3]" (for messages).
std::string join_ints(c10::IntArrayRef values);

std::string describe(const std::vector<std::vector<at::Tensor>>& lists, size_t k,
                            size_t i);

// Checks that lists has `depth` or `depth + 1` (with an out slot) slots of equal length, every
// tensor strided, non-overlapping and dense, on one device of `device_type`, one dtype per slot
// (unless mixed_dtypes: the kernel dispatches per tensor), and at each position the same numel and
// layout as list 0's tensor. A list the kernel cannot take raises here, before anything is read.
// Returns whether the optional out slot is present.
bool check_tensor_lists(const std::vector<std::vector<at::Tensor>>& lists, size_t depth,
                               c10::DeviceType device_type, const char* name,
                               bool mixed_dtypes = false);

// check_tensor_lists for a kernel without an out slot: exactly `depth` lists (`slots` names them
// in the message, e.g. " [src, dst]").
void check_tensor_lists_no_out(const std::vector<std::vector<at::Tensor>>& lists,
                                      size_t depth, c10::DeviceType device_type, const char* name,
                                      bool mixed_dtypes = false, const char* slots = "");

// The 7 lists of the compact Adam kernels (adam_compact_math.h: grads, params, remainders,
// exp_avg, exp_avg_sq, exp_avg_scales, exp_avg_sq_scales): list lengths (remainders empty or one
// per param; scales one per param for the blockwise kernel, else empty), every element tensor
// dense, on one device of `device_type`, with its position's numel, one dtype per list, laid out as
// its param (blockwise: contiguous, since blocks follow the element order); remainders int16,
// exp_avg and exp_avg_sq of one dtype among `state_dtypes`; scales contiguous float32 tensors of
// ceil(numel / 256) elements. Grad and param dtypes are checked by dispatch_master. Returns whether
// remainders are present.
bool check_compact_lists(const std::vector<std::vector<at::Tensor>>& lists, bool blockwise,
                         c10::DeviceType device_type, const char* name,
                         std::initializer_list<at::ScalarType> state_dtypes);

// The out slot's dtype if present.
std::optional<at::ScalarType> out_dtype(const std::vector<std::vector<at::Tensor>>& lists,
                                               size_t depth);

// State slots hold acc_t (fp32, or fp64 for fp64 params).
template <typename T>
void check_state_dtype(const std::vector<at::Tensor>& list, const char* name, const char* slot) {
  if (list.empty()) return;
  TORCH_CHECK(list[0].scalar_type() == c10::CppTypeToScalarType<T>::value, name, ": ", slot,
              " must be ", c10::CppTypeToScalarType<T>::value, ", got ", list[0].scalar_type());
}

// A per-tensor vector (norms) has one entry per tensor. The CPU kernels take any floating dtype.
void check_per_tensor(const at::Tensor& t, size_t n, const char* name, const char* what);

// The CUDA kernels read per-tensor vectors in place: a contiguous float32 vector on `device`.
const float* per_tensor_vector(const at::Tensor& t, size_t n, const at::Device& device,
                                      const char* name, const char* what);

// A flag or value the kernel reads in place (found_inf): a 1-element float32 tensor on `device`.
float* device_scalar(const at::Tensor& t, const at::Device& device, const char* name,
                            const char* what);

// The data pointer of an optional device scalar (lr_t, step_t, ...), or nullptr when absent.
const float* device_scalar(const std::optional<at::Tensor>& t, const at::Device& device,
                                  const char* name, const char* what);

}  // namespace shardopt
