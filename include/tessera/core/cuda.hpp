#pragma once
// The CUDA runtime as Tessera uses it: which GPUs there are, which one this rank drives, and
// device memory through a caching allocator. No CUDA types appear here, so every level can
// include it; in a build without CUDA (TESSERA_ENABLE_CUDA=OFF) the queries answer "none" and
// everything else fails with a message that says how to get a CUDA build.
//
// All of Tessera's compute on a GPU is issued on one stream per device (the one `stream()`
// returns), so memory freed on the host side can be handed out again at once: any kernel still
// reading it was queued before any kernel that will write it. Communication between GPUs (NCCL)
// runs on a second stream per device (`comm_stream()`), so that it overlaps compute. It is
// fenced by events both ways: it starts after the compute queued before it, and a request's
// wait() makes the compute stream wait for it. So the rule above holds for buffers that cross
// to the communication stream, as long as each request is waited for before its buffers are
// released.
#include <cstddef>
#include <cstdint>
#include <string>

namespace tessera::cuda {

/// True when this binary was built with TESSERA_ENABLE_CUDA=ON.
bool built();
/// GPUs this process can use; 0 when the build has no CUDA, there is no driver or no device.
/// Never throws.
int device_count();
/// Why device_count() is 0 ("" when it is not): for skipped tests and clear errors.
std::string unavailable_reason();
/// "NVIDIA H200, compute capability 9.0, 139.8 GiB, driver 13.0, runtime 13.0" (throws without a device).
std::string describe_device(int device);

/// The device's memory in bytes (all of it, not what is free now; throws without a device).
std::size_t device_memory_bytes(int device);

/// The GPU's UUID as 32 hex digits: the same GPU gives the same UUID in every process, however
/// CUDA_VISIBLE_DEVICES numbers it there.
std::string device_uuid(int device);

/// Makes `device` current for this thread (and creates its stream). Throws with the reason
/// when there is no such device.
void set_device(int device);
int current_device();
/// One rank per GPU: the GPU of a rank is its node-local rank modulo the GPUs it sees.
/// Makes it current and returns it.
int select_device_for_local_rank(int local_rank);

/// The stream all of Tessera's work on the current device goes to, as an opaque handle
/// (a cudaStream_t inside the CUDA sources).
void* stream();
/// Waits until every queued operation on the current device's stream has finished; throws
/// if one of them failed.
void synchronize();
/// The current device's communication stream (see above), as an opaque handle.
void* comm_stream();

/// Device memory of the current device from the caching allocator: blocks are kept when
/// released and handed out again for requests of the same rounded size. Throws an Error that
/// states the request, what is in use and cached, and the device's free memory when the device
/// is out of memory even after the cache was returned to it.
void* allocate(std::size_t bytes);
/// Returns a block from allocate() to the cache (nullptr is ignored).
void release(void* pointer);
/// Gives every cached, unused block back to the device.
void empty_cache();

struct AllocatorStats {
  std::size_t bytes_in_use = 0;     ///< handed out and not released
  std::size_t bytes_cached = 0;     ///< released, kept for reuse
  std::size_t peak_bytes_in_use = 0;
  std::int64_t device_allocations = 0;  ///< cudaMalloc calls so far
  std::int64_t cache_hits = 0;          ///< requests served from the cache
};
AllocatorStats allocator_stats();

/// Copies bytes between any two of host and device memory, ordered on stream() and finished
/// when the call returns.
void copy(void* destination, const void* source, std::size_t bytes);
/// Copies bytes between two buffers of device memory, queued on stream() (no wait: later work on
/// the stream sees the copy).
void copy_on_device(void* destination, const void* source, std::size_t bytes);
/// Sets `count` floats of device memory to `value` (queued on stream()).
void fill(float* destination, std::int64_t count, float value);

}  // namespace tessera::cuda
