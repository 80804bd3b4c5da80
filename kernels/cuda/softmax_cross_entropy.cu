// Fused softmax + cross-entropy over the padded vocabulary, loss and logits gradient in one op.
// Design choice: one block per row; each thread keeps an ONLINE (max, sum-of-exp) pair over its
// columns of the bf16 logits, the block combines them, and a second pass overwrites the logits
// IN PLACE with dloss_scale * (softmax - onehot) in bf16 (padded columns written as exact 0).
// Full-precision logits or probabilities never exist in memory: 2 reads + 1 write of N x Vp bf16.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kThreads = 512;

template <int kVec>
__global__ void softmax_cross_entropy_kernel(float* losses, bf16* logits, const int* targets,
                                             int Vp, int V, float dloss_scale,
                                             bool write_dlogits) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  bf16* x = logits + row * Vp;
  const int target = targets[row];
  // Read before any thread can overwrite it (the reductions below hold barriers).
  const float target_logit = to_float(x[target]);
  float m = -INFINITY, s = 0.0f;
  for (int c0 = threadIdx.x * kVec; c0 < V; c0 += blockDim.x * kVec) {
    float v[kVec];
    if constexpr (kVec == 8) {
      Packed128<bf16> p = load128(x + c0);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = to_float(p[k]);
    } else {
      v[0] = to_float(x[c0]);
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (c0 + k >= V) break;
      if (v[k] > m) {
        s = s * expf(m - v[k]) + 1.0f;
        m = v[k];
      } else {
        s += expf(v[k] - m);
      }
    }
  }
  const float row_max = block_max(m, shared);
  s = (m == -INFINITY) ? 0.0f : s * expf(m - row_max);
  const float lse = row_max + logf(block_sum(s, shared));
  if (threadIdx.x == 0) losses[row] = lse - target_logit;
  if (!write_dlogits) return;
  for (int c0 = threadIdx.x * kVec; c0 < Vp; c0 += blockDim.x * kVec) {
    if constexpr (kVec == 8) {
      Packed128<bf16> p = load128(x + c0);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int c = c0 + k;
        float d = 0.0f;
        if (c < V) d = dloss_scale * (expf(to_float(p[k]) - lse) - (c == target ? 1.0f : 0.0f));
        p[k] = __float2bfloat16_rn(d);
      }
      store128(x + c0, p);
    } else {
      float d = 0.0f;
      if (c0 < V) d = dloss_scale * (expf(to_float(x[c0]) - lse) - (c0 == target ? 1.0f : 0.0f));
      x[c0] = __float2bfloat16_rn(d);
    }
  }
}

}  // namespace

void CudaBackend::run_softmax_cross_entropy(Tensor losses, Tensor logits, Tensor targets,
                                            int vocab_size, float dloss_scale, bool write_dlogits) {
  const int Vp = static_cast<int>(logits.dim(-1));
  const int64_t N = logits.numel() / Vp;
  if (N == 0) return;
  if (Vp % 8 == 0 && aligned(logits.data, 16))
    softmax_cross_entropy_kernel<8><<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(
        losses.ptr<float>(), logits.ptr<bf16>(), targets.ptr<int>(), Vp, vocab_size,
        dloss_scale, write_dlogits);
  else
    softmax_cross_entropy_kernel<1><<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(
        losses.ptr<float>(), logits.ptr<bf16>(), targets.ptr<int>(), Vp, vocab_size,
        dloss_scale, write_dlogits);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
