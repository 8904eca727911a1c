// One cuBLASLt matmul on views of torch tensors (lt_matmul.h).
//
// cuBLASLt's entry points are looked up at the first call in the libraries already loaded with
// torch (libtorch_cuda and its dependencies), never linked: the extension loads wherever torch
// does, and a torch without cuBLASLt makes lt_matmul decline, so its callers fall back to torch.
//
// Each distinct case (dtype, shapes, operand orientations, leading and batch strides, pointer
// alignments, beta zero or not) gets its descriptors and cuBLASLt's first heuristic algorithm
// once, kept for the process: a call then only launches. Newton-Schulz makes a handful of cases
// per model (one per shape and product), so the cache stays small; the 124M GPT set's products
// are short enough that building descriptors per call showed in its time.
#include "lt_matmul.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace shardopt {

namespace {

// cuBLASLt's functions, looked up once
struct LtApi {
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) layout_set = nullptr;
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
  find(lib, "cublasLtMatrixLayoutCreate", a.layout_create);
  find(lib, "cublasLtMatrixLayoutSetAttribute", a.layout_set);
  find(lib, "cublasLtMatmulPreferenceCreate", a.pref_create);
  find(lib, "cublasLtMatmulPreferenceSetAttribute", a.pref_set);
  find(lib, "cublasLtMatmulPreferenceDestroy", a.pref_destroy);
  find(lib, "cublasLtMatmulAlgoGetHeuristic", a.heuristic);
  find(lib, "cublasLtMatmul", a.matmul);
}

bool complete(const LtApi& a) {
  return a.desc_create && a.desc_set && a.layout_create && a.layout_set && a.pref_create &&
         a.pref_set && a.pref_destroy && a.heuristic && a.matmul;
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
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "cuBLASLt matmul: ", #expr,     \
                " failed with cuBLAS status ", static_cast<int>(status_));        \
  } while (0)

// One operand of the column-major product: torch's row-major X (R x C) is, as cuBLAS sees it,
// the C x R matrix Xᵀ; a row-major X is that matrix stored (op N), a transposed view (column-major
// X) stores X itself (op T).
struct Operand {
  cublasOperation_t op;
  int64_t rows, cols, ld, batch_stride;
};

int64_t batch_stride(const at::Tensor& x, int64_t matrix_elements) {
  return x.size(0) > 1 ? x.stride(0) : matrix_elements;
}

bool operand(const at::Tensor& x, Operand& out) {
  const int64_t r = x.size(1), c = x.size(2);
  if (x.stride(2) == 1 && x.stride(1) >= std::max<int64_t>(c, 1)) {
    out = {CUBLAS_OP_N, c, r, x.stride(1), batch_stride(x, r * x.stride(1))};
    return true;
  }
  if (x.stride(1) == 1 && x.stride(2) >= std::max<int64_t>(r, 1)) {
    out = {CUBLAS_OP_T, r, c, x.stride(2), batch_stride(x, c * x.stride(2))};
    return true;
  }
  return false;
}

// c and d: row-major (k, p, r) with any leading stride, as cuBLAS's column-major r x p
bool result(const at::Tensor& x, Operand& out) {
  const int64_t p = x.size(1), r = x.size(2);
  if (x.stride(2) != 1 || x.stride(1) < std::max<int64_t>(r, 1)) return false;
  out = {CUBLAS_OP_N, r, p, x.stride(1), batch_stride(x, p * x.stride(1))};
  return true;
}

int alignment(const void* p) {
  const auto v = reinterpret_cast<std::uintptr_t>(p);
  int a = 256;
  while (a > 1 && v % a) a /= 2;
  return a;
}

// descriptors and algorithm of one case, made once and kept for the process
struct Plan {
  bool ok = false;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

cublasLtMatrixLayout_t batched_layout(const LtApi& api, cudaDataType_t type, const Operand& o,
                                      int64_t batch) {
  cublasLtMatrixLayout_t desc = nullptr;
  SHARDOPT_LT_CHECK(api.layout_create(&desc, type, o.rows, o.cols, o.ld));
  const int32_t count = static_cast<int32_t>(batch);
  SHARDOPT_LT_CHECK(
      api.layout_set(desc, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  SHARDOPT_LT_CHECK(api.layout_set(desc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                   &o.batch_stride, sizeof(o.batch_stride)));
  return desc;
}

// cuBLAS computes Dᵀ = Bᵀ Aᵀ: its first operand is b (ob), its second a (oa)
std::unique_ptr<Plan> make_plan(const LtApi& api, cublasLtHandle_t handle, cudaDataType_t type,
                                int64_t batch, const Operand& oa, const Operand& ob,
                                const Operand& oc, const Operand& od, bool c_is_d,
                                const int (&aligns)[4]) {
  auto plan = std::make_unique<Plan>();
  SHARDOPT_LT_CHECK(api.desc_create(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  SHARDOPT_LT_CHECK(api.desc_set(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &ob.op, sizeof(ob.op)));
  SHARDOPT_LT_CHECK(api.desc_set(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &oa.op, sizeof(oa.op)));
  plan->a = batched_layout(api, type, ob, batch);
  plan->b = batched_layout(api, type, oa, batch);
  plan->d = batched_layout(api, type, od, batch);
  plan->c = c_is_d ? plan->d : batched_layout(api, type, oc, batch);

  cublasLtMatmulPreference_t pref = nullptr;
  SHARDOPT_LT_CHECK(api.pref_create(&pref));
  const uint64_t ws = kLtWorkspaceBytes;
  cublasStatus_t status =
      api.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  const cublasLtMatmulPreferenceAttributes_t attrs[] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4 && status == CUBLAS_STATUS_SUCCESS; ++i) {
    const uint32_t v = static_cast<uint32_t>(aligns[i]);
    status = api.pref_set(pref, attrs[i], &v, sizeof(v));
  }
  cublasLtMatmulHeuristicResult_t found_algo{};
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = api.heuristic(handle, plan->op, plan->a, plan->b, plan->c, plan->d, pref, 1,
                           &found_algo, &found);
  }
  api.pref_destroy(pref);
  plan->ok = status == CUBLAS_STATUS_SUCCESS && found > 0;
  plan->algo = found_algo.algo;
  return plan;
}

}  // namespace

bool lt_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, at::Tensor& d,
               float alpha, float beta, void* workspace) {
  const LtApi& api = lt_api();
  const auto dtype = d.scalar_type();
  const int64_t batch = d.size(0), p = d.size(1), q = a.size(2), r = d.size(2);
  Operand oa, ob, oc, od;
  if (!api.ok || (dtype != at::kBFloat16 && dtype != at::kHalf) || batch == 0 || p == 0 ||
      q == 0 || r == 0 || batch > INT32_MAX || !operand(a, oa) || !operand(b, ob) ||
      !result(c, oc) || !result(d, od)) {
    return false;
  }
  const bool c_is_d = c.data_ptr() == d.data_ptr() && oc.ld == od.ld &&
                      oc.batch_stride == od.batch_stride;
  const int aligns[4] = {alignment(b.data_ptr()), alignment(a.data_ptr()),
                         alignment(c.data_ptr()), alignment(d.data_ptr())};
  const std::vector<int64_t> key{d.get_device(), static_cast<int64_t>(dtype), batch, p, q, r,
                                 oa.op, oa.ld, oa.batch_stride, ob.op, ob.ld, ob.batch_stride,
                                 oc.ld, oc.batch_stride, od.ld, od.batch_stride, aligns[0],
                                 aligns[1], aligns[2], aligns[3], beta == 0.0f, c_is_d};
  static std::mutex mutex;
  static std::map<std::vector<int64_t>, std::unique_ptr<Plan>> plans;
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const cudaDataType_t type = dtype == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  const Plan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = plans.find(key);
    if (it == plans.end()) {
      it = plans.emplace(key, make_plan(api, handle, type, batch, oa, ob, oc, od, c_is_d, aligns))
               .first;
    }
    plan = it->second.get();
  }
  if (!plan->ok) return false;  // no algorithm for this case
  SHARDOPT_LT_CHECK(api.matmul(handle, plan->op, &alpha, b.data_ptr(), plan->a, a.data_ptr(),
                               plan->b, &beta, c.data_ptr(), plan->c, d.data_ptr(), plan->d,
                               &plan->algo, workspace, kLtWorkspaceBytes,
                               at::cuda::getCurrentCUDAStream()));
  return true;
}

}  // namespace shardopt
