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
//
// Note: tuning the matmuls
// cuBLASLt's heuristic ranks its algorithms by a model, not by timing them. With tuning on
// (set_matmul_tuning(n), or SHARDOPT_MATMUL_TUNING=n), a new case asks for the heuristic's first
// n and, at its first call, times each on the call's own operands: the device is synchronized
// first (no other stream's work in the timings), each candidate runs once to warm up, then three
// rounds of enough runs to fill about half a millisecond, into a scratch tensor as large as D
// (D and an in-place C are never written by the timing). The fastest round's best is kept, and
// the heuristic's first stays unless another is more than 2% faster (near-ties keep the
// heuristic's choice, so reruns of a process mostly choose alike). Every candidate computes the
// same sum in fp32 with one rounding, but in its own order: the bits of a tuned product are
// those of the algorithm chosen, which timing picks, so two processes may differ in the last
// bits. Hence off by default; and measured on an H100 it did not pay (docs/benchmarks.md,
// 2026-12-07 23:48 UTC: the Newton-Schulz chains 4% faster to 5% slower, the step unchanged).
// A case first met while its stream is being captured into a CUDA graph is not timed
// (synchronizing would break the capture): it keeps the heuristic's first.
#include "lt_matmul.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
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
                " failed with cuBLAS status ",                                    \
                std::to_string(static_cast<int>(status_)));                       \
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
  // the heuristic's algorithms, first first, while the case waits to be timed (Note: tuning the
  // matmuls): `waiting` of them; 0 once timed, or untuned. A fixed array: a std::vector member
  // here crashed nvcc 13.0's front end under -std=c++20 (an internal error in a destructor)
  cublasLtMatmulAlgo_t candidates[kMaxTuningCandidates] = {};
  int64_t waiting = 0;
};

// the tuning setting (-1: not yet read from the environment) and its statistics
std::atomic<int64_t> g_tuning{-1};
std::atomic<int64_t> g_tuned{0}, g_changed{0};

int64_t clamp_candidates(int64_t n) {
  return std::max<int64_t>(0, std::min(n, kMaxTuningCandidates));
}

int64_t tuning_now() {
  int64_t n = g_tuning.load();
  if (n < 0) {
    // the whole value must be an integer in range (as kernels.matmul_tuning reads it without
    // CUDA); otherwise every product says so, rather than run with a setting nobody asked for
    const char* env = std::getenv("SHARDOPT_MATMUL_TUNING");
    int64_t v = 0;
    if (env != nullptr && *env != '\0') {
      char* end = nullptr;
      errno = 0;
      v = std::strtoll(env, &end, 10);
      TORCH_CHECK(errno == 0 && *end == '\0' && v >= 0 && v <= kMaxTuningCandidates,
                  "SHARDOPT_MATMUL_TUNING must be an integer in [0, ",
                  std::to_string(kMaxTuningCandidates), "], got '", env, "'");
    }
    int64_t expected = -1;
    g_tuning.compare_exchange_strong(expected, v);
    n = g_tuning.load();
  }
  return n;
}

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
                                const int (&aligns)[4], int64_t candidates) {
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
  const int wanted = static_cast<int>(std::max<int64_t>(candidates, 1));
  cublasLtMatmulHeuristicResult_t results[kMaxTuningCandidates] = {};
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = api.heuristic(handle, plan->op, plan->a, plan->b, plan->c, plan->d, pref, wanted,
                           results, &found);
  }
  api.pref_destroy(pref);
  for (int i = 0; i < found; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS) {
      plan->candidates[plan->waiting++] = results[i].algo;
    }
  }
  plan->ok = status == CUBLAS_STATUS_SUCCESS && plan->waiting > 0;
  if (plan->ok) plan->algo = plan->candidates[0];
  if (plan->waiting < 2) plan->waiting = 0;  // nothing to choose between
  return plan;
}

// One tuning run of `algo` into `scratch` (Note: tuning the matmuls)
struct TuningRun {
  const LtApi* api;
  cublasLtHandle_t handle;
  const Plan* plan;
  const void *a, *b, *c;
  void* scratch;
  float alpha, beta;
  void* workspace;
  cudaStream_t stream;
  cudaEvent_t start, stop;

  bool run(const cublasLtMatmulAlgo_t& algo) const {
    return api->matmul(handle, plan->op, &alpha, b, plan->a, a, plan->b, &beta, c, plan->c,
                       scratch, plan->d, &algo, workspace, kLtWorkspaceBytes,
                       stream) == CUBLAS_STATUS_SUCCESS;
  }

  // ms per run of `runs` runs, or -1 where one fails
  float timed(const cublasLtMatmulAlgo_t& algo, int runs) const {
    C10_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < runs; ++i) {
      if (!run(algo)) return -1.0f;
    }
    C10_CUDA_CHECK(cudaEventRecord(stop, stream));
    C10_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms / static_cast<float>(runs);
  }

  // the best of three rounds of about half a millisecond each, after a warm-up; -1: it fails
  float best(const cublasLtMatmulAlgo_t& algo) const {
    if (!run(algo)) return -1.0f;
    const float once = timed(algo, 1);
    if (once < 0.0f) return -1.0f;
    const int runs =
        static_cast<int>(std::min(10.0f, std::max(1.0f, 0.5f / std::max(once, 1e-3f))));
    float t = once;
    for (int round = 0; round < 3; ++round) {
      const float r = timed(algo, runs);
      if (r < 0.0f) return -1.0f;
      t = std::min(t, r);
    }
    return t;
  }
};

// Times the plan's candidates on this call's operands and keeps the fastest (Note: tuning the
// matmuls). `d_elements`: the span of D's footprint, in elements.
void tune(const LtApi& api, cublasLtHandle_t handle, Plan& plan, const void* a, const void* b,
          const void* c, const at::Tensor& d, int64_t d_elements, float alpha, float beta,
          void* workspace, cudaStream_t stream) {
  // the timed runs write here, never into D; C is read where it is (it is D itself only with
  // beta 0, when it is not read)
  at::Tensor scratch = at::empty({d_elements}, d.options());
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  TuningRun t{&api, handle, &plan, a, b, c, scratch.data_ptr(), alpha, beta, workspace, stream,
              nullptr, nullptr};
  C10_CUDA_CHECK(cudaEventCreate(&t.start));
  C10_CUDA_CHECK(cudaEventCreate(&t.stop));
  float times[kMaxTuningCandidates] = {};
  for (int64_t i = 0; i < plan.waiting; ++i) times[i] = t.best(plan.candidates[i]);
  C10_CUDA_CHECK(cudaEventDestroy(t.start));
  C10_CUDA_CHECK(cudaEventDestroy(t.stop));
  int64_t pick = 0;
  for (int64_t i = 1; i < plan.waiting; ++i) {
    if (times[i] >= 0.0f && (times[pick] < 0.0f || times[i] < times[pick])) pick = i;
  }
  // the heuristic's first unless another beats it by more than 2%
  if (pick != 0 && times[0] >= 0.0f && times[pick] > 0.98f * times[0]) pick = 0;
  plan.algo = plan.candidates[pick];
  plan.waiting = 0;
  g_tuned.fetch_add(1);
  if (pick != 0) g_changed.fetch_add(1);
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
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
  const int64_t candidates = tuning_now();
  const std::vector<int64_t> key{d.get_device(), static_cast<int64_t>(dtype), batch, p, q, r,
                                 oa.op, oa.ld, oa.batch_stride, ob.op, ob.ld, ob.batch_stride,
                                 oc.ld, oc.batch_stride, od.ld, od.batch_stride, aligns[0],
                                 aligns[1], aligns[2], aligns[3], beta == 0.0f, c_is_d,
                                 candidates > 1 ? candidates : 1};
  static std::mutex mutex;
  static std::map<std::vector<int64_t>, std::unique_ptr<Plan>> plans;
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const cudaDataType_t type = dtype == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cublasLtMatmulAlgo_t algo{};
  const Plan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = plans.find(key);
    if (it == plans.end()) {
      it = plans.emplace(key, make_plan(api, handle, type, batch, oa, ob, oc, od, c_is_d, aligns,
                                        candidates))
               .first;
    }
    Plan& found = *it->second;
    if (found.ok && found.waiting > 0 && !capturing(stream)) {
      // D's footprint: its last entry's offset + 1
      const int64_t span = (batch - 1) * od.batch_stride + (p - 1) * od.ld + r;
      tune(api, handle, found, a.data_ptr(), b.data_ptr(), c.data_ptr(), d, span, alpha, beta,
           workspace, stream);
    }
    plan = &found;
    algo = found.algo;
  }
  if (!plan->ok) return false;  // no algorithm for this case
  SHARDOPT_LT_CHECK(api.matmul(handle, plan->op, &alpha, b.data_ptr(), plan->a, a.data_ptr(),
                               plan->b, &beta, c.data_ptr(), plan->c, d.data_ptr(), plan->d,
                               &algo, workspace, kLtWorkspaceBytes, stream));
  return true;
}

void set_matmul_tuning(int64_t candidates) { g_tuning.store(clamp_candidates(candidates)); }

int64_t matmul_tuning() { return tuning_now(); }

std::pair<int64_t, int64_t> matmul_tuning_stats() { return {g_tuned.load(), g_changed.load()}; }

}  // namespace shardopt
