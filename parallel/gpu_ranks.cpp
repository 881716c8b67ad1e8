// ranks_sharing_a_gpu (tessera/parallel/nccl_communicator.hpp): built with and without CUDA.
#include <algorithm>
#include <utility>
#include <vector>

#include "tessera/core/cuda.hpp"
#include "tessera/parallel/nccl_communicator.hpp"

namespace tessera {

std::optional<SharedGpu> ranks_sharing_a_gpu(Communicator& comm) {
  const std::string mine = cuda::device_uuid(cuda::current_device());
  std::vector<char> all(mine.size() * static_cast<std::size_t>(comm.size()));
  comm.allgather(mine.data(), all.data(), mine.size(), DType::U8);
  // (uuid, rank) sorted: two ranks on one GPU end up next to each other.
  std::vector<std::pair<std::string, int>> gpus;
  for (int r = 0; r < comm.size(); ++r)
    gpus.emplace_back(std::string(all.data() + mine.size() * static_cast<std::size_t>(r), mine.size()), r);
  std::sort(gpus.begin(), gpus.end());
  for (std::size_t i = 1; i < gpus.size(); ++i)
    if (gpus[i].first == gpus[i - 1].first) return SharedGpu{gpus[i - 1].second, gpus[i].second, gpus[i].first};
  return std::nullopt;
}

}  // namespace tessera
