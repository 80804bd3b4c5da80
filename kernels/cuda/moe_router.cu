// Mixture-of-Experts routing on the GPU (the reference is kernels/cpu/moe_router.cpp). One warp
// per token: lane l holds experts l, l + 32, ... (E <= 256), so softmax, sigmoid, entropy and
// each top-k arg-max are warp reductions with no shared memory, and the k picks run in
// registers. Everything summed over tokens (counts, the aux loss's mean scores, z, entropy) goes
// through float atomics into scratch and one tiny kernel folds it into the layer's statistics:
// counts are integers (exact in f32), the rest is telemetry, so atomic order does not matter
// for training. Ties pick the lower expert, as on the CPU.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kMaxPerLane = 8;  // experts per lane: E <= 256
constexpr int kWarps = 4;       // tokens per block

// Arg-max over the warp of (v, i), ties to the lower index; every lane gets the result.
__device__ inline void warp_argmax(float& v, int& i) {
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
    if (v2 > v || (v2 == v && i2 < i)) v = v2, i = i2;
  }
}

// Loads a token's logits into the lane's slots (-inf past E) and returns logsumexp; p gets the
// softmax.
__device__ inline float load_softmax(const bf16* row, int E, float (&l)[kMaxPerLane],
                                     float (&p)[kMaxPerLane]) {
  const int lane = threadIdx.x % 32;
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int e = lane + 32 * i;
    l[i] = e < E ? to_float(row[e]) : -INFINITY;
    mx = fmaxf(mx, l[i]);
  }
  mx = warp_max(mx);
  float sum = 0;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) sum += (p[i] = lane + 32 * i < E ? expf(l[i] - mx) : 0.0f);
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) p[i] /= sum;
  return mx + logf(sum);
}

// sums: [E] the tokens' p summed per expert, then z (sum lse^2), then entropy; counts: [E].
__global__ void router_forward_kernel(float* scores, int* topk_idx, float* topk_w, float* counts,
                                      float* sums, const bf16* logits, const float* bias, int64_t N,
                                      int E, int K, bool sigmoid, bool renormalize) {
  const int64_t n = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32;
  if (n >= N) return;
  const int lane = threadIdx.x % 32;
  float l[kMaxPerLane], p[kMaxPerLane], s[kMaxPerLane];
  const float lse = load_softmax(logits + n * E, E, l, p);
  if (sigmoid) {
    float sum = 0;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i)
      sum += (s[i] = lane + 32 * i < E ? 1.0f / (1.0f + expf(-l[i])) : 0.0f);
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) p[i] = s[i] / sum;
  } else {
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) s[i] = p[i];
  }
  float h = 0;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int e = lane + 32 * i;
    if (e >= E) continue;
    scores[n * E + e] = s[i];
    if (p[i] > 0) h -= p[i] * logf(p[i]);
    if (sums) atomicAdd(&sums[e], p[i]);
  }
  h = warp_sum(h);
  bool taken[kMaxPerLane] = {};
  float w[32];  // k <= 32: the picks' scores, the same in every lane
  float wsum = 0;
  for (int j = 0; j < K; ++j) {
    float v = -INFINITY;
    int best = 1 << 30;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e >= E || taken[i]) continue;
      const float sel = s[i] + (bias ? bias[e] : 0.0f);
      if (sel > v || (sel == v && e < best)) v = sel, best = e;
    }
    warp_argmax(v, best);
    float mine = 0;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i)
      if (lane + 32 * i == best) taken[i] = true, mine = s[i];
    w[j] = __shfl_sync(0xffffffffu, mine, best % 32);
    wsum += w[j];
    if (lane == 0) {
      topk_idx[n * K + j] = best;
      atomicAdd(&counts[best], 1.0f);
    }
  }
  if (lane == 0) {
    for (int j = 0; j < K; ++j) topk_w[n * K + j] = renormalize ? w[j] / wsum : w[j];
    if (sums) {
      atomicAdd(&sums[E], lse * lse);
      atomicAdd(&sums[E + 1], h);
    }
  }
}

// stats += counts, aux * N, z, entropy, N (one block).
__global__ void router_stats_kernel(float* stats, const float* counts, const float* sums, int64_t N,
                                    int E, int K) {
  __shared__ float shared[32];
  float aux = 0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    aux += counts[e] / static_cast<float>(N * K) * sums[e] / static_cast<float>(N);
    stats[e] += counts[e];
  }
  aux = block_sum(aux, shared);
  if (threadIdx.x == 0) {
    stats[E + kMoeAux] += E * aux * static_cast<float>(N);
    stats[E + kMoeZ] += sums[E];
    stats[E + kMoeEntropy] += sums[E + 1];
    stats[E + kMoeTokens] += static_cast<float>(N);
  }
}

__global__ void router_backward_kernel(bf16* dlogits, const float* dtopk_w, const bf16* logits,
                                       const float* scores, const int* topk_idx,
                                       const float* counts, int64_t N, int E, int K, bool sigmoid,
                                       bool renormalize, float aux_scale, float dz) {
  const int64_t n = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32;
  if (n >= N) return;
  const int lane = threadIdx.x % 32;
  const float* sn = scores + n * E;
  const int* in = topk_idx + n * K;
  const float* gn = dtopk_w + n * K;
  float d[kMaxPerLane] = {}, s[kMaxPerLane], daux[kMaxPerLane];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int e = lane + 32 * i;
    s[i] = e < E ? sn[e] : 0.0f;
    daux[i] = e < E ? aux_scale * counts[e] : 0.0f;
  }
  // Through the (renormalized) top-k weights into the scores.
  float ssum = 0, gw = 0;
  for (int j = 0; j < K; ++j) ssum += sn[in[j]];
  if (renormalize)
    for (int j = 0; j < K; ++j) gw += gn[j] * sn[in[j]] / ssum;
  for (int j = 0; j < K; ++j) {
    const int e = in[j];
    if (e % 32 == lane) d[e / 32] += renormalize ? (gn[j] - gw) / ssum : gn[j];
  }
  if (!sigmoid) {
    float dot = 0;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) dot += (d[i] += daux[i]) * s[i];
    dot = warp_sum(dot);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) d[i] = s[i] * (d[i] - dot);
  } else {
    float sum = 0, dp = 0;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) sum += s[i];
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) dp += daux[i] * s[i] / sum;
    dp = warp_sum(dp);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i)
      d[i] = (d[i] + (daux[i] - dp) / sum) * s[i] * (1.0f - s[i]);
  }
  if (dz != 0) {
    float l[kMaxPerLane], p[kMaxPerLane];
    const float lse = load_softmax(logits + n * E, E, l, p);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) d[i] += dz * lse * p[i];
  }
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int e = lane + 32 * i;
    if (e < E) dlogits[n * E + e] = from_float<bf16>(d[i]);
  }
}

__global__ void bias_update_kernel(float* bias, const float* counts, int E, float rate) {
  __shared__ float shared[32];
  float sum = 0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) sum += counts[e];
  const float mean = block_sum(sum, shared) / static_cast<float>(E);
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    bias[e] += counts[e] < mean ? rate : counts[e] > mean ? -rate : 0.0f;
}

// The kernels hold a token's scores in a warp (kMaxPerLane a lane) and its top-k in lanes.
void check_routing(const OpCheck& c, const MoeRouting& r) {
  if (r.n_experts > 32 * kMaxPerLane || r.top_k > 32)
    c.fail("r", "needs top_k <= 32 and n_experts <= " + std::to_string(32 * kMaxPerLane) +
                    ", got top_k " + std::to_string(r.top_k) + " of " +
                    std::to_string(r.n_experts));
}

}  // namespace

void CudaBackend::run_moe_router_forward(Tensor scores, Tensor topk_idx, Tensor topk_w,
                                         Tensor counts, Tensor stats, Tensor logits, Tensor bias,
                                         const MoeRouting& r) {
  check_routing(op_check("moe_router_forward"), r);
  const int64_t N = logits.dim(0);
  const int E = r.n_experts, K = r.top_k;
  if (N == 0) return;
  float* sums = nullptr;
  if (stats.defined()) {
    sums = static_cast<float*>(scratch((E + 2) * sizeof(float)));
    KILN_CUDA_CHECK(cudaMemsetAsync(sums, 0, (E + 2) * sizeof(float), stream_));
  }
  KILN_CUDA_CHECK(cudaMemsetAsync(counts.data, 0, E * sizeof(float), stream_));
  router_forward_kernel<<<ceil_div(N, kWarps), 32 * kWarps, 0, stream_>>>(
      scores.ptr<float>(), topk_idx.ptr<int>(), topk_w.ptr<float>(), counts.ptr<float>(), sums,
      logits.ptr<bf16>(), bias.defined() ? bias.ptr<float>() : nullptr, N, E, K,
      r.score == MoeScore::sigmoid, r.renormalize);
  KILN_CUDA_LAUNCH_CHECK();
  if (stats.defined()) {
    router_stats_kernel<<<1, 256, 0, stream_>>>(stats.ptr<float>(), counts.ptr<float>(), sums, N, E,
                                                K);
    KILN_CUDA_LAUNCH_CHECK();
  }
}

void CudaBackend::run_moe_router_backward(Tensor dlogits, Tensor dtopk_w, Tensor logits,
                                          Tensor scores, Tensor topk_idx, Tensor counts,
                                          const MoeRouting& r, float loss_scale) {
  check_routing(op_check("moe_router_backward"), r);
  const int64_t N = logits.dim(0);
  const int E = r.n_experts, K = r.top_k;
  if (N == 0) return;
  // d(loss_scale * coef * aux) / dp[n,e] = aux_scale * counts[e].
  const float aux_scale = loss_scale * r.aux_loss_coef * static_cast<float>(E) /
                          static_cast<float>(N * K) / static_cast<float>(N);
  const float dz = loss_scale * r.z_loss_coef * 2.0f / static_cast<float>(N);
  router_backward_kernel<<<ceil_div(N, kWarps), 32 * kWarps, 0, stream_>>>(
      dlogits.ptr<bf16>(), dtopk_w.ptr<float>(), logits.ptr<bf16>(), scores.ptr<float>(),
      topk_idx.ptr<int>(), counts.ptr<float>(), N, E, K, r.score == MoeScore::sigmoid,
      r.renormalize, aux_scale, dz);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_moe_bias_update(Tensor bias, Tensor counts, float rate) {
  bias_update_kernel<<<1, 256, 0, stream_>>>(bias.ptr<float>(), counts.ptr<float>(),
                                             static_cast<int>(bias.numel()), rate);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
