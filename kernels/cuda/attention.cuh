// Internal to the attention files: the shape every implementation derives from qkv and the
// op's AttentionDims, and the shared delta = rowsum(dout * out) pre-pass of the backward.
#pragma once

#include "kernels/cuda/cuda_backend.h"

namespace kiln {
namespace cuda {

// qkv[B,T,qkv_stride]: per token NH query heads, then KV key heads, then KV value heads, each hs
// wide. Query head h reads kv head h / group. Offsets are in elements within a token's row.
struct AttentionShape {
  int B = 0, T = 0, NH = 0, KV = 0, hs = 0;
  int group = 1;       // NH / KV: query heads per kv head
  int qkv_stride = 0;  // (NH + 2 KV) hs
  int out_stride = 0;  // NH hs
  int k_offset = 0;    // NH hs: the first key head
  int v_offset = 0;    // (NH + KV) hs: the first value head
  float scale = 1.0f;  // 1 / sqrt(hs)
};

// The shape of qkv as `a` splits it (the op's contract has checked that they agree).
AttentionShape attention_shape(const Tensor& qkv, const AttentionDims& a);
// delta f32[B,NH,T] in the backend's scratch (valid until the next op that uses scratch).
float* attention_delta(CudaBackend& backend, const AttentionShape& d, const Tensor& dout,
                       const Tensor& out);

}  // namespace cuda
}  // namespace kiln
