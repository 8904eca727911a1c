// The pybind11 module shardopt._C (and its per-ISA builds _C_avx2, _C_avx512): the only file that
// includes torch/extension.h. Kernels are exposed per backend (_C.cpu.*, _C.cuda.*), one m.def per
// entry of kernels.def; shardopt/kernels/loader.py picks the module, shardopt/kernels/dispatch.py
// the backend.
//
// Note: ISA guard
// Every translation unit of a module is compiled for that module's CPU level (-march=x86-64-v2,
// -v3 or -v4: shardopt/kernels/build.py), so running any of its code on a CPU below that level can
// stop the interpreter with SIGILL, and tools that import every module of a package
// (pkgutil.walk_packages, pytest --doctest-modules, Sphinx autosummary) do import _C_avx512. So
// the module's entry point, PyInit_<name>, is written here (PYBIND11_MODULE's is renamed) and is
// compiled for the x86-64 baseline (target("arch=x86-64")): before any code built for the module's
// level runs, it checks the CPU and raises ImportError when a feature is missing. The only code that
// runs earlier is the static initializers (std::ios_base::Init and the like), which hold no vector
// code. SHARDOPT_SIMULATE_CPU_LEVEL=default|avx2 makes the check see a CPU of at most that level
// (the tests use it to exercise the refusal on any machine).
#include <torch/extension.h>

#include <cstdlib>
#include <cstring>

#include "kernels.h"
#include "multi_tensor/cpu_apply.h"
#ifdef SHARDOPT_WITH_CUDA
#include "linalg/lt_matmul.h"
#include "linalg/matmul_checks.h"
#include "multi_tensor/cuda_chunk.h"
#endif

// Token pasting with TORCH_EXTENSION_NAME expanded first (PYBIND11_CONCAT pastes it unexpanded).
#define SHARDOPT_CAT_(a, b) a##b
#define SHARDOPT_CAT(a, b) SHARDOPT_CAT_(a, b)
#define SHARDOPT_PYINIT SHARDOPT_CAT(PyInit_, TORCH_EXTENSION_NAME)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SHARDOPT_ISA_GUARD 1
#define SHARDOPT_BASELINE __attribute__((target("arch=x86-64"), noinline))
#if defined(__AVX512F__)
#define SHARDOPT_ISA_LEVEL "avx512"
#define SHARDOPT_ISA_RANK 2
#elif defined(__AVX2__)
#define SHARDOPT_ISA_LEVEL "avx2"
#define SHARDOPT_ISA_RANK 1
#else
#define SHARDOPT_ISA_LEVEL "default"
#define SHARDOPT_ISA_RANK 0
#endif
#else
#define SHARDOPT_BASELINE
#endif

#ifdef SHARDOPT_ISA_GUARD
namespace {

// The first CPU feature this module was compiled to use that the CPU lacks, else nullptr. The
// lists are the features GCC and clang emit at each x86-64 level (psABI v2, v3, v4).
SHARDOPT_BASELINE const char* missing_cpu_feature() {
  const char* simulated = std::getenv("SHARDOPT_SIMULATE_CPU_LEVEL");
  if (simulated != nullptr) {
    int rank = std::strcmp(simulated, "default") == 0 ? 0
               : std::strcmp(simulated, "avx2") == 0  ? 1
                                                      : 2;
    if (rank < SHARDOPT_ISA_RANK) {
      return rank == 0 ? "avx2 (SHARDOPT_SIMULATE_CPU_LEVEL=default)"
                       : "avx512f (SHARDOPT_SIMULATE_CPU_LEVEL=avx2)";
    }
  }
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("ssse3")) return "ssse3";
  if (!__builtin_cpu_supports("sse4.1")) return "sse4.1";
  if (!__builtin_cpu_supports("sse4.2")) return "sse4.2";
  if (!__builtin_cpu_supports("popcnt")) return "popcnt";
#if SHARDOPT_ISA_RANK >= 1
  if (!__builtin_cpu_supports("avx")) return "avx";
  if (!__builtin_cpu_supports("avx2")) return "avx2";
  if (!__builtin_cpu_supports("fma")) return "fma";
  if (!__builtin_cpu_supports("bmi")) return "bmi";
  if (!__builtin_cpu_supports("bmi2")) return "bmi2";
#endif
#if SHARDOPT_ISA_RANK >= 2
  if (!__builtin_cpu_supports("avx512f")) return "avx512f";
  if (!__builtin_cpu_supports("avx512bw")) return "avx512bw";
  if (!__builtin_cpu_supports("avx512cd")) return "avx512cd";
  if (!__builtin_cpu_supports("avx512dq")) return "avx512dq";
  if (!__builtin_cpu_supports("avx512vl")) return "avx512vl";
#endif
  return nullptr;
}

}  // namespace
#endif

// The bindings: pybind11's own PYBIND11_MODULE (so any pybind11 version's init protocol), with
// the entry point it defines renamed: the module's real PyInit_<name> below runs the ISA guard
// first and only then calls it. The names are the modules build.py and jit.py make.
#define PyInit__C shardopt_pybind11_pyinit
#define PyInit__C_avx2 shardopt_pybind11_pyinit
#define PyInit__C_avx512 shardopt_pybind11_pyinit
#define PyInit_shardopt_C shardopt_pybind11_pyinit
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace shardopt;
  using namespace pybind11::literals;  // "name"_a in kernels.def
  // Every kernel releases the GIL while it runs: the arguments are converted to C++ objects
  // before the call and the return value after it, and the kernels touch no Python object, so
  // the offload worker thread's CPU update overlaps the Python thread issuing the next work.
  using ReleaseGil = py::call_guard<py::gil_scoped_release>;
  auto cpu = m.def_submodule("cpu", "C++ CPU kernels");
#define SHARDOPT_KERNEL(name, ret, params, doc, ...) \
  cpu.def(#name, &name##_cpu, doc, ReleaseGil(), __VA_ARGS__);
#include "kernels.def"
#undef SHARDOPT_KERNEL
  m.attr("cpu_chunk_size") = cpu::kChunkSize;
#ifdef SHARDOPT_ISA_GUARD
  m.attr("cpu_level") = SHARDOPT_ISA_LEVEL;
#else
  m.attr("cpu_level") = "default";
#endif
#ifdef SHARDOPT_WITH_CUDA
  auto cuda = m.def_submodule("cuda", "CUDA kernels");
#define SHARDOPT_KERNEL(name, ret, params, doc, ...) \
  cuda.def(#name, &name##_cuda, doc, ReleaseGil(), __VA_ARGS__);
#include "kernels.def"
#undef SHARDOPT_KERNEL
  // the matmuls' arguments are checked here, host-compiled, before their nvcc-built code runs
  // (Note: checks before nvcc-built code in linalg/matmul_checks.cpp)
  cuda.def(
      "bmm_add",
      [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, double alpha,
         double beta) {
        check_batched_matmul("bmm_add", a, b, c, false);
        return bmm_add_cuda(a, b, c, alpha, beta);
      },
      "alpha * a @ b + beta * c for 3-D CUDA tensors into a new tensor: one cuBLASLt "
      "matmul for bf16/fp16 (C read, D written, no copy of C), torch.baddbmm otherwise",
      ReleaseGil(), "a"_a, "b"_a, "c"_a, "alpha"_a = 1.0, "beta"_a = 1.0);
  cuda.def(
      "symmetric_bmm_add",
      [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, double alpha,
         double beta, int64_t blocks) {
        check_batched_matmul("symmetric_bmm_add", a, b, c, true, blocks);
        return symmetric_bmm_add_cuda(a, b, c, alpha, beta, blocks);
      },
      "bmm_add for a square product known to be symmetric: the lower block rows of "
      "blocks bands as cuBLASLt matmuls, then mirrored",
      ReleaseGil(), "a"_a, "b"_a, "c"_a, "alpha"_a = 1.0, "beta"_a = 1.0, "blocks"_a = 1);
  cuda.def(
      "symmetric_bmm",
      [](const at::Tensor& a, const at::Tensor& b, double alpha, int64_t blocks) {
        check_batched_matmul("symmetric_bmm", a, b, at::Tensor(), true, blocks);
        return symmetric_bmm_cuda(a, b, alpha, blocks);
      },
      "alpha * a @ b for a square product known to be symmetric (symmetric_bmm_add "
      "without an addend)",
      ReleaseGil(), "a"_a, "b"_a, "alpha"_a = 1.0, "blocks"_a = 1);
  cuda.def("set_matmul_tuning", &set_matmul_tuning,
           "how many of cuBLASLt's heuristic algorithms a new matmul case times at its first "
           "call (0 or 1: the first, untimed); Note: tuning the matmuls in linalg/lt_matmul.cu",
           "candidates"_a);
  cuda.def("matmul_tuning", &matmul_tuning, "the candidates set_matmul_tuning set");
  cuda.def("matmul_tuning_stats", &matmul_tuning_stats,
           "(cases timed so far, how many kept another algorithm than the heuristic's first)");
  m.attr("has_cuda") = true;
  m.attr("cuda_chunk_size") = cuda::kChunkSize;
#else
  m.attr("has_cuda") = false;
#endif
}
#undef PyInit__C
#undef PyInit__C_avx2
#undef PyInit__C_avx512
#undef PyInit_shardopt_C

// The entry point: see Note: ISA guard.
extern "C" PYBIND11_EXPORT PyObject* SHARDOPT_PYINIT();
extern "C" PYBIND11_EXPORT SHARDOPT_BASELINE PyObject* SHARDOPT_PYINIT() {
#ifdef SHARDOPT_ISA_GUARD
  if (const char* missing = missing_cpu_feature()) {
    PyErr_Format(PyExc_ImportError,
                 "%s is built for %s CPUs and this CPU lacks %s: import shardopt instead, which "
                 "loads the kernels built for this CPU (see shardopt.kernels.loader)",
                 PYBIND11_TOSTRING(TORCH_EXTENSION_NAME), SHARDOPT_ISA_LEVEL, missing);
    return nullptr;
  }
#endif
  return shardopt_pybind11_pyinit();
}
