// Internal to the attention files: the dimensions every implementation derives from qkv, and
// the shared delta = rowsum(dout * out) pre-pass of the backward.
#pragma once

#include "kernels/cuda/cuda_backend.h"

namespace kiln {
namespace cuda {

struct AttentionDims {
  int B = 0, T = 0, C = 0, NH = 0, hs = 0;
  float scale = 1.0f;
};

AttentionDims attention_dims(const Tensor& qkv, int n_head, const char* op);
// delta f32[B,NH,T] in the backend's scratch (valid until the next op that uses scratch).
float* attention_delta(CudaBackend& backend, const AttentionDims& d, const Tensor& dout,
                       const Tensor& out);

}  // namespace cuda
}  // namespace kiln
