#pragma once
// Streaming stores for host kernels whose outputs are larger than the caches: such an output is
// written straight to memory (no read for ownership of its lines, and nothing its kernel reads is
// evicted for it); its reader misses the caches either way.
#include <cstdint>
#include <cstring>

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace tessera::host {

/// Whether a kernel writes an output of `bytes` with streaming stores: more than streaming_threshold().
bool streams_output(std::int64_t bytes);
/// Half of this rank's share of the last-level cache (the rest is for the kernel's inputs): the
/// cache (sysfs; 32 MiB where it says none) over the ranks that share it, set_ranks_on_node's
/// ranks spread over the node's caches of that level.
std::int64_t streaming_threshold();
/// For tests: outputs of more than `bytes` stream (0: all of them); negative: the cache's rule.
void set_streaming_threshold(std::int64_t bytes);

/// dst[0, n) = src[0, n); with `stream`, in streaming stores where dst is 16-byte aligned and n a
/// multiple of 4 (else as a plain copy). A thread that streamed calls stream_fence before others
/// read what it wrote.
inline void stream_copy(float* dst, const float* src, std::int64_t n, bool stream) {
#if defined(__SSE__)
  if (stream && n % 4 == 0 && reinterpret_cast<std::uintptr_t>(dst) % 16 == 0) {
    for (std::int64_t i = 0; i < n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
}

/// Orders this thread's streaming stores before its later stores (and so before the barrier that
/// ends a parallel loop).
inline void stream_fence() {
#if defined(__SSE__)
  _mm_sfence();
#endif
}

}  // namespace tessera::host
