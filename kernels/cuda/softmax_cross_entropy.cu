// Softmax + cross-entropy over the padded vocabulary, loss and logits gradient in one op, and the
// same loss with the vocabulary split over tensor-parallel ranks (stats, then combine).
// Design choice: one block per row; each thread keeps an ONLINE (max, sum-of-exp) pair over its
// columns of the bf16 logits, the block combines them, and a second pass overwrites the logits
// IN PLACE with dloss_scale * (softmax - onehot) in bf16 (padded columns written as exact 0).
// Full-precision logits or probabilities never exist in memory: 2 reads + 1 write of N x Vp bf16.
// The vocabulary-parallel pair splits the fused kernel at its one reduction: the stats kernel is
// its first pass over a rank's slice, writing (max, sum, target logit) instead of the loss; the
// combine kernel merges the ranks' pairs into the log-sum-exp and runs the same second pass.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kThreads = 512;

// This thread's online (max m, sum s of exp(x - m)) over its columns of x[0, V): kVec columns
// every blockDim.x * kVec (kVec = 8: 16-byte loads, x 16-byte aligned).
template <int kVec>
__device__ inline void online_max_sum(const bf16* x, int V, float& m, float& s) {
  m = -INFINITY;
  s = 0.0f;
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
}

// The block's (max, sum of exp(x - max)) from every thread's pair: returns the max (-inf where
// no thread saw a column), the sum into `sum` (0 then).
__device__ inline float block_max_sum(float m, float s, float* shared, float& sum) {
  const float row_max = block_max(m, shared);
  s = (m == -INFINITY) ? 0.0f : s * expf(m - row_max);
  sum = block_sum(s, shared);
  return row_max;
}

// x[0, Vp) = dloss_scale * (exp(x - lse) - (c == target)) on the columns c < V, exact 0 past
// them, in bf16 (a target outside [0, V) subtracts nothing).
template <int kVec>
__device__ inline void write_dlogits_row(bf16* x, int Vp, int V, int target, float lse,
                                         float dloss_scale) {
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

template <int kVec>
__global__ void softmax_cross_entropy_kernel(float* losses, bf16* logits, const int* targets,
                                             int Vp, int V, float dloss_scale, bool write_dlogits) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  bf16* x = logits + row * Vp;
  const int target = targets[row];
  // Read before any thread can overwrite it (the reductions below hold barriers).
  const float target_logit = to_float(x[target]);
  float m, s, sum;
  online_max_sum<kVec>(x, V, m, s);
  const float row_max = block_max_sum(m, s, shared, sum);
  const float lse = row_max + logf(sum);
  if (threadIdx.x == 0) losses[row] = lse - target_logit;
  if (!write_dlogits) return;
  write_dlogits_row<kVec>(x, Vp, V, target, lse, dloss_scale);
}

// Row n's stats over the first V_here columns of this rank's Vl (its real ones); the target's
// column here is targets[n] - first_col.
template <int kVec>
__global__ void softmax_cross_entropy_stats_kernel(float* stats, const bf16* logits,
                                                   const int* targets, int Vl, int V_here,
                                                   int first_col) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const bf16* x = logits + row * Vl;
  float m, s, sum;
  online_max_sum<kVec>(x, V_here, m, s);
  const float row_max = block_max_sum(m, s, shared, sum);
  if (threadIdx.x != 0) return;
  const int t = targets[row] - first_col;
  float* out = stats + row * kCrossEntropyStats;
  out[kCeMax] = row_max;
  out[kCeSumExp] = sum;
  out[kCeTarget] = (t >= 0 && t < V_here) ? to_float(x[t]) : 0.0f;
}

// Every thread merges the P ranks' stats of its row (3P floats, the same addresses across the
// block: broadcast reads) into the log-sum-exp; then the fused kernel's second pass.
template <int kVec>
__global__ void softmax_cross_entropy_combine_kernel(float* losses, bf16* logits,
                                                     const float* stats_all, const int* targets,
                                                     int64_t N, int P, int Vl, int V_here,
                                                     int first_col, float dloss_scale,
                                                     bool write_dlogits) {
  const int64_t row = blockIdx.x;
  float M = -INFINITY;
  for (int p = 0; p < P; ++p) M = fmaxf(M, stats_all[(p * N + row) * kCrossEntropyStats + kCeMax]);
  float S = 0.0f, z = 0.0f;
  for (int p = 0; p < P; ++p) {
    const float* st = stats_all + (p * N + row) * kCrossEntropyStats;
    if (st[kCeMax] != -INFINITY) S += st[kCeSumExp] * expf(st[kCeMax] - M);
    z += st[kCeTarget];
  }
  const float lse = M + logf(S);
  if (threadIdx.x == 0) losses[row] = lse - z;
  if (!write_dlogits) return;
  write_dlogits_row<kVec>(logits + row * Vl, Vl, V_here, targets[row] - first_col, lse,
                          dloss_scale);
}

// How many of a slice's Vl columns from first_col are real in a vocabulary of V.
int real_columns(int64_t first_col, int Vl, int V) {
  return static_cast<int>(std::clamp<int64_t>(V - first_col, 0, Vl));
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

void CudaBackend::run_softmax_cross_entropy_stats(Tensor stats, Tensor logits, Tensor targets,
                                                  int64_t first_col, int vocab_size) {
  const int Vl = static_cast<int>(logits.dim(-1));
  const int64_t N = matrix_rows(logits);
  if (N == 0) return;
  const int V_here = real_columns(first_col, Vl, vocab_size);
  const int first = static_cast<int>(first_col);
  if (Vl % 8 == 0 && aligned(logits.data, 16))
    softmax_cross_entropy_stats_kernel<8><<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(
        stats.ptr<float>(), logits.ptr<bf16>(), targets.ptr<int>(), Vl, V_here, first);
  else
    softmax_cross_entropy_stats_kernel<1><<<static_cast<unsigned>(N), kThreads, 0, stream_>>>(
        stats.ptr<float>(), logits.ptr<bf16>(), targets.ptr<int>(), Vl, V_here, first);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_softmax_cross_entropy_combine(Tensor losses, Tensor logits, Tensor stats_all,
                                                    Tensor targets, int64_t first_col,
                                                    int vocab_size, float dloss_scale,
                                                    bool write_dlogits) {
  const int Vl = static_cast<int>(logits.dim(-1));
  const int64_t N = matrix_rows(logits);
  if (N == 0) return;
  const int P = static_cast<int>(stats_all.numel() / (N * kCrossEntropyStats));
  const int V_here = real_columns(first_col, Vl, vocab_size);
  const int first = static_cast<int>(first_col);
  // Without dlogits a row is a few dozen flops: one warp per row.
  const int threads = write_dlogits ? kThreads : 32;
  if (Vl % 8 == 0 && aligned(logits.data, 16))
    softmax_cross_entropy_combine_kernel<8><<<static_cast<unsigned>(N), threads, 0, stream_>>>(
        losses.ptr<float>(), logits.ptr<bf16>(), stats_all.ptr<float>(), targets.ptr<int>(), N, P,
        Vl, V_here, first, dloss_scale, write_dlogits);
  else
    softmax_cross_entropy_combine_kernel<1><<<static_cast<unsigned>(N), threads, 0, stream_>>>(
        losses.ptr<float>(), logits.ptr<bf16>(), stats_all.ptr<float>(), targets.ptr<int>(), N, P,
        Vl, V_here, first, dloss_scale, write_dlogits);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
