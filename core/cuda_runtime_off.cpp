// tessera/core/cuda.hpp in a build without CUDA: no devices, and a clear error for every use.
#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"

namespace tessera::cuda {
namespace {
[[noreturn]] void not_built(const char* what) {
  fail("cannot {}: {}. Rebuild with -DTESSERA_ENABLE_CUDA=ON (needs the CUDA toolkit with cuDNN and NCCL).", what,
       unavailable_reason());
}
}  // namespace

bool built() { return false; }
int device_count() { return 0; }
std::string unavailable_reason() { return "this Tessera was built without CUDA (TESSERA_ENABLE_CUDA=OFF)"; }
std::string describe_device(int) { not_built("describe a GPU"); }
std::size_t device_memory_bytes(int) { not_built("query a GPU's memory"); }
std::string device_uuid(int) { not_built("identify a GPU"); }
void set_device(int) { not_built("select a GPU"); }
int current_device() { not_built("query the current GPU"); }
int select_device_for_local_rank(int) { not_built("select a GPU"); }
void* stream() { not_built("use a GPU stream"); }
void synchronize() { not_built("synchronize a GPU"); }
void* comm_stream() { not_built("use a GPU stream"); }
void* allocate(std::size_t) { not_built("allocate GPU memory"); }
void release(void*) {}
void empty_cache() {}
AllocatorStats allocator_stats() { return {}; }
void copy(void*, const void*, std::size_t) { not_built("copy to or from a GPU"); }
void copy_on_device(void*, const void*, std::size_t) { not_built("copy on a GPU"); }
void fill(float*, std::int64_t, float) { not_built("fill GPU memory"); }

}  // namespace tessera::cuda
