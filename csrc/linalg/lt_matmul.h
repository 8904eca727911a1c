// One cuBLASLt matmul on views of torch tensors (csrc/linalg/lt_matmul.cu): the engine of
// bmm_add and symmetric_bmm_add (bmm_add_cuda.cu).
#pragma once

#include <torch/extension.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace shardopt {

// cuBLAS's recommendation for Hopper: the workspace each lt_matmul is given
constexpr size_t kLtWorkspaceBytes = 32u << 20;

// d = alpha * a @ b + beta * c on one stream, for 3-D 16-bit CUDA views with one dtype: a (k, p,
// q) and b (k, q, r) each row-major or a transposed view (unit stride in one of the last two
// dims), c and d (k, p, r) row-major with any leading and batch strides (d may be a block of a
// larger tensor; c may be d itself when beta is 0). Returns false, having launched nothing,
// where cuBLASLt is missing or takes no such case: the caller falls back to torch. Descriptors
// and the algorithm are made once per case (shapes, strides, alignments) and kept.
bool lt_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, at::Tensor& d,
               float alpha, float beta, void* workspace);

// How many of cuBLASLt's heuristic algorithms a new case times at its first call, keeping the
// fastest (Note: tuning the matmuls in lt_matmul.cu); 0 or 1: the heuristic's first, untimed
// (the default). The environment variable SHARDOPT_MATMUL_TUNING sets it at the first matmul
// (a value that is not an integer in [0, kMaxTuningCandidates] makes every product raise, naming
// it). set_matmul_tuning clamps to that range; cases made before a change keep their algorithm.
constexpr int64_t kMaxTuningCandidates = 32;
void set_matmul_tuning(int64_t candidates);
int64_t matmul_tuning();
// (cases timed so far, how many of them kept another algorithm than the heuristic's first)
std::pair<int64_t, int64_t> matmul_tuning_stats();

}  // namespace shardopt
