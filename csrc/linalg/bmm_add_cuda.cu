// bmm_add and symmetric_bmm_add on CUDA tensors: D = alpha * A @ B + beta * C for batched 16-bit
// matrices as cuBLASLt matmuls (lt_matmul.cu) that read C and write a fresh D (Note: why
// bmm_add), the symmetric one computing only the lower block rows of D (Note: symmetric
// products).
//
// Note: why bmm_add
// Newton-Schulz's two products with an addend (B = b A + c A², X = a X + B X) are baddbmm calls.
// Out of place, torch's CUDA baddbmm copies C into the result and then runs the GEMM with beta
// reading it back: an extra read and write of every X per step, about a tenth of the iteration's
// time on the 1.3B GPT set. cuBLASLt takes C and D as two matrices, so the copy goes. The GEMM
// is the same (fp32 accumulation, alpha and beta applied in fp32 in the epilogue, one rounding
// to the output dtype), so the result is baddbmm's up to the GEMM's own choice of kernel.
// fp32/fp64 matrices keep at::baddbmm (and torch's TF32 settings), as do layouts cuBLASLt cannot
// take as strides and a torch without cuBLASLt.
//
// Note: symmetric products
// Newton-Schulz's A = X Xᵀ and B = b A + c A² (and Gram Newton-Schulz's P and P R P) are
// symmetric. Cut D's rows into `blocks` bands of h rows (h a multiple of 8, the last band
// shorter): band i's entries left of the diagonal block's end, D[ih:(i+1)h, :(i+1)h], are one
// matmul of A's rows ih:(i+1)h with B's first (i+1)h columns, written into D in place (a view
// with D's leading stride). That is the lower block triangle with the diagonal blocks whole:
// (blocks + 1) / (2 blocks) of the full product's multiply-adds. A mirror kernel then copies
// each entry below the diagonal blocks to its transposed place above them. Each entry computed
// is the same dot product as in the full product (fp32 accumulation, one rounding), so D is the
// full product's up to the GEMM's choice of kernel, and exactly symmetric off the diagonal blocks.
// The bands are shorter GEMMs than the whole, so this pays only where a band is still large
// (shardopt.kernels.matmul picks `blocks` from n).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "../kernels.h"
#include "lt_matmul.h"

// The arguments are checked before these entry points are called (bindings.cpp runs
// check_batched_matmul: Note: checks before nvcc-built code in matmul_checks.cpp).

namespace shardopt {
namespace {

at::Tensor workspace_for(const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(kLtWorkspaceBytes)}, like.options().dtype(at::kByte));
}

at::Tensor torch_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                         double alpha, double beta) {
  if (!c.defined()) return alpha == 1.0 ? at::bmm(a, b) : at::bmm(a, b).mul_(alpha);
  return at::baddbmm(c, a, b, beta, alpha);
}

// d[k][r][c] = d[k][c][r] for r / h < c / h: the entries above the diagonal blocks from those
// below them (Note: symmetric products). 32 x 32 tiles through shared memory: the reads of the
// lower tile and the writes of the upper one both run along rows. Entries only read are never
// written, so tiles need no order.
__global__ void mirror_lower_blocks(uint16_t* d, int64_t n, int64_t h, int64_t batch) {
  __shared__ uint16_t tile[32][33];
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * 32;  // of the upper tile
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * 32;
  const int64_t last_col = col0 + 31 < n ? col0 + 31 : n - 1;
  if (row0 / h >= last_col / h) return;  // no entry of this tile lies above a diagonal block
  for (int64_t k = blockIdx.z; k < batch; k += gridDim.z) {
    uint16_t* m = d + k * n * n;
    for (int y = threadIdx.y; y < 32; y += blockDim.y) {
      const int64_t src_row = col0 + y, src_col = row0 + threadIdx.x;
      if (src_row < n && src_col < n) tile[y][threadIdx.x] = m[src_row * n + src_col];
    }
    __syncthreads();
    for (int y = threadIdx.y; y < 32; y += blockDim.y) {
      const int64_t r = row0 + y, c = col0 + threadIdx.x;
      if (r < n && c < n && r / h < c / h) m[r * n + c] = tile[threadIdx.x][y];
    }
    __syncthreads();
  }
}

// the whole product into a new row-major tensor: one cuBLASLt matmul, else torch
at::Tensor full_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                        double alpha, double beta) {
  const at::Tensor cc = c.defined() ? c.contiguous() : at::Tensor();
  at::Tensor d = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  if (d.numel() == 0 || a.size(2) == 0) return torch_product(a, b, c, alpha, beta);
  at::Tensor workspace = workspace_for(d);
  if (!lt_matmul(a, b, cc.defined() ? cc : d, d, static_cast<float>(alpha),
                 cc.defined() ? static_cast<float>(beta) : 0.0f, workspace.data_ptr())) {
    return torch_product(a, b, c, alpha, beta);
  }
  return d;
}

}  // namespace

at::Tensor bmm_add_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                        double alpha, double beta) {
  c10::cuda::CUDAGuard guard(c.device());
  return full_product(a, b, c, alpha, beta);
}

namespace {

// symmetric_bmm_add and symmetric_bmm: c undefined for the latter
at::Tensor symmetric_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                             double alpha, double beta, int64_t blocks) {
  c10::cuda::CUDAGuard guard(a.device());
  const int64_t batch = a.size(0), n = a.size(1);
  // bands of h rows, h a multiple of 8 (16-byte aligned offsets in 16-bit rows)
  const int64_t h = ((n + blocks - 1) / blocks + 7) / 8 * 8;
  const bool half = a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf;
  if (!half) return torch_product(a, b, c, alpha, beta);
  if (blocks == 1 || h >= n || batch == 0 || a.size(2) == 0) {
    return full_product(a, b, c, alpha, beta);
  }
  const at::Tensor cc = c.defined() ? c.contiguous() : at::Tensor();
  at::Tensor d = at::empty({batch, n, n}, a.options());
  at::Tensor workspace = workspace_for(d);
  const float alpha_f = static_cast<float>(alpha);
  const float beta_f = cc.defined() ? static_cast<float>(beta) : 0.0f;
  for (int64_t row = 0; row < n; row += h) {
    const int64_t rows = std::min(h, n - row), cols = row + rows;
    at::Tensor band = d.narrow(1, row, rows).narrow(2, 0, cols);
    const at::Tensor addend = cc.defined() ? cc.narrow(1, row, rows).narrow(2, 0, cols) : band;
    if (!lt_matmul(a.narrow(1, row, rows), b.narrow(2, 0, cols), addend, band, alpha_f, beta_f,
                   workspace.data_ptr())) {
      // a band cuBLASLt declines: the whole product by torch, on the same stream, into a new
      // tensor (the bands already launched only wrote into d, which is dropped)
      return torch_product(a, b, c, alpha, beta);
    }
  }
  const dim3 threads(32, 8);
  const dim3 grid(static_cast<unsigned>((n + 31) / 32), static_cast<unsigned>((n + 31) / 32),
                  static_cast<unsigned>(std::min<int64_t>(batch, 65535)));
  // a copy of 16-bit entries: one kernel for bf16 and fp16
  mirror_lower_blocks<<<grid, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<uint16_t*>(d.data_ptr()), n, h, batch);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return d;
}

}  // namespace

at::Tensor symmetric_bmm_add_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                                  double alpha, double beta, int64_t blocks) {
  return symmetric_product(a, b, c, alpha, beta, blocks);
}

at::Tensor symmetric_bmm_cuda(const at::Tensor& a, const at::Tensor& b, double alpha,
                              int64_t blocks) {
  return symmetric_product(a, b, at::Tensor(), alpha, 0.0, blocks);
}

}  // namespace shardopt
