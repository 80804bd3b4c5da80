#include "kernels/backend.h"

#include <cstdlib>
#include <new>
#include <stdexcept>

namespace kiln {

void* Backend::allocate_host(size_t bytes) {
  void* p = std::calloc(bytes == 0 ? 1 : bytes, 1);
  if (!p) throw std::bad_alloc();
  return p;
}

void Backend::release_host(void* p) { std::free(p); }

#ifndef KILN_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend(int) {
  throw std::runtime_error("this kiln was built without CUDA (KILN_CUDA=OFF or no nvcc)");
}
bool cuda_available() { return false; }
int cuda_device_count() { return 0; }
#endif

}  // namespace kiln
