// Argument checks shared by every Communicator, and the NCCL factory's stand-in for builds
// without CUDA (nccl_communicator.cpp compiles to nothing there).
#include "dist/communicator.h"

#include <stdexcept>

#include "kernels/error.h"

namespace kiln {

void check_collective(const std::string& who, const char* op, const Tensor& out, const Tensor& in,
                      int64_t in_chunks, int64_t out_chunks) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(who + " " + op + "(out " + out.str() + ", in " + in.str() +
                                "): " + why);
  };
  if (!out.defined() || !in.defined()) fail("undefined tensor");
  if (out.dtype != in.dtype) fail("dtypes differ");
  if (out.device != in.device) fail("devices differ");
  if (out.numel() * out_chunks != in.numel() * in_chunks)
    fail("element counts do not match the world size");
}

#ifndef KILN_WITH_CUDA
std::unique_ptr<Communicator> make_nccl_communicator(StoreClient&, int, int, int, void*, int,
                                                     const std::string&) {
  throw InputError("NCCL needs a CUDA build of kiln; this one is CPU-only (use gloo)");
}
#endif

}  // namespace kiln
