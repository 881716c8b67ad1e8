// Synchronization modes across replica groups (synchronizer.hpp), each against the guarantee it
// states: local_sgd with period 1 equals bsp, diloco with outer SGD at lr 1 equals local_sgd,
// averaging happens exactly on schedule, easgd conserves the sum of the groups and the center,
// gossip keeps the mean and its consensus distance falls geometrically, AdaScale's gain is the
// paper's estimate and lies in [1, S], ssp and eager sum every gradient exactly once within their
// bound. At 1-4 ranks (one group at 1 rank: nothing crosses groups).
#include <numeric>

#include "invariant_harness.hpp"
#include <chrono>
#include <thread>

#include "tessera/parallel/straggler.hpp"
#include "tessera/parallel/synchronizer.hpp"
#include "tessera/train/trainer.hpp"

namespace tessera::testing {
namespace {

constexpr std::int64_t kBatch = 8;

SyncOptions mode(const std::string& name, std::optional<int> period = std::nullopt) {
  SyncOptions s;
  s.mode = name;
  s.period = period;
  return s;
}

/// Trains cosmo_style_model under `plan_text` on every rank of the job, as replica groups
/// synchronized by `sync`, the way the trainer does; returns this rank's weights.
std::vector<Tensor> train_synced(const std::string& plan_text, const SyncOptions& sync, int steps,
                                 const OptimizerConfig& optimizer_config = sgd_momentum()) {
  auto world = MpiCommunicator::world();
  Model model = Model::parse(cosmo_style_model(10, "softmax_cross_entropy"), "sync_test_model");
  model.init_parameters(11);
  ExecutorOptions options;
  options.global_batch = kBatch;
  options.seed = 11;
  options.within_groups = sums_within_groups(sync);
  options.reducer.bucket_bytes = 4 << 10;
  const Plan plan = Plan::parse(plan_text, "sync_test_plan");
  Executor executor(model, plan, world, options);
  auto optimizer = create_optimizer(optimizer_config);
  Synchronizer synchronizer(sync, executor.replica_groups(), *world);
  synchronizer.attach(synchronized_tensors(model, executor, *optimizer));
  const auto params = model.parameters();
  Tensor inputs, labels;
  for (int step = 0; step < steps; ++step) {
    synthetic_batch(model.sample_shape(), kBatch, step, inputs, labels);
    const auto [begin, end] = executor.local_samples(kBatch);
    executor.train_step(local_tile(inputs, begin, end, executor.input_sample_box()), labels.slice(begin, end).clone(),
                        kBatch, step);
    const double lr = synchronizer.before_update(step, [](std::int64_t) { return 0.05; });
    optimizer->step(params, lr);
    synchronizer.after_update(step);
  }
  std::vector<Tensor> weights;
  for (auto* p : params) weights.push_back(p->value.to(Device::host()).clone());
  return weights;
}

void expect_close(const std::vector<Tensor>& a, const std::vector<Tensor>& b, double tolerance) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_LT(relative_error(a[i], b[i]), tolerance) << "parameter " << i;
}

/// The plans the equalities run under: 1-rank groups, and at an even number of ranks 2-rank
/// groups split spatially and by filter.
std::vector<std::string> plans() {
  std::vector<std::string> out{"ranks: 1\ndefault: {sample: 1}\n"};
  if (ranks() % 2 == 0) {
    out.push_back("ranks: 2\ndefault: {sample: 2}\nlayers:\n  conv1: {sample: 1, spatial: [2, 1, 1]}\n"
                  "  act1: {sample: 1, spatial: [2, 1, 1]}\n  pool1: {sample: 1, spatial: [2, 1, 1]}\n");
    out.push_back("ranks: 2\ndefault: {sample: 2}\nlayers:\n  fc1: {sample: 1, filter: 2}\n");
  }
  return out;
}

TEST(SyncModes, LocalSgdWithPeriodOneEqualsBsp) {
  for (const auto& plan : plans()) {
    SCOPED_TRACE(plan);
    const auto bsp = train_synced(plan, mode("bsp"), 4);
    expect_close(train_synced(plan, mode("local_sgd", 1), 4), bsp, 1e-5);
    // Averaging the momentum too changes nothing for SGD (the update is linear in it).
    SyncOptions with_state = mode("local_sgd", 1);
    with_state.optimizer_state = true;
    expect_close(train_synced(plan, with_state, 4), bsp, 1e-5);
  }
}

TEST(SyncModes, DilocoWithOuterSgdAtLearningRateOneEqualsLocalSgd) {
  for (const auto& plan : plans()) {
    SCOPED_TRACE(plan);
    SyncOptions diloco = mode("diloco", 2);
    diloco.outer_optimizer = "sgd";
    diloco.outer_lr = 1.0;
    diloco.outer_momentum = 0.0;
    const auto local = train_synced(plan, mode("local_sgd", 2), 4);
    expect_close(train_synced(plan, diloco, 4), local, 1e-5);
    if (ranks() / Plan::parse(plan, "p.yaml").ranks() > 1) {  // groups differed between syncs: bsp is another run
      const auto bsp = train_synced(plan, mode("bsp"), 4);
      double differs = 0;
      for (std::size_t i = 0; i < bsp.size(); ++i) differs = std::max(differs, relative_error(local[i], bsp[i]));
      EXPECT_GT(differs, 1e-4);
    }
  }
}

/// One scalar tensor per rank whose gradient is unused: the synchronizer's parameter-level rules
/// alone. Value: `value(group)`.
struct OneTensor {
  Tensor value{Shape({5})}, grad{Shape({5})};
  void set(const std::function<float(std::int64_t)>& at) {
    for (std::int64_t k = 0; k < value.numel(); ++k) value.data()[k] = at(k);
  }
  std::vector<SyncTensor> tensors() { return {{"w", &value, &grad, 1.0, {}}}; }
};

/// Σ over groups of `t` (fp64), per element.
std::vector<double> sum_over_groups(const Tensor& t) {
  std::vector<double> v(t.data(), t.data() + t.numel());
  MpiCommunicator::world()->allreduce(std::span<double>(v));
  return v;
}

TEST(SyncModes, AveragingHappensExactlyOnSchedule) {
  auto world = MpiCommunicator::world();
  const int g = world->rank(), groups = world->size();
  // Post-local SGD from step 5, period 3: averages after steps 7, 10 and 13; diloco, easgd and
  // gossip with period 4: after steps 3, 7, 11.
  SyncOptions post_local = mode("local_sgd", 3);
  post_local.start = 5;
  const std::vector<std::pair<SyncOptions, std::vector<std::int64_t>>> cases{
      {post_local, {7, 10, 13}}, {mode("local_sgd", 4), {3, 7, 11}}, {mode("diloco", 4), {3, 7, 11}},
      {mode("easgd", 4), {3, 7, 11}}, {mode("gossip", 4), {3, 7, 11}}};
  for (const auto& [sync, expected] : cases) {
    SCOPED_TRACE(sync.mode);
    Synchronizer synchronizer(sync, groups, *world);
    OneTensor t;
    t.set([&](std::int64_t k) { return static_cast<float>(k); });
    synchronizer.attach(t.tensors());
    std::vector<std::int64_t> changed;
    for (std::int64_t step = 0; step < 15; ++step) {
      // Differs per group, and no group holds the mean.
      t.set([&](std::int64_t k) { return static_cast<float>(100 * g * g + k + step); });
      const Tensor before = t.value.clone();
      synchronizer.after_update(step);
      EXPECT_EQ(synchronizer.syncs_after(step), groups > 1 && std::count(expected.begin(), expected.end(), step) == 1);
      if (relative_error(before, t.value) > 0) changed.push_back(step);
    }
    EXPECT_EQ(changed, groups > 1 ? expected : std::vector<std::int64_t>{});
    EXPECT_EQ(synchronizer.stats().syncs, groups > 1 ? static_cast<std::int64_t>(expected.size()) : 0);
  }
}

TEST(SyncModes, LocalSgdAveragesTheGroups) {
  auto world = MpiCommunicator::world();
  const int g = world->rank(), groups = world->size();
  Synchronizer synchronizer(mode("local_sgd", 1), groups, *world);
  OneTensor t;
  synchronizer.attach(t.tensors());
  t.set([&](std::int64_t k) { return static_cast<float>(g * 4 + k); });
  synchronizer.after_update(0);
  for (std::int64_t k = 0; k < 5; ++k) EXPECT_FLOAT_EQ(t.value.data()[k], 2.0f * static_cast<float>(groups - 1) + k);
  if (groups > 1) {
    ASSERT_TRUE(synchronizer.stats().consensus);
    EXPECT_GT(*synchronizer.stats().consensus, 0);
  }
}

TEST(SyncModes, EasgdConservesTheSumOfGroupsAndCenter) {
  auto world = MpiCommunicator::world();
  const int g = world->rank(), groups = world->size();
  for (const double alpha : {0.3, 0.0}) {
    SCOPED_TRACE(alpha);
    SyncOptions sync = mode("easgd", 1);
    sync.easgd_alpha = alpha;
    Synchronizer synchronizer(sync, groups, *world);
    OneTensor t;
    t.set([&](std::int64_t k) { return 0.5f * static_cast<float>(k); });  // the center starts here
    synchronizer.attach(t.tensors());
    Tensor& center = *synchronizer.state().at(0).tensor;
    for (std::int64_t step = 0; step < 3; ++step) {
      t.set([&](std::int64_t k) { return static_cast<float>(std::sin(1.0 + g * 7 + k * 3 + step)); });
      const Tensor value = t.value.clone(), centre = center.clone();
      const auto before = sum_over_groups(t.value);
      synchronizer.after_update(step);
      const auto after = sum_over_groups(t.value);
      for (std::int64_t k = 0; k < 5; ++k) {
        const double total_before = before[k] + centre.data()[k], total_after = after[k] + center.data()[k];
        EXPECT_NEAR(total_after, total_before, 1e-6 * (1 + std::fabs(total_before))) << "element " << k;
      }
      if (alpha == 0.0) {  // no pull: every group keeps its own values, the center stays
        EXPECT_EQ(relative_error(t.value, value), 0.0);
        EXPECT_EQ(relative_error(center, centre), 0.0);
      } else if (groups > 1) {
        EXPECT_GT(relative_error(t.value, value), 0.0);
      }
    }
  }
}

/// ‖x_g − mean‖ summed over groups, and the mean, from the test's own fp64 sums.
std::pair<double, std::vector<double>> spread(const Tensor& t) {
  const int groups = MpiCommunicator::world()->size();
  auto mean = sum_over_groups(t);
  for (auto& m : mean) m /= groups;
  double own = 0;
  for (std::int64_t k = 0; k < t.numel(); ++k) own += std::pow(t.data()[k] - mean[static_cast<std::size_t>(k)], 2);
  return {std::sqrt(MpiCommunicator::world()->allreduce_value(own)), mean};
}

TEST(SyncModes, GossipKeepsTheMeanAndContracts) {
  auto world = MpiCommunicator::world();
  const int g = world->rank(), groups = world->size();
  constexpr double kPi = 3.14159265358979323846;
  for (const std::string topology : {"ring", "exponential"}) {
    SCOPED_TRACE(topology);
    SyncOptions sync = mode("gossip", 1);
    sync.topology = topology;
    Synchronizer synchronizer(sync, groups, *world);
    OneTensor t;
    t.set([&](std::int64_t k) { return static_cast<float>(std::cos(g * 5.0 + k)); });
    synchronizer.attach(t.tensors());
    // The ring's mixing matrix contracts the spread by its second eigenvalue each round: for G >= 3
    // max over k > 0 of |1 + 2 cos(2 pi k / G)| / 3 (0 for G = 2 and 3); the one-peer exponential
    // graph reaches the mean after log2 G rounds when G is a power of two.
    double ring_rate = 0;
    for (int k = 1; k < groups && groups > 3; ++k)
      ring_rate = std::max(ring_rate, std::fabs(1 + 2 * std::cos(2 * kPi * k / groups)) / 3);
    int log2 = 0;
    while ((1 << log2) < groups) ++log2;
    const bool power_of_two = (1 << log2) == groups;
    auto [distance, mean] = spread(t.value);
    const double initial = distance;
    if (groups > 1) {
      EXPECT_GT(initial, 0.1);
    }
    for (std::int64_t round = 0; round < 6; ++round) {
      synchronizer.gossip(round);
      const auto [next, next_mean] = spread(t.value);
      for (std::size_t k = 0; k < mean.size(); ++k) EXPECT_NEAR(next_mean[k], mean[k], 1e-6) << "round " << round;
      if (topology == "ring") EXPECT_LE(next, ring_rate * distance + 1e-6) << "round " << round;
      else EXPECT_LE(next, distance + 1e-6) << "round " << round;
      if (topology == "exponential" && power_of_two && round + 1 == log2) {
        EXPECT_LT(next, 1e-6 * (1 + initial));
      }
      distance = next;
    }
    if (groups > 1) {
      EXPECT_LT(distance, 0.05 * initial);
    }
  }
}

TEST(SyncModes, AdaScaleGainIsThePapersEstimateWithinOneAndS) {
  auto world = MpiCommunicator::world();
  const int g = world->rank(), groups = world->size();
  if (groups == 1) {  // refused with one group: nothing to estimate from
    EXPECT_THROW(Synchronizer(mode("adascale"), 1, *world), InputError);
    return;
  }
  // Identical gradients (no variance: gain 1), a signal with noise (the paper's estimate), and
  // noise alone (the estimate of ‖∇F‖² falls to 0 or below: the gain is S, its bound).
  enum Case { kIdentical, kSignal, kNoise };
  const auto gradient = [&](Case c, int group, std::int64_t k) {
    if (c == kIdentical) return 0.25 + 0.1 * static_cast<double>(k);
    if (c == kSignal) return 1.0 + 0.5 * std::sin(3.0 * group + static_cast<double>(k));
    return std::sin(3.0 * group + static_cast<double>(k)) - std::sin(3.0 * (groups - 1 - group) + static_cast<double>(k));
  };
  for (const Case c : {kIdentical, kSignal, kNoise}) {
    SCOPED_TRACE(static_cast<int>(c));
    Synchronizer synchronizer(mode("adascale"), groups, *world);
    OneTensor t;
    synchronizer.attach(t.tensors());
    // Each group's gradient as the executor leaves it: 1/G of its own mean gradient.
    std::vector<double> own(5);
    for (std::int64_t k = 0; k < 5; ++k) {
      own[static_cast<std::size_t>(k)] = gradient(c, g, k);
      t.grad.data()[k] = static_cast<float>(own[static_cast<std::size_t>(k)] / groups);
    }
    const double lr = synchronizer.before_update(0, [](std::int64_t) { return 0.1; });
    const double gain = synchronizer.stats().gain;
    // The paper's estimate from the test's own sums (the first step's moving average is the
    // estimate itself): σ² = (Σ‖ĝ_g‖² − G‖ḡ‖²)/(G − 1), μ² = ‖ḡ‖² − σ²/G, r = (σ² + μ²)/(σ²/G + μ²).
    double group_sq = 0;
    for (double v : own) group_sq += v * v;
    group_sq = world->allreduce_value(group_sq);
    double mean_sq = 0;  // after the sum every group holds ḡ
    for (std::int64_t k = 0; k < 5; ++k) mean_sq += std::pow(t.grad.data()[k], 2);
    const double variance = std::max((group_sq - groups * mean_sq) / (groups - 1), 0.0);
    const double square = mean_sq - variance / groups;
    const double expected = (variance + square) / (variance / groups + square);
    EXPECT_GE(gain, 1.0);
    EXPECT_LE(gain, static_cast<double>(groups));
    if (c == kIdentical) {
      EXPECT_NEAR(gain, 1.0, 1e-5);
    } else if (c == kSignal) {
      EXPECT_NEAR(gain, expected, 1e-4 * expected);
      EXPECT_GT(gain, 1.01);
    } else {
      EXPECT_LE(square, 1e-9);
      EXPECT_EQ(gain, static_cast<double>(groups));
    }
    EXPECT_NEAR(lr, gain * 0.1, 1e-12);
    EXPECT_DOUBLE_EQ(synchronizer.stats().scaled_time, gain);
    // The gradient the update uses is the bsp one: Σ over groups of what the executor left.
    for (std::int64_t k = 0; k < 5; ++k) {
      double sum = 0;
      for (int q = 0; q < groups; ++q) sum += gradient(c, q, k) / groups;
      EXPECT_NEAR(t.grad.data()[k], sum, 1e-5);
    }
  }
}

TEST(SyncModes, SspAndDsspWithStalenessZeroEqualBsp) {
  SyncOptions ssp = mode("ssp");
  ssp.staleness = 0;
  SyncOptions dssp = mode("dssp");
  dssp.staleness_low = dssp.staleness_high = 0;
  for (const auto& plan : plans()) {
    SCOPED_TRACE(plan);
    const auto bsp = train_synced(plan, mode("bsp"), 4);
    for (const auto& sync : {ssp, dssp}) {
      SCOPED_TRACE(sync.mode);
      const auto stale = train_synced(plan, sync, 4);
      // Two 1-rank groups add the same two gradients either way: the same to the bit.
      const bool exact = ranks() <= 2 && Plan::parse(plan, "p.yaml").ranks() == 1;
      expect_close(stale, bsp, 1e-5);
      for (std::size_t i = 0; exact && i < bsp.size(); ++i) EXPECT_EQ(relative_error(stale[i], bsp[i]), 0.0) << i;
    }
  }
}

TEST(SyncModes, SspAppliesEveryGradientOnceWithinTheBound) {
  auto world = MpiCommunicator::world();
  const int g = world->rank(), groups = world->size();
  // ssp with bounds 1 and 3; dssp choosing its bound in [1, 3] from the groups' step intervals.
  for (const int case_index : {0, 1, 2}) {
    const bool dynamic = case_index == 2;
    const int bound = case_index == 0 ? 1 : 3;
    SCOPED_TRACE(case_index);
    SyncOptions sync = mode(dynamic ? "dssp" : "ssp");
    if (dynamic) {
      sync.staleness_low = 1;
      sync.staleness_high = 3;
    } else {
      sync.staleness = bound;
    }
    Synchronizer synchronizer(sync, groups, *world);
    OneTensor t;
    synchronizer.attach(t.tensors());
    constexpr int kSteps = 9;
    const auto own = [&](int group, int step, std::int64_t k) {  // a group's own mean gradient
      return static_cast<double>(std::cos(0.7 * group + 0.3 * step + 0.11 * static_cast<double>(k)));
    };
    std::vector<double> applied(5, 0.0), produced(5, 0.0);
    for (int step = 0; step < kSteps; ++step) {
      for (std::int64_t k = 0; k < 5; ++k) t.grad.data()[k] = static_cast<float>(own(g, step, k) / groups);
      // Group 1 straggles: the others run ahead, within the bound the collectives enforce.
      if (g == 1) std::this_thread::sleep_for(std::chrono::milliseconds(3 * (step % 3)));
      synchronizer.before_update(step, [](std::int64_t) { return 0.1; });
      const std::int64_t staleness = synchronizer.stats().staleness;
      EXPECT_LE(staleness, bound) << "step " << step;
      if (dynamic && groups > 1) {
        EXPECT_GE(synchronizer.stats().bound, 1);
        EXPECT_LE(synchronizer.stats().bound, 3);
        EXPECT_LE(staleness, synchronizer.stats().bound) << "step " << step;
      } else {
        EXPECT_EQ(staleness, step >= bound && groups > 1 ? bound : 0) << "step " << step;
      }
      for (std::int64_t k = 0; k < 5; ++k) {
        applied[static_cast<std::size_t>(k)] += t.grad.data()[k];
        for (int q = 0; q < groups; ++q) produced[static_cast<std::size_t>(k)] += own(q, step, k) / groups;
      }
    }
    // What is still pending: the corrections of the last `bound` steps (Σ_g g_g − this group's own).
    for (const auto& state : synchronizer.state()) {
      EXPECT_TRUE(state.per_group);
      for (std::int64_t k = 0; k < 5 && groups > 1; ++k) applied[static_cast<std::size_t>(k)] += state.tensor->data()[k];
    }
    for (std::int64_t k = 0; k < 5; ++k)
      EXPECT_NEAR(applied[static_cast<std::size_t>(k)], produced[static_cast<std::size_t>(k)], 1e-5) << "element " << k;
  }
}

TEST(SyncModes, EagerWithStalenessZeroOrTwoGroupsOfMajorityEqualsBsp) {
  // Staleness 0 makes every round wait for every group; so does a majority of two groups.
  std::vector<SyncOptions> modes;
  for (const char* quorum : {"solo", "majority"}) {
    SyncOptions eager = mode("eager");
    eager.quorum = quorum;
    eager.staleness = 0;
    modes.push_back(eager);
  }
  for (const auto& plan : plans()) {
    SCOPED_TRACE(plan);
    const int groups = ranks() / Plan::parse(plan, "p.yaml").ranks();
    const auto bsp = train_synced(plan, mode("bsp"), 4);
    auto all = modes;
    if (groups == 2) all.push_back(mode("eager"));  // majority, staleness 4
    for (const auto& sync : all) {
      SCOPED_TRACE(sync.to_yaml());
      const auto eager = train_synced(plan, sync, 4);
      const bool exact = ranks() <= 2 && Plan::parse(plan, "p.yaml").ranks() == 1;
      expect_close(eager, bsp, 1e-5);
      for (std::size_t i = 0; exact && i < bsp.size(); ++i) EXPECT_EQ(relative_error(eager[i], bsp[i]), 0.0) << i;
    }
  }
}

TEST(SyncModes, EagerSumsEveryGradientOnceWithinTheBoundAndGroupsStayEqual) {
  auto world = MpiCommunicator::world();
  const int g = world->rank(), groups = world->size();
  for (const char* quorum : {"solo", "majority"}) {
    for (const int bound : {1, 3}) {
      SCOPED_TRACE(fmt::format("{} staleness {}", quorum, bound));
      SyncOptions sync = mode("eager");
      sync.quorum = quorum;
      sync.staleness = bound;
      constexpr int kSteps = 12;
      std::vector<double> applied(5, 0.0), produced(5, 0.0);
      int partial_rounds = 0;
      const auto own = [&](int group, int step, std::int64_t k) {
        return static_cast<double>(std::cos(0.7 * group + 0.3 * step + 0.11 * static_cast<double>(k)));
      };
      OneTensor t;
      const auto run = [&](Synchronizer& synchronizer, int first, int last) {
        for (int step = first; step < last; ++step) {
          for (std::int64_t k = 0; k < 5; ++k) t.grad.data()[k] = static_cast<float>(own(g, step, k) / groups);
          // Group 1 straggles: the rounds go on without it, within the bound.
          if (g == 1) std::this_thread::sleep_for(std::chrono::milliseconds(4 * (step % 3)));
          synchronizer.before_update(step, [](std::int64_t) { return 0.1; });
          const SyncStats& stats = synchronizer.stats();
          EXPECT_LE(stats.staleness, bound) << "step " << step;
          EXPECT_GE(stats.contributors, groups > 1 ? (std::string(quorum) == "solo" ? 1 : groups / 2 + 1) : 1);
          EXPECT_LE(stats.contributors, groups);
          partial_rounds += stats.contributors < groups;
          // Every group applies the same sum in every round.
          double mine = 0;
          for (std::int64_t k = 0; k < 5; ++k) mine = mine * 1.5 + t.grad.data()[k];
          for (double other : world->allgather_value(mine)) EXPECT_EQ(other, mine) << "step " << step;
          for (std::int64_t k = 0; k < 5; ++k) {
            applied[static_cast<std::size_t>(k)] += t.grad.data()[k];
            for (int q = 0; q < groups; ++q) produced[static_cast<std::size_t>(k)] += own(q, step, k) / groups;
          }
        }
      };
      // A run of kSteps, then one that resumes from its state (what a checkpoint holds) for 6 more.
      std::vector<Tensor> saved;
      {
        Synchronizer synchronizer(sync, groups, *world);
        synchronizer.attach(t.tensors());
        run(synchronizer, 0, kSteps);
        for (const auto& state : synchronizer.state()) {
          EXPECT_TRUE(state.per_group);
          saved.push_back(state.tensor->clone());
        }
      }
      Synchronizer resumed(sync, groups, *world);
      resumed.attach(t.tensors());
      const auto states = resumed.state();
      ASSERT_EQ(states.size(), saved.size());
      for (std::size_t i = 0; i < saved.size(); ++i) states[i].tensor->copy_from(saved[i]);
      resumed.restored(kSteps);
      run(resumed, kSteps, kSteps + 6);
      // Whatever no round summed yet is held by its group for the next (and for checkpoints).
      Tensor held(Shape({5}));
      held.zero();
      for (const auto& state : resumed.state())
        for (std::int64_t k = 0; k < 5; ++k) held.data()[k] += state.tensor->data()[k];
      const auto held_by_all = sum_over_groups(held);
      for (std::int64_t k = 0; k < 5; ++k) applied[static_cast<std::size_t>(k)] += held_by_all[static_cast<std::size_t>(k)];
      for (std::int64_t k = 0; k < 5; ++k)
        EXPECT_NEAR(applied[static_cast<std::size_t>(k)], produced[static_cast<std::size_t>(k)], 1e-5) << "element " << k;
      // Solo never waits for the sleeping group: some rounds went on without it.
      if (groups > 1 && std::string(quorum) == "solo") {
        EXPECT_GT(partial_rounds, 0);
      }
    }
  }
}

TEST(SyncModes, TheStragglerScheduleIsTheSameOnEveryRank) {
  auto world = MpiCommunicator::world();
  const int groups = std::max(world->size(), 2);
  for (const char* text : {"slow:1:3x", "random:1:50ms", "random:2:2x", "tail:10ms"}) {
    SCOPED_TRACE(text);
    const StragglerSpec spec = parse_straggler(text);
    if (spec.count > groups) continue;
    // The schedule (not its timing): every group's delay at every step for a fixed compute time.
    double mine = 0;
    std::vector<double> delays;
    for (std::int64_t step = 0; step < 200; ++step)
      for (int group = 0; group < groups; ++group) {
        delays.push_back(straggler_delay(spec, 7, step, group, groups, 0.01));
        mine = mine * 1.000001 + delays.back();
      }
    const auto all = world->allgather_value(mine);
    for (double other : all) EXPECT_EQ(other, mine);
    double total = 0;
    int delayed = 0;
    for (double d : delays) {
      total += d;
      delayed += d > 0;
    }
    const std::int64_t expected_delayed = spec.kind == StragglerSpec::Kind::Slow     ? 200  // group 1, every step
                                          : spec.kind == StragglerSpec::Kind::Random ? 200 * spec.count
                                                                                     : -1;
    if (expected_delayed >= 0) {
      EXPECT_EQ(delayed, expected_delayed);
    } else {
      EXPECT_NEAR(total / static_cast<double>(delays.size()), 0.01, 0.0015);
    }
    // Another seed draws another schedule (where there is a choice).
    if (spec.kind == StragglerSpec::Kind::Tail || (spec.kind == StragglerSpec::Kind::Random && spec.count < groups)) {
      double other = 0;
      for (std::int64_t step = 0; step < 200; ++step)
        for (int group = 0; group < groups; ++group)
          other = other * 1.000001 + straggler_delay(spec, 8, step, group, groups, 0.01);
      EXPECT_NE(other, mine);
    }
  }
}

}  // namespace
}  // namespace tessera::testing
