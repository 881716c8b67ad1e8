// Model files that are YAML but not the shapes the parser expects end in an InputError naming the
// file, like every other bad model file. Found by fuzzing (tests/fuzz/fuzz_model.cpp): yaml-cpp's
// YAML::TypedBadConversion escaped from Model::parse.
#include <gtest/gtest.h>

#include <string>

#include "tessera/core/error.hpp"
#include "tessera/layers/dnn_backend.hpp"
#include "tessera/train/kernel_probes.hpp"
#include "tessera/train/model.hpp"

namespace tessera {
namespace {

const std::string kLayers = "layers:\n  - {name: fc, type: linear, out: 2}\nloss: softmax_cross_entropy\n";

void expect_input_error(const std::string& yaml, const std::string& needle) {
  SCOPED_TRACE(yaml);
  try {
    (void)Model::parse(yaml, "m.yaml");
    ADD_FAILURE() << "parsed";
  } catch (const InputError& e) {
    EXPECT_NE(e.message().find(needle), std::string::npos) << e.message();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than an InputError: " << e.what();
  }
}

TEST(ModelParse, ParsesAValidFile) {
  const Model model = Model::parse("input: {shape: [4]}\n" + kLayers, "m.yaml");
  EXPECT_EQ(model.nodes().size(), 1u);
}

TEST(ModelParse, KeysAndNamesThatAreNotWordsAreInputErrors) {
  expect_input_error("[input]: {shape: [4]}\n" + kLayers, "model file 'm.yaml': unexpected YAML");
  expect_input_error("name: {a: 1}\ninput: {shape: [4]}\n" + kLayers, "unexpected YAML");
  expect_input_error("input: {shape: [4], [x]: 1}\n" + kLayers, "unexpected YAML");
  expect_input_error("input: {shape: [4]}\nlayers:\n  - {name: fc, type: linear, out: 2, inputs: [{a: 1}]}\n"
                     "loss: softmax_cross_entropy\n",
                     "unexpected YAML");
  expect_input_error("input: {shape: [4]}\n" + kLayers + "output: [fc]\n", "unexpected YAML");
}

// Also found by fuzzing: sizes near the int64 limits overflowed the shape arithmetic (UBSan reports
// in convolution_layer.cpp and shape.cpp).
TEST(ModelParse, SizesBeyondWhatTesseraAcceptsAreInputErrors) {
  expect_input_error("input: {shape: [1, 28, 28]}\nlayers:\n  - {name: c, type: conv, filters: 2, kernel: 3, "
                     "padding: 4611686018427387904}\n  - {name: f, type: flatten}\n  - {name: l, type: linear, "
                     "out: 10}\nloss: softmax_cross_entropy\n",
                     "parameter 'padding' is 4611686018427387904, beyond what Tessera accepts");
  expect_input_error("input: {shape: [1, 28, 28]}\nlayers:\n  - {name: c, type: conv, filters: 100000000000, "
                     "kernel: [3, 3]}\n  - {name: f, type: flatten}\n  - {name: l, type: linear, out: 10}\n"
                     "loss: softmax_cross_entropy\n",
                     "parameter 'filters' is 100000000000");
  expect_input_error("input: {shape: [9223372036854775807, 9223372036854775807]}\n" + kLayers,
                     "an input sample of more than 2147483647 elements");
}

// Found by fuzzing: a linear layer of 2^31 weights (the flatten of a 512^3 volume without its
// pooling) allocated 8 GiB when its file was parsed. A model parsed with its weights built whole
// has limits per layer and per model, refused before the layer allocates anything; one parsed
// without them (what tessera train does) allocates nothing at parse, and its limit is the rank's
// memory under the plan.
TEST(ModelParse, WeightsBeyondWhatARankBuildsAreInputErrors) {
  expect_input_error("input: {shape: [16777216]}\nlayers:\n  - {name: fc, type: linear, out: 128}\n"
                     "loss: softmax_cross_entropy\n",
                     "layer 'fc' (linear): its weight would have 2.147e+09 elements, more than the 134217728 (512 MiB "
                     "of fp32) a layer built whole may have");
  expect_input_error("input: {shape: [1, 8, 8, 8]}\nlayers:\n  - {name: c, type: conv, filters: 8388608, kernel: 3, "
                     "padding: 1, bias: false}\n  - {name: f, type: flatten}\n  - {name: l, type: linear, out: 1}\n"
                     "loss: mse\n",
                     "layer 'c' (conv): its weight would have 2.265e+08 elements");
  // A model's total, checked layer by layer (here with a limit of 1000 elements).
  ModelOptions small;
  small.largest_weights = 1000;
  const std::string text = "input: {shape: [20]}\nlayers:\n  - {name: a, type: linear, out: 20}\n"
                           "  - {name: b, type: linear, out: 20}\n  - {name: c, type: linear, out: 20}\n"
                           "loss: softmax_cross_entropy\n";
  try {
    (void)Model::parse(text, "m.yaml", small);
    ADD_FAILURE() << "parsed";
  } catch (const InputError& e) {
    EXPECT_NE(e.message().find("its layers up to 'c' have 1260 weight elements, more than the 1000"),
              std::string::npos)
        << e.message();
  }
  EXPECT_EQ(Model::parse(text, "m.yaml").parameter_count(), 1260);
  // Deferred: 2^31 + 2^24 weights parse without a byte of them allocated.
  ModelOptions deferred;
  deferred.allocate_parameters = false;
  Model large = Model::parse("input: {shape: [16777216]}\nlayers:\n  - {name: fc, type: linear, out: 128}\n"
                             "  - {name: out, type: linear, out: 131072}\nloss: mse\n", "large.yaml", deferred);
  EXPECT_EQ(large.parameter_count(), (std::int64_t{1} << 31) + 128 + (std::int64_t{1} << 24) + 131072);
  for (auto* p : large.parameters()) {
    EXPECT_FALSE(p->allocated()) << p->name;
    EXPECT_FALSE(p->value.defined()) << p->name;
  }
}

/// Which layers of `text` (parsed with `options`) compute with bf16 operands: each layer is fed the
/// activations of the all-fp32 model of the same text and weights, and one whose output differs
/// from the fp32 layer's on the same input rounds its operands.
std::vector<bool> bf16_layers(const std::string& text, const ModelOptions& options) {
  ModelOptions fp32;
  fp32.precision = Precision::F32;
  Model model = Model::parse(text, "m.yaml", options);
  Model reference = Model::parse(text, "m.yaml", fp32);
  model.init_parameters(3);
  reference.init_parameters(3);
  auto backend = make_host_backend();
  LayerContext context;
  context.backend = backend.get();
  Tensor input(model.input_shape(2));
  for (std::int64_t i = 0; i < input.numel(); ++i) input.data()[i] = 0.1f * static_cast<float>(i % 17) - 0.77f;
  std::vector<Tensor> activations(model.nodes().size());
  std::vector<bool> bf16;
  for (std::size_t n = 0; n < model.nodes().size(); ++n) {
    const int from = model.nodes()[n].inputs[0];
    const Tensor* inputs[] = {from == Model::kModelInput ? &input : &activations[static_cast<std::size_t>(from)]};
    Tensor output;
    model.nodes()[n].layer->forward(inputs, output, context);
    reference.nodes()[n].layer->forward(inputs, activations[n], context);
    bf16.push_back(max_relative_difference(output, activations[n]) > 0.0);
  }
  return bf16;
}

TEST(ModelParse, PrecisionIsModelWideUnlessALayerNamesItsOwn) {
  const std::string body = R"(
input: {shape: [2, 6, 6]}
layers:
  - {name: conv, type: conv, filters: 3, kernel: 3}
  - {name: flatten, type: flatten}
  - {name: fc1, type: linear, out: 5}
  - {name: fc2, type: linear, out: 4, precision: fp32}
loss: softmax_cross_entropy
)";
  const std::string text = "precision: bf16\n" + body;
  EXPECT_EQ(Model::parse(text, "m.yaml").precision(), Precision::BF16);
  EXPECT_EQ(Model::parse(body, "m.yaml").precision(), Precision::F32);
  // Model-wide bf16 for conv and linear layers; fc2 keeps its own fp32.
  EXPECT_EQ(bf16_layers(text, {}), (std::vector<bool>{true, false, true, false}));
  // A command line's --precision replaces the model-wide one; fc2 still keeps its own.
  ModelOptions fp32_options;
  fp32_options.precision = Precision::F32;
  EXPECT_EQ(Model::parse(text, "m.yaml", fp32_options).precision(), Precision::F32);
  EXPECT_EQ(bf16_layers(text, fp32_options), (std::vector<bool>{false, false, false, false}));
  ModelOptions bf16_options;
  bf16_options.precision = Precision::BF16;
  EXPECT_EQ(bf16_layers(body, bf16_options), (std::vector<bool>{true, false, true, false}));
  EXPECT_EQ(bf16_layers(body, {}), (std::vector<bool>{false, false, false, false}));
  // The planner prices what each layer computes, and keeps bf16 timings apart from fp32 ones.
  const PlannerGraph graph = Model::parse(text, "m.yaml").planner_graph(4);
  EXPECT_EQ(graph.layers[0].precision, Precision::BF16);
  EXPECT_EQ(graph.layers[0].signature, "model/conv@bf16");
  EXPECT_EQ(graph.layers[2].signature, "model/fc1@bf16");
  EXPECT_EQ(graph.layers[3].precision, Precision::F32);
  EXPECT_EQ(graph.layers[3].signature, "model/fc2");
}

TEST(KernelProbes, AWorkloadRunsWithTheLeakyReluTheStepPlanFusesIntoIt) {
  // What calibrate times is what the step runs: the convolution applies the leaky ReLU after it
  // (on the host not a plain ReLU, which oneDNN's post-op cannot), the pooling does its backward.
  // (Not into a channel split's partial sums.)
  const auto text = [](const std::string& activation) {
    return "input: {shape: [2, 8, 8]}\nlayers:\n  - {name: conv, type: conv, filters: 4, kernel: 3, padding: 1}\n"
           "  - {name: act, type: " +
           activation +
           "}\n  - {name: pool, type: maxpool, kernel: 2}\n"
           "  - {name: flat, type: flatten}\n  - {name: fc, type: linear, out: 3}\nloss: mse\n";
  };
  const std::string wide = text("leaky_relu, slope: 0.25");
  const auto benches = [&](const std::string& activation) {
    const Model model = Model::parse(text(activation), "m.yaml");
    const PlannerGraph graph = model.planner_graph(4);
    std::vector<Bench> out;
    for (int layer = 0; layer < 3; ++layer) {
      Workload w;
      w.layer = layer;
      w.samples = 4;
      out.push_back(workload_bench(model, graph, w, Device::host()));
    }
    return out;
  };
  std::vector<Bench> leaky = benches("leaky_relu, slope: 0.25");
  EXPECT_EQ(leaky[0].leaky_relu_after, 0.25f);
  EXPECT_FALSE(leaky[0].leaky_relu_before);
  EXPECT_FALSE(leaky[1].leaky_relu_after || leaky[1].leaky_relu_before);
  EXPECT_EQ(leaky[2].leaky_relu_before, 0.25f);
  EXPECT_FALSE(leaky[2].leaky_relu_after);
  Workload channels;
  channels.layer = 0;
  channels.samples = 4;
  channels.channel_parts = 2;
  const PlannerGraph wide_graph = Model::parse(wide, "m.yaml").planner_graph(4);
  EXPECT_FALSE(workload_bench(Model::parse(wide, "m.yaml"), wide_graph, channels, Device::host()).leaky_relu_after);
  const std::vector<Bench> relu = benches("relu");
  EXPECT_FALSE(relu[0].leaky_relu_after);
  EXPECT_EQ(relu[2].leaky_relu_before, 0.0f);
  // And so they run.
  const auto backend = make_host_backend();
  for (Bench& b : leaky) EXPECT_GT(time_once(b, *backend), 0.0);
}

TEST(ModelParse, BadPrecisionsAreInputErrors) {
  expect_input_error("precision: fp16\ninput: {shape: [4]}\n" + kLayers,
                     "model file 'm.yaml': precision must be fp32 or bf16, got 'fp16'");
  expect_input_error("precision: [bf16]\ninput: {shape: [4]}\n" + kLayers, "'precision' must be fp32 or bf16");
  expect_input_error("input: {shape: [4]}\nlayers:\n  - {name: fc, type: linear, out: 2, precision: half}\n"
                     "loss: softmax_cross_entropy\n",
                     "layer 'fc' (linear): precision must be fp32 or bf16, got 'half'");
}

}  // namespace
}  // namespace tessera
