#include "tessera/train/optimizer.hpp"

#include <cmath>

#include "tessera/core/error.hpp"

namespace tessera {
namespace {

bool is_finite(double x) { return std::isfinite(x); }

// The update loops: fp32 storage and arithmetic (like PyTorch's float kernels), one pass over
// each array, restrict-qualified so the compiler vectorizes them.

/// SGD, PyTorch semantics: g' = g + wd*p; buf = m*buf + g' (buf starts at 0, so the first step
/// gives buf = g' exactly); d = nesterov ? g' + m*buf : buf; p -= lr*d. Without momentum d = g'.
void sgd_update(std::int64_t n, float* __restrict p, const float* __restrict g, float* __restrict buf,
                float lr, float momentum, float weight_decay, bool nesterov) {
  if (buf == nullptr) {
    if (weight_decay != 0.0f) {
      for (std::int64_t i = 0; i < n; ++i) p[i] -= lr * (g[i] + weight_decay * p[i]);
    } else {
      for (std::int64_t i = 0; i < n; ++i) p[i] -= lr * g[i];
    }
    return;
  }
  if (nesterov) {
    for (std::int64_t i = 0; i < n; ++i) {
      const float d = g[i] + weight_decay * p[i];
      const float b = momentum * buf[i] + d;
      buf[i] = b;
      p[i] -= lr * (d + momentum * b);
    }
  } else {
    for (std::int64_t i = 0; i < n; ++i) {
      const float d = g[i] + weight_decay * p[i];
      const float b = momentum * buf[i] + d;
      buf[i] = b;
      p[i] -= lr * b;
    }
  }
}

/// Adam / AdamW, PyTorch semantics (torch.optim.Adam, AdamW; amsgrad off):
///   adamw: p *= 1 - lr*decoupled_decay
///   g' = g + l2_decay*p
///   m = b1*m + (1-b1)*g';  v = b2*v + (1-b2)*g'^2
///   p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
struct AdamScalars {
  float l2_decay;         // added to the gradient (adam)
  float decoupled_scale;  // 1 - lr*wd (adamw), else 1
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float epsilon;
};

void adam_update(std::int64_t n, float* __restrict p, const float* __restrict g, float* __restrict m,
                 float* __restrict v, const AdamScalars& s) {
  const float l2 = s.l2_decay, scale = s.decoupled_scale, b1 = s.beta1, c1 = s.one_minus_beta1;
  const float b2 = s.beta2, c2 = s.one_minus_beta2, step_size = s.step_size;
  const float bc2 = s.bias_correction2_sqrt, eps = s.epsilon;
  for (std::int64_t i = 0; i < n; ++i) {
    const float pi = p[i] * scale;
    const float gi = g[i] + l2 * pi;
    const float mi = b1 * m[i] + c1 * gi;
    const float vi = b2 * v[i] + c2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - step_size * (mi / (std::sqrt(vi) / bc2 + eps));
  }
}

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
      const float wd = param->decay ? static_cast<float>(config_.weight_decay) : 0.0f;
      float* buffer = slot.tensors.empty() ? nullptr : slot.tensors[0].data();
      sgd_update(param->value.numel(), param->value.data(), param->grad.data(), buffer,
                 static_cast<float>(lr), momentum, wd, config_.nesterov);
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
    AdamScalars s{};
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
      adam_update(param->value.numel(), param->value.data(), param->grad.data(), slot.tensors[0].data(),
                  slot.tensors[1].data(), s);
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
  TESSERA_CHECK(param.value.device().is_host() && param.grad.device().is_host(),
                "optimizer: parameter '{}' is not on the host (only host updates are built)", param.name);
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
