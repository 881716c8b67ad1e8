#include "tessera/train/optimizer.hpp"

#include <cmath>

#include "tessera/core/error.hpp"
#include "tessera/layers/dnn_backend.hpp"

namespace tessera {
namespace {

bool is_finite(double x) { return std::isfinite(x); }

class Sgd final : public Optimizer {
 public:
  using Optimizer::Optimizer;
  std::string_view type() const override { return "sgd"; }
  int state_tensors_per_parameter() const override { return config_.momentum != 0 ? 1 : 0; }

  void step(std::span<Parameter* const> params, double lr) override {
    check_lr(lr);
    const auto momentum = static_cast<float>(config_.momentum);
    for (Parameter* param : params) {
      Slot& slot = begin_update(*param);
      SgdStep sgd;
      sgd.lr = static_cast<float>(lr);
      sgd.momentum = momentum;
      sgd.weight_decay = param->decay ? static_cast<float>(config_.weight_decay) : 0.0f;
      sgd.nesterov = config_.nesterov;
      float* buffer = slot.tensors.empty() ? nullptr : slot.tensors[0].data();
      elementwise_kernels(param->value.device())
          .sgd_update(param->value.data(), param->grad.data(), buffer, param->value.numel(), sgd);
    }
    finish_step();
  }

 protected:
  std::vector<std::string_view> state_names() const override {
    if (config_.momentum == 0) return {};
    return {"momentum"};
  }
};

class Adam final : public Optimizer {
 public:
  Adam(OptimizerConfig config, bool decoupled) : Optimizer(std::move(config)), decoupled_(decoupled) {}
  std::string_view type() const override { return decoupled_ ? "adamw" : "adam"; }
  int state_tensors_per_parameter() const override { return 2; }

  void step(std::span<Parameter* const> params, double lr) override {
    check_lr(lr);
    const double t = static_cast<double>(steps_taken() + 1);
    AdamStep s;
    s.beta1 = static_cast<float>(config_.beta1);
    s.one_minus_beta1 = static_cast<float>(1.0 - config_.beta1);
    s.beta2 = static_cast<float>(config_.beta2);
    s.one_minus_beta2 = static_cast<float>(1.0 - config_.beta2);
    s.step_size = static_cast<float>(lr / (1.0 - std::pow(config_.beta1, t)));
    s.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(config_.beta2, t)));
    s.epsilon = static_cast<float>(config_.epsilon);
    for (Parameter* param : params) {
      Slot& slot = begin_update(*param);
      const double wd = param->decay ? config_.weight_decay : 0.0;
      s.l2_decay = decoupled_ ? 0.0f : static_cast<float>(wd);
      s.decoupled_scale = decoupled_ ? static_cast<float>(1.0 - lr * wd) : 1.0f;
      elementwise_kernels(param->value.device())
          .adam_update(param->value.data(), param->grad.data(), slot.tensors[0].data(), slot.tensors[1].data(),
                       param->value.numel(), s);
    }
    finish_step();
  }

 protected:
  std::vector<std::string_view> state_names() const override { return {"exp_avg", "exp_avg_sq"}; }

 private:
  bool decoupled_;
};

}  // namespace

void Optimizer::check_lr(double lr) {
  if (!is_finite(lr) || lr < 0) fail_input("optimizer: learning rate must be finite and >= 0, got {}", lr);
}

Optimizer::Slot& Optimizer::slot_for(const Parameter& param) {
  const Shape& shape = param.value.shape();
  auto found = slot_by_name_.find(param.name);
  if (found != slot_by_name_.end()) {
    Slot& slot = *found->second;
    for (const Tensor& tensor : slot.tensors) {
      TESSERA_CHECK(tensor.shape() == shape,
                    "optimizer: parameter '{}' has shape {}, but its optimizer state was made for {}",
                    param.name, shape.to_string(), tensor.shape().to_string());
    }
    return slot;
  }
  auto slot = std::make_unique<Slot>();
  slot->parameter = param.name;
  for (std::size_t i = 0; i < state_names().size(); ++i) slot->tensors.emplace_back(shape, param.value.device());
  Slot* raw = slot.get();
  slots_.push_back(std::move(slot));
  slot_by_name_.emplace(param.name, raw);
  return *raw;
}

Optimizer::Slot& Optimizer::begin_update(const Parameter& param) {
  TESSERA_CHECK(param.grad.shape() == param.value.shape(),
                "optimizer: parameter '{}' has shape {} but its gradient has shape {}", param.name,
                param.value.shape().to_string(), param.grad.shape().to_string());
  TESSERA_CHECK(param.value.is_contiguous() && param.grad.is_contiguous(),
                "optimizer: parameter '{}' or its gradient is not contiguous", param.name);
  TESSERA_CHECK(param.value.device() == param.grad.device(),
                "optimizer: parameter '{}' is on {} but its gradient on {}", param.name,
                param.value.device().to_string(), param.grad.device().to_string());
  Slot& slot = slot_for(param);
  TESSERA_CHECK(slot.last_step != steps_taken_, "optimizer: parameter '{}' was passed twice to one step",
                param.name);
  slot.last_step = steps_taken_;
  return slot;
}

void Optimizer::prepare(std::span<Parameter* const> params) {
  for (Parameter* param : params) slot_for(*param);
}

std::vector<std::pair<std::string, Tensor*>> Optimizer::state() {
  std::vector<std::pair<std::string, Tensor*>> named;
  const auto names = state_names();
  for (auto& slot : slots_) {
    for (std::size_t i = 0; i < slot->tensors.size(); ++i) {
      named.emplace_back(slot->parameter + "." + std::string(names[i]), &slot->tensors[i]);
    }
  }
  return named;
}

std::int64_t Optimizer::state_bytes() const {
  std::int64_t bytes = 0;
  for (const auto& slot : slots_) {
    for (const Tensor& tensor : slot->tensors) bytes += tensor.numel() * static_cast<std::int64_t>(sizeof(float));
  }
  return bytes;
}

void Optimizer::set_steps_taken(std::int64_t steps) {
  if (steps < 0) fail_input("optimizer: step count must be >= 0, got {}", steps);
  steps_taken_ = steps;
  for (auto& slot : slots_) slot->last_step = -1;
}

std::vector<std::string> optimizer_types() { return {"sgd", "adam", "adamw"}; }

std::unique_ptr<Optimizer> create_optimizer(const OptimizerConfig& config) {
  const OptimizerConfig& c = config;
  const bool sgd = c.type == "sgd";
  const bool adam = c.type == "adam" || c.type == "adamw";
  if (!sgd && !adam) fail_input("optimizer: unknown type '{}' (known: sgd, adam, adamw)", c.type);
  if (!is_finite(c.weight_decay) || c.weight_decay < 0) {
    fail_input("optimizer '{}': weight_decay must be finite and >= 0, got {}", c.type, c.weight_decay);
  }
  if (sgd) {
    if (!is_finite(c.momentum) || c.momentum < 0 || c.momentum >= 1) {
      fail_input("optimizer 'sgd': momentum must be in [0, 1), got {}", c.momentum);
    }
    if (c.nesterov && c.momentum == 0) fail_input("optimizer 'sgd': nesterov needs a momentum > 0");
    return std::make_unique<Sgd>(c);
  }
  if (c.momentum != 0 || c.nesterov) {
    fail_input("optimizer '{}': momentum and nesterov apply to sgd only (use beta1)", c.type);
  }
  if (!(c.beta1 >= 0 && c.beta1 < 1)) fail_input("optimizer '{}': beta1 must be in [0, 1), got {}", c.type, c.beta1);
  if (!(c.beta2 >= 0 && c.beta2 < 1)) fail_input("optimizer '{}': beta2 must be in [0, 1), got {}", c.type, c.beta2);
  if (!is_finite(c.epsilon) || c.epsilon <= 0) {
    fail_input("optimizer '{}': epsilon must be finite and > 0, got {}", c.type, c.epsilon);
  }
  return std::make_unique<Adam>(c, c.type == "adamw");
}

}  // namespace tessera
