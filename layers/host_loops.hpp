#pragma once
// Element-wise loops over raw host pointers as Kokkos parallel_for / parallel_reduce on the
// default host execution space. Debian's Kokkos has only the Serial space there, so host_for
// splits a loop over the rank's OpenMP threads itself (as the convolutions do); a build whose
// Kokkos has a threaded host space runs it there. Included only by .cpp files: Kokkos is heavy.
#include <omp.h>

#include <cstdint>
#include <type_traits>

#include <Kokkos_Core.hpp>

namespace tessera {

using HostRange = Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace, Kokkos::IndexType<std::int64_t>>;

/// A loop smaller than this many elements runs on the calling thread: starting the other threads
/// costs more than they save.
constexpr std::int64_t kParallelElements = 32768;

/// body(i) for i in [0, count), each thread taking one contiguous range of i. `elements`: about how
/// many elements one i touches (a plane's, for loops over planes), to leave small loops alone.
template <typename Body>
void host_for(const char* label, std::int64_t count, const Body& body, std::int64_t elements = 1) {
  if (count <= 0) return;
  if constexpr (std::is_same_v<Kokkos::DefaultHostExecutionSpace, Kokkos::Serial>) {
    const int threads = omp_get_max_threads();
    if (threads == 1 || count == 1 || count * elements < kParallelElements || omp_in_parallel()) {
      for (std::int64_t i = 0; i < count; ++i) body(i);
      return;
    }
#pragma omp parallel num_threads(threads)
    {
      // A copy of its own: the compiler then sees that the loop's stores leave the body's captures
      // alone, and vectorises it.
      const Body local = body;
      const std::int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
      const std::int64_t end = count * (part + 1) / parts;
      for (std::int64_t i = count * part / parts; i < end; ++i) local(i);
    }
  } else {
    Kokkos::parallel_for(label, HostRange(0, count), body);
  }
}

/// Sum of body(i) over [0, count) in double.
template <typename Body>
double host_sum(const char* label, std::int64_t count, const Body& body) {
  double total = 0.0;
  if (count <= 0) return total;
  Kokkos::parallel_reduce(
      label, HostRange(0, count), [&](std::int64_t i, double& partial) { partial += body(i); }, total);
  return total;
}

}  // namespace tessera
