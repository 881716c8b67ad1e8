// Model files that are YAML but not the shapes the parser expects end in an InputError naming the
// file, like every other bad model file. Found by fuzzing (tests/fuzz/fuzz_model.cpp): yaml-cpp's
// YAML::TypedBadConversion escaped from Model::parse.
#include <gtest/gtest.h>

#include <string>

#include "tessera/core/error.hpp"
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

}  // namespace
}  // namespace tessera
