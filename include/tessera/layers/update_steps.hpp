#pragma once
// The scalars of one optimizer step, as the element-wise kernels take them
// (ElementwiseKernels::sgd_update, adam_update). Plain C++17: the CUDA kernels include it too.

namespace tessera {

/// One SGD step (torch.optim.SGD's semantics): g' = g + weight_decay * p; without a momentum
/// buffer p -= lr * g'; with one, buf = momentum * buf + g' (the first step gives buf = g'
/// exactly, the buffer starting at 0) and p -= lr * (nesterov ? g' + momentum * buf : buf).
struct SgdStep {
  float lr = 0;
  float momentum = 0;
  float weight_decay = 0;
  bool nesterov = false;
};

/// One Adam / AdamW step (torch.optim.Adam, AdamW; amsgrad off), with the step's scalars
/// precomputed: p' = p * decoupled_scale; g' = g + l2_decay * p'; m = beta1 * m + (1 - beta1) * g';
/// v = beta2 * v + (1 - beta2) * g'^2; p = p' - step_size * m / (sqrt(v) / bias_correction2_sqrt + epsilon).
struct AdamStep {
  float l2_decay = 0;         ///< added to the gradient (adam)
  float decoupled_scale = 1;  ///< 1 - lr * weight_decay (adamw), else 1
  float beta1 = 0, one_minus_beta1 = 1, beta2 = 0, one_minus_beta2 = 1;
  float step_size = 0;              ///< lr / (1 - beta1^t)
  float bias_correction2_sqrt = 1;  ///< sqrt(1 - beta2^t)
  float epsilon = 0;
};

}  // namespace tessera
