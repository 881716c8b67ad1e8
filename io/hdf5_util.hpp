#pragma once
// Private HDF5 helpers of the io level: owning handles, and turning HDF5's error stack into one
// readable reason instead of letting the library print its own stack traces.
#include <hdf5.h>

#include <string>
#include <utility>
#include <vector>

namespace tessera::hdf5 {

/// An owning hid_t, closed with the H5?close function matching its type.
class Handle {
 public:
  Handle() = default;
  explicit Handle(hid_t id) : id_(id) {}
  ~Handle() { reset(); }
  Handle(Handle&& other) noexcept : id_(std::exchange(other.id_, H5I_INVALID_HID)) {}
  Handle& operator=(Handle&& other) noexcept {
    if (this != &other) {
      reset();
      id_ = std::exchange(other.id_, H5I_INVALID_HID);
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  void reset();

 private:
  hid_t id_ = H5I_INVALID_HID;
};

/// Turns off HDF5's automatic printing of its error stack (per thread in thread-safe builds, so
/// every thread that calls HDF5 calls this first).
void silence_errors();

/// The innermost messages of the current HDF5 error stack ("unable to open file: ... No such
/// file or directory"), then clears it. Empty when the stack is empty.
std::string error_reason();

/// error_reason() formatted as ": <reason>", or empty when HDF5 recorded none.
std::string with_reason();

/// Names of the objects in `group` (for "no such dataset; the file holds ...").
std::vector<std::string> list_names(hid_t group);

/// Whether `name` (a path) names a dataset in `file`, without raising HDF5 errors.
bool dataset_exists(hid_t file, const std::string& name);

/// "uint8", "int64", "float32", ... for a dataset's type.
std::string type_name(hid_t type);

/// Extents of a simple dataspace.
std::vector<hsize_t> extents(hid_t space);

/// "[60000, 1, 28, 28]".
std::string extents_string(const std::vector<hsize_t>& dims);

}  // namespace tessera::hdf5
