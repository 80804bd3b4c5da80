#include "kernels/device_runtime.h"

#include <cstdlib>
#include <new>

namespace kiln {

void* DeviceRuntime::allocate_host(size_t bytes) {
  void* p = std::calloc(bytes == 0 ? 1 : bytes, 1);
  if (!p) throw std::bad_alloc();
  return p;
}

void DeviceRuntime::release_host(void* p) noexcept {
  std::free(p);
}

}  // namespace kiln
