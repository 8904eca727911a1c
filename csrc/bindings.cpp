// The pybind11 module shardopt._C: the only file that includes torch/extension.h.
// Kernels are exposed per backend (_C.cpu.*, _C.cuda.*); shardopt/_ops.py picks one.
#include <torch/extension.h>

#include "kernels.h"
#include "multi_tensor/cpu_apply.h"
#ifdef SHARDOPT_WITH_CUDA
#include "multi_tensor/cuda_chunk.h"
#endif

namespace {

template <typename Adam, typename Sgd, typename Adagrad, typename Lamb1, typename Lamb2,
          typename NovoGrad, typename Norm, typename Scale>
void bind_backend(py::module_& m, Adam adam, Sgd sgd, Adagrad adagrad, Lamb1 lamb_stage1,
                  Lamb2 lamb_stage2, NovoGrad novograd, Norm norm, Scale scale) {
  m.def("adam", adam, "Fused Adam/AdamW update over tensor lists [grad, param, exp_avg, exp_avg_sq(, out)]",
        py::arg("lists"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("step"), py::arg("adam_w_mode"), py::arg("bias_correction"),
        py::arg("weight_decay"), py::arg("lr_t") = py::none(), py::arg("step_t") = py::none(),
        py::arg("grad_scale_t") = py::none(), py::arg("found_inf_t") = py::none());
  m.def("sgd", sgd, "Fused SGD update over tensor lists [grad, param, momentum_buffer(, out)]",
        py::arg("lists"), py::arg("lr"), py::arg("momentum"), py::arg("dampening"),
        py::arg("weight_decay"), py::arg("nesterov"), py::arg("first_run"),
        py::arg("wd_after_momentum"), py::arg("scale"), py::arg("lr_t") = py::none(),
        py::arg("grad_scale_t") = py::none(), py::arg("found_inf_t") = py::none(),
        py::arg("first_run_t") = py::none());
  m.def("adagrad", adagrad, "Fused Adagrad update over tensor lists [grad, param, sum(, out)]",
        py::arg("lists"), py::arg("lr"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("adagrad_w_mode"), py::arg("lr_t") = py::none(),
        py::arg("grad_scale_t") = py::none(), py::arg("found_inf_t") = py::none());
  m.def("lamb_stage1", lamb_stage1,
        "LAMB moments over [grad, param, exp_avg, exp_avg_sq]; returns the per-tensor sums of "
        "squares (w_sq, u_sq) of the param before the update and of the update term",
        py::arg("lists"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step"),
        py::arg("bias_correction"), py::arg("weight_decay"), py::arg("grad_averaging"),
        py::arg("adam_w_mode"), py::arg("step_t") = py::none(),
        py::arg("grad_scale_t") = py::none(), py::arg("found_inf_t") = py::none());
  m.def("lamb_stage2", lamb_stage2,
        "LAMB trust-ratio apply over [param, exp_avg, exp_avg_sq(, out)]: recomputes the update "
        "term from the moments stage 1 stored",
        py::arg("lists"), py::arg("w_norm"), py::arg("u_norm"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("step"), py::arg("bias_correction"),
        py::arg("weight_decay"), py::arg("adam_w_mode"), py::arg("use_nvlamb"),
        py::arg("lr_t") = py::none(), py::arg("step_t") = py::none(),
        py::arg("found_inf_t") = py::none());
  m.def("novograd", novograd, "NovoGrad update over [grad, param, exp_avg(, out)]",
        py::arg("lists"), py::arg("v_norm"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("step"), py::arg("bias_correction"), py::arg("weight_decay"),
        py::arg("grad_averaging"), py::arg("moment_mode"), py::arg("lr_t") = py::none(),
        py::arg("step_t") = py::none(), py::arg("grad_scale_t") = py::none(),
        py::arg("found_inf_t") = py::none());
  m.def("norm", norm,
        "Deterministic (total, per_tensor) sum of squares, or max |x| when max_norm is true",
        py::arg("tensors"), py::arg("max_norm"));
  m.def("scale", scale, "dst = src * scale over [src, dst]; sets found_inf to 1 on inf/nan in src",
        py::arg("lists"), py::arg("scale"), py::arg("scale_t"), py::arg("found_inf"));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace shardopt;
  auto cpu = m.def_submodule("cpu", "C++ CPU kernels");
  bind_backend(cpu, &adam_cpu, &sgd_cpu, &adagrad_cpu, &lamb_stage1_cpu, &lamb_stage2_cpu,
               &novograd_cpu, &norm_cpu, &scale_cpu);
  m.attr("cpu_chunk_size") = cpu::kChunkSize;
#ifdef SHARDOPT_WITH_CUDA
  auto cuda = m.def_submodule("cuda", "CUDA kernels");
  bind_backend(cuda, &adam_cuda, &sgd_cuda, &adagrad_cuda, &lamb_stage1_cuda, &lamb_stage2_cuda,
               &novograd_cuda, &norm_cuda, &scale_cuda);
  m.attr("has_cuda") = true;
  m.attr("cuda_chunk_size") = cuda::kChunkSize;
#else
  m.attr("has_cuda") = false;
#endif
}
