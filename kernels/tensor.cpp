#include "kernels/tensor.h"

#include <sstream>
#include <stdexcept>

namespace kiln {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::fp8_e4m3: return 1;
    case DType::fp8_e5m2: return 1;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u16: return 2;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::fp8_e4m3: return "fp8_e4m3";
    case DType::fp8_e5m2: return "fp8_e5m2";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u16: return "u16";
  }
  return "?";
}

const char* device_name(Device device) { return device == Device::cpu ? "cpu" : "cuda"; }

Shape::Shape(std::initializer_list<int64_t> d) {
  if (d.size() > kMaxDims) throw std::invalid_argument("Shape: more than 4 dims");
  for (int64_t v : d) dims[static_cast<size_t>(ndim++)] = v;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= dims[static_cast<size_t>(i)];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim != o.ndim) return false;
  for (int i = 0; i < ndim; ++i)
    if (dims[static_cast<size_t>(i)] != o.dims[static_cast<size_t>(i)]) return false;
  return true;
}

std::string Shape::str() const {
  std::ostringstream s;
  s << '[';
  for (int i = 0; i < ndim; ++i) s << (i ? "," : "") << dims[static_cast<size_t>(i)];
  s << ']';
  return s.str();
}

Tensor Tensor::view(Shape s) const {
  if (s.numel() != numel())
    throw std::invalid_argument("Tensor::view: " + str() + " cannot be viewed as " + s.str());
  Tensor t = *this;
  t.shape = s;
  return t;
}

Tensor Tensor::slice(int64_t offset, Shape s) const {
  if (offset < 0 || offset + s.numel() > numel())
    throw std::invalid_argument("Tensor::slice: [" + std::to_string(offset) + ", +" +
                                std::to_string(s.numel()) + ") out of " + str());
  Tensor t = *this;
  t.data = static_cast<char*>(data) + static_cast<size_t>(offset) * dtype_size(dtype);
  t.shape = s;
  return t;
}

Tensor Tensor::rows(int64_t first, int64_t n) const {
  const int64_t width = dim(-1);
  return slice(first * width, {n, width});
}

std::string Tensor::str() const {
  return std::string(dtype_name(dtype)) + shape.str() + "@" + device_name(device);
}

void expect_shape(const Tensor& t, const Shape& s, const char* what) {
  if (t.shape != s)
    throw std::invalid_argument(std::string(what) + ": expected shape " + s.str() + ", got " +
                                t.str());
}

void expect_dtype(const Tensor& t, DType d, const char* what) {
  if (t.dtype != d)
    throw std::invalid_argument(std::string(what) + ": expected dtype " + dtype_name(d) +
                                ", got " + t.str());
}

}  // namespace kiln
