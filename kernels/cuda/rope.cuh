// Internal to the CUDA ops: rope.cu's rotation, shared by rope_forward, rope_backward and
// attention_decode (which rotates a KV cache's newest row), so all rotate with the same angles.
#pragma once

#include "kernels/cuda/cuda_backend.h"

namespace kiln::cuda {

// Rotates the query and key heads of inp[B,T,qkv_dim] into out (which may be inp), row t of each
// sequence for position t0 + t (or positions[b,t] when defined, i32 in device memory), by -angle
// when `backward`; value heads are copied.
void rope_rotate(const OpCheck& c, cudaStream_t stream, Tensor out, Tensor inp,
                 const AttentionDims& a, const Rope& rope, bool backward, int t0,
                 Tensor positions = Tensor{});

}  // namespace kiln::cuda
