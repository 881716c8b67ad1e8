#pragma once
// The parameters of one layer as the model file gave them, with typed getters that name the
// layer and the parameter in every error, and a check that no unknown parameter is left over.
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace tessera {

class LayerOptions {
 public:
  LayerOptions() = default;
  /// `context` names the owner in errors, e.g. "layer 'conv1' (conv)".
  explicit LayerOptions(std::string context) : context_(std::move(context)) {}

  /// Scalars are stored as text, lists as their items.
  void set(const std::string& key, std::string scalar);
  void set_list(const std::string& key, std::vector<std::string> items);
  bool has(const std::string& key) const;

  std::int64_t get_int(const std::string& key) const;
  std::int64_t get_int(const std::string& key, std::int64_t fallback) const;
  double get_float(const std::string& key) const;
  double get_float(const std::string& key, double fallback) const;
  bool get_bool(const std::string& key, bool fallback) const;
  std::string get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  /// A list of `count` integers; a scalar is repeated `count` times.
  std::vector<std::int64_t> get_ints(const std::string& key, int count) const;
  std::vector<std::int64_t> get_ints(const std::string& key, int count, std::int64_t fallback) const;
  /// A list of integers of any length (a scalar gives one item), for layers that learn how many
  /// they need (2-D or 3-D) only from their input shape; an absent key gives `fallback`
  /// (an error when `fallback` is empty: the parameter is required).
  std::vector<std::int64_t> get_int_list(const std::string& key, std::vector<std::int64_t> fallback) const;

  /// Throws InputError naming every key no getter asked for.
  void check_all_used() const;
  const std::string& context() const { return context_; }

 private:
  const std::vector<std::string>& items(const std::string& key) const;
  std::string context_;
  std::map<std::string, std::vector<std::string>> values_;
  std::map<std::string, bool> is_list_;
  mutable std::set<std::string> used_;
};

}  // namespace tessera
