#include "tessera/tensor/tensor.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"

namespace tessera {
namespace {
std::vector<std::int64_t> contiguous_strides(const Shape& shape) {
  std::vector<std::int64_t> strides(static_cast<std::size_t>(shape.rank()));
  std::int64_t s = 1;
  for (int i = shape.rank() - 1; i >= 0; --i) {
    strides[static_cast<std::size_t>(i)] = s;
    s *= shape[i];
  }
  return strides;
}
}  // namespace

Tensor::Tensor(Shape shape, Device device) : shape_(std::move(shape)), device_(device) {
  strides_ = contiguous_strides(shape_);
  capacity_ = shape_.numel();
  if (capacity_ <= 0) return;
  if (device_.is_host()) {
    buffer_ = std::shared_ptr<float[]>(new float[static_cast<std::size_t>(capacity_)]());
    return;
  }
  // GPU memory from the caching allocator, returned to it when the last view goes.
  cuda::set_device(device_.index);
  auto* memory = static_cast<float*>(cuda::allocate(static_cast<std::size_t>(capacity_) * sizeof(float)));
  buffer_ = std::shared_ptr<float[]>(memory, [](float* pointer) { cuda::release(pointer); });
  cuda::fill(memory, capacity_, 0.0f);
}

bool Tensor::is_contiguous() const { return strides_ == contiguous_strides(shape_); }

Tensor Tensor::slice(std::int64_t begin, std::int64_t end) const {
  TESSERA_CHECK(rank() >= 1 && begin >= 0 && begin <= end && end <= shape_[0],
                "Tensor::slice [{}, {}) out of range for shape {}", begin, end, shape_.to_string());
  Tensor view = *this;
  view.shape_[0] = end - begin;
  view.offset_ = offset_ + begin * strides_[0];
  view.slice_ = true;
  return view;
}

Tensor Tensor::reshape(Shape shape) const {
  TESSERA_CHECK(shape.numel() == numel(), "Tensor::reshape {} -> {}: element counts differ",
                shape_.to_string(), shape.to_string());
  TESSERA_CHECK(is_contiguous(), "Tensor::reshape of a non-contiguous tensor");
  Tensor view = *this;
  view.shape_ = std::move(shape);
  view.strides_ = contiguous_strides(view.shape_);
  return view;
}

Tensor Tensor::clone() const {
  Tensor copy(shape_, device_);
  copy.copy_from(*this);
  return copy;
}

void Tensor::fill(float value) {
  TESSERA_CHECK(is_contiguous(), "Tensor::fill of a non-contiguous tensor");
  if (device_.is_host()) {
    std::fill_n(data(), numel(), value);
  } else {
    cuda::set_device(device_.index);
    cuda::fill(data(), numel(), value);
  }
}

void Tensor::copy_from(const Tensor& other) {
  TESSERA_CHECK(other.shape_.dims() == shape_.dims(), "Tensor::copy_from: shape {} into {}",
                other.shape_.to_string(), shape_.to_string());
  TESSERA_CHECK(is_contiguous() && other.is_contiguous(), "Tensor::copy_from of a non-contiguous tensor");
  if (numel() == 0) return;
  const auto bytes = static_cast<std::size_t>(numel()) * sizeof(float);
  if (device_.is_host() && other.device_.is_host()) {
    std::memcpy(data(), other.data(), bytes);
  } else if (!device_.is_host() && !other.device_.is_host()) {
    cuda::set_device(device_.index);
    cuda::copy_on_device(data(), other.data(), bytes);  // ordered on the stream: no wait
  } else {
    cuda::set_device(device_.is_host() ? other.device_.index : device_.index);
    cuda::copy(data(), other.data(), bytes);
  }
}

Tensor Tensor::to(Device device) const {
  if (device == device_) return *this;
  if (!buffer_) {  // nothing allocated yet: the same (empty) tensor, on the other device
    Tensor moved = *this;
    moved.device_ = device;
    return moved;
  }
  Tensor copy(shape_, device);
  copy.copy_from(*this);
  return copy;
}

void Tensor::resize(const Shape& shape) {
  if (buffer_ && shape.numel() == numel()) {  // same size: keep the memory (and any aliasing view)
    shape_ = shape;
    strides_ = contiguous_strides(shape_);
    return;
  }
  if (shape.numel() > capacity_ || !buffer_ || offset_ != 0 || slice_) {
    *this = Tensor(shape, device_);
    return;
  }
  shape_ = shape;
  strides_ = contiguous_strides(shape_);
}

void Tensor::resize(const Shape& shape, Device device) {
  if (device != device_) {
    *this = Tensor(shape, device);
    return;
  }
  resize(shape);
}

float Tensor::at(const std::vector<std::int64_t>& index) const {
  return const_cast<Tensor*>(this)->at(index);
}

float& Tensor::at(const std::vector<std::int64_t>& index) {
  TESSERA_CHECK(device_.is_host(), "Tensor::at on a tensor on {}: copy it to the host first (Tensor::to)",
                device_.to_string());
  TESSERA_CHECK(static_cast<int>(index.size()) == rank(), "Tensor::at: {} indices for rank {}", index.size(), rank());
  std::int64_t off = 0;
  for (std::size_t i = 0; i < index.size(); ++i) {
    TESSERA_CHECK(index[i] >= 0 && index[i] < shape_[static_cast<int>(i)], "Tensor::at: index out of range");
    off += index[i] * strides_[i];
  }
  return data()[off];
}

double max_relative_difference(const Tensor& a, const Tensor& b, double floor) {
  TESSERA_CHECK(a.shape().dims() == b.shape().dims(), "max_relative_difference: shapes {} and {}",
                a.shape().to_string(), b.shape().to_string());
  TESSERA_CHECK(a.device().is_host() && b.device().is_host(),
                "max_relative_difference compares host tensors (got {} and {})", a.device().to_string(),
                b.device().to_string());
  double worst = 0.0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.data()[i], y = b.data()[i];
    if (std::isnan(x) != std::isnan(y)) return INFINITY;
    const double scale = std::max({std::fabs(x), std::fabs(y), floor});
    worst = std::max(worst, std::fabs(x - y) / scale);
  }
  return worst;
}

}  // namespace tessera
