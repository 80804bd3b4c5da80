// CpuBackend memory and transfers. Device memory is host memory: allocate() returns zero-filled
// memory aligned to 256 bytes (the same alignment the Arena keeps for every buffer, and enough
// for any SIMD load), copies are memcpy, and synchronize() has nothing to wait for.
// copy() converts f32 <-> bf16 with round-to-nearest-even (kernels/bf16.h).
#include "kernels/cpu/cpu_backend.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "kernels/bf16.h"
#include "kernels/cpu/parallel.h"

namespace kiln {

namespace {

constexpr size_t kAlign = 256;

// std::bad_alloc that says how much was asked for.
class CpuAllocError : public std::bad_alloc {
 public:
  explicit CpuAllocError(size_t bytes)
      : msg_("cpu allocate: cannot allocate " + std::to_string(bytes) + " bytes of host memory") {}
  const char* what() const noexcept override { return msg_.c_str(); }

 private:
  std::string msg_;
};

}  // namespace

void* CpuBackend::allocate(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kAlign, bytes == 0 ? kAlign : bytes) != 0) throw CpuAllocError(bytes);
  std::memset(p, 0, bytes);
  return p;
}

void CpuBackend::release(void* p) noexcept {
  std::free(p);
}

void CpuBackend::copy_from_host(Tensor dst, const void* src) {
  op_check("copy_from_host").defined("dst", dst);
  std::memcpy(dst.data, src, dst.nbytes());
}

void CpuBackend::copy_to_host(void* dst, Tensor src) {
  op_check("copy_to_host").defined("src", src);
  std::memcpy(dst, src.data, src.nbytes());
}

void CpuBackend::copy(Tensor dst, Tensor src) {
  const OpCheck c = op_check("copy");
  c.defined("dst", dst);
  c.defined("src", src);
  c.numel("dst", dst, src.numel());
  const int64_t n = src.numel();
  if (dst.dtype == src.dtype) {
    std::memmove(dst.data, src.data, src.nbytes());
  } else if (dst.dtype == DType::bf16 && src.dtype == DType::f32) {
    uint16_t* d = dst.ptr<uint16_t>();
    const float* s = src.ptr<float>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(n))
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]);
  } else if (dst.dtype == DType::f32 && src.dtype == DType::bf16) {
    float* d = dst.ptr<float>();
    const uint16_t* s = src.ptr<uint16_t>();
#pragma omp parallel for schedule(static) if (cpu::worth_parallel(n))
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
  } else {
    c.fail("dst", std::string("cannot convert ") + src.str() + " to " + dst.str() +
                      " (only f32 <-> bf16 converts)");
  }
}

void CpuBackend::fill_zero(Tensor t) {
  op_check("fill_zero").defined("t", t);
  std::memset(t.data, 0, t.nbytes());
}

std::unique_ptr<Backend> make_cpu_backend() {
  return std::make_unique<CpuBackend>();
}

}  // namespace kiln
