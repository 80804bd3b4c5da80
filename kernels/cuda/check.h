// Host-side checks shared by every file of the CUDA backend (.cu and .cpp): the check macros
// (every CUDA / cuBLASLt call is checked; a failure throws std::runtime_error naming file:line
// and the failing call), and the small host helpers the launchers share. The ops' arguments are
// checked before they get here, by their contracts (kernels/contracts.h).
#pragma once

#include <algorithm>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "kernels/tensor.h"

namespace kiln {
namespace cuda {

[[noreturn]] void throw_cuda_error(const char* what, const char* call, const char* file, int line);

#define KILN_CUDA_CHECK(call)                                                               \
  do {                                                                                      \
    cudaError_t kiln_err_ = (call);                                                         \
    if (kiln_err_ != cudaSuccess)                                                           \
      ::kiln::cuda::throw_cuda_error(cudaGetErrorString(kiln_err_), #call, __FILE__, __LINE__); \
  } while (0)

#define KILN_CUBLAS_CHECK(call)                                                             \
  do {                                                                                      \
    cublasStatus_t kiln_st_ = (call);                                                       \
    if (kiln_st_ != CUBLAS_STATUS_SUCCESS)                                                  \
      ::kiln::cuda::throw_cuda_error(cublasLtGetStatusString(kiln_st_), #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: catches bad launch configurations at the call site.
#define KILN_CUDA_LAUNCH_CHECK() KILN_CUDA_CHECK(cudaGetLastError())

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Median time in ms of 5 runs of `run` on `stream`, after one untimed run; -1 if `run` returns
// false (a variant that cannot run). Waits for the GPU: for one-off choices at first use.
float median_ms(cudaStream_t stream, const std::function<bool()>& run);

// GELU (tanh form) as a pass of its own over bf16 tensors of one shape, where a GEMM has no GELU
// epilogue (matmul.cu): d *= gelu'(pre) in place, and out = gelu(pre).
void gelu_backward_inplace(Tensor d, Tensor pre, int sm_count, cudaStream_t stream);
void gelu_forward(Tensor out, Tensor pre, int sm_count, cudaStream_t stream);

// True when p is aligned to `bytes` (16 for the packed loads).
inline bool aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}
// True when rows of C values can be read 8 at a time from every pointer given (null pointers,
// absent tensors, are skipped): one 16-byte load of bf16, or two of f32 (norm weights read in
// f32), each aligned where the base is.
inline bool vec8_ok(int64_t C, std::initializer_list<const void*> ptrs) {
  if (C % 8 != 0) return false;
  for (const void* p : ptrs)
    if (p && !aligned(p, 16)) return false;
  return true;
}
// The norms' two-pass weight gradients: N rows cut into at most 256 chunks of at least 32 rows,
// a column sum per chunk, then the chunks' partials added in order (deterministic).
struct RowChunks {
  int64_t rows;  // rows per chunk
  int count;     // chunks
};
inline RowChunks row_chunks(int64_t N) {
  const int64_t rows = ceil_div(N, std::min<int64_t>(ceil_div(N, 32), 256));
  return {rows, ceil_div(N, rows)};
}

}  // namespace cuda
}  // namespace kiln
