#include "tessera/parallel/tile_exchange.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/tensor/box_ops.hpp"

namespace tessera {
namespace {

std::string box_string(const Box& box) {
  std::string out = "[";
  for (std::size_t d = 0; d < box.begin.size(); ++d) {
    if (d > 0) out += ", ";
    out += fmt::format("{}:{}", box.begin[d], box.begin[d] + box.extent[d]);
  }
  return out + ")";
}

/// The intersection of two boxes (extent 0 in some dimension when they do not meet).
Box intersect(const Box& a, const Box& b) {
  Box out;
  out.begin.resize(a.begin.size());
  out.extent.resize(a.begin.size());
  for (std::size_t d = 0; d < a.begin.size(); ++d) {
    const std::int64_t begin = std::max(a.begin[d], b.begin[d]);
    const std::int64_t end = std::min(a.begin[d] + a.extent[d], b.begin[d] + b.extent[d]);
    out.begin[d] = begin;
    out.extent[d] = std::max<std::int64_t>(end - begin, 0);
  }
  return out;
}

Box whole(const Shape& shape) {
  return Box{std::vector<std::int64_t>(static_cast<std::size_t>(shape.rank()), 0), shape.dims()};
}

bool inside(const Box& box, const Shape& global) {
  for (int d = 0; d < global.rank(); ++d) {
    const auto i = static_cast<std::size_t>(d);
    if (box.begin[i] < 0 || box.begin[i] + box.extent[i] > global[d]) return false;
  }
  return true;
}

/// Checks that `tensor` is a dense tile of `box` (an empty box accepts any empty tensor).
void check_tile(const Tensor& tensor, const Box& box, const char* what) {
  if (box.numel() == 0 && tensor.numel() == 0) return;
  TESSERA_CHECK(tensor.shape().dims() == box.extent, "TileExchange: {} has shape {}, expected the extents of box {}",
                what, tensor.shape().to_string(), box_string(box));
  TESSERA_CHECK(tensor.is_contiguous(), "TileExchange: {} is not contiguous", what);
}

}  // namespace

TileExchange::TileExchange(Communicator& comm, Shape global, std::vector<Box> held, std::vector<Box> needed,
                           Transport transport, int tag)
    : comm_(comm),
      global_(std::move(global)),
      held_(std::move(held)),
      needed_(std::move(needed)),
      transport_(transport),
      tag_(tag),
      me_(comm.rank()) {
  const int p = comm_.size();
  const int rank = global_.rank();
  TESSERA_CHECK(rank >= 1 && rank <= kMaxBoxRank, "TileExchange: global shape {} must have 1 to {} dimensions",
                global_.to_string(), kMaxBoxRank);
  TESSERA_CHECK(static_cast<int>(held_.size()) == p && static_cast<int>(needed_.size()) == p,
                "TileExchange: {} held and {} needed boxes for {} ranks of {}", held_.size(), needed_.size(), p,
                comm_.name());
  auto check_box = [&](const Box& box, int r, const char* what) {
    TESSERA_CHECK(static_cast<int>(box.begin.size()) == rank && static_cast<int>(box.extent.size()) == rank,
                  "TileExchange: rank {}'s {} box has {} begins and {} extents for global shape {}", r, what,
                  box.begin.size(), box.extent.size(), global_.to_string());
    for (auto e : box.extent)
      TESSERA_CHECK(e >= 0, "TileExchange: rank {}'s {} box {} has a negative extent", r, what, box_string(box));
  };
  for (int r = 0; r < p; ++r) {
    const Box& h = held_[static_cast<std::size_t>(r)];
    const Box& n = needed_[static_cast<std::size_t>(r)];
    check_box(h, r, "held");
    check_box(n, r, "needed");
    TESSERA_CHECK(inside(h, global_), "TileExchange: rank {}'s held box {} is not inside the global shape {}", r,
                  box_string(h), global_.to_string());
    if (!(h == n)) identity_ = false;
  }
  plan();
}

TileExchange::~TileExchange() {
  // Requests still in flight complete (on a GPU: fence its compute stream) in their destructors,
  // before the buffers they use are released.
  requests_.clear();
}

const Box& TileExchange::held_box() const {
  return held_[static_cast<std::size_t>(me_)];
}
const Box& TileExchange::needed_box() const {
  return needed_[static_cast<std::size_t>(me_)];
}

void TileExchange::plan() {
  const int p = comm_.size();
  const Box domain = whole(global_);

  // Replica groups: ranks with identical non-empty held boxes, each group's ranks ascending.
  std::vector<int> order;
  for (int r = 0; r < p; ++r)
    if (held_[static_cast<std::size_t>(r)].numel() > 0) order.push_back(r);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const Box& x = held_[static_cast<std::size_t>(a)];
    const Box& y = held_[static_cast<std::size_t>(b)];
    return std::tie(x.begin, x.extent) < std::tie(y.begin, y.extent);
  });
  std::vector<std::vector<int>> groups;
  std::vector<int> group_of(static_cast<std::size_t>(p), -1);
  for (std::size_t k = 0; k < order.size(); ++k) {
    const int r = order[k];
    if (k == 0 || !(held_[static_cast<std::size_t>(r)] == held_[static_cast<std::size_t>(order[k - 1])]))
      groups.emplace_back();
    groups.back().push_back(r);
    group_of[static_cast<std::size_t>(r)] = static_cast<int>(groups.size()) - 1;
    if (groups.back().size() > 1) has_replicas_ = true;
  }
  auto box_of = [&](std::size_t g) -> const Box& { return held_[static_cast<std::size_t>(groups[g].front())]; };
  // The replica of group g that serves `receiver`: the receiver itself when it is one; else the
  // replicas are dealt out round robin over the other ranks in rank order (k-th non-member gets
  // replica k % count), so that every replica serves about as many receivers.
  auto holder = [&](std::size_t g, int receiver) {
    if (group_of[static_cast<std::size_t>(receiver)] == static_cast<int>(g)) return receiver;
    const auto& members = groups[g];
    const auto members_before = std::lower_bound(members.begin(), members.end(), receiver) - members.begin();
    return members[static_cast<std::size_t>(receiver - members_before) % members.size()];
  };

  // Distinct held boxes must be disjoint.
  for (std::size_t a = 0; a < groups.size(); ++a)
    for (std::size_t b = a + 1; b < groups.size(); ++b)
      TESSERA_CHECK(intersect(box_of(a), box_of(b)).numel() == 0,
                    "TileExchange: held boxes {} (rank {}) and {} (rank {}) overlap without being identical",
                    box_string(box_of(a)), groups[a].front(), box_string(box_of(b)), groups[b].front());

  // Every in-domain element of every needed box is held: the groups are disjoint, so the volumes of
  // their intersections with the clipped needed box must add up to its volume.
  for (int q = 0; q < p; ++q) {
    const Box& need = needed_[static_cast<std::size_t>(q)];
    const Box clipped = intersect(need, domain);
    std::int64_t covered = 0;
    for (std::size_t g = 0; g < groups.size(); ++g) covered += intersect(box_of(g), clipped).numel();
    TESSERA_CHECK(covered == clipped.numel(),
                  "TileExchange over {}: rank {} needs box {} of global shape {}, but {} of its {} elements inside "
                  "the global tensor are held by no rank",
                  comm_.name(), q, box_string(need), global_.to_string(), clipped.numel() - covered, clipped.numel());
  }

  // This rank's transfers.
  const Box& mine = held_box();
  const Box& need = needed_box();
  const Box clipped = intersect(need, domain);
  const int my_group = group_of[static_cast<std::size_t>(me_)];
  if (my_group >= 0) {
    for (int q = 0; q < p; ++q) {
      if (q == me_ || holder(static_cast<std::size_t>(my_group), q) != me_) continue;
      Box region = intersect(mine, intersect(needed_[static_cast<std::size_t>(q)], domain));
      if (region.numel() > 0) outgoing_.push_back({q, std::move(region)});
    }
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const int from = holder(g, me_);
    if (from == me_) continue;
    Box region = intersect(box_of(g), clipped);
    if (region.numel() > 0) incoming_.push_back({from, std::move(region)});
  }
  std::sort(incoming_.begin(), incoming_.end(), [](const Transfer& a, const Transfer& b) { return a.peer < b.peer; });
  local_ = intersect(mine, clipped);  // empty when this rank holds nothing

  // Parts of the needed box outside the domain: for each dimension d, the slabs below and above the
  // clipped box in d, restricted to the clipped range in the dimensions before d.
  if (need.numel() > 0) {
    if (clipped.numel() == 0) {
      outside_.push_back(need);
    } else {
      for (std::size_t d = 0; d < need.begin.size(); ++d) {
        Box below = need, above = need;
        for (std::size_t e = 0; e < d; ++e) {
          below.begin[e] = above.begin[e] = clipped.begin[e];
          below.extent[e] = above.extent[e] = clipped.extent[e];
        }
        below.extent[d] = clipped.begin[d] - need.begin[d];
        above.begin[d] = clipped.begin[d] + clipped.extent[d];
        above.extent[d] = need.begin[d] + need.extent[d] - above.begin[d];
        if (below.numel() > 0) outside_.push_back(below);
        if (above.numel() > 0) outside_.push_back(above);
      }
    }
  }

  // Buffer layouts: transfers back to back in peer order.
  for (auto* transfers : {&outgoing_, &incoming_}) {
    std::int64_t offset = 0;
    for (auto& t : *transfers) {
      t.count = t.region.numel();
      t.offset = offset;
      offset += t.count;
    }
  }
  if (transport_ == Transport::AllToAllV) {
    const auto n = static_cast<std::size_t>(p);
    outgoing_counts_.assign(n, 0);
    outgoing_displs_.assign(n, 0);
    incoming_counts_.assign(n, 0);
    incoming_displs_.assign(n, 0);
    for (const auto& t : outgoing_) {
      outgoing_counts_[static_cast<std::size_t>(t.peer)] = t.count;
      outgoing_displs_[static_cast<std::size_t>(t.peer)] = t.offset;
    }
    for (const auto& t : incoming_) {
      incoming_counts_[static_cast<std::size_t>(t.peer)] = t.count;
      incoming_displs_[static_cast<std::size_t>(t.peer)] = t.offset;
    }
  }
}

std::int64_t TileExchange::send_elements() const {
  return outgoing_.empty() ? 0 : outgoing_.back().offset + outgoing_.back().count;
}

std::int64_t TileExchange::recv_elements() const {
  return incoming_.empty() ? 0 : incoming_.back().offset + incoming_.back().count;
}

int TileExchange::peers() const { return static_cast<int>(peer_ranks().size()); }

std::vector<int> TileExchange::peer_ranks() const {
  std::vector<int> ranks;
  for (const auto& t : outgoing_) ranks.push_back(t.peer);
  for (const auto& t : incoming_) ranks.push_back(t.peer);
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  return ranks;
}

void TileExchange::post(const std::vector<Transfer>& sends, float* send_area, const std::vector<Transfer>& receives,
                        float* receive_area) {
  if (transport_ == Transport::AllToAllV && !comm_.moves_gpu_memory()) return;  // one alltoallv instead
  if (sends.empty() && receives.empty()) return;
  // Reused between calls (their capacity stays): no allocation per exchange.
  sends_.clear();
  receives_.clear();
  for (const auto& t : sends) sends_.push_back({send_area + t.offset, static_cast<std::size_t>(t.count), t.peer});
  for (const auto& t : receives) receives_.push_back({receive_area + t.offset, static_cast<std::size_t>(t.count), t.peer});
  requests_.push_back(comm_.exchange(sends_, receives_, DType::F32, tag_));
}

void TileExchange::wait_all() {
  for (auto& request : requests_) request->wait();
  requests_.clear();
}

// ---------------------------------------------------------------------------------------------
// Forward

// Packing and unpacking run where the tensors are (copy_box and friends on device_). Messages go
// from and to where the communicator moves memory: on the host, the host buffers; on a GPU with
// a communicator of GPU memory (NCCL), the GPU buffers the messages are packed in; on a GPU with a
// communicator of host memory (MPI), the packed messages are staged through the host buffers.

bool TileExchange::staged() const { return !device_.is_host() && !comm_.moves_gpu_memory(); }

float* TileExchange::gpu_buffer(Tensor& buffer, std::size_t elements) {
  buffer.resize(Shape{std::max<std::int64_t>(static_cast<std::int64_t>(elements), 1)}, device_);
  return buffer.data();
}

float* TileExchange::packing_area(std::vector<float>& host, Tensor& gpu, std::size_t elements) {
  if (device_.is_host() || staged()) host.resize(elements);
  return device_.is_host() ? host.data() : gpu_buffer(gpu, elements);
}

float* TileExchange::message_area(std::vector<float>& host, Tensor& gpu, std::size_t elements) {
  if (device_.is_host() || staged()) {
    host.resize(elements);
    return host.data();
  }
  return gpu_buffer(gpu, elements);
}

void TileExchange::stage_to_host(std::vector<float>& host, const Tensor& gpu) {
  if (!staged()) return;
  cuda::set_device(device_.index);  // the copy is ordered on this GPU's stream, after the packing
  cuda::copy(host.data(), gpu.data(), host.size() * sizeof(float));
}

const float* TileExchange::received(std::vector<float>& host, Tensor& gpu) {
  if (device_.is_host()) return host.data();
  if (staged()) {
    gpu_buffer(gpu, host.size());
    cuda::set_device(device_.index);
    cuda::copy(gpu.data(), host.data(), host.size() * sizeof(float));
  }
  return gpu.data();
}

void TileExchange::set_device(Device device) {
  TESSERA_CHECK(!device.is_host() || !comm_.moves_gpu_memory(),
                "TileExchange over {}: that communicator moves GPU memory, but the exchange's tensors are on the host",
                comm_.name());
  device_ = device;
}

void TileExchange::check_device(const Tensor& tensor, const char* what) const {
  TESSERA_CHECK(!device_.is_host() || !comm_.moves_gpu_memory(),
                "TileExchange over {}: that communicator moves GPU memory; set_device the exchange to a GPU",
                comm_.name());
  TESSERA_CHECK(tensor.numel() == 0 || tensor.device() == device_, "TileExchange: {} is on {}, the exchange on {}",
                what, tensor.device().to_string(), device_.to_string());
}

void TileExchange::start_forward(const Tensor& held_in, Tensor& needed_out, float fill) {
  TESSERA_CHECK(pending_ == Pending::None, "TileExchange::start_forward while another exchange is in flight");
  TESSERA_CHECK(&held_in != &needed_out, "TileExchange::forward: held_in and needed_out are the same tensor");
  check_tile(held_in, held_box(), "forward's held_in");
  check_device(held_in, "forward's held_in");
  needed_out.resize(Shape(needed_box().extent, global_.kinds()), device_);
  TESSERA_CHECK(needed_out.numel() == 0 || held_in.numel() == 0 || needed_out.data() != held_in.data(),
                "TileExchange::forward: held_in and needed_out share memory");
  send_forward(&held_in, needed_out, fill);
}

bool TileExchange::holds_own_tile() const { return local_ == held_box(); }

void TileExchange::start_forward_in_place(Tensor& window, float fill) {
  TESSERA_CHECK(pending_ == Pending::None, "TileExchange::start_forward_in_place while another exchange is in flight");
  TESSERA_CHECK(holds_own_tile(), "TileExchange::forward in place: the needed box {} does not hold the held box {}",
                box_string(needed_box()), box_string(held_box()));
  check_tile(window, needed_box(), "forward's window");
  check_device(window, "forward's window");
  send_forward(nullptr, window, fill);
}

void TileExchange::send_forward(const Tensor* held_in, Tensor& needed_out, float fill) {
  // Sent from the held tile, or in place from the window that holds it.
  const float* source = held_in ? held_in->data() : needed_out.data();
  const Box& source_box = held_in ? held_box() : needed_box();
  const Box& need = needed_box();
  target_ = needed_out;
  pending_ = Pending::Forward;

  const auto sending = static_cast<std::size_t>(send_elements()), receiving = static_cast<std::size_t>(recv_elements());
  float* packed = packing_area(outgoing_buffer_, outgoing_gpu_, sending);
  for (const auto& t : outgoing_) copy_box(t.region, source, source_box, packed + t.offset, t.region, device_);
  stage_to_host(outgoing_buffer_, outgoing_gpu_);
  post(outgoing_, message_area(outgoing_buffer_, outgoing_gpu_, sending), incoming_,
       message_area(incoming_buffer_, incoming_gpu_, receiving));

  // While messages fly: the local overlap (unless it is in place already) and the padding
  // outside the global tensor, and zeros where the messages will land, so that a kernel over the
  // whole window before finish (halo overlap) never reads stale values (a GPU's FFT or Winograd
  // algorithm mixes every input).
  if (held_in) copy_box(local_, source, source_box, needed_out.data(), need, device_);
  for (const auto& slab : outside_) fill_box(slab, needed_out.data(), need, fill, device_);
  for (const auto& t : incoming_) fill_box(t.region, needed_out.data(), need, 0.0f, device_);

  // The Communicator has no nonblocking alltoallv: the collective runs here, finish only unpacks.
  if (transport_ == Transport::AllToAllV && !comm_.moves_gpu_memory())
    comm_.alltoallv(outgoing_buffer_.data(), outgoing_counts_, outgoing_displs_, incoming_buffer_.data(),
                    incoming_counts_, incoming_displs_, DType::F32);
}

void TileExchange::finish_forward() {
  TESSERA_CHECK(pending_ == Pending::Forward, "TileExchange::finish_forward without start_forward");
  wait_all();
  const Box& need = needed_box();
  const float* messages = received(incoming_buffer_, incoming_gpu_);
  for (const auto& t : incoming_)
    copy_box(t.region, messages + t.offset, t.region, target_.data(), need, device_);
  target_ = Tensor();
  pending_ = Pending::None;
}

void TileExchange::forward(const Tensor& held_in, Tensor& needed_out, float fill) {
  start_forward(held_in, needed_out, fill);
  finish_forward();
}

// ---------------------------------------------------------------------------------------------
// Reverse: the same transfers with the directions swapped, received sums added in source order.

void TileExchange::check_reverse_allowed() const {
  TESSERA_CHECK(!has_replicas_,
                "TileExchange::reverse over {}: held boxes have replicas (their sum would need a reduction "
                "over each replica group)",
                comm_.name());
  TESSERA_CHECK(pending_ == Pending::None, "TileExchange::start_reverse while another exchange is in flight");
}

void TileExchange::start_reverse(const Tensor& needed_in, Tensor& held_out, bool accumulate) {
  check_reverse_allowed();
  TESSERA_CHECK(&needed_in != &held_out, "TileExchange::reverse: needed_in and held_out are the same tensor");
  const Box& mine = held_box();
  const Box& need = needed_box();
  check_tile(needed_in, need, "reverse's needed_in");
  check_device(needed_in, "reverse's needed_in");
  if (accumulate) {
    check_tile(held_out, mine, "reverse's accumulated held_out");
    check_device(held_out, "reverse's accumulated held_out");
    if (held_out.numel() == 0) held_out.resize(Shape(mine.extent, global_.kinds()), device_);
  } else {
    held_out.resize(Shape(mine.extent, global_.kinds()), device_);
    // finish copies this rank's own part over its local box (a halo's: all of it); the rest starts at zero.
    if (!holds_own_tile()) held_out.zero();
  }
  overwrite_ = !accumulate;
  in_place_ = false;
  TESSERA_CHECK(needed_in.numel() == 0 || held_out.numel() == 0 || needed_in.data() != held_out.data(),
                "TileExchange::reverse: needed_in and held_out share memory");
  target_ = held_out;
  send_reverse(needed_in);
}

void TileExchange::start_reverse_in_place(Tensor& window) {
  check_reverse_allowed();
  TESSERA_CHECK(holds_own_tile(), "TileExchange::reverse in place: the needed box {} does not hold the held box {}",
                box_string(needed_box()), box_string(held_box()));
  check_tile(window, needed_box(), "reverse's window");
  check_device(window, "reverse's window");
  overwrite_ = true;
  in_place_ = true;
  target_ = window;
  send_reverse(window);
}

void TileExchange::send_reverse(const Tensor& needed_in) {
  const Box& need = needed_box();
  source_ = needed_in;
  pending_ = Pending::Reverse;

  const auto sending = static_cast<std::size_t>(recv_elements()), receiving = static_cast<std::size_t>(send_elements());
  float* packed = packing_area(incoming_buffer_, incoming_gpu_, sending);
  for (const auto& t : incoming_) copy_box(t.region, needed_in.data(), need, packed + t.offset, t.region, device_);
  stage_to_host(incoming_buffer_, incoming_gpu_);
  post(incoming_, message_area(incoming_buffer_, incoming_gpu_, sending), outgoing_,
       message_area(outgoing_buffer_, outgoing_gpu_, receiving));
  if (transport_ == Transport::AllToAllV && !comm_.moves_gpu_memory())
    comm_.alltoallv(incoming_buffer_.data(), incoming_counts_, incoming_displs_, outgoing_buffer_.data(),
                    outgoing_counts_, outgoing_displs_, DType::F32);
}

void TileExchange::finish_reverse() {
  TESSERA_CHECK(pending_ == Pending::Reverse, "TileExchange::finish_reverse without start_reverse");
  wait_all();
  const Box& mine = held_box();
  const float* messages = received(outgoing_buffer_, outgoing_gpu_);
  if (in_place_) {
    // This rank's own contribution is in place; the others in ascending source rank.
    for (const auto& t : outgoing_)
      add_box(t.region, messages + t.offset, t.region, target_.data(), needed_box(), device_);
  } else if (overwrite_) {
    // This rank's own contribution first (onto zero it is itself: a copy), then the others in
    // ascending source rank: outgoing_ is sorted by peer.
    copy_box(local_, source_.data(), needed_box(), target_.data(), mine, device_);
    for (const auto& t : outgoing_) add_box(t.region, messages + t.offset, t.region, target_.data(), mine, device_);
  } else {
    // Ascending source rank, this rank's own contribution in its place.
    bool local_done = false;
    auto add_local = [&] {
      add_box(local_, source_.data(), needed_box(), target_.data(), mine, device_);
      local_done = true;
    };
    for (const auto& t : outgoing_) {
      if (!local_done && t.peer > me_) add_local();
      add_box(t.region, messages + t.offset, t.region, target_.data(), mine, device_);
    }
    if (!local_done) add_local();
  }
  target_ = Tensor();
  source_ = Tensor();
  pending_ = Pending::None;
}

void TileExchange::finish_pending() {
  if (pending_ == Pending::Forward) finish_forward();
  if (pending_ == Pending::Reverse) finish_reverse();
}

void TileExchange::reverse(const Tensor& needed_in, Tensor& held_out, bool accumulate) {
  start_reverse(needed_in, held_out, accumulate);
  finish_reverse();
}

}  // namespace tessera
