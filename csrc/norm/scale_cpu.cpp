// Multi-tensor scale with an inf/nan check on CPU (gradient unscaling for loss scaling).
#include <cmath>

#include "../kernels.h"
#include "../multi_tensor/cpu_apply.h"
#include "../multi_tensor/dispatch.h"

namespace shardopt {

void scale_cpu(const TensorLists& lists, double scale, const OptTensor& scale_t,
               const at::Tensor& found_inf) {
  // each tensor is dispatched on its own dtype: a slot may mix dtypes here
  check_tensor_lists_no_out(lists, 2, c10::DeviceType::CPU, "scale", /*mixed_dtypes=*/true,
                            " [src, dst]");
  device_scalar(found_inf, at::Device(at::kCPU), "scale", "found_inf");
  if (lists[0].empty()) return;
  const float s = static_cast<float>(cpu::scalar_or(scale_t, scale));
  const auto items = cpu::work_items(lists[0]);
  std::vector<char> bad(items.size(), 0);
  cpu::apply(items, [&](int64_t idx, int64_t k, int64_t b, int64_t e) {
    dispatch_float(lists[0][k].scalar_type(), "scale", [&](auto src_tag) {
      dispatch_float(lists[1][k].scalar_type(), "scale", [&](auto dst_tag) {
        using S = decltype(src_tag);
        using D = decltype(dst_tag);
        using Acc = std::conditional_t<std::is_same_v<S, double>, double, float>;
        const S* src = static_cast<const S*>(lists[0][k].data_ptr());
        D* dst = static_cast<D*>(lists[1][k].data_ptr());
        bool nonfinite = false;
        for (int64_t i = b; i < e; ++i) {
          const Acc x = static_cast<Acc>(src[i]);
          nonfinite |= !std::isfinite(x);
          dst[i] = static_cast<D>(x * static_cast<Acc>(s));
        }
        bad[idx] = nonfinite;
      });
    });
  });
  for (char b : bad) {
    if (b) {
      found_inf.fill_(1.0);
      break;
    }
  }
}

}  // namespace shardopt
