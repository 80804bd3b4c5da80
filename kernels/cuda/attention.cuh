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
  // Document masking: key_start[b*T + t] is query t's first key (attention_forward's contract:
  // <= t, never decreasing in t); nullptr: 0, plain causal.
  const int* key_start = nullptr;
};

#ifdef __CUDACC__
// Query t's first key in sequence b.
__device__ inline int first_key(const AttentionShape& d, int b, int t) {
  return d.key_start ? d.key_start[static_cast<int64_t>(b) * d.T + t] : 0;
}
#endif

// The shape of qkv as `a` splits it (the op's contract has checked that they agree), with
// key_start's device pointer when it is defined.
AttentionShape attention_shape(const Tensor& qkv, const AttentionDims& a,
                               const Tensor& key_start = Tensor{});
// delta f32[B,NH,T] in the backend's scratch (valid until the next op that uses scratch).
float* attention_delta(CudaBackend& backend, const AttentionShape& d, const Tensor& dout,
                       const Tensor& out);

}  // namespace cuda
}  // namespace kiln
