// The CPU multi-tensor traversal: (tensor, chunk) work items taken one by one by ATen's intra-op
// threads (Note: items taken one by one), with the per-element loop left to the caller (a plain
// loop the compiler vectorises). Honours torch.get_num_threads() through ATen's intra-op pool.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <type_traits>
#include <vector>

#include "checks.h"

namespace shardopt {
namespace cpu {

// Elements per work item: large enough to amortise scheduling, small enough to balance threads.
constexpr int64_t kChunkSize = 16384;

struct WorkItem {
  int64_t tensor;
  int64_t start;
  int64_t end;
};

inline std::vector<WorkItem> work_items(const std::vector<at::Tensor>& tensors) {
  std::vector<WorkItem> items;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t n = tensors[t].numel();
    for (int64_t s = 0; s < n; s += kChunkSize) {
      items.push_back({static_cast<int64_t>(t), s, std::min(s + kChunkSize, n)});
    }
  }
  return items;
}

// Note: items taken one by one. at::parallel_for hands each intra-op thread one contiguous range
// of the items, fixed before the call (static). A thread whose core is shared with another busy
// thread (a rank's main thread launching GPU work beside the CPU update of offload, a
// communication library's progress thread, another process) then holds every other thread at the
// end of the call: the call takes as long as the slowed thread's share. Here each thread takes the
// next run of items from a shared counter until none is left (runs shrinking as the items run
// out, OpenMP's "guided" schedule), so a slowed thread simply runs fewer items.
// Every kernel's result is a function of its item alone (reductions write one partial per item,
// combined in item order after the call), so the bits do not depend on which thread ran an item.

// Calls f(item_index, tensor, start, end) for every chunk of every tensor, in parallel.
template <typename F>
void apply(const std::vector<WorkItem>& items, F&& f) {
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) f(i, items[i].tensor, items[i].start, items[i].end);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t first = next.load(std::memory_order_relaxed);
    while (first < n) {
      // guided: half of a fair share of what is left, so a thread's run of items stays
      // contiguous in memory (as a static split's would) and the last runs are single items
      const int64_t take = std::max<int64_t>(1, (n - first) / (2 * threads));
      if (!next.compare_exchange_weak(first, first + take, std::memory_order_relaxed)) continue;
      for (int64_t i = first; i < first + take; ++i) {
        f(i, items[i].tensor, items[i].start, items[i].end);
      }
      first = next.load(std::memory_order_relaxed);
    }
  });
}

template <typename F>
void apply(const std::vector<at::Tensor>& tensors, F&& f) {
  const auto items = work_items(tensors);
  apply(items, [&](int64_t, int64_t t, int64_t s, int64_t e) { f(t, s, e); });
}

// Note: vectorised CPU loops. The per-element loops are plain loops over __restrict local
// pointers with the kernel's flags (adam_w_mode, nesterov, ...) as compile-time constants. Both are
// needed for GCC to vectorise a loop that stores 16-bit values (bf16/fp16 params or out slots):
// a runtime bool read from the Hyper struct gets "no vectype" there, and `#pragma omp simd`
// privatises the element's accumulator into an "omp simd array" (update() takes it by reference),
// which the 16-bit store then cannot vectorise. Loops storing only fp32 vectorised either way; with
// a bf16 out slot the scalar loop was 6x slower than the fp32 one
// (launch_scripts/bench/bench_cpu_adam.py).
// The conversions stay c10's (round to nearest even, NaN kept), so the bits do not change.

// Calls f(std::true_type{}) or f(std::false_type{}) as `flag` is: a runtime flag made a
// compile-time constant of the loop inside f (see Note: vectorised CPU loops).
template <typename F>
decltype(auto) with_flag(bool flag, F&& f) {
  if (flag) return f(std::true_type{});
  return f(std::false_type{});
}

// Typed data pointers of one slot.
template <typename T>
std::vector<T*> pointers(const std::vector<at::Tensor>& list) {
  std::vector<T*> out(list.size());
  for (size_t i = 0; i < list.size(); ++i) out[i] = static_cast<T*>(list[i].data_ptr());
  return out;
}

// The value of an optional device scalar (a CPU tensor here), or `fallback`.
inline double scalar_or(const std::optional<at::Tensor>& t, double fallback) {
  return t.has_value() ? t->item<double>() : fallback;
}

// True when a found_inf flag is present and set: the kernel must leave everything unchanged.
inline bool skip_step(const std::optional<at::Tensor>& found_inf) {
  return found_inf.has_value() && found_inf->item<double>() != 0.0;
}

}  // namespace cpu
}  // namespace shardopt
