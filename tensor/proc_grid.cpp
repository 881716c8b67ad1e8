#include "tessera/tensor/proc_grid.hpp"

#include "tessera/core/error.hpp"

namespace tessera {

ProcGrid::ProcGrid(std::shared_ptr<Communicator> comm, std::vector<int> shape)
    : comm_(std::move(comm)), shape_(std::move(shape)) {
  TESSERA_CHECK(comm_ != nullptr, "ProcGrid: no communicator");
  if (size() != comm_->size())
    fail_input("the processor grid has {} ranks but the job has {}", size(), comm_->size());
  coords_ = coords_of(comm_->rank());
}

int ProcGrid::size() const {
  int n = 1;
  for (int s : shape_) n *= s;
  return n;
}

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

Communicator& ProcGrid::sub_comm(const std::vector<int>& axes) {
  auto it = sub_comms_.find(axes);
  if (it != sub_comms_.end()) return *it->second;
  // Ranks in one sub-communicator share every coordinate outside `axes`.
  std::vector<bool> inside(shape_.size(), false);
  for (int a : axes) {
    TESSERA_CHECK(a >= 0 && a < ndims(), "ProcGrid::sub_comm: axis {} outside a {}-axis grid", a, ndims());
    inside[static_cast<std::size_t>(a)] = true;
  }
  int color = 0, key = 0;
  for (int a = 0; a < ndims(); ++a) {
    const auto i = static_cast<std::size_t>(a);
    if (inside[i]) key = key * shape_[i] + coords_[i];
    else color = color * shape_[i] + coords_[i];
  }
  auto [pos, _] = sub_comms_.emplace(axes, comm_->split(color, key));
  return *pos->second;
}

}  // namespace tessera
