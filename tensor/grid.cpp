#include "tessera/tensor/grid.hpp"

namespace tessera {

std::vector<int> grid_coords(const std::vector<int>& grid, int rank) {
  std::vector<int> c(grid.size());
  for (std::size_t a = grid.size(); a-- > 0;) {
    c[a] = rank % grid[a];
    rank /= grid[a];
  }
  return c;
}

int grid_rank(const std::vector<int>& grid, const std::vector<int>& coords) {
  int r = 0;
  for (std::size_t a = 0; a < grid.size(); ++a) r = r * grid[a] + coords[a];
  return r;
}

}  // namespace tessera
