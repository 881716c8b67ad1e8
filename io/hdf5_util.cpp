#include "hdf5_util.hpp"

#include <fmt/format.h>

namespace tessera::hdf5 {

void Handle::reset() {
  if (id_ < 0) return;
  switch (H5Iget_type(id_)) {
    case H5I_FILE: H5Fclose(id_); break;
    case H5I_GROUP: H5Gclose(id_); break;
    case H5I_DATASET: H5Dclose(id_); break;
    case H5I_DATASPACE: H5Sclose(id_); break;
    case H5I_DATATYPE: H5Tclose(id_); break;
    case H5I_ATTR: H5Aclose(id_); break;
    case H5I_GENPROP_LST: H5Pclose(id_); break;
    default: H5Idec_ref(id_); break;
  }
  id_ = H5I_INVALID_HID;
}

void silence_errors() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

namespace {
herr_t collect(unsigned /*n*/, const H5E_error2_t* error, void* data) {
  auto& messages = *static_cast<std::vector<std::string>*>(data);
  if (error->desc != nullptr && error->desc[0] != '\0') messages.emplace_back(error->desc);
  return 0;
}
}  // namespace

std::string error_reason() {
  std::vector<std::string> messages;  // innermost (the actual cause) first
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, collect, &messages);
  H5Eclear2(H5E_DEFAULT);
  // The innermost two entries carry the cause ("No such file or directory", "file signature not
  // found"); the outer ones only repeat "unable to open file" up the call chain.
  std::string reason;
  for (std::size_t i = 0; i < messages.size() && i < 2; ++i) {
    if (!reason.empty()) reason += "; ";
    reason += messages[i];
  }
  return reason;
}

std::string with_reason() {
  const std::string reason = error_reason();
  return reason.empty() ? std::string() : ": " + reason;
}

namespace {
herr_t collect_name(hid_t /*group*/, const char* name, const H5L_info_t* /*info*/, void* data) {
  static_cast<std::vector<std::string>*>(data)->emplace_back(name);
  return 0;
}
}  // namespace

std::vector<std::string> list_names(hid_t group) {
  std::vector<std::string> names;
  hsize_t index = 0;
  H5Literate(group, H5_INDEX_NAME, H5_ITER_INC, &index, collect_name, &names);
  H5Eclear2(H5E_DEFAULT);
  return names;
}

bool dataset_exists(hid_t file, const std::string& name) {
  // H5Lexists fails (rather than answering false) when an intermediate group is missing, and
  // needs each path component checked; H5Oget_info_by_name answers both with one call.
  H5O_info_t info;
  const herr_t status = H5Oget_info_by_name(file, name.c_str(), &info, H5P_DEFAULT);
  H5Eclear2(H5E_DEFAULT);
  return status >= 0 && info.type == H5O_TYPE_DATASET;
}

std::string type_name(hid_t type) {
  const std::size_t bytes = H5Tget_size(type);
  switch (H5Tget_class(type)) {
    case H5T_INTEGER:
      return fmt::format("{}int{}", H5Tget_sign(type) == H5T_SGN_NONE ? "u" : "", 8 * bytes);
    case H5T_FLOAT: return fmt::format("float{}", 8 * bytes);
    case H5T_STRING: return "string";
    case H5T_COMPOUND: return "compound";
    case H5T_ENUM: return "enum";
    case H5T_ARRAY: return "array";
    default: return "an unsupported type";
  }
}

std::vector<hsize_t> extents(hid_t space) {
  const int rank = H5Sget_simple_extent_ndims(space);
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank > 0 ? rank : 0));
  if (rank > 0) H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  return dims;
}

std::string extents_string(const std::vector<hsize_t>& dims) {
  return fmt::format("[{}]", fmt::join(dims, ", "));
}

}  // namespace tessera::hdf5
