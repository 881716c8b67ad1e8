#pragma once
// One mechanism for halo exchange and redistribution. A global row-major float32 tensor is held in
// tiles: rank r holds box `held[r]` as a dense local tensor. Each rank wants box `needed[r]`, which
// may overlap other ranks' needed boxes and may reach outside the global tensor (zero padding).
//   - halo exchange: needed = held grown by the halo; the messages go to the neighbours whose held
//     boxes touch the halo (faces, edges and corners fall out of the box intersections);
//   - redistribution: needed = the tile of another distribution (D-split to H-split, spatial to
//     sample split), every rank may talk to every other;
//   - replication: every rank needs everything (an allgather).
// Every rank knows every box, so the plan (who sends which sub-box to whom) is computed locally,
// with no communication. Forward gathers needed tiles from their holders; reverse is its adjoint
// (gradients over needed boxes are summed into their holders, in a fixed order).
#include <cstdint>
#include <memory>
#include <vector>

#include "tessera/core/communicator.hpp"
#include "tessera/tensor/box.hpp"
#include "tessera/tensor/shape.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {

class TileExchange {
 public:
  enum class Transport {
    PointToPoint,  ///< isend/irecv to and from the ranks with non-empty intersections only
    AllToAllV,     ///< the same plan executed as exactly one alltoallv on the communicator
  };
  /// The executor redistributes with one alltoallv on jobs of up to this many ranks and point to
  /// point above, where an alltoallv's (P - 1) latencies would dominate (the planner prices the same).
  static constexpr int kAllToAllVUpTo = 16;

  /// `held.size() == needed.size() == comm.size()`; boxes have the rank of `global` (1 to 6).
  /// Held boxes lie inside `global` and are disjoint, except that identical boxes may repeat
  /// (replicas): forward then takes each element from one replica: the receiver itself when it is one,
  /// else replica `k % count` for the k-th rank (in rank order) outside the group, so the load is
  /// spread over the replicas. Empty held boxes hold nothing. Every element of every needed box that
  /// lies inside `global` must be held by someone. The checks cover every rank's boxes, so every rank
  /// throws the same error. `tag` separates concurrent exchanges on one communicator of host
  /// memory; NCCL has no tags, so over one of GPU memory messages match in the order exchanges
  /// start (the executor has one in flight at a time, started in the same order on every rank).
  /// `comm` must outlive the exchange.
  TileExchange(Communicator& comm, Shape global, std::vector<Box> held, std::vector<Box> needed,
               Transport transport = Transport::PointToPoint, int tag = 0);
  ~TileExchange();
  TileExchange(const TileExchange&) = delete;
  TileExchange& operator=(const TileExchange&) = delete;

  /// Where the tensors given to and filled by forward and reverse live (default: the host).
  /// Outputs are allocated there. On a GPU the messages are packed and unpacked there (box
  /// kernels). With a communicator of GPU memory (NCCL) they travel straight from and to GPU
  /// buffers, as one group of sends and receives (either transport) on the communication stream,
  /// so they overlap compute queued after start; with one of host memory (MPI) only the packed
  /// messages are staged through host buffers: one copy of the halo each way, not of the tile.
  /// A communicator of GPU memory needs a GPU here (refused otherwise).
  void set_device(Device device);
  Device device() const { return device_; }

  /// True when every rank needs exactly the box it holds: forward/reverse are plain copies, no messages.
  bool is_identity() const { return identity_; }
  /// True when some held boxes repeat (forward only).
  bool has_replicas() const { return has_replicas_; }
  Transport transport() const { return transport_; }
  const Shape& global_shape() const { return global_; }
  /// This rank's boxes.
  const Box& held_box() const;
  const Box& needed_box() const;
  /// The part of needed_box() this rank takes from its own held box (start_forward copies it
  /// before any message arrives; may be empty).
  const Box& local_box() const { return local_; }

  /// Forward (gather): `needed_out` is resized to needed_box().extent and filled: elements inside the
  /// global tensor from their holders, elements outside with `fill`. `held_in` has extents
  /// held_box().extent (any empty tensor when that box is empty). start posts the receives, packs and
  /// posts the sends (with AllToAllV: runs the alltoallv) and copies the local overlap; `held_in` may
  /// change after start. finish waits and unpacks into `needed_out`, which must stay alive until then.
  void start_forward(const Tensor& held_in, Tensor& needed_out, float fill = 0.0f);
  void finish_forward();
  void forward(const Tensor& held_in, Tensor& needed_out, float fill = 0.0f);

  /// Reverse (the adjoint, for gradients): each element of `needed_in` (extents needed_box().extent)
  /// that lies inside the global tensor is summed into its holder; elements outside are dropped.
  /// `held_out` is resized to held_box().extent and overwritten, or added to when `accumulate` (then it
  /// must already have that shape). Overwritten, an element is this rank's own contribution (a copy,
  /// or zero where it has none) plus the others' in ascending source rank; accumulated, the
  /// contributions are added to it in ascending source rank, this rank's own in its place. So results
  /// are reproducible and equal for both transports. Refused when held boxes have replicas.
  /// `needed_in` (its local part is taken in finish) and `held_out` must stay alive and unchanged
  /// until finish_reverse.
  void start_reverse(const Tensor& needed_in, Tensor& held_out, bool accumulate = false);
  void finish_reverse();
  /// Finishes whichever exchange is in flight (none: nothing).
  void finish_pending();
  void reverse(const Tensor& needed_in, Tensor& held_out, bool accumulate = false);

  /// Whether this rank's needed box holds its whole held box (local_box() == held_box()): then
  /// the held tile can live inside the needed one, and the in-place exchanges below apply.
  bool holds_own_tile() const;
  /// Forward in place: `window` (extents needed_box().extent) already holds this rank's held
  /// tile at its place, written there by its producer; the other ranks' parts and the padding
  /// are filled in as forward fills them. finish_forward ends it. Refused unless holds_own_tile().
  void start_forward_in_place(Tensor& window, float fill = 0.0f);
  /// Reverse in place: the held gradient is the part of `window` (the needed box's gradient)
  /// at the held box: the other ranks' contributions are added into it in ascending source rank
  /// (this rank's own first: reverse's overwriting order, so the same values to the bit).
  /// finish_reverse ends it. Refused unless holds_own_tile(), and with replicas.
  void start_reverse_in_place(Tensor& window);

  /// Elements this rank sends to other ranks per forward (reverse receives as many).
  std::int64_t send_elements() const;
  /// Elements this rank receives from other ranks per forward (reverse sends as many).
  std::int64_t recv_elements() const;
  /// Number of other ranks this rank exchanges messages with.
  int peers() const;
  /// Those ranks, ascending.
  std::vector<int> peer_ranks() const;

 private:
  /// One message: a sub-box (global coordinates) to or from `peer`, packed at `offset` in a buffer.
  struct Transfer {
    int peer = -1;
    Box region;
    std::int64_t offset = 0;
    std::int64_t count = 0;
  };
  enum class Pending { None, Forward, Reverse };

  void plan();
  /// Messages are staged through host buffers: tensors on a GPU, a communicator of host memory.
  bool staged() const;
  /// `gpu` resized on device_ to hold `elements` (at least one).
  float* gpu_buffer(Tensor& gpu, std::size_t elements);
  /// Where `elements` floats of messages are packed: the host buffer on the host, else the GPU one
  /// (the host buffer is sized too when staged).
  float* packing_area(std::vector<float>& host, Tensor& gpu, std::size_t elements);
  /// Where the communicator sends them from or receives them into (sized to `elements`).
  float* message_area(std::vector<float>& host, Tensor& gpu, std::size_t elements);
  /// When staged: the packed messages from the GPU buffer to the host one.
  void stage_to_host(std::vector<float>& host, const Tensor& gpu);
  /// Where received messages are unpacked from (when staged: copied to the GPU buffer first).
  const float* received(std::vector<float>& host, Tensor& gpu);
  /// A tensor given to the exchange must be where it works (empty ones anywhere).
  void check_device(const Tensor& tensor, const char* what) const;
  /// The messages of one direction as one grouped exchange (none when an alltoallv over host
  /// memory carries them instead).
  void post(const std::vector<Transfer>& sends, float* send_area, const std::vector<Transfer>& receives,
            float* receive_area);
  void wait_all();
  /// Forward's start from the held tile `held_in` into `needed_out`, or (null) in place in
  /// `needed_out`, which holds it.
  void send_forward(const Tensor* held_in, Tensor& needed_out, float fill);
  /// Refuses a reverse with replicas or while another exchange is in flight.
  void check_reverse_allowed() const;
  /// Reverse's start: packs and posts the contributions of `needed_in` to the other ranks.
  void send_reverse(const Tensor& needed_in);

  Communicator& comm_;
  Shape global_;
  std::vector<Box> held_;
  std::vector<Box> needed_;
  Transport transport_;
  int tag_;
  int me_;
  bool identity_ = true;
  bool has_replicas_ = false;

  // The plan for this rank, transfers sorted by peer (at most one per peer and direction).
  /// Sub-boxes of this rank's held box that other ranks need (forward sends, reverse receives).
  std::vector<Transfer> outgoing_;
  /// Sub-boxes of this rank's needed box held by other ranks (forward receives, reverse sends).
  std::vector<Transfer> incoming_;
  /// The part of the needed box this rank takes from its own held box (may be empty).
  Box local_;
  /// Parts of the needed box outside the global tensor (filled with `fill` by forward).
  std::vector<Box> outside_;
  /// Per-peer counts and displacements for AllToAllV (empty for PointToPoint).
  std::vector<std::int64_t> outgoing_counts_, outgoing_displs_, incoming_counts_, incoming_displs_;

  // Buffers and state reused between calls.
  std::vector<float> outgoing_buffer_, incoming_buffer_;
  std::vector<std::unique_ptr<CommRequest>> requests_;
  /// The messages of the exchange in flight (see post).
  std::vector<Message> sends_, receives_;
  Pending pending_ = Pending::None;
  Tensor target_;  ///< shares memory with the tensor being written (needed_out / held_out)
  Tensor source_;  ///< reverse: shares memory with needed_in (its local part is taken in finish)
  bool overwrite_ = false;  ///< reverse: held_out is overwritten (this rank's own part copied first)
  bool in_place_ = false;   ///< reverse: target_ is the window, holding the held gradient in place
  Device device_ = Device::host();
  /// On a GPU: the packed messages there (sent by NCCL, or staged through the host buffers above).
  Tensor outgoing_gpu_, incoming_gpu_;
};

}  // namespace tessera
