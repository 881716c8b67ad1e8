// Checkpoint/restart in one process per rank: a run interrupted by a checkpoint and a restore into
// fresh objects continues bit-identically (same ranks) or within rounding (another rank count);
// corrupt, truncated, incomplete and foreign checkpoints are refused, naming the file, and skipped
// by find_resume_checkpoint; a failed restore changes nothing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "training_test_util.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/io/checkpoint.hpp"
#include "tessera/parallel/mpi_communicator.hpp"
#include "tessera/train/checkpoint.hpp"
#include "tessera/train/executor.hpp"
#include "tessera/train/optimizer.hpp"

namespace tessera {
namespace {
using testing::relative_error;
using testing::synthetic_batch;
namespace fs = std::filesystem;

constexpr std::uint64_t kSeed = 7;


struct Case {
  std::string model_file;
  std::int64_t batch;
  OptimizerConfig optimizer;
  double lr;
};

Case residual_adam() {
  OptimizerConfig adam;
  adam.type = "adam";
  return {"residual_cnn.yaml", 16, adam, 1e-3};
}
Case fashion_sgd() {
  OptimizerConfig sgd;
  sgd.momentum = 0.9;
  return {"fashion_cnn.yaml", 22, sgd, 0.05};
}

/// A model, executor and optimizer on `comm`, initialized with `init_seed`.
struct Trainee {
  Case c;
  std::unique_ptr<Model> model;
  std::unique_ptr<Executor> executor;
  std::unique_ptr<Optimizer> optimizer;

  Trainee(const Case& the_case, std::shared_ptr<Communicator> comm, std::uint64_t init_seed = kSeed) : c(the_case) {
    model = std::make_unique<Model>(Model::load(std::string(TESSERA_SOURCE_DIR) + "/models/" + c.model_file));
    model->init_parameters(init_seed);
    ExecutorOptions options;
    options.global_batch = c.batch;
    options.seed = kSeed;
    options.reducer.bucket_bytes = 64 << 10;
    executor = std::make_unique<Executor>(*model, Plan::sample_parallel(comm->size()), comm, options);
    optimizer = create_optimizer(c.optimizer);
  }
  std::vector<double> train(int from, int to) {
    std::vector<double> losses;
    const auto params = model->parameters();
    Tensor inputs, labels;
    for (int step = from; step < to; ++step) {
      synthetic_batch(model->sample_shape(), c.batch, step, inputs, labels);
      const auto [begin, end] = executor->local_samples(c.batch);
      const BatchResult r = executor->train_step(inputs.slice(begin, end).clone(), labels.slice(begin, end).clone(),
                                                 c.batch, step);
      losses.push_back(r.mean_loss());
      optimizer->step(params, c.lr);
    }
    return losses;
  }
  CheckpointMeta meta(std::int64_t step) const { return {step, 0, c.batch, kSeed, "sample-parallel"}; }
  std::string save(const std::string& dir, std::int64_t step, int keep = 3) {
    return save_checkpoint(dir, *model, *executor, *optimizer, meta(step), keep);
  }
  std::int64_t restore(const std::string& path) {
    return restore_checkpoint(path, *model, *executor, *optimizer, meta(0)).step;
  }
  /// Parameters, optimizer state and buffers, copied.
  std::vector<Tensor> state() {
    std::vector<Tensor> out;
    for (auto* p : model->parameters()) out.push_back(p->value.clone());
    for (auto& [name, t] : optimizer->state()) out.push_back(t->clone());
    for (auto& node : model->nodes())
      for (Tensor* b : node.layer->buffers()) out.push_back(b->clone());
    return out;
  }
};

bool bit_identical(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(float)) == 0;
}


/// A fresh folder shared by the ranks of `world`.
std::string fresh_dir(Communicator& world, const std::string& what) {
  std::int64_t pid = static_cast<std::int64_t>(::getpid());
  world.broadcast(std::span<std::int64_t>(&pid, 1), 0);
  const std::string dir = (fs::temp_directory_path() / fmt::format("tessera_ckpt_{}_{}_np{}", what, pid, world.size())).string();
  if (world.rank() == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  world.barrier();
  return dir;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

template <typename F> std::string input_error_of(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.message();
  }
  return "(no InputError)";
}

void expect_bit_identical_resume(const Case& c) {
  auto world = MpiCommunicator::world();
  const std::string dir = fresh_dir(*world, "bits");
  Trainee full(c, world);
  const auto all = full.train(0, 6);
  const auto full_state = full.state();

  std::string path;
  {
    Trainee first(c, world);
    const auto before = first.train(0, 3);
    for (int s = 0; s < 3; ++s) EXPECT_EQ(before[static_cast<std::size_t>(s)], all[static_cast<std::size_t>(s)]);
    path = first.save(dir, 3);
  }
  EXPECT_EQ(path, dir + "/ckpt-00000003.h5");
  Trainee second(c, world, /*init_seed=*/12345);  // other weights: the restore must replace them all
  EXPECT_EQ(second.restore(path), 3);
  const auto after = second.train(3, 6);
  for (int s = 0; s < 3; ++s)
    EXPECT_EQ(after[static_cast<std::size_t>(s)], all[static_cast<std::size_t>(s + 3)])
        << c.model_file << " step " << s + 3 << " on " << world->size() << " ranks";
  const auto resumed_state = second.state();
  ASSERT_EQ(resumed_state.size(), full_state.size());
  for (std::size_t i = 0; i < full_state.size(); ++i)
    EXPECT_TRUE(bit_identical(full_state[i], resumed_state[i])) << c.model_file << " state tensor " << i;
  EXPECT_EQ(second.optimizer->steps_taken(), 6);
  world->barrier();
  if (world->rank() == 0) fs::remove_all(dir);
}

TEST(Checkpoint, ResumeIsBitIdenticalResidualCnnAdam) { expect_bit_identical_resume(residual_adam()); }
TEST(Checkpoint, ResumeIsBitIdenticalFashionCnnSgdMomentum) { expect_bit_identical_resume(fashion_sgd()); }

TEST(Checkpoint, RestoreOnAnotherRankCount) {
  const Case c = residual_adam();
  auto world = MpiCommunicator::world();
  std::shared_ptr<Communicator> self = world->split(world->rank(), 0);
  const std::string dir = fresh_dir(*world, "ranks");
  Trainee full(c, world);
  const auto all = full.train(0, 6);
  const auto full_state = full.state();
  const auto check = [&](Trainee& t, const std::vector<double>& losses, const char* what) {
    for (int s = 0; s < 3; ++s)
      EXPECT_NEAR(losses[static_cast<std::size_t>(s)], all[static_cast<std::size_t>(s + 3)],
                  1e-5 * std::fabs(all[static_cast<std::size_t>(s + 3)]))
          << what << " step " << s + 3;
    const auto state = t.state();
    for (std::size_t i = 0; i < state.size(); ++i) EXPECT_LT(relative_error(full_state[i], state[i]), 1e-5) << what << " " << i;
  };
  // N -> 1: written by this job's ranks, restored by each rank alone.
  std::string path;
  {
    Trainee writer(c, world);
    writer.train(0, 3);
    path = writer.save(dir + "/n", 3);
  }
  {
    Trainee alone(c, self, 999);
    EXPECT_EQ(alone.restore(path), 3);
    check(alone, alone.train(3, 6), "N -> 1");
  }
  // 1 -> N: written by rank 0 alone, restored on this job's ranks.
  if (world->rank() == 0) {
    Trainee writer(c, self);
    writer.train(0, 3);
    writer.save(dir + "/one", 3);
  }
  world->barrier();
  Trainee many(c, world, 999);
  EXPECT_EQ(many.restore(dir + "/one/ckpt-00000003.h5"), 3);
  check(many, many.train(3, 6), "1 -> N");
  world->barrier();
  if (world->rank() == 0) fs::remove_all(dir);
}

TEST(Checkpoint, ChecksumIsOrderIndependent) {
  const std::vector<std::int64_t> shape{4, 3, 5};
  std::vector<float> data(60);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(i) * 0.37f - 3;
  const Box whole{{0, 0, 0}, {4, 3, 5}};
  const Box top{{0, 0, 0}, {1, 3, 5}}, bottom{{1, 0, 0}, {3, 3, 5}};
  EXPECT_EQ(dataset_checksum(shape, whole, data.data()),
            dataset_checksum(shape, bottom, data.data() + 15) + dataset_checksum(shape, top, data.data()));
  std::vector<float> swapped = data;
  std::swap(swapped[3], swapped[4]);
  EXPECT_NE(dataset_checksum(shape, whole, data.data()), dataset_checksum(shape, whole, swapped.data()));
}

TEST(Checkpoint, BadFilesAreRefusedAndSkipped) {
  auto world = MpiCommunicator::world();
  const std::string dir = fresh_dir(*world, "bad");
  Trainee t(fashion_sgd(), world);
  t.train(0, 2);
  const std::string good = t.save(dir, 2, /*keep=*/0);
  t.train(2, 3);
  const std::string corrupt = t.save(dir, 3, 0);
  t.train(3, 4);
  const std::string truncated = t.save(dir, 4, 0);
  EXPECT_EQ(find_resume_checkpoint(dir, *world), truncated);

  // Flip bytes in the middle of a dataset's data.
  const auto [offset, size] = CheckpointReader(corrupt, *world).tensor_file_extent("param/conv1.weight");
  ASSERT_GT(offset, 0);
  ASSERT_GT(size, 16);
  if (world->rank() == 0) {
    std::fstream f(corrupt, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(offset + size / 2);
    char bytes[4];
    f.read(bytes, 4);
    for (char& b : bytes) b = static_cast<char>(~b);
    f.seekp(offset + size / 2);
    f.write(bytes, 4);
  }
  // Cut a file in half.
  if (world->rank() == 0) fs::resize_file(truncated, fs::file_size(truncated) / 2);
  // A kill during a write: the .tmp is left (and ignored), and a file without the complete marker.
  {
    CheckpointWriter w(dir, checkpoint_name(5), *world);
    const float x[2] = {1, 2};
    w.write_tensor("param/x", {2}, Box{{0}, {2}}, x, world->rank() == 0);
  }
  world->barrier();
  EXPECT_TRUE(fs::exists(dir + "/ckpt-00000005.h5.tmp"));
  const std::string incomplete = dir + "/ckpt-00000006.h5";
  if (world->rank() == 0) fs::copy_file(dir + "/ckpt-00000005.h5.tmp", incomplete);
  // Not HDF5 at all.
  const std::string text = dir + "/ckpt-00000007.h5";
  if (world->rank() == 0) std::ofstream(text) << "not a checkpoint\n";
  world->barrier();

  std::string message = input_error_of([&] { CheckpointReader(corrupt, *world).verify(); });
  EXPECT_NE(message.find(corrupt), std::string::npos) << message;
  EXPECT_NE(message.find("param/conv1.weight"), std::string::npos) << message;
  EXPECT_NE(message.find("corrupt"), std::string::npos) << message;
  message = input_error_of([&] { CheckpointReader(truncated, *world).verify(); });
  EXPECT_NE(message.find(truncated), std::string::npos) << message;
  message = input_error_of([&] { CheckpointReader(incomplete, *world).verify(); });
  EXPECT_NE(message.find(incomplete), std::string::npos) << message;
  EXPECT_NE(message.find("incomplete"), std::string::npos) << message;
  message = input_error_of([&] { CheckpointReader(text, *world); });
  EXPECT_NE(message.find(text), std::string::npos) << message;
  EXPECT_NE(message.find("not HDF5"), std::string::npos) << message;
  message = input_error_of([&] {
    CheckpointReader r(good, *world);
    float out[4];
    r.read_tensor("param/nope", Box{{0}, {4}}, out);
  });
  EXPECT_NE(message.find(good), std::string::npos) << message;
  EXPECT_NE(message.find("param/nope"), std::string::npos) << message;

  // Newest first: 7 (text), 6 (incomplete), 4 (truncated), 3 (corrupt) are skipped; 2 is good.
  EXPECT_EQ(find_resume_checkpoint(dir, *world), good);

  // A failed restore changes nothing, in memory or on disk.
  const auto state = t.state();
  const std::string bytes = file_bytes(corrupt);
  message = input_error_of([&] { t.restore(corrupt); });
  EXPECT_NE(message.find(corrupt), std::string::npos) << message;
  EXPECT_EQ(file_bytes(corrupt), bytes);
  const auto after = t.state();
  for (std::size_t i = 0; i < state.size(); ++i) EXPECT_TRUE(bit_identical(state[i], after[i])) << i;
  world->barrier();
  if (world->rank() == 0) fs::remove_all(dir);
}

TEST(Checkpoint, AnotherModelOrBatchIsRefused) {
  auto world = MpiCommunicator::world();
  const std::string dir = fresh_dir(*world, "other");
  Trainee residual(residual_adam(), world);
  const std::string path = residual.save(dir, 0);
  const std::string bytes = file_bytes(path);
  Trainee fashion(fashion_sgd(), world);
  const auto state = fashion.state();
  std::string message = input_error_of([&] { fashion.restore(path); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("another model"), std::string::npos) << message;
  EXPECT_NE(message.find("layer 1"), std::string::npos) << message;
  const auto after = fashion.state();
  for (std::size_t i = 0; i < state.size(); ++i) EXPECT_TRUE(bit_identical(state[i], after[i])) << i;
  EXPECT_EQ(file_bytes(path), bytes);

  Trainee same(residual_adam(), world);
  CheckpointMeta other = same.meta(0);
  other.global_batch = 32;
  message = input_error_of([&] { restore_checkpoint(path, *same.model, *same.executor, *same.optimizer, other); });
  EXPECT_NE(message.find("global batch 16"), std::string::npos) << message;
  other = same.meta(0);
  other.seed = 8;
  message = input_error_of([&] { restore_checkpoint(path, *same.model, *same.executor, *same.optimizer, other); });
  EXPECT_NE(message.find("seed 7"), std::string::npos) << message;
  world->barrier();
  if (world->rank() == 0) fs::remove_all(dir);
}

TEST(Checkpoint, KeepsTheNewestAndWritesLatest) {
  auto world = MpiCommunicator::world();
  const std::string dir = fresh_dir(*world, "keep");
  Trainee t(fashion_sgd(), world);
  for (int step = 1; step <= 5; ++step) t.save(dir, step, /*keep=*/2);
  world->barrier();
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"ckpt-00000004.h5", "ckpt-00000005.h5", "latest"}));
  std::string latest;
  std::getline(std::ifstream(dir + "/latest"), latest);
  EXPECT_EQ(latest, "ckpt-00000005.h5");
  world->barrier();
  if (world->rank() == 0) fs::remove_all(dir);
}

}  // namespace
}  // namespace tessera
