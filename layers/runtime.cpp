#include "tessera/layers/runtime.hpp"

#include <atomic>
#include <mutex>

#include <Kokkos_Core.hpp>
#include <omp.h>

#include "tessera/core/error.hpp"

namespace tessera {
namespace {

// Kokkos may be initialized once per process and never again after finalize, so runtimes nest:
// the first one initializes, the last one to go finalizes, and a later one reports the misuse.
std::mutex runtime_mutex;
int live_runtimes = 0;
bool kokkos_finalized_here = false;
bool kokkos_initialized_here = false;

std::atomic<int> current_threads{0};

}  // namespace

LayersRuntime::LayersRuntime(int threads) {
  {
    std::lock_guard lock(runtime_mutex);
    if (live_runtimes == 0) {
      if (kokkos_finalized_here)
        fail("LayersRuntime: Kokkos was already finalized in this process and cannot be started again; "
             "keep one LayersRuntime alive for the whole program");
      if (!Kokkos::is_initialized()) {
        Kokkos::initialize();
        kokkos_initialized_here = true;
      }
    }
    ++live_runtimes;
  }
  set_backend_threads(threads);
}

LayersRuntime::~LayersRuntime() {
  std::lock_guard lock(runtime_mutex);
  if (--live_runtimes == 0 && kokkos_initialized_here) {
    Kokkos::finalize();
    kokkos_initialized_here = false;
    kokkos_finalized_here = true;
  }
}

void set_backend_threads(int threads) {
  if (threads < 1) fail_input("backend threads must be at least 1, got {}", threads);
  // oneDNN's OpenMP runtime sizes its parallel regions by omp_get_max_threads() of the calling
  // thread, so this is the knob (and also caps OpenMP regions in anything else we call).
  omp_set_num_threads(threads);
  current_threads = threads;
}

int backend_threads() {
  const int threads = current_threads.load();
  return threads > 0 ? threads : omp_get_max_threads();
}

}  // namespace tessera
