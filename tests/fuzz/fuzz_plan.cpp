// libFuzzer target: Plan::parse on arbitrary text, then Plan::validate against a fixed small model
// (the Fashion-MNIST CNN) at the plan's own rank count and at 4 ranks.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/train/model.hpp"

namespace {
const char* const kModel = R"(
name: fuzz_cnn
input: {shape: [1, 28, 28]}
layers:
  - {name: conv1, type: conv, filters: 4, kernel: 3, padding: 1}
  - {name: relu1, type: relu}
  - {name: pool1, type: maxpool, kernel: 2}
  - {name: conv2, type: conv, filters: 8, kernel: 3, padding: 1}
  - {name: bn2, type: batchnorm, global: true}
  - {name: relu2, type: relu}
  - {name: pool2, type: maxpool, kernel: 2}
  - {name: flat, type: flatten}
  - {name: fc, type: linear, out: 10}
loss: softmax_cross_entropy
)";

const std::vector<tessera::PlanLayerInfo>& model_info() {
  static const std::vector<tessera::PlanLayerInfo> info = tessera::Model::parse(kModel, "<fuzz model>").plan_info(64);
  return info;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto& info = model_info();
  const std::string text(reinterpret_cast<const char*>(data), size);
  tessera::fuzz::expect_only_input_errors([&] {
    const tessera::Plan plan = tessera::Plan::parse(text, "<fuzz>");
    tessera::fuzz::expect_only_input_errors([&] { plan.validate(plan.ranks(), info); });
    tessera::fuzz::expect_only_input_errors([&] { plan.validate(4, info); });
    (void)plan.to_yaml();
  });
  return 0;
}
