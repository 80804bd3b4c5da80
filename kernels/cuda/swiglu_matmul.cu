// swiglu_matmul_backward: the backward of out = swiglu(pre) @ weight^T (the SwiGLU MLP's proj)
// with SwiGLU's backward in the input-gradient GEMM's epilogue, so that the [N,F] gradient
// w.r.t. swiglu's output never reaches memory:
//   dpre[N,2F] = swiglu_backward(dout[N,C] @ weight[C,F], pre)   (swiglu_matmul_sm90.cu)
//   dweight += dout^T @ act, dbias += column sums of dout          (matmul_backward, cuBLASLt)
// The fused GEMM is a CUTLASS sm90 kernel, built for sm_90a alone: it runs where the backend
// runs the Hopper kernels (sm90_kernels(): built, a compute capability 9.0 GPU, no
// KILN_PORTABLE_KERNELS) and C and F are multiples of 8 with 16-byte aligned operands.
// Elsewhere (any other GPU, unaligned shapes) the op is the two calls it replaces, through the
// dact scratch.
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

bool CudaBackend::swiglu_dgrad_fusable(const Tensor& dpre, const Tensor& dout, const Tensor& weight,
                                       const Tensor& pre) const {
  const int64_t C = weight.dim(0), F = weight.dim(1);
  return sm90_kernels_ && C % 8 == 0 && F % 8 == 0 && dout.numel() / C <= INT32_MAX &&
         aligned(dpre.data, 16) && aligned(dout.data, 16) && aligned(weight.data, 16) &&
         aligned(pre.data, 16);
}

#ifndef KILN_WITH_SM90_KERNELS
void CudaBackend::swiglu_dgrad(Tensor, Tensor, Tensor, Tensor) {
  throw std::logic_error("swiglu_matmul_backward: built without the sm_90a kernels");
}
#endif

void CudaBackend::run_swiglu_matmul_backward(Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout,
                                             Tensor act, Tensor weight, Tensor pre, Tensor dact,
                                             bool accumulate) {
  if (!swiglu_fused_ || !swiglu_dgrad_fusable(dpre, dout, weight, pre)) {
    matmul_backward(dact, dweight, dbias, dout, act, weight, Tensor{}, accumulate);
    swiglu_backward(dpre, dact, pre);
    return;
  }
  // The weight's gradient first, then the fused input gradient.
  matmul_backward(Tensor{}, dweight, dbias, dout, act, weight, Tensor{}, accumulate);
  if (pre.numel() == 0) return;
  swiglu_dgrad(dpre, dout, weight, pre);
}

}  // namespace kiln
