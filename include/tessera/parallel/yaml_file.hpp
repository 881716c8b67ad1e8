#pragma once
// Reading the project's YAML files (plan, machine and model files): the file's text, and that
// text parsed into a top-level mapping, each failing with an InputError that names the file.
// Includes yaml-cpp: for the .cpp files that parse these files, not for other headers.
#include <yaml-cpp/yaml.h>

#include <string>

namespace tessera {

/// The text of the file at `path`; "cannot open <kind> '<path>'" when it cannot be opened.
std::string read_input_file(const std::string& path, const std::string& kind);

/// `text` parsed as YAML whose top level is a mapping; "<description> is not valid YAML: ..."
/// (`not_yaml` gives the words after the description) or "<description>: expected <expected>".
YAML::Node parse_yaml_mapping(const std::string& text, const std::string& description, const std::string& expected,
                              const std::string& not_yaml = " is not valid YAML");

}  // namespace tessera
