// The CUDA runtime behind tessera/core/cuda.hpp: device choice, one stream per device, and the
// caching allocator. Built only with TESSERA_ENABLE_CUDA=ON (cuda_runtime_off.cpp otherwise).
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"

namespace tessera::cuda {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    const char* message = cudaGetErrorString(status);
    cudaGetLastError();  // clear a sticky-free error so that later calls report their own
    fail("CUDA: {} failed: {} ({})", what, message, static_cast<int>(status));
  }
}

std::string gib(std::size_t bytes) { return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1ull << 30)); }

/// Requests are rounded so that blocks can be reused for slightly different sizes: to 512 bytes
/// below 1 MiB, to 2 MiB above. A cached block serves a request up to twice smaller than it.
std::size_t rounded(std::size_t bytes) {
  constexpr std::size_t small = 512, large = 2u << 20;
  if (bytes < (1u << 20)) return (bytes + small - 1) / small * small;
  return (bytes + large - 1) / large * large;
}

struct Block {
  std::size_t bytes;
  int device;
};

/// One allocator for the process, one cache per device. A mutex because prefetch threads may
/// allocate staging buffers while the training thread runs.
class CachingAllocator {
 public:
  void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    const std::size_t size = rounded(bytes);
    int device = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    std::lock_guard lock(mutex_);
    auto& cache = cached_[device];
    if (auto it = cache.lower_bound(size); it != cache.end() && it->first <= 2 * size) {
      void* pointer = it->second;
      const std::size_t block = it->first;
      cache.erase(it);
      stats_.bytes_cached -= block;
      ++stats_.cache_hits;
      return hand_out(pointer, block, device);
    }
    void* pointer = nullptr;
    cudaError_t status = cudaMalloc(&pointer, size);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      release_cache(device);
      status = cudaMalloc(&pointer, size);
    }
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      std::size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      fail("CUDA: out of memory on device {}: asked for {} ({} bytes); Tessera holds {} in use and {} "
           "cached; the device has {} free of {}. Use fewer samples per rank or split the layers further.",
           device, gib(size), bytes, gib(stats_.bytes_in_use), gib(stats_.bytes_cached), gib(free_bytes),
           gib(total_bytes));
    }
    check(status, "cudaMalloc");
    ++stats_.device_allocations;
    return hand_out(pointer, size, device);
  }

  void release(void* pointer) {
    if (pointer == nullptr) return;
    std::lock_guard lock(mutex_);
    auto it = live_.find(pointer);
    if (it == live_.end()) return;  // not ours: nothing to do (never throw from a deleter)
    const Block block = it->second;
    live_.erase(it);
    stats_.bytes_in_use -= block.bytes;
    stats_.bytes_cached += block.bytes;
    cached_[block.device].emplace(block.bytes, pointer);
  }

  void empty_cache() {
    std::lock_guard lock(mutex_);
    for (auto& [device, cache] : cached_) release_cache(device);
  }

  AllocatorStats stats() {
    std::lock_guard lock(mutex_);
    return stats_;
  }

 private:
  void* hand_out(void* pointer, std::size_t bytes, int device) {
    live_[pointer] = {bytes, device};
    stats_.bytes_in_use += bytes;
    stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
    return pointer;
  }

  /// Called with the mutex held. cudaFree waits for the device, so queued kernels finish first.
  void release_cache(int device) {
    int current = 0;
    cudaGetDevice(&current);
    cudaSetDevice(device);
    for (auto& [bytes, pointer] : cached_[device]) {
      cudaFree(pointer);
      stats_.bytes_cached -= bytes;
    }
    cached_[device].clear();
    cudaSetDevice(current);
  }

  std::mutex mutex_;
  std::unordered_map<void*, Block> live_;
  std::map<int, std::multimap<std::size_t, void*>> cached_;
  AllocatorStats stats_;
};

CachingAllocator& allocator() {
  static auto* instance = new CachingAllocator();  // never destroyed: tensors may outlive statics
  return *instance;
}

std::mutex streams_mutex;
std::map<int, cudaStream_t>& streams() {
  static auto* instance = new std::map<int, cudaStream_t>();
  return *instance;
}

/// The stream of `device` in `all`, created (non-blocking) on first use; `urgent`: with the
/// device's greatest priority (communication: its kernels are scheduled before waiting compute).
cudaStream_t stream_of(int device, std::map<int, cudaStream_t>& all, bool urgent = false) {
  std::lock_guard lock(streams_mutex);
  auto it = all.find(device);
  if (it == all.end()) {
    int least = 0, greatest = 0;
    if (urgent) check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    cudaStream_t created = nullptr;
    check(cudaStreamCreateWithPriority(&created, cudaStreamNonBlocking, urgent ? greatest : least),
          "cudaStreamCreateWithPriority");
    it = all.emplace(device, created).first;
  }
  return it->second;
}

}  // namespace

bool built() { return true; }

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

std::string unavailable_reason() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return fmt::format("no usable CUDA device: {}", cudaGetErrorString(status));
  }
  return count == 0 ? "no CUDA device is visible to this process" : "";
}

std::string describe_device(int device) {
  cudaDeviceProp properties{};
  check(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties");
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  return fmt::format("{}, compute capability {}.{}, {} SMs, {}, driver {}.{}, runtime {}.{}", properties.name,
                     properties.major, properties.minor, properties.multiProcessorCount,
                     gib(properties.totalGlobalMem), driver / 1000, driver % 1000 / 10, runtime / 1000,
                     runtime % 1000 / 10);
}

std::size_t device_memory_bytes(int device) {
  cudaDeviceProp properties{};
  check(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties");
  return properties.totalGlobalMem;
}

std::string device_uuid(int device) {
  cudaDeviceProp properties{};
  check(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties");
  std::string hex;
  for (char byte : properties.uuid.bytes) hex += fmt::format("{:02x}", static_cast<unsigned char>(byte));
  return hex;
}

void set_device(int device) {
  static const int count = device_count();  // fixed for the life of the process
  if (device < 0 || device >= count) {
    if (count == 0) fail("CUDA device {} requested, but {}", device, unavailable_reason());
    fail("CUDA device {} requested, but this process sees {} (0..{})", device, count, count - 1);
  }
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == device) return;  // the common case: no call
  check(cudaSetDevice(device), "cudaSetDevice");
}

int current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

int select_device_for_local_rank(int local_rank) {
  const int count = device_count();
  if (count == 0) fail("this rank needs a GPU, but {}", unavailable_reason());
  const int device = local_rank % count;
  set_device(device);
  return device;
}

void* stream() {
  const int device = current_device();
  // The last answer of this thread, so that launches take no lock.
  thread_local int cached_device = -1;
  thread_local cudaStream_t cached_stream = nullptr;
  if (device == cached_device) return cached_stream;
  cached_stream = stream_of(device, streams());
  cached_device = device;
  return cached_stream;
}

void* comm_stream() {
  static auto* communication = new std::map<int, cudaStream_t>();
  return stream_of(current_device(), *communication, true);
}

void synchronize() { check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream())), "a queued GPU operation"); }

void* allocate(std::size_t bytes) { return allocator().allocate(bytes); }
void release(void* pointer) { allocator().release(pointer); }
void empty_cache() { allocator().empty_cache(); }
AllocatorStats allocator_stats() { return allocator().stats(); }

void copy(void* destination, const void* source, std::size_t bytes) {
  if (bytes == 0) return;
  auto* s = static_cast<cudaStream_t>(stream());
  check(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault, s), "cudaMemcpyAsync");
  check(cudaStreamSynchronize(s), "a copy between host and GPU");
}

void copy_on_device(void* destination, const void* source, std::size_t bytes) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream())),
        "cudaMemcpyAsync");
}

}  // namespace tessera::cuda
