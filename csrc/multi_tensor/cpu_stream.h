// Streaming (non-temporal) stores of a CPU kernel's out slot (Note: streamed out slots).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace shardopt {
namespace cpu {

// Note: streamed out slots. A kernel that writes the new low-precision params into an out slot
// (the offload kernel's bf16 out slot, which the device copies up next) never reads that slot: an
// ordinary store first reads each line it writes into the cache (read for ownership), 2 B a param
// more of DRAM traffic on a DRAM-bound update (~28 B a param) that also shares the memory with
// the slot's DMA. So the loop writes its out values for a block of elements into a small local
// buffer (in L1), and stream_bytes moves the block to the slot with non-temporal stores, which
// write whole lines without reading them. stream_fence() after the last block of a work item makes
// the stores globally visible before the item's thread reports it done (the device copy that
// reads the slot is issued after the call returns). The values, and so the bits, do not change.
// The slot's lines end in DRAM, not in the cache: a reader right after the call (a CPU job's
// forward on small params) reads them from memory; on the offload path the reader is the DMA.

// Elements of the local out buffer per block: 2 KiB of 16-bit values.
constexpr int64_t kStreamBlock = 1024;

// Copies `bytes` from src to dst, the whole vectors of dst with non-temporal stores (a plain
// copy where the ISA has none).
inline void stream_bytes(void* dst, const void* src, size_t bytes) {
#if defined(__SSE2__)
#if defined(__AVX512F__)
  constexpr size_t kVec = 64;
#elif defined(__AVX__)
  constexpr size_t kVec = 32;
#else
  constexpr size_t kVec = 16;
#endif
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  size_t head = (kVec - reinterpret_cast<uintptr_t>(d) % kVec) % kVec;
  if (head > bytes) head = bytes;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  for (; bytes >= kVec; bytes -= kVec, d += kVec, s += kVec) {
#if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d), _mm512_loadu_si512(s));
#elif defined(__AVX__)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
#else
    _mm_stream_si128(reinterpret_cast<__m128i*>(d),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
#endif
  }
  std::memcpy(d, s, bytes);
#else
  std::memcpy(dst, src, bytes);
#endif
}

inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace cpu
}  // namespace shardopt
