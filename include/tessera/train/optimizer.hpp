#pragma once
// Optimizers: update rules over the model's Parameters, with PyTorch's semantics (torch.optim.SGD,
// Adam, AdamW), fp32 state allocated lazily per parameter and keyed by the parameter's name, and
// named state tensors for checkpoints.
//
// Every rank holds the same (reduced) gradients of the parameters it owns and applies the same
// update, so the optimizer needs no communication.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tessera/layers/layer.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {

struct OptimizerConfig {
  /// "sgd", "adam" or "adamw".
  std::string type = "sgd";
  /// sgd only: buf = momentum * buf + g (the first step gives buf = g); 0 disables momentum.
  double momentum = 0;
  /// sgd only: the update uses g + momentum * buf (needs momentum > 0).
  bool nesterov = false;
  /// sgd, adam: L2 penalty added to the gradient (g += wd * p);
  /// adamw: decoupled decay (p -= lr * wd * p). Parameters with decay == false skip it.
  double weight_decay = 0;
  /// adam, adamw.
  double beta1 = 0.9, beta2 = 0.999, epsilon = 1e-8;
};

class Optimizer {
 public:
  explicit Optimizer(OptimizerConfig config) : config_(std::move(config)) {}
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  virtual std::string_view type() const = 0;
  const OptimizerConfig& config() const { return config_; }

  /// Applies one update with learning rate `lr` (>= 0, finite) to every parameter from its
  /// `grad`. State of a parameter seen for the first time is allocated (zeros) here.
  /// Throws InputError for a bad lr; Error for a parameter whose value and grad shapes differ,
  /// whose shape changed since its state was made, or that appears twice in `params`.
  virtual void step(std::span<Parameter* const> params, double lr) = 0;

  /// Allocates (zero) state for every parameter now instead of at its first step: call it
  /// before restoring a checkpoint into state(), or to count state_bytes() up front.
  void prepare(std::span<Parameter* const> params);

  /// Named state tensors, e.g. "conv1.weight.momentum", "fc1.bias.exp_avg_sq", in the order
  /// parameters were first seen. The pointers stay valid for the optimizer's lifetime.
  virtual std::vector<std::pair<std::string, Tensor*>> state();
  /// Bytes of all state tensors.
  std::int64_t state_bytes() const;
  /// Number of state tensors this optimizer keeps per parameter (0, 1 or 2).
  virtual int state_tensors_per_parameter() const = 0;

  /// Number of step() calls so far (Adam's bias correction uses it).
  std::int64_t steps_taken() const { return steps_taken_; }
  /// For checkpoint restore: the step count saved with the state.
  void set_steps_taken(std::int64_t steps);

 protected:
  /// The state tensors of one parameter, in the order of state_names().
  struct Slot {
    std::string parameter;
    std::vector<Tensor> tensors;
    std::int64_t last_step = -1;  ///< detects a parameter passed twice to one step()
  };
  /// Suffixes of the per-parameter state tensors ("momentum"; "exp_avg", "exp_avg_sq").
  virtual std::vector<std::string_view> state_names() const = 0;
  /// The parameter's slot (allocated on first use), checked against its shape.
  Slot& slot_for(const Parameter& param);
  /// Checks lr and the parameter, marks the slot as used in the current step.
  Slot& begin_update(const Parameter& param);
  static void check_lr(double lr);
  void finish_step() { ++steps_taken_; }

  OptimizerConfig config_;

 private:
  std::vector<std::unique_ptr<Slot>> slots_;
  std::unordered_map<std::string, Slot*> slot_by_name_;
  std::int64_t steps_taken_ = 0;
};

/// Validates the configuration (unknown type, negative momentum or weight decay, beta outside
/// [0, 1), epsilon <= 0, Nesterov without momentum, momentum given to Adam: InputError) and
/// creates the optimizer.
std::unique_ptr<Optimizer> create_optimizer(const OptimizerConfig& config);

/// The optimizer type names create_optimizer accepts.
std::vector<std::string> optimizer_types();

}  // namespace tessera
