// bmm_add on CUDA tensors: D = alpha * A @ B + beta * C for batched 16-bit matrices, one
// cuBLASLt matmul that reads C and writes a fresh D (Note: why bmm_add).
//
// Note: why bmm_add
// Newton-Schulz's two products with an addend (B = b A + c A², X = a X + B X) are baddbmm calls.
// Out of place, torch's CUDA baddbmm copies C into the result and then runs the GEMM with beta
// reading it back: an extra read and write of every X per step, about a tenth of the iteration's
// time on the 1.3B GPT set. cuBLASLt takes C and D as two matrices, so the copy goes. The GEMM
// is the same (fp32 accumulation, alpha and beta applied in fp32 in the epilogue, one rounding
// to the output dtype), so the result is baddbmm's up to the GEMM's own choice of kernel.
//
// cuBLASLt's entry points are looked up at the first call in the libraries already loaded with
// torch (libtorch_cuda and its dependencies), never linked: the extension loads wherever torch
// does, and a torch without cuBLASLt makes bmm_add fall back to at::baddbmm (as do fp32/fp64
// matrices, which keep torch's TF32 settings, and layouts cuBLASLt cannot take as strides).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <dlfcn.h>
#include <torch/extension.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "../kernels.h"

namespace shardopt {
namespace {

// cuBLASLt's functions, looked up once (Note: why bmm_add)
struct LtApi {
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) layout_set = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  bool ok = false;
};

template <typename F>
void find(void* lib, const char* name, F& fn) {
  if (fn == nullptr && lib != nullptr) fn = reinterpret_cast<F>(dlsym(lib, name));
}

void find_all(void* lib, LtApi& a) {
  find(lib, "cublasLtMatmulDescCreate", a.desc_create);
  find(lib, "cublasLtMatmulDescSetAttribute", a.desc_set);
  find(lib, "cublasLtMatmulDescDestroy", a.desc_destroy);
  find(lib, "cublasLtMatrixLayoutCreate", a.layout_create);
  find(lib, "cublasLtMatrixLayoutSetAttribute", a.layout_set);
  find(lib, "cublasLtMatrixLayoutDestroy", a.layout_destroy);
  find(lib, "cublasLtMatmulPreferenceCreate", a.pref_create);
  find(lib, "cublasLtMatmulPreferenceSetAttribute", a.pref_set);
  find(lib, "cublasLtMatmulPreferenceDestroy", a.pref_destroy);
  find(lib, "cublasLtMatmulAlgoGetHeuristic", a.heuristic);
  find(lib, "cublasLtMatmul", a.matmul);
}

bool complete(const LtApi& a) {
  return a.desc_create && a.desc_set && a.desc_destroy && a.layout_create && a.layout_set &&
         a.layout_destroy && a.pref_create && a.pref_set && a.pref_destroy && a.heuristic &&
         a.matmul;
}

const LtApi& lt_api() {
  static const LtApi api = [] {
    LtApi a;
    // torch's CUDA library (found from one of its functions) and what it loaded with it
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(&at::cuda::getCurrentCUDABlasLtHandle), &info) &&
        info.dli_fname != nullptr) {
      find_all(dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD), a);
    }
#ifdef CUBLAS_VER_MAJOR
    if (!complete(a)) {
      const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
      find_all(dlopen(soname.c_str(), RTLD_LAZY | RTLD_NOLOAD), a);
    }
#endif
    if (!complete(a)) find_all(RTLD_DEFAULT, a);
    a.ok = complete(a);
    return a;
  }();
  return api;
}

#define SHARDOPT_LT_CHECK(expr)                                                   \
  do {                                                                            \
    cublasStatus_t status_ = (expr);                                              \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "bmm_add: ", #expr,             \
                " failed with cuBLAS status ", static_cast<int>(status_));        \
  } while (0)

// One operand of the column-major product: torch's row-major X (R x C) is, as cuBLAS sees it,
// the C x R matrix Xᵀ; a row-major X is that matrix stored (op N), a transposed view (column-major
// X) stores X itself (op T).
struct Operand {
  cublasOperation_t op;
  int64_t rows, cols, ld, batch_stride;
};

bool operand(const at::Tensor& x, Operand& out) {
  const int64_t r = x.size(1), c = x.size(2);
  const int64_t batch_stride = x.size(0) > 1 ? x.stride(0) : r * c;
  if (x.stride(2) == 1 && x.stride(1) >= std::max<int64_t>(c, 1)) {
    out = {CUBLAS_OP_N, c, r, x.stride(1), batch_stride};
    return true;
  }
  if (x.stride(1) == 1 && x.stride(2) >= std::max<int64_t>(r, 1)) {
    out = {CUBLAS_OP_T, r, c, x.stride(2), batch_stride};
    return true;
  }
  return false;
}

int alignment(const void* p) {
  const auto v = reinterpret_cast<std::uintptr_t>(p);
  int a = 256;
  while (a > 1 && v % a) a /= 2;
  return a;
}

using AlgoKey = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int, int, int64_t, int64_t,
                           int64_t, int64_t, int64_t, int, int, int, int, bool>;

struct Descriptors {
  const LtApi& api;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, cd = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descriptors() {
    if (pref) api.pref_destroy(pref);
    if (cd) api.layout_destroy(cd);
    if (b) api.layout_destroy(b);
    if (a) api.layout_destroy(a);
    if (op) api.desc_destroy(op);
  }
};

void batched_layout(const LtApi& api, cublasLtMatrixLayout_t& desc, cudaDataType_t type,
                    int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
  SHARDOPT_LT_CHECK(api.layout_create(&desc, type, rows, cols, ld));
  const int32_t count = static_cast<int32_t>(batch);
  SHARDOPT_LT_CHECK(
      api.layout_set(desc, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  SHARDOPT_LT_CHECK(api.layout_set(desc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                   sizeof(stride)));
}

// "(d0, d1, ...)": a shape for an error message, as plain text (streaming IntArrayRef into
// TORCH_CHECK from this nvcc-built file crashed the process on torch 2.11: seen on an H100)
std::string shape(const at::Tensor& x) {
  std::string out = "(";
  for (int64_t i = 0; i < x.dim(); ++i) out += (i ? ", " : "") + std::to_string(x.size(i));
  return out + ")";
}

constexpr size_t kWorkspaceBytes = 32u << 20;  // cuBLAS's recommendation for Hopper

}  // namespace

at::Tensor bmm_add_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                        double alpha, double beta) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && c.dim() == 3,
              "bmm_add: a, b and c must be 3-D (batch, rows, cols), got shapes ", shape(a), ", ",
              shape(b), ", ", shape(c));
  const int64_t batch = c.size(0), p = a.size(1), q = a.size(2), r = b.size(2);
  TORCH_CHECK(a.size(0) == batch && b.size(0) == batch && b.size(1) == q && c.size(1) == p &&
                  c.size(2) == r,
              "bmm_add: shapes do not chain: a ", shape(a), " @ b ", shape(b), " + c ", shape(c));
  TORCH_CHECK(a.is_cuda() && b.device() == a.device() && c.device() == a.device(),
              "bmm_add: a, b and c must be on one CUDA device");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && a.scalar_type() == c.scalar_type(),
              "bmm_add: a, b and c must have one dtype, got ", a.scalar_type(), ", ",
              b.scalar_type(), ", ", c.scalar_type());
  const auto dtype = c.scalar_type();
  const LtApi& api = lt_api();
  Operand oa, ob;  // cuBLAS computes Dᵀ = Bᵀ Aᵀ: its first operand is b, its second a
  const bool half = dtype == at::kBFloat16 || dtype == at::kHalf;
  if (!api.ok || !half || batch == 0 || p == 0 || q == 0 || r == 0 || !operand(b, ob) ||
      !operand(a, oa) || batch > INT32_MAX) {
    return at::baddbmm(c, a, b, beta, alpha);
  }
  c10::cuda::CUDAGuard guard(c.device());
  const at::Tensor cc = c.contiguous();
  at::Tensor d = at::empty_like(cc);
  const cudaDataType_t type = dtype == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;

  Descriptors desc{api};
  SHARDOPT_LT_CHECK(api.desc_create(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  SHARDOPT_LT_CHECK(api.desc_set(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &ob.op, sizeof(ob.op)));
  SHARDOPT_LT_CHECK(api.desc_set(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &oa.op, sizeof(oa.op)));
  batched_layout(api, desc.a, type, ob.rows, ob.cols, ob.ld, batch, ob.batch_stride);
  batched_layout(api, desc.b, type, oa.rows, oa.cols, oa.ld, batch, oa.batch_stride);
  batched_layout(api, desc.cd, type, r, p, r, batch, p * r);  // C and D: one layout

  const int align_a = alignment(b.data_ptr()), align_b = alignment(a.data_ptr());
  const int align_c = alignment(cc.data_ptr()), align_d = alignment(d.data_ptr());
  const AlgoKey key{c.get_device(), static_cast<int>(dtype), batch, p, q, r,
                    static_cast<int>(oa.op), static_cast<int>(ob.op), oa.ld, ob.ld,
                    oa.batch_stride, ob.batch_stride, static_cast<int64_t>(kWorkspaceBytes),
                    align_a, align_b, align_c, align_d, beta == 0.0};
  static std::mutex mutex;
  static std::map<AlgoKey, std::pair<bool, cublasLtMatmulAlgo_t>> algos;
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  std::pair<bool, cublasLtMatmulAlgo_t> chosen{false, {}};
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = algos.find(key);
    if (it != algos.end()) {
      chosen = it->second;
    } else {
      SHARDOPT_LT_CHECK(api.pref_create(&desc.pref));
      const uint64_t ws = kWorkspaceBytes;
      SHARDOPT_LT_CHECK(api.pref_set(desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                     sizeof(ws)));
      const std::pair<cublasLtMatmulPreferenceAttributes_t, int> aligns[] = {
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
      for (const auto& [attr, bytes] : aligns) {
        const uint32_t v = static_cast<uint32_t>(bytes);
        SHARDOPT_LT_CHECK(api.pref_set(desc.pref, attr, &v, sizeof(v)));
      }
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      const cublasStatus_t status = api.heuristic(handle, desc.op, desc.a, desc.b, desc.cd,
                                                  desc.cd, desc.pref, 1, &result, &found);
      chosen = {status == CUBLAS_STATUS_SUCCESS && found > 0, result.algo};
      algos.emplace(key, chosen);
    }
  }
  if (!chosen.first) return at::baddbmm(c, a, b, beta, alpha);  // no algorithm for this case

  at::Tensor workspace = at::empty({static_cast<int64_t>(kWorkspaceBytes)},
                                   cc.options().dtype(at::kByte));
  const float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
  SHARDOPT_LT_CHECK(api.matmul(handle, desc.op, &alpha_f, b.data_ptr(), desc.a, a.data_ptr(),
                               desc.b, &beta_f, cc.data_ptr(), desc.cd, d.data_ptr(), desc.cd,
                               &chosen.second, workspace.data_ptr(), kWorkspaceBytes,
                               at::cuda::getCurrentCUDAStream()));
  return d;
}

}  // namespace shardopt
