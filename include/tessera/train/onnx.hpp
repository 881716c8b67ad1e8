#pragma once
// ONNX graphs <-> Tessera models: `tessera import onnx` reads a graph exported from PyTorch (or any
// ONNX producer) as a model file and its weights; `tessera export onnx` writes a trained network
// as an inference graph. docs/onnx.md lists the operators and what each maps to.
#include <string>
#include <vector>

#include "tessera/tensor/tensor.hpp"

namespace tessera {

/// A whole tensor of a weights file, by its name there: "param/conv1.weight", "buffer/bn.0".
struct NamedTensor {
  std::string name;
  Tensor value;
};

/// A network read from an ONNX graph: a model file and the weights it starts from.
struct ImportedModel {
  std::string model_text;
  std::vector<NamedTensor> tensors;
};

struct OnnxImportOptions {
  /// The model's loss (the graph has none): empty for the graph's own "tessera.loss" metadata
  /// (graphs Tessera exported), else softmax_cross_entropy.
  std::string loss;
  /// The model's name: empty for the graph's "tessera.name" metadata, else `fallback_name`.
  std::string name;
  std::string fallback_name = "imported";
};

/// The operators import_onnx() reads, for messages and docs.
extern const char* const kOnnxImportedOperators;

/// Converts a serialized ONNX model. InputError naming `source` (and the node, its operator and
/// what is supported) for anything that is not a valid graph of operators Tessera has, or whose
/// shapes do not chain; the model text is checked by parsing it as Tessera does.
ImportedModel import_onnx(const std::string& bytes, const std::string& source, const OnnxImportOptions& options = {});

/// The serialized ONNX inference graph (opset 13) of a model file's text and its weights (whole
/// tensors named as in checkpoints: "param/<parameter>", "buffer/<layer>.<index>").
/// InputError for a model with what ONNX's operators cannot express.
std::string export_onnx(const std::string& model_text, const std::string& source, const std::vector<NamedTensor>& tensors);

}  // namespace tessera
