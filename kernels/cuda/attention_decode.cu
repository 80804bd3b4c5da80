// One decoding step against a KV cache (sampling): the newest row of a packed qkv attends over
// every row before it and itself. One block per (query head, sequence); each warp takes every
// kWarps-th key with an online softmax (running max, sum and output, f32), its lanes splitting
// the head's channels, and the warps' partial results are merged at the end. No [T] score row is
// kept, so any cache length runs in the same shared memory. The work is T * hs per head, a tiny
// fraction of the step's GEMMs: the kernel is written to be simple, not fast. With `rotate` the
// newest row's q and k heads are first rotated by rope.cu's own kernel (at position T-1), so a
// decoded token's rotation has the bits of rope_forward's.
#include <cmath>
#include <string>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/rope.cuh"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kWarps = 8;
constexpr int kMaxHeadDim = 256;

// kPer: channels per lane, ceil(hs / 32).
template <int kPer>
__global__ void __launch_bounds__(kWarps * 32)
    attention_decode_kernel(bf16* out, const bf16* qkv, AttentionShape d) {
  const int h = blockIdx.x, b = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kvh = h / d.group;
  const bf16* seq = qkv + static_cast<int64_t>(b) * d.T * d.qkv_stride;
  const bf16* q = seq + static_cast<int64_t>(d.T - 1) * d.qkv_stride + h * d.hs;
  float qr[kPer], acc[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const int i = lane + 32 * e;
    qr[e] = i < d.hs ? to_float(q[i]) : 0.0f;
    acc[e] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;  // this warp's running max and sum of exp(score - m)
  for (int j = warp; j < d.T; j += kWarps) {
    const bf16* row = seq + static_cast<int64_t>(j) * d.qkv_stride;
    const bf16* k = row + d.k_offset + kvh * d.hs;
    const bf16* v = row + d.v_offset + kvh * d.hs;
    float s = 0.0f;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int i = lane + 32 * e;
      if (i < d.hs) s += qr[e] * to_float(k[i]);
    }
    s = warp_sum(s) * d.scale;
    const float m_new = fmaxf(m, s);
    const float rescale = expf(m - m_new), p = expf(s - m_new);
    l = l * rescale + p;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int i = lane + 32 * e;
      if (i < d.hs) acc[e] = acc[e] * rescale + p * to_float(v[i]);
    }
    m = m_new;
  }

  __shared__ float m_s[kWarps], l_s[kWarps], acc_s[kWarps][kPer * 32];
  if (lane == 0) {
    m_s[warp] = m;
    l_s[warp] = l;
  }
#pragma unroll
  for (int e = 0; e < kPer; ++e) acc_s[warp][lane + 32 * e] = acc[e];
  __syncthreads();
  // A warp that had no key (T < kWarps) has m = -inf and adds nothing.
  float M = -INFINITY;
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, m_s[w]);
  float L = 0.0f;
  for (int w = 0; w < kWarps; ++w)
    if (m_s[w] > -INFINITY) L += l_s[w] * expf(m_s[w] - M);
  bf16* o = out + static_cast<int64_t>(b) * d.out_stride + h * d.hs;
  for (int i = threadIdx.x; i < d.hs; i += blockDim.x) {
    float sum = 0.0f;
    for (int w = 0; w < kWarps; ++w)
      if (m_s[w] > -INFINITY) sum += acc_s[w][i] * expf(m_s[w] - M);
    o[i] = from_float<bf16>(sum / L);
  }
}

}  // namespace

void CudaBackend::run_attention_decode(Tensor out, Tensor qkv, const AttentionDims& a, bool rotate,
                                       const Rope& rope) {
  const OpCheck c = op_check("attention_decode");
  if (a.head_dim > kMaxHeadDim)
    c.fail("dims",
           "head_dim " + std::to_string(a.head_dim) + " is over " + std::to_string(kMaxHeadDim));
  const AttentionShape d = attention_shape(qkv, a);
  if (rotate)
    for (int64_t b = 0; b < d.B; ++b) {
      const Tensor newest = qkv.slice((b * d.T + d.T - 1) * a.qkv_dim(), {1, 1, a.qkv_dim()});
      rope_rotate(c, stream_, newest, newest, a, rope, false, d.T - 1);
    }
  const dim3 grid(static_cast<unsigned>(d.NH), static_cast<unsigned>(d.B));
  bf16* o = out.ptr<bf16>();
  const bf16* x = qkv.ptr<bf16>();
  if (d.hs <= 32)
    attention_decode_kernel<1><<<grid, kWarps * 32, 0, stream_>>>(o, x, d);
  else if (d.hs <= 64)
    attention_decode_kernel<2><<<grid, kWarps * 32, 0, stream_>>>(o, x, d);
  else if (d.hs <= 128)
    attention_decode_kernel<4><<<grid, kWarps * 32, 0, stream_>>>(o, x, d);
  else
    attention_decode_kernel<8><<<grid, kWarps * 32, 0, stream_>>>(o, x, d);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
