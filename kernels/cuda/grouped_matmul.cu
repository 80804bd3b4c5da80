// Grouped GEMM for the MoE experts (reference: kernels/cpu/grouped_matmul.cpp): rows
// [offsets[e], offsets[e+1]) of the input through expert e's weight.
//   forward:  out[m, o] = sum_c inp[m, c] W[e][o, c]            (+ GELU epilogue)
//   dinp:     dinp[m, c] = sum_o dout[m, o] W[e][o, c]          (* gelu'(pre))
//   dweight:  dW[e][o, c] += sum_{m in e} dout[m, o] inp[m, c]  (f32)
// Offsets in device memory go to CUTLASS's grouped GEMM (grouped_matmul_cutlass.cu), one launch
// a call that reads the group sizes on the device: no sync, and a graph can capture it. Offsets
// in host memory (the MoE layer's copy, once per pass, where the backend reads no device
// offsets: no CUTLASS, expert parallelism) run every non-empty group as a cuBLASLt GEMM
// (grouped_matmul_*_by_group, matmul.cu). With device offsets GELU is a pass of its own over
// all M rows after the GEMM (the groups cover them all). Device offsets the CUTLASS path cannot
// take (unaligned operands, widths not multiples of 8) are copied to the host, warning once.
// cuBLAS 13.0's grouped GEMM (cublasGemmGroupedBatchedEx) takes host sizes too. A WMMA kernel
// that read the offsets on the device ran the experts at ~40 TFLOP/s on an H100; it is gone.
#include <spdlog/spdlog.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr const char* kNotTaken =
    "CUTLASS's grouped GEMM does not take these operands here (sm_90, C and OC multiples of 8, "
    "16-byte alignment)";

void check_grouped(const Tensor& inp, const Tensor& weight, const Tensor& offsets,
                   const char* op) {
  expect_activation(inp, op, "inp");
  expect_activation(weight, op, "weight");
  if (inp.ndim() != 2 || weight.ndim() != 3 || weight.dim(2) != inp.dim(1) ||
      offsets.dtype != DType::i32 || offsets.numel() != weight.dim(0) + 1)
    throw std::invalid_argument(std::string("cuda ") + op + ": inp " + inp.str() + ", weight " +
                                weight.str() + " and offsets " + offsets.str() +
                                " must be [M,C], [E,OC,C] and i32[E+1]");
}

}  // namespace

const int* CudaBackend::host_group_offsets(Tensor offsets, int64_t rows, const char* op) const {
  if (capturing_)
    throw std::runtime_error(std::string("cuda ") + op + ": the group sizes are read on the " +
                             "host, which a CUDA graph cannot capture");
  if (offsets.device != Device::cpu)
    throw std::invalid_argument(std::string("cuda ") + op + ": offsets " + offsets.str() +
                                " must be in host memory (copy them once for a pass's calls)");
  const int* o = offsets.ptr<int>();
  for (int64_t e = 0; e + 1 < offsets.numel(); ++e)
    if (o[0] != 0 || o[e] > o[e + 1] || o[e + 1] > rows)
      throw std::logic_error(std::string("cuda ") + op + ": group offsets " +
                             std::to_string(o[e]) + ", " + std::to_string(o[e + 1]) +
                             " at group " + std::to_string(e) + " do not split " +
                             std::to_string(rows) + " rows");
  return o;
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

void CudaBackend::grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, Tensor offsets,
                                         Tensor pre_gelu) {
  const char* op = "grouped_matmul_forward";
  check_grouped(inp, weight, offsets, op);
  const int64_t M = inp.dim(0), OC = weight.dim(1);
  expect_activation(out, op, "out");
  expect_numel(out, M * OC, op, "out");
  if (pre_gelu.defined()) {
    expect_activation(pre_gelu, op, "pre_gelu");
    expect_numel(pre_gelu, M * OC, op, "pre_gelu");
  }
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

void CudaBackend::grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                                          Tensor weight, Tensor offsets, Tensor inp_pre_gelu) {
  const char* op = "grouped_matmul_backward";
  check_grouped(inp, weight, offsets, op);
  const int64_t M = inp.dim(0), C = inp.dim(1), OC = weight.dim(1);
  expect_activation(dout, op, "dout");
  expect_numel(dout, M * OC, op, "dout");
  expect_f32(dweight, op, "dweight");
  expect_numel(dweight, weight.numel(), op, "dweight");
  if (dinp.defined()) {
    expect_activation(dinp, op, "dinp");
    expect_numel(dinp, M * C, op, "dinp");
  }
  if (inp_pre_gelu.defined()) {
    expect_activation(inp_pre_gelu, op, "inp_pre_gelu");
    expect_numel(inp_pre_gelu, M * C, op, "inp_pre_gelu");
  }
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
