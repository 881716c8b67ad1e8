// The synchronization modes' update rules (docs/sync.md gives them with their sources).
#include "tessera/parallel/synchronizer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "tessera/core/error.hpp"
#include "tessera/core/log.hpp"
#include "tessera/parallel/flat_pack.hpp"
#include "tessera/parallel/plan.hpp"

namespace tessera {
namespace {

constexpr std::size_t kFloat = sizeof(float);

bool one_of(const std::string& mode, std::initializer_list<const char*> modes) {
  return std::any_of(modes.begin(), modes.end(), [&](const char* m) { return mode == m; });
}

}  // namespace

Synchronizer::Synchronizer(const SyncOptions& sync, int groups, Communicator& world, CommDelay delay)
    : sync_(sync), groups_(groups) {
  check_sync(sync_, groups_);
  if (groups_ < 1 || world.size() % groups_ != 0)
    fail("synchronizer: {} ranks do not form {} replica groups", world.size(), groups_);
  const ReplicaPlace place = replica_place(world.rank(), world.size(), groups_);
  group_ = place.group;
  across_ = delayed(world.split(place.rank, group_), delay);
  all_ = delayed(world.duplicate(), delay);
  control_ = world.duplicate();
  if (sync_.mode == "eager") {  // the rounds' agent thread has communicators of its own
    rounds_ = across_->duplicate();
    within_ = world.split(group_, place.rank);
  }
}

Synchronizer::~Synchronizer() {
  partial_.reset();  // every rank took the same last round
  // Every rank started the same sums and posted the same flags: waiting for them completes.
  for (auto& p : pending_)
    if (p.request) p.request->wait();
  for (auto& p : posted_) p->request->wait();
}

bool Synchronizer::agree(std::int64_t step, bool flag) {
  if (lag() == 0) return control_->allreduce_value(flag ? 1 : 0, ReduceOp::Max) != 0;
  auto post = std::make_unique<Posted>();
  post->step = step;
  post->flag = flag ? 1 : 0;
  post->request = control_->iallreduce(&post->flag, 1, DType::I32, ReduceOp::Max);
  posted_.push_back(std::move(post));
  if (posted_.front()->step + lag() > step) return false;
  const auto begin = std::chrono::steady_clock::now();
  posted_.front()->request->wait();
  stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  const bool any = posted_.front()->flag != 0;
  posted_.pop_front();
  return any;
}

bool Synchronizer::stale() const { return sync_.mode == "ssp" || sync_.mode == "dssp"; }

int Synchronizer::lag() const { return sync_lag(sync_); }

int Synchronizer::lowest_bound() const {
  return sync_.mode == "dssp" ? sync_.staleness_low.value_or(1) : lag();
}

bool Synchronizer::within_groups() const { return sums_within_groups(sync_); }

bool Synchronizer::groups_differ() const {
  return one_of(sync_.mode, {"local_sgd", "diloco", "easgd", "gossip"}) || (stale() && lag() > 0);
}

int Synchronizer::period() const {
  if (sync_.period) return *sync_.period;
  if (sync_.mode == "diloco") return 16;
  if (sync_.mode == "gossip") return 1;
  return 4;
}

void Synchronizer::attach(std::vector<SyncTensor> tensors) {
  tensors_ = std::move(tensors);
  offsets_.assign(1, 0);
  for (const auto& t : tensors_) {
    if (t.value == nullptr || t.grad == nullptr) fail("synchronizer: tensor '{}' has no value or gradient", t.name);
    offsets_.push_back(offsets_.back() + t.value->numel());
  }
  reset_state();
}

std::vector<Tensor*> Synchronizer::values() const {
  std::vector<Tensor*> out;
  for (const auto& t : tensors_) out.push_back(t.value);
  return out;
}

std::vector<Tensor*> Synchronizer::gradients() const {
  std::vector<Tensor*> out;
  for (const auto& t : tensors_) out.push_back(t.grad);
  return out;
}

void Synchronizer::reset_state() {
  center_ = Tensor();
  outer_momentum_ = Tensor();
  state_views_.clear();
  for (auto& p : pending_)
    if (p.request) p.request->wait();
  pending_.clear();
  pending_sums_ = Tensor();
  partial_.reset();
  held_ = Tensor();
  restored_items_.clear();
  const auto views = [&](Tensor& flat, std::int64_t at, const std::string& name) {
    for (std::size_t i = 0; i < tensors_.size(); ++i)
      state_views_.emplace_back(fmt::format("{}/{}", name, tensors_[i].name),
                                flat.slice(at + offsets_[i], at + offsets_[i + 1]).reshape(tensors_[i].value->shape()));
  };
  if (stale() && lag() > 0) {
    const int slots = lag();
    pending_.resize(static_cast<std::size_t>(slots));
    pending_sums_ = Tensor(Shape({slots * slot_size()}));
    pending_sums_.zero();
    for (int j = 0; j < slots; ++j) views(pending_sums_, j * slot_size(), fmt::format("pending/{}", j));
    intervals_.assign(static_cast<std::size_t>(groups_), 0.0f);
    return;
  }
  if (sync_.mode == "eager" && lag() > 0 && groups_ > 1) {
    held_ = Tensor(Shape({lag() * offsets_.back()}));
    held_.zero();
    for (int j = 0; j < lag(); ++j) views(held_, j * offsets_.back(), fmt::format("pending/{}", j));
    return;
  }
  if (sync_.mode != "easgd" && sync_.mode != "diloco") return;
  // One flat buffer each, so that an exchange is one collective; state() gives per-parameter views.
  center_ = pack_flat(values());
  views(center_, 0, sync_.mode == "easgd" ? "center" : "anchor");
  if (sync_.mode == "diloco") {
    outer_momentum_ = Tensor(center_.shape());
    outer_momentum_.zero();
    views(outer_momentum_, 0, "outer_momentum");
  }
}

std::vector<SyncState> Synchronizer::state() {
  // Every slot settled; one already folded in holds a zero correction, so that a resumed run,
  // which folds every slot it finds, adds nothing twice.
  for (std::size_t j = 0; j < pending_.size(); ++j) {
    settle(j);
    if (pending_[j].folded) {
      float* sum = pending_sums_.data() + static_cast<std::int64_t>(j) * slot_size();
      std::fill(sum, sum + offsets_.back(), 0.0f);
    }
  }
  // eager: each gradient not summed yet in the slot of its step (at most `staleness` of them, of
  // the last `staleness` steps).
  if (held_.defined()) {
    held_.zero();
    const std::int64_t n = offsets_.back();
    for (const auto& item : partial_ ? partial_->pending() : restored_items_)
      std::copy(item.values.begin(), item.values.end(), held_.data() + (item.step % lag()) * n);
  }
  std::vector<SyncState> out;
  for (auto& [name, view] : state_views_) out.push_back({name, &view, stale() || held_.defined()});
  return out;
}

void Synchronizer::restored(std::int64_t next) {
  if (held_.defined()) {  // the slots that hold a gradient of the steps (next − staleness, next)
    const std::int64_t n = offsets_.back();
    restored_items_.clear();
    for (std::int64_t step = std::max<std::int64_t>(next - lag(), 0); step < next; ++step) {
      const float* slot = held_.data() + (step % lag()) * n;
      if (std::all_of(slot, slot + n, [](float v) { return v == 0.0f; })) continue;
      restored_items_.push_back({step, std::vector<float>(slot, slot + n)});
    }
    return;
  }
  // Slot j holds the last step before `next` that is j mod its size (none before step 0).
  const auto slots = static_cast<std::int64_t>(pending_.size());
  for (std::int64_t step = std::max<std::int64_t>(next - slots, 0); step < next; ++step) {
    Pending& p = pending_[static_cast<std::size_t>(step % slots)];
    p.step = step;
    p.settled = true;
    p.folded = false;
  }
}

void Synchronizer::settle(std::size_t slot) {
  Pending& p = pending_[slot];
  if (p.step < 0 || p.settled) return;
  const auto begin = std::chrono::steady_clock::now();
  p.request->wait();
  p.request.reset();
  stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  const std::int64_t n = offsets_.back();
  float* sum = pending_sums_.data() + static_cast<std::int64_t>(slot) * slot_size();
  const float* own = p.own.data();
  for (std::int64_t k = 0; k < n; ++k) sum[k] -= own[k];
  if (p.step > intervals_step_) {  // every group's step interval as of that step
    std::copy(sum + n, sum + n + groups_, intervals_.begin());
    intervals_step_ = p.step;
  }
  p.settled = true;  // its own gradient's buffer stays for the slot's next step
}

int Synchronizer::choose_bound() {
  const int low = lowest_bound(), high = lag();
  if (low == high) return low;
  // DSSP's rule: the fastest group may run r* steps beyond the low bound, r* the number of its
  // own steps that fit into the slowest group's next one (its projected wait), at most high − low.
  const double mine = interval_, slowest = *std::max_element(intervals_.begin(), intervals_.end());
  if (!(mine > 0) || !(slowest > mine)) return low;
  const auto extra = static_cast<int>(std::lround(slowest / mine)) - 1;
  return low + std::clamp(extra, 0, high - low);
}

void Synchronizer::ssp_step(std::int64_t step) {
  // Each group steps on its own gradient at once; the sum over groups of step t's gradients
  // arrives while later steps compute and replaces this group's own at the first step t' with
  // t <= t' − bound(t'). So every update has applied every group's gradients up to `bound` steps
  // before it and this group's own after them (ssp: bound s; dssp: chosen in [low, high]).
  // This group's own step time: since the last step, less what it spent waiting for the others.
  const auto now = std::chrono::steady_clock::now();
  if (last_step_time_) {
    const double seconds = std::chrono::duration<double>(now - *last_step_time_).count() -
                           (stats_.wait_seconds - wait_at_last_step_);
    interval_ = interval_ > 0 ? 0.8 * interval_ + 0.2 * std::max(seconds, 0.0) : std::max(seconds, 0.0);
  }
  last_step_time_ = now;
  wait_at_last_step_ = stats_.wait_seconds;
  const auto slots = static_cast<std::int64_t>(pending_.size());
  const std::int64_t n = offsets_.back();
  // Buffers reused from step to step: this step's share of the sum, and the gradient it uses.
  pack_flat_into(gradients(), summand_);  // 1/G of this group's own mean gradient
  const Tensor& summand = summand_;
  if (!use_.defined() || use_.numel() != n) use_ = Tensor(Shape({n}));
  Tensor& use = use_;
  for (std::int64_t k = 0; k < n; ++k) use.data()[k] = summand.data()[k] * static_cast<float>(groups_);
  const int bound = choose_bound();
  if (bound != stats_.bound && sync_.mode == "dssp" && group_ == 0 && step > 0)
    log_info("dssp: staleness bound {} from step {} (step intervals: this group {:.3g} s, slowest {:.3g} s)", bound,
             step, interval_, *std::max_element(intervals_.begin(), intervals_.end()));
  stats_.bound = bound;
  // Fold in, oldest first, every step at least `bound` old whose correction is not in yet.
  std::vector<std::size_t> due;
  for (std::size_t j = 0; j < pending_.size(); ++j)
    if (pending_[j].step >= 0 && !pending_[j].folded && pending_[j].step <= step - bound) due.push_back(j);
  std::sort(due.begin(), due.end(), [&](std::size_t a, std::size_t b) { return pending_[a].step < pending_[b].step; });
  float* u = use.data();
  for (std::size_t j : due) {
    settle(j);
    const float* correction = pending_sums_.data() + static_cast<std::int64_t>(j) * slot_size();
    for (std::int64_t k = 0; k < n; ++k) u[k] += correction[k];
    pending_[j].folded = true;
    newest_folded_ = std::max(newest_folded_, pending_[j].step);
  }
  stats_.staleness = newest_folded_ >= 0 ? step - newest_folded_ : 0;
  stats_.contributors = due.empty() ? 1 : groups_;
  const auto slot = static_cast<std::size_t>(step % slots);
  Pending& p = pending_[slot];
  if (p.step >= 0 && !p.folded) fail("synchronizer: step {} would overwrite step {}, not yet folded in", step, p.step);
  float* sum = pending_sums_.data() + static_cast<std::int64_t>(slot) * slot_size();
  std::copy(summand.data(), summand.data() + n, sum);
  std::fill(sum + n, sum + slot_size(), 0.0f);
  sum[n + group_] = static_cast<float>(interval_);
  p.step = step;
  if (!p.own.defined() || p.own.numel() != n) p.own = Tensor(Shape({n}));
  for (std::int64_t k = 0; k < n; ++k) p.own.data()[k] = summand.data()[k] * static_cast<float>(groups_);
  p.settled = false;
  p.folded = false;
  p.request = across_->iallreduce(sum, static_cast<std::size_t>(slot_size()), DType::F32, ReduceOp::Sum);
  stats_.bytes += static_cast<double>(slot_size()) * kFloat;
  ++stats_.syncs;
  unpack_flat(use, gradients());
}

void Synchronizer::eager_step(std::int64_t step) {
  const auto n = static_cast<std::size_t>(offsets_.back());
  if (!partial_)
    partial_ = std::make_unique<PartialAllreduce>(*rounds_, *within_, eager_quorum(sync_, groups_), lag(), n, step,
                                                  std::move(restored_items_));
  pack_flat_into(gradients(), summand_);  // 1/G of this group's own mean gradient (the buffer is reused)
  partial_->contribute(step, summand_.data());
  const PartialRound round = partial_->result(step);
  unpack_flat(round.sum.data(), gradients());
  stats_.staleness = round.staleness;
  stats_.contributors = round.contributors;
  stats_.wait_seconds += round.wait_seconds;
  stats_.bytes += static_cast<double>(n + 2 * static_cast<std::size_t>(groups_)) * kFloat;
  ++stats_.syncs;
}

bool Synchronizer::syncs_after(std::int64_t step) const {
  if (!one_of(sync_.mode, {"local_sgd", "diloco", "easgd", "gossip"}) || groups_ == 1) return false;
  const std::int64_t start = sync_.start.value_or(0);
  if (step < start) return false;  // post-local SGD: gradients are summed until then
  return (step + 1 - start) % period() == 0;
}

double Synchronizer::before_update(std::int64_t step, const std::function<double(std::int64_t)>& schedule) {
  // Every group's gradient is in this update, unless the mode below says otherwise.
  stats_.contributors = groups_;
  if (groups_ == 1) return schedule(step);
  if (sync_.mode == "bsp") {  // the executor summed every gradient over all groups
    ++stats_.syncs;
    stats_.bytes += static_cast<double>(offsets_.back()) * kFloat;
    return schedule(step);
  }
  if (sync_.mode == "adascale") {
    stats_.gain = adascale_step();
    const double lr = stats_.gain * schedule(static_cast<std::int64_t>(std::floor(stats_.scaled_time)));
    stats_.scaled_time += stats_.gain;
    return lr;
  }
  if ((sync_.mode == "local_sgd" && step < sync_.start.value_or(0)) || (stale() && lag() == 0)) {
    sum_gradients();
    return schedule(step);
  }
  if (stale()) {
    ssp_step(step);
    return schedule(step);
  }
  if (sync_.mode == "eager") {
    eager_step(step);
    return schedule(step);
  }
  // A group's gradient summed within it is 1/G of the mean over its own samples.
  scale_gradients(static_cast<float>(groups_));
  stats_.contributors = 1;
  return schedule(step);
}

void Synchronizer::after_update(std::int64_t step) {
  if (!syncs_after(step)) return;
  if (sync_.mode == "local_sgd") average(sync_.optimizer_state.value_or(false));
  else if (sync_.mode == "diloco") diloco_step();
  else if (sync_.mode == "easgd") easgd_step();
  else if (sync_.mode == "gossip") gossip(stats_.syncs);
  ++stats_.syncs;
}

void Synchronizer::allreduce_across(Tensor& flat, bool count) {
  across_->allreduce(flat.data(), static_cast<std::size_t>(flat.numel()), DType::F32, ReduceOp::Sum);
  if (count) stats_.bytes += static_cast<double>(flat.numel()) * kFloat;
}

Tensor Synchronizer::mean_across(const Tensor& flat, bool count) {
  Tensor mean = flat.clone();
  allreduce_across(mean, count);
  float* m = mean.data();
  for (std::int64_t k = 0; k < mean.numel(); ++k) m[k] /= static_cast<float>(groups_);
  return mean;
}

void Synchronizer::sum_gradients() {
  ++stats_.syncs;
  Tensor flat = pack_flat(gradients());
  allreduce_across(flat);
  unpack_flat(flat, gradients());
}

void Synchronizer::scale_gradients(float factor) {
  for (auto& t : tensors_) {
    OnHost g(*t.grad);
    float* d = g.data();
    for (std::size_t i = 0; i < g.size(); ++i) d[i] *= factor;
  }
}

double Synchronizer::weighted_sum(const std::function<double(std::size_t)>& term) {
  double local = 0;
  for (std::size_t i = 0; i < tensors_.size(); ++i) local += tensors_[i].norm_weight * term(i);
  return all_->allreduce_value(local, ReduceOp::Sum);
}

void Synchronizer::measure_consensus(const Tensor& own, const Tensor& mean) {
  // Summed over all ranks with the norm weights: Σ_g ‖x_g − x̄‖² and G ‖x̄‖².
  std::vector<double> local{0, 0};
  const float* x = own.data();
  const float* m = mean.data();
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    double spread = 0, size = 0;
    for (std::int64_t k = offsets_[i]; k < offsets_[i + 1]; ++k) {
      const double d = static_cast<double>(x[k]) - m[k];
      spread += d * d;
      size += static_cast<double>(m[k]) * m[k];
    }
    local[0] += tensors_[i].norm_weight * spread;
    local[1] += tensors_[i].norm_weight * size;
  }
  all_->allreduce(std::span<double>(local), ReduceOp::Sum);
  stats_.consensus = local[1] > 0 ? std::sqrt(local[0] / local[1]) : 0.0;
}

std::vector<Tensor> Synchronizer::consensus(bool record) {
  // easgd's consensus is its center; the mean over groups is needed for it only to measure.
  Tensor mean = sync_.mode == "easgd" ? center_.clone() : Tensor();
  if (record || !mean.defined()) {
    const Tensor own = pack_flat(values());
    // Not counted in stats().bytes: checkpoints call it too, and a resumed run must count what the
    // uninterrupted one does.
    Tensor average = groups_ > 1 ? mean_across(own, /*count=*/false) : own.clone();
    if (record) measure_consensus(own, average);
    if (!mean.defined()) mean = std::move(average);
  }
  std::vector<Tensor> out;
  for (std::size_t i = 0; i < tensors_.size(); ++i)
    out.push_back(mean.slice(offsets_[i], offsets_[i + 1]).reshape(tensors_[i].value->shape()).clone());
  return out;
}

void Synchronizer::average(bool optimizer_state) {
  const Tensor own = pack_flat(values());
  const Tensor mean = mean_across(own);
  measure_consensus(own, mean);  // of the values before the average
  unpack_flat(mean, values());
  if (!optimizer_state) return;
  std::vector<Tensor*> state;
  for (const auto& t : tensors_) state.insert(state.end(), t.optimizer_state.begin(), t.optimizer_state.end());
  if (state.empty()) return;
  unpack_flat(mean_across(pack_flat(state)), state);
}

void Synchronizer::diloco_step() {
  // The pseudo-gradient Δ = anchor − x_g, averaged over groups, is the outer optimizer's gradient.
  const double lr = sync_.outer_lr.value_or(0.7);
  const bool nesterov = sync_.outer_optimizer.value_or("nesterov") == "nesterov";
  const double mu = sync_.outer_momentum.value_or(nesterov ? 0.9 : 0.0);
  const Tensor own = pack_flat(values());
  Tensor delta = center_.clone();
  float* d = delta.data();
  for (std::int64_t k = 0; k < delta.numel(); ++k) d[k] -= own.data()[k];
  allreduce_across(delta);
  Tensor mean = center_.clone();  // x̄ = anchor − mean Δ
  float* m = mean.data();
  for (std::int64_t k = 0; k < delta.numel(); ++k) {
    d[k] /= static_cast<float>(groups_);
    m[k] -= d[k];
  }
  measure_consensus(own, mean);
  float* anchor = center_.data();
  float* buf = outer_momentum_.data();
  for (std::int64_t k = 0; k < delta.numel(); ++k) {
    float step = d[k];
    if (mu > 0) {
      buf[k] = static_cast<float>(mu) * buf[k] + d[k];
      step = nesterov ? d[k] + static_cast<float>(mu) * buf[k] : buf[k];
    }
    anchor[k] -= static_cast<float>(lr) * step;
  }
  unpack_flat(center_, values());
}

void Synchronizer::easgd_step() {
  // Synchronous EASGD: x_g ← x_g − α (x_g − c), c ← c + α Σ_g (x_g − c), from the same old values,
  // so Σ_g x_g + c is unchanged.
  const auto alpha = static_cast<float>(sync_.easgd_alpha.value_or(0.9 / groups_));
  Tensor own = pack_flat(values());
  Tensor diff = own.clone();
  float* d = diff.data();
  const float* c = center_.data();
  for (std::int64_t k = 0; k < diff.numel(); ++k) d[k] -= c[k];
  Tensor sum = diff.clone();
  allreduce_across(sum);
  Tensor mean = center_.clone();  // x̄ = c + Σ_g (x_g − c) / G
  float* m = mean.data();
  const float* all = sum.data();
  for (std::int64_t k = 0; k < mean.numel(); ++k) m[k] += all[k] / static_cast<float>(groups_);
  measure_consensus(own, mean);  // of the values before the pull
  float* x = own.data();
  float* centre = center_.data();
  for (std::int64_t k = 0; k < own.numel(); ++k) {
    x[k] -= alpha * d[k];
    centre[k] += alpha * all[k];
  }
  unpack_flat(own, values());
}

void Synchronizer::gossip(std::int64_t round) {
  // Doubly stochastic mixing over the cross-group communicator: ring: equal weights over this
  // group and its distinct neighbours g ± 1; exponential (one peer): receive from g − 2^k and send
  // to g + 2^k, k cycling over the powers of two below G, weights 1/2.
  const int g = group_, n = groups_;
  std::vector<int> from, to;
  if (sync_.topology.value_or("exponential") == "ring") {
    for (int peer : {(g + n - 1) % n, (g + 1) % n})
      if (peer != g && std::find(from.begin(), from.end(), peer) == from.end()) from.push_back(peer);
    to = from;
  } else {
    int powers = 0;
    while ((1 << powers) < n) ++powers;
    const int offset = 1 << (round % std::max(powers, 1));
    from.push_back((g - offset % n + n) % n);
    to.push_back((g + offset) % n);
  }
  Tensor mine = pack_flat(values());
  const auto total = static_cast<std::size_t>(mine.numel());
  std::vector<Tensor> theirs;
  std::vector<Message> sends, receives;
  for (int peer : from) {
    theirs.emplace_back(Shape({static_cast<std::int64_t>(total)}));
    receives.push_back({theirs.back().data(), total, peer});
  }
  for (int peer : to) sends.push_back({mine.data(), total, peer});
  across_->exchange(sends, receives, DType::F32, 7301)->wait();
  stats_.bytes += static_cast<double>(total * kFloat * to.size());
  const auto weight = static_cast<float>(1.0 / static_cast<double>(from.size() + 1));
  float* m = mine.data();
  for (std::size_t k = 0; k < total; ++k) {
    float sum = m[k];
    for (const auto& t : theirs) sum += t.data()[k];
    m[k] = sum * weight;
  }
  unpack_flat(mine, values());
}

double Synchronizer::squared_norm(bool gradients) {
  return weighted_sum([&](std::size_t i) {
    const Tensor t = (gradients ? tensors_[i].grad : tensors_[i].value)->to(Device::host());
    double s = 0;
    for (std::int64_t k = 0; k < t.numel(); ++k) s += static_cast<double>(t.data()[k]) * t.data()[k];
    return s;
  });
}

double Synchronizer::adascale_step() {
  // Per group ĝ_g = G · (its gradient summed within the group); ḡ = Σ_g (that sum) = mean_g ĝ_g.
  // σ̂² = (Σ_g ‖ĝ_g‖² − G ‖ḡ‖²) / (G − 1) and μ̂² = ‖ḡ‖² − σ̂² / G (unbiased for the variance of one
  // group's gradient and the squared norm of the true gradient); their moving averages give
  // r = (σ² + μ²) / (σ²/G + μ²), which lies in [1, G] whenever σ² ≥ 0 and μ² > 0.
  const double G = groups_;
  const double group_sq = squared_norm(true) * G * G;  // Σ_g ‖ĝ_g‖²
  sum_gradients();
  const double mean_sq = squared_norm(true) / G;       // every group holds ḡ
  const double variance = std::max((group_sq - G * mean_sq) / (G - 1), 0.0);
  const double square = std::max(mean_sq - variance / G, 0.0);
  const double theta = std::max(1.0 - G / 1000.0, 0.0);
  stats_.gain_variance = theta * stats_.gain_variance + (1 - theta) * variance;
  stats_.gain_square = theta * stats_.gain_square + (1 - theta) * square;
  ++stats_.gain_updates;
  const double debias = 1 - std::pow(theta, static_cast<double>(stats_.gain_updates));
  const double var = stats_.gain_variance / debias, sq = stats_.gain_square / debias;
  if (!(sq > 0)) return var > 0 ? G : 1.0;
  return std::clamp((var + sq) / (var / G + sq), 1.0, G);
}

}  // namespace tessera
