#pragma once
// Starts and stops what the layers need for the life of a process: Kokkos, and the number of
// threads the DNN backend uses.

namespace tessera {

class LayersRuntime {
 public:
  /// `threads`: threads per rank for the backend (>= 1).
  explicit LayersRuntime(int threads);
  ~LayersRuntime();
  LayersRuntime(const LayersRuntime&) = delete;
  LayersRuntime& operator=(const LayersRuntime&) = delete;
};

/// Sets the backend's threads per rank (oneDNN's OpenMP pool).
void set_backend_threads(int threads);
int backend_threads();

}  // namespace tessera
