#pragma once
// Row-major processor-grid arithmetic (the last axis varies fastest): a rank's coordinates and back.
#include <vector>

namespace tessera {

std::vector<int> grid_coords(const std::vector<int>& grid, int rank);
int grid_rank(const std::vector<int>& grid, const std::vector<int>& coords);

}  // namespace tessera
