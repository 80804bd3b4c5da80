// Grouped GEMM for the MoE experts (reference: kernels/cpu/grouped_matmul.cpp): rows
// [offsets[e], offsets[e+1]) of the input through expert e's weight.
//   forward:  out[m, o] = sum_c inp[m, c] W[e][o, c]            (+ GELU epilogue)
//   dinp:     dinp[m, c] = sum_o dout[m, o] W[e][o, c]          (* gelu'(pre))
//   dweight:  dW[e][o, c] += sum_{m in e} dout[m, o] inp[m, c]  (f32)
// Offsets in device memory go to CUTLASS's grouped GEMM (grouped_matmul_sm90.cu), one launch
// a call that reads the group sizes on the device: no sync, and a graph can capture it. Offsets
// in host memory (the MoE layer's copy, once per pass, where the backend reads no device
// offsets: any GPU but Hopper, a build without the sm_90a kernels, KILN_PORTABLE_KERNELS, expert
// parallelism) run every non-empty group as a cuBLASLt GEMM
// (grouped_matmul_*_by_group, matmul.cu). With device offsets GELU is a pass of its own over
// all M rows after the GEMM (the groups cover them all). Device offsets the CUTLASS path cannot
// take (unaligned operands, widths not multiples of 8) are copied to the host, warning once.
// cuBLAS 13.0's grouped GEMM (cublasGemmGroupedBatchedEx) takes host sizes too. Device offsets
// go to CUTLASS, not a kernel of our own: a WMMA kernel reading them ran the experts at only
// ~40 TFLOP/s on an H100.
#include <spdlog/spdlog.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr const char* kNotTaken =
    "CUTLASS's grouped GEMM does not take these operands here (the sm_90a kernels, C and OC "
    "multiples of 8, 16-byte alignment)";

}  // namespace

bool CudaBackend::grouped_takes_device_offsets(const Tensor& inp, const Tensor& weight,
                                               const Tensor& out) const {
  return sm90_kernels_ && inp.dim(1) % 8 == 0 && weight.dim(1) % 8 == 0 && aligned(inp.data, 16) &&
         aligned(weight.data, 16) && aligned(out.data, 16);
}

#ifndef KILN_WITH_SM90_KERNELS
struct GroupedGemms {};
void GroupedGemmsDeleter::operator()(GroupedGemms* p) const {
  delete p;
}
void CudaBackend::grouped_matmul_forward_device(Tensor, Tensor, Tensor, Tensor) {
  throw std::logic_error("cuda grouped GEMM: built without the sm_90a kernels");
}
void CudaBackend::grouped_matmul_backward_device(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor) {
  throw std::logic_error("cuda grouped GEMM: built without the sm_90a kernels");
}
#endif

const int* CudaBackend::host_group_offsets(Tensor offsets, int64_t rows, const char* op) const {
  if (capturing_)
    throw std::runtime_error(std::string("cuda ") + op + ": the group sizes are read on the " +
                             "host, which a CUDA graph cannot capture");
  op_check(op).offsets("offsets", offsets, offsets.numel() - 1, rows, /*to_the_end=*/false);
  return offsets.ptr<int>();
}

const int* CudaBackend::group_offsets_to_host(Tensor offsets, int64_t rows, const char* op,
                                              const char* why) {
  if (!grouped_fallback_logged_) {
    spdlog::warn("cuda {}: {}; the group offsets are copied to the host (a stream sync a call)",
                 op, why);
    grouped_fallback_logged_ = true;
  }
  grouped_host_offsets_.resize(static_cast<size_t>(offsets.numel()));
  copy_to_host(grouped_host_offsets_.data(), offsets);
  return host_group_offsets(
      Tensor{grouped_host_offsets_.data(), offsets.shape, DType::i32, Device::cpu}, rows, op);
}

void CudaBackend::run_grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor offsets,
                                             Tensor pre_gelu) {
  const char* op = "grouped_matmul_forward";
  const int64_t M = inp.dim(0);
  if (M == 0) return;
  if (offsets.device != Device::cuda) {
    grouped_matmul_forward_by_group(out, inp, weight, pre_gelu,
                                    host_group_offsets(offsets, M, op));
  } else if (!grouped_takes_device_offsets(inp, weight, pre_gelu.defined() ? pre_gelu : out)) {
    grouped_matmul_forward_by_group(out, inp, weight, pre_gelu,
                                    group_offsets_to_host(offsets, M, op, kNotTaken));
  } else if (pre_gelu.defined()) {
    // No GELU epilogue: the GEMM writes pre_gelu, then a pass over all M rows writes out.
    grouped_matmul_forward_device(pre_gelu, inp, weight, offsets);
    gelu_forward(out, pre_gelu, sm_count_, stream_);
  } else {
    grouped_matmul_forward_device(out, inp, weight, offsets);
  }
}

void CudaBackend::run_grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                                              Tensor weight, Tensor offsets, Tensor inp_pre_gelu) {
  const char* op = "grouped_matmul_backward";
  const int64_t M = inp.dim(0);
  if (M == 0) return;
  if (offsets.device != Device::cuda) {
    grouped_matmul_backward_by_group(dinp, dweight, dout, inp, weight, inp_pre_gelu,
                                     host_group_offsets(offsets, M, op));
  } else if (!grouped_takes_device_offsets(inp, weight, dout) ||
             (dinp.defined() && !aligned(dinp.data, 16)) || !aligned(dweight.data, 16)) {
    grouped_matmul_backward_by_group(dinp, dweight, dout, inp, weight, inp_pre_gelu,
                                     group_offsets_to_host(offsets, M, op, kNotTaken));
  } else {
    grouped_matmul_backward_device(dinp, dweight, dout, inp, weight, offsets);
    if (dinp.defined() && inp_pre_gelu.defined())
      gelu_backward_inplace(dinp, inp_pre_gelu, sm_count_, stream_);
  }
}

}  // namespace kiln
