#include "tessera/parallel/yaml_file.hpp"

#include <fstream>
#include <sstream>

#include "tessera/core/error.hpp"

namespace tessera {

std::string read_input_file(const std::string& path, const std::string& kind) {
  std::ifstream file(path);
  if (!file) fail_input("cannot open {} '{}'", kind, path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

YAML::Node parse_yaml_mapping(const std::string& text, const std::string& description, const std::string& expected,
                              const std::string& not_yaml) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    fail_input("{}{}: {}", description, not_yaml, e.what());
  }
  if (!root.IsMap()) fail_input("{}: expected {}", description, expected);
  return root;
}

}  // namespace tessera
