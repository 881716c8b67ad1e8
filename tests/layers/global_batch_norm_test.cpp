// Global batch norm over the sample communicator computes what one rank computes on the whole
// batch: forward outputs, input gradients, and (summed over ranks) parameter gradients.
// Run at 1-4 ranks; the batch splits unevenly and some ranks get no sample at all.
#include <gtest/gtest.h>

#include "layer_test_utils.hpp"
#include "tessera/parallel/mpi_communicator.hpp"

namespace tessera::testing {
namespace {

void check_global_batch_norm(const Shape& whole_shape) {
  auto comm = MpiCommunicator::world();
  const std::int64_t batch = whole_shape[0], ranks = comm->size(), rank = comm->rank();
  const std::int64_t begin = batch * rank / ranks, end = batch * (rank + 1) / ranks;

  const Tensor input = random_tensor(whole_shape, 70);
  const Tensor probe = random_tensor(whole_shape, 71);

  // Reference: this process alone, whole batch.
  auto reference = make_layer("batchnorm", {{"global", {"true"}}});
  reference->setup({whole_shape});
  reference->parameters()[0]->value.copy_from(random_tensor(Shape{whole_shape[1]}, 72));
  LayerContext alone;
  alone.global_batch = batch;
  Tensor reference_output, reference_grad;
  {
    const Tensor* inputs[] = {&input};
    Tensor* grads[] = {&reference_grad};
    reference->forward(inputs, reference_output, alone);
    reference->backward(inputs, reference_output, probe, grads, alone);
  }

  // Distributed: this rank's slice, statistics over the world communicator.
  auto layer = make_layer("batchnorm", {{"global", {"true"}}});
  layer->setup({whole_shape.with(0, end - begin)});
  layer->parameters()[0]->value.copy_from(random_tensor(Shape{whole_shape[1]}, 72));
  LayerContext context;
  context.sample_comm = comm.get();
  context.sample_offset = begin;
  context.global_batch = batch;
  const Tensor local_input = input.slice(begin, end).clone();
  const Tensor local_probe = probe.slice(begin, end).clone();
  Tensor output, grad;
  const Tensor* inputs[] = {&local_input};
  Tensor* grads[] = {&grad};
  layer->forward(inputs, output, context);
  layer->backward(inputs, output, local_probe, grads, context);

  EXPECT_LT(max_relative_difference(output, reference_output.slice(begin, end).clone(), 1e-3), 1e-4);
  EXPECT_LT(max_relative_difference(grad, reference_grad.slice(begin, end).clone(), 1e-3), 1e-4);
  for (std::size_t p = 0; p < 2; ++p) {
    Tensor summed = layer->parameters()[p]->grad.clone();
    comm->allreduce(std::span<float>(summed.data(), static_cast<std::size_t>(summed.numel())));
    EXPECT_LT(max_relative_difference(summed, reference->parameters()[p]->grad, 1e-3), 1e-4) << "parameter " << p;
  }
  for (std::size_t b = 0; b < 2; ++b)
    EXPECT_LT(max_relative_difference(*layer->buffers()[b], *reference->buffers()[b], 1e-3), 1e-5) << "buffer " << b;
}

TEST(GlobalBatchNorm, MatchesOneRankOnTheWholeBatch2d) { check_global_batch_norm(Shape::image(7, 3, {4, 5})); }

TEST(GlobalBatchNorm, MatchesOneRankWithEmptyRanks3d) { check_global_batch_norm(Shape::image(3, 2, {2, 3, 3})); }

TEST(GlobalBatchNorm, MatchesOneRankOnFeatures) { check_global_batch_norm(Shape::flat(5, 4)); }

}  // namespace
}  // namespace tessera::testing
