// Tensor: a typed, shaped view into memory owned by an Arena (or by a test). It never owns
// memory itself, so copying a Tensor is free and every buffer's lifetime is the arena's: that is
// what lets the trainer plan all memory once and capture whole steps in a CUDA graph.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace kiln {

enum class DType : uint8_t { f32, bf16, fp8_e4m3, fp8_e5m2, i32, i64, u16 };
enum class Device : uint8_t { cpu, cuda };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
const char* device_name(Device device);

constexpr int kMaxDims = 4;

struct Shape {
  std::array<int64_t, kMaxDims> dims{};
  int ndim = 0;

  Shape() = default;
  Shape(std::initializer_list<int64_t> d);
  int64_t numel() const;
  int64_t operator[](int i) const { return dims[static_cast<size_t>(i < 0 ? i + ndim : i)]; }
  bool operator==(const Shape& o) const;
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string str() const;  // "[4,64,128]"
};

struct Tensor {
  void* data = nullptr;
  Shape shape;
  DType dtype = DType::f32;
  Device device = Device::cpu;

  bool defined() const { return data != nullptr; }
  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  int64_t dim(int i) const { return shape[i]; }
  int ndim() const { return shape.ndim; }

  template <class T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  // Same memory, another shape with the same element count.
  Tensor view(Shape s) const;
  // `numel(s)` elements starting `offset` elements in, as shape `s`.
  Tensor slice(int64_t offset, Shape s) const;
  // Rows [first, first + n) as [n, dim(-1)], the tensor read as rows of its last dimension.
  Tensor rows(int64_t first, int64_t n) const;
  // "f32[4,64,128]@cpu"
  std::string str() const;
};

// Throws std::invalid_argument naming `what` when the tensor's shape or dtype differ.
void expect_shape(const Tensor& t, const Shape& s, const char* what);
void expect_dtype(const Tensor& t, DType d, const char* what);

}  // namespace kiln
