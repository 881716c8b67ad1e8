// Optimizers and learning-rate schedules against values computed by hand from PyTorch's update
// rules (torch.optim.SGD / Adam / AdamW; the same numbers come out of torch 1.13 in float64).
// Every test starts from w = [1, -2] and the gradients [0.5, -1], [1, 2], [0, 0] of steps 1-3.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/layers/layer.hpp"
#include "tessera/train/optimizer.hpp"
#include "tessera/train/schedule.hpp"

namespace tessera {
namespace {

// fp32 updates of values around 1: a few ulps.
constexpr double kTolerance = 2e-6;

const std::vector<std::vector<float>> kGradients = {{0.5f, -1.0f}, {1.0f, 2.0f}, {0.0f, 0.0f}};

Parameter make_parameter(const std::string& name, bool decay = true) {
  Parameter param;
  param.name = name;
  param.value = Tensor(Shape{2});
  param.grad = Tensor(Shape{2});
  param.value.data()[0] = 1.0f;
  param.value.data()[1] = -2.0f;
  param.decay = decay;
  return param;
}

void set_gradient(Parameter& param, int step) {
  param.grad.data()[0] = kGradients[static_cast<std::size_t>(step)][0];
  param.grad.data()[1] = kGradients[static_cast<std::size_t>(step)][1];
}

/// Runs `expected.size()` steps with lr 0.1 and checks the parameter after each.
void expect_trajectory(const OptimizerConfig& config, const std::vector<std::vector<double>>& expected,
                       bool decay = true) {
  auto optimizer = create_optimizer(config);
  Parameter param = make_parameter("fc.weight", decay);
  Parameter* params[] = {&param};
  for (std::size_t step = 0; step < expected.size(); ++step) {
    set_gradient(param, static_cast<int>(step));
    optimizer->step(params, 0.1);
    SCOPED_TRACE(testing::Message() << config.type << " step " << step + 1);
    EXPECT_NEAR(param.value.data()[0], expected[step][0], kTolerance);
    EXPECT_NEAR(param.value.data()[1], expected[step][1], kTolerance);
  }
  EXPECT_EQ(optimizer->steps_taken(), static_cast<std::int64_t>(expected.size()));
}

OptimizerConfig sgd(double momentum = 0, bool nesterov = false, double weight_decay = 0) {
  OptimizerConfig config;
  config.type = "sgd";
  config.momentum = momentum;
  config.nesterov = nesterov;
  config.weight_decay = weight_decay;
  return config;
}

OptimizerConfig adam(const std::string& type, double weight_decay = 0) {
  OptimizerConfig config;
  config.type = type;
  config.weight_decay = weight_decay;
  return config;
}

TEST(Sgd, Plain) {
  // p -= 0.1 g
  expect_trajectory(sgd(), {{0.95, -1.9}, {0.85, -2.1}});
}

TEST(Sgd, Momentum) {
  // buf1 = g1 = [0.5, -1]; buf2 = 0.9 buf1 + g2 = [1.45, 1.1]; buf3 = 0.9 buf2 = [1.305, 0.99]
  expect_trajectory(sgd(0.9), {{0.95, -1.9}, {0.805, -2.01}, {0.6745, -2.109}});
}

TEST(Sgd, Nesterov) {
  // step 1: d = g1 + 0.9 g1 = [0.95, -1.9]; step 2: d = g2 + 0.9 [1.45, 1.1] = [2.305, 2.99]
  expect_trajectory(sgd(0.9, true), {{0.905, -1.81}, {0.6745, -2.109}});
}

TEST(Sgd, WeightDecay) {
  // g' = g + 0.1 p: [0.6, -1.2], then [1.094, 1.812]
  expect_trajectory(sgd(0, false, 0.1), {{0.94, -1.88}, {0.8306, -2.0612}});
}

TEST(Sgd, WeightDecaySkipsParametersWithoutDecay) {
  expect_trajectory(sgd(0, false, 0.1), {{0.95, -1.9}, {0.85, -2.1}}, /*decay=*/false);
}

TEST(Sgd, MomentumWithWeightDecay) {
  // buf2 = 0.9 [0.6, -1.2] + [1.094, 1.812] = [1.634, 0.732]
  expect_trajectory(sgd(0.9, false, 0.1), {{0.94, -1.88}, {0.7766, -1.9532}});
}

TEST(Adam, ThreeSteps) {
  // Step 1 moves by lr * sign(g) (bias correction); steps 2 and 3 from m, v and t.
  expect_trajectory(adam("adam"), {{0.9, -1.9}, {0.8034818006, -1.936610353}, {0.7288729515, -1.964910262}});
}

TEST(Adam, L2WeightDecayGoesIntoTheGradient) {
  expect_trajectory(adam("adam", 0.1),
                    {{0.9, -1.9}, {0.8025029703, -1.925017878}, {0.7231797379, -1.938636981}});
}

TEST(AdamW, DecoupledWeightDecay) {
  // Step 1: p *= 1 - 0.1*0.1, then the Adam step of lr * sign(g): differs from Adam with L2 decay.
  expect_trajectory(adam("adamw", 0.1),
                    {{0.89, -1.88}, {0.7845818006, -1.897810353}, {0.7021271334, -1.907132158}});
}

TEST(AdamW, WithoutDecayEqualsAdam) {
  expect_trajectory(adam("adamw", 0.1),
                    {{0.9, -1.9}, {0.8034818006, -1.936610353}, {0.7288729515, -1.964910262}},
                    /*decay=*/false);
}

TEST(Optimizer, StateIsLazyNamedAndCounted) {
  auto optimizer = create_optimizer(adam("adam"));
  EXPECT_EQ(optimizer->type(), "adam");
  EXPECT_EQ(optimizer->state_tensors_per_parameter(), 2);
  EXPECT_TRUE(optimizer->state().empty());
  EXPECT_EQ(optimizer->state_bytes(), 0);

  Parameter weight = make_parameter("conv1.weight");
  Parameter bias = make_parameter("conv1.bias", false);
  Parameter* params[] = {&weight, &bias};
  set_gradient(weight, 0);
  set_gradient(bias, 0);
  optimizer->step(params, 0.1);
  auto state = optimizer->state();
  ASSERT_EQ(state.size(), 4u);
  EXPECT_EQ(state[0].first, "conv1.weight.exp_avg");
  EXPECT_EQ(state[1].first, "conv1.weight.exp_avg_sq");
  EXPECT_EQ(state[2].first, "conv1.bias.exp_avg");
  EXPECT_EQ(state[3].first, "conv1.bias.exp_avg_sq");
  EXPECT_NEAR(state[0].second->data()[0], 0.05, 1e-7);   // (1 - 0.9) * 0.5
  EXPECT_NEAR(state[1].second->data()[1], 0.001, 1e-9);  // (1 - 0.999) * 1
  EXPECT_EQ(optimizer->state_bytes(), 4 * 2 * 4);

  auto momentum = create_optimizer(sgd(0.9));
  EXPECT_EQ(momentum->state_tensors_per_parameter(), 1);
  momentum->step(params, 0.1);
  ASSERT_EQ(momentum->state().size(), 2u);
  EXPECT_EQ(momentum->state()[0].first, "conv1.weight.momentum");

  auto plain = create_optimizer(sgd());
  plain->step(params, 0.1);
  EXPECT_TRUE(plain->state().empty());
  EXPECT_EQ(plain->state_bytes(), 0);
}

TEST(Optimizer, StateRestoredFromACheckpointContinuesExactly) {
  for (const char* type : {"sgd", "adam", "adamw"}) {
    SCOPED_TRACE(type);
    OptimizerConfig config = type == std::string("sgd") ? sgd(0.9, true, 0.1) : adam(type, 0.1);
    // Reference: three uninterrupted steps.
    auto reference = create_optimizer(config);
    Parameter expected = make_parameter("w");
    Parameter* expected_params[] = {&expected};
    for (int step = 0; step < 3; ++step) {
      set_gradient(expected, step);
      reference->step(expected_params, 0.1);
    }
    // Two steps, "checkpoint", restore into a fresh optimizer, third step.
    auto first = create_optimizer(config);
    Parameter param = make_parameter("w");
    Parameter* params[] = {&param};
    for (int step = 0; step < 2; ++step) {
      set_gradient(param, step);
      first->step(params, 0.1);
    }
    auto restored = create_optimizer(config);
    restored->prepare(params);
    auto saved = first->state();
    auto loaded = restored->state();
    ASSERT_EQ(saved.size(), loaded.size());
    for (std::size_t i = 0; i < saved.size(); ++i) {
      EXPECT_EQ(saved[i].first, loaded[i].first);
      loaded[i].second->copy_from(*saved[i].second);
    }
    restored->set_steps_taken(first->steps_taken());
    set_gradient(param, 2);
    restored->step(params, 0.1);
    EXPECT_EQ(param.value.data()[0], expected.value.data()[0]);
    EXPECT_EQ(param.value.data()[1], expected.value.data()[1]);
  }
}

TEST(Optimizer, MisusedParametersAreErrors) {
  auto optimizer = create_optimizer(sgd(0.9));
  Parameter param = make_parameter("w");
  Parameter* twice[] = {&param, &param};
  EXPECT_THROW(optimizer->step(twice, 0.1), Error);

  auto fresh = create_optimizer(sgd(0.9));
  Parameter* params[] = {&param};
  fresh->step(params, 0.1);
  Parameter reshaped = make_parameter("w");
  reshaped.value = Tensor(Shape{3});
  reshaped.grad = Tensor(Shape{3});
  Parameter* changed[] = {&reshaped};
  EXPECT_THROW(fresh->step(changed, 0.1), Error);

  Parameter mismatched = make_parameter("v");
  mismatched.grad = Tensor(Shape{3});
  Parameter* bad_grad[] = {&mismatched};
  EXPECT_THROW(fresh->step(bad_grad, 0.1), Error);

  EXPECT_THROW(fresh->step(params, -0.1), InputError);
  EXPECT_THROW(fresh->step(params, std::nan("")), InputError);
}

TEST(Optimizer, BadConfigurationsAreInputErrors) {
  auto expect_rejected = [](OptimizerConfig config, const char* why) {
    SCOPED_TRACE(why);
    EXPECT_THROW(create_optimizer(config), InputError);
  };
  OptimizerConfig unknown;
  unknown.type = "rmsprop";
  expect_rejected(unknown, "unknown type");
  expect_rejected(sgd(-0.1), "negative momentum");
  expect_rejected(sgd(1.0), "momentum 1");
  expect_rejected(sgd(0, true), "nesterov without momentum");
  expect_rejected(sgd(0, false, -1e-4), "negative weight decay");
  OptimizerConfig beta1 = adam("adam");
  beta1.beta1 = 1.0;
  expect_rejected(beta1, "beta1 = 1");
  OptimizerConfig beta2 = adam("adamw");
  beta2.beta2 = -0.1;
  expect_rejected(beta2, "negative beta2");
  OptimizerConfig epsilon = adam("adam");
  epsilon.epsilon = 0;
  expect_rejected(epsilon, "epsilon 0");
  OptimizerConfig momentum = adam("adam");
  momentum.momentum = 0.9;
  expect_rejected(momentum, "momentum given to adam");

  try {
    create_optimizer(unknown);
    FAIL() << "no exception";
  } catch (const InputError& error) {
    EXPECT_NE(std::string(error.what()).find("rmsprop"), std::string::npos) << error.what();
  }
  EXPECT_NO_THROW(create_optimizer(sgd(0.9, true, 5e-4)));
  EXPECT_NO_THROW(create_optimizer(adam("adamw", 0.01)));
}

ScheduleConfig schedule(const std::string& type, double base_lr, std::int64_t warmup = 0) {
  ScheduleConfig config;
  config.type = type;
  config.base_lr = base_lr;
  config.warmup_steps = warmup;
  return config;
}

TEST(LrSchedule, ConstantWithWarmup) {
  LrSchedule lr(schedule("constant", 0.1, 4), 64);
  EXPECT_DOUBLE_EQ(lr.lr(0), 0.025);
  EXPECT_DOUBLE_EQ(lr.lr(1), 0.05);
  EXPECT_DOUBLE_EQ(lr.lr(3), 0.1);
  EXPECT_DOUBLE_EQ(lr.lr(4), 0.1);
  EXPECT_DOUBLE_EQ(lr.lr(1000), 0.1);
  LrSchedule flat(schedule("constant", 0.1), 64);
  EXPECT_DOUBLE_EQ(flat.lr(0), 0.1);
}

TEST(LrSchedule, StepDecaysAtBoundaries) {
  ScheduleConfig config = schedule("step", 0.1);
  config.step_size = 10;
  config.gamma = 0.5;
  LrSchedule lr(config, 64);
  EXPECT_DOUBLE_EQ(lr.lr(0), 0.1);
  EXPECT_DOUBLE_EQ(lr.lr(9), 0.1);
  EXPECT_DOUBLE_EQ(lr.lr(10), 0.05);
  EXPECT_DOUBLE_EQ(lr.lr(19), 0.05);
  EXPECT_DOUBLE_EQ(lr.lr(20), 0.025);
  EXPECT_DOUBLE_EQ(lr.lr(35), 0.0125);

  config.warmup_steps = 5;  // the ramp applies to step schedules too
  LrSchedule warm(config, 64);
  EXPECT_DOUBLE_EQ(warm.lr(0), 0.02);
  EXPECT_DOUBLE_EQ(warm.lr(4), 0.1);
  EXPECT_DOUBLE_EQ(warm.lr(10), 0.05);
}

TEST(LrSchedule, CosineAfterWarmup) {
  ScheduleConfig config = schedule("cosine", 0.1, 10);
  config.min_lr = 0.01;
  config.total_steps = 110;
  LrSchedule lr(config, 64);
  EXPECT_DOUBLE_EQ(lr.lr(0), 0.01);   // 0.1 * 1/10
  EXPECT_DOUBLE_EQ(lr.lr(4), 0.05);   // 0.1 * 5/10
  EXPECT_DOUBLE_EQ(lr.lr(9), 0.1);    // end of warm-up: the peak
  EXPECT_DOUBLE_EQ(lr.lr(10), 0.1);   // cosine starts at the peak
  EXPECT_NEAR(lr.lr(60), 0.055, 1e-15);  // midpoint: (peak + min) / 2
  EXPECT_NEAR(lr.lr(35), 0.01 + 0.09 * 0.5 * (1 + std::cos(std::numbers::pi / 4)), 1e-15);
  EXPECT_NEAR(lr.lr(110), 0.01, 1e-15);  // end
  EXPECT_NEAR(lr.lr(500), 0.01, 1e-15);  // stays at min_lr
  EXPECT_GT(lr.lr(59), lr.lr(60));
}

TEST(LrSchedule, LinearScalingRule) {
  ScheduleConfig config = schedule("constant", 0.1, 5);
  config.reference_batch = 256;
  LrSchedule lr(config, 1024);
  EXPECT_DOUBLE_EQ(lr.peak_lr(), 0.4);
  EXPECT_DOUBLE_EQ(lr.lr(0), 0.08);
  EXPECT_DOUBLE_EQ(lr.lr(100), 0.4);
  config.reference_batch = 0;  // no scaling
  EXPECT_DOUBLE_EQ(LrSchedule(config, 1024).lr(100), 0.1);
}

TEST(LrSchedule, BadConfigurationsAreInputErrors) {
  auto expect_rejected = [](ScheduleConfig config, std::int64_t batch, const char* why) {
    SCOPED_TRACE(why);
    EXPECT_THROW(LrSchedule(config, batch), InputError);
  };
  expect_rejected(schedule("linear", 0.1), 64, "unknown type");
  expect_rejected(schedule("cosine", 0.1), 64, "cosine without total_steps");
  ScheduleConfig short_cosine = schedule("cosine", 0.1, 100);
  short_cosine.total_steps = 100;
  expect_rejected(short_cosine, 64, "cosine total_steps not beyond warm-up");
  ScheduleConfig high_floor = schedule("cosine", 0.1);
  high_floor.total_steps = 100;
  high_floor.min_lr = 0.2;
  expect_rejected(high_floor, 64, "min_lr above the peak");
  expect_rejected(schedule("step", 0.1), 64, "step without step_size");
  ScheduleConfig zero_gamma = schedule("step", 0.1);
  zero_gamma.step_size = 10;
  zero_gamma.gamma = 0;
  expect_rejected(zero_gamma, 64, "gamma 0");
  ScheduleConfig stray = schedule("constant", 0.1);
  stray.step_size = 10;
  expect_rejected(stray, 64, "step_size on a constant schedule");
  expect_rejected(schedule("constant", -0.1), 64, "negative base_lr");
  expect_rejected(schedule("constant", 0.1, -1), 64, "negative warm-up");
  ScheduleConfig scaled = schedule("constant", 0.1);
  scaled.reference_batch = 256;
  expect_rejected(scaled, 0, "linear scaling without a global batch");

  try {
    LrSchedule(schedule("cosine", 0.1), 64);
    FAIL() << "no exception";
  } catch (const InputError& error) {
    EXPECT_NE(std::string(error.what()).find("total_steps"), std::string::npos) << error.what();
  }
  LrSchedule good(schedule("constant", 0.1), 64);
  EXPECT_THROW(good.lr(-1), InputError);
}

}  // namespace
}  // namespace tessera
