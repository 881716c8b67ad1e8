#pragma once
// Element-wise loops over raw host pointers as Kokkos parallel_for / parallel_reduce on the
// default host execution space (Serial in Debian's Kokkos; OpenMP or Threads when a build has
// them, without touching the layers). Included only by .cpp files: Kokkos headers are heavy.
#include <cstdint>

#include <Kokkos_Core.hpp>

namespace tessera {

using HostRange = Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace, Kokkos::IndexType<std::int64_t>>;

/// body(i) for i in [0, count).
template <typename Body>
void host_for(const char* label, std::int64_t count, const Body& body) {
  if (count <= 0) return;
  Kokkos::parallel_for(label, HostRange(0, count), body);
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
