// The argument checks of the batched matmuls (bmm_add_cuda.cu), host-compiled
// (matmul_checks.cpp): the bindings call them before the CUDA entry points (Note: checks
// before nvcc-built code).
#pragma once

#include <torch/extension.h>

#include <string>

namespace shardopt {

// "(d0, d1, ...)": a shape for an error message, as plain text
std::string shape_text(const at::Tensor& x);

// name's arguments: 3-D a (k, p, q), b (k, q, r), c (k, p, r) if defined, one CUDA device, one
// dtype; with `square` p == r (a symmetric product) and blocks >= 1
void check_batched_matmul(const char* name, const at::Tensor& a, const at::Tensor& b,
                          const at::Tensor& c, bool square, int64_t blocks = 1);

}  // namespace shardopt
