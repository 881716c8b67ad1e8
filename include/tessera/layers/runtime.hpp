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

/// Sets how many ranks of this job run on this rank's node (1 until set): they share its caches,
/// and host kernels write an output larger than half of this rank's share of the last-level
/// cache in streaming stores. The executor sets it, and calibrate for the rank count it times.
void set_ranks_on_node(int ranks);

}  // namespace tessera
