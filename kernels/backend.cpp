#include "kernels/backend.h"

#include <stdexcept>

namespace kiln {

OpCheck Backend::op_check(const char* op) const {
  return OpCheck{op, device(), activation_dtype()};
}

#ifndef KILN_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend(int) {
  throw std::runtime_error("this kiln was built without CUDA (KILN_CUDA=OFF or no nvcc)");
}
bool cuda_available() { return false; }
int cuda_device_count() { return 0; }
bool cuda_device_memory(int, std::string*, size_t*) { return false; }
#endif

}  // namespace kiln
