// The argument checks of the batched matmuls (matmul_checks.h).
//
// Note: checks before nvcc-built code
// On an H100 with torch 2.11, a failed check of symmetric_bmm_add / symmetric_bmm killed the
// process (a segfault, in the test suite and in a child process alike) while bmm_add's raised.
// Moving the checks here, host-compiled, did not help; launch_scripts/probe/probe_matmul_checks.py
// (each case in its own child, 2026-12-07 23:48 UTC) then showed that only `blocks=0` crashed:
// its message streamed an integer, the crash multi_tensor/checks.cpp already names (streaming an
// integer from this module on the GPU image kills the process instead of raising). So numbers
// go into these messages as std::to_string text, as elsewhere in csrc/. The checks stay here,
// run by bindings.cpp before csrc/linalg/*.cu is entered, so the nvcc-built entry points hold
// no error paths of their own. (The fix has not yet run on a GPU.)
#include "matmul_checks.h"

namespace shardopt {

std::string shape_text(const at::Tensor& x) {
  std::string out = "(";
  for (int64_t i = 0; i < x.dim(); ++i) out += (i ? ", " : "") + std::to_string(x.size(i));
  return out + ")";
}

void check_batched_matmul(const char* name, const at::Tensor& a, const at::Tensor& b,
                          const at::Tensor& c, bool square, int64_t blocks) {
  const std::string with_c = c.defined() ? ", " + shape_text(c) : std::string();
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && (!c.defined() || c.dim() == 3), name,
              ": a, b and c must be 3-D (batch, rows, cols), got shapes ", shape_text(a), ", ",
              shape_text(b), with_c);
  const int64_t batch = a.size(0), p = a.size(1), q = a.size(2), r = b.size(2);
  const bool c_ok = !c.defined() || (c.size(0) == batch && c.size(1) == p && c.size(2) == r);
  TORCH_CHECK(b.size(0) == batch && b.size(1) == q && c_ok, name, ": shapes do not chain: a ",
              shape_text(a), " @ b ", shape_text(b),
              c.defined() ? " + c " + shape_text(c) : std::string());
  TORCH_CHECK(!square || p == r, name, ": the product must be square (symmetric), got a ",
              shape_text(a), " @ b ", shape_text(b));
  TORCH_CHECK(a.is_cuda() && b.device() == a.device() && (!c.defined() || c.device() == a.device()),
              name, ": a, b and c must be on one CUDA device");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() &&
                  (!c.defined() || c.scalar_type() == a.scalar_type()),
              name, ": a, b and c must have one dtype, got ", a.scalar_type(), ", ",
              b.scalar_type(), c.defined() ? ", " + std::string(c10::toString(c.scalar_type()))
                                           : std::string());
  TORCH_CHECK(blocks >= 1, name, ": blocks must be at least 1, got ", std::to_string(blocks));
}

}  // namespace shardopt
