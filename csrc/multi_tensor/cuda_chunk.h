// The CUDA traversal's chunk size, in a plain header so bindings.cpp (host compiler) can expose it.
#pragma once

#include <cstdint>

namespace shardopt {
namespace cuda {

// Elements per (tensor, chunk) work unit of one thread block.
constexpr int64_t kChunkSize = 65536;

}  // namespace cuda
}  // namespace shardopt
