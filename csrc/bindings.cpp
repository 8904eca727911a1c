// The pybind11 module shardopt._C: the only file that includes torch/extension.h.
// Kernels are exposed per backend (_C.cpu.*, _C.cuda.*), one m.def per entry of kernels.def;
// shardopt/_ops.py picks one.
#include <torch/extension.h>

#include "kernels.h"
#include "multi_tensor/cpu_apply.h"
#ifdef SHARDOPT_WITH_CUDA
#include "multi_tensor/cuda_chunk.h"
#endif

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
#ifdef SHARDOPT_WITH_CUDA
  auto cuda = m.def_submodule("cuda", "CUDA kernels");
#define SHARDOPT_KERNEL(name, ret, params, doc, ...) \
  cuda.def(#name, &name##_cuda, doc, ReleaseGil(), __VA_ARGS__);
#include "kernels.def"
#undef SHARDOPT_KERNEL
  m.attr("has_cuda") = true;
  m.attr("cuda_chunk_size") = cuda::kChunkSize;
#else
  m.attr("has_cuda") = false;
#endif
}
