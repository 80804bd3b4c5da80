// Causal self-attention: backend selection, argument checks, and the NAIVE kernels.
// Three implementations share one contract so any forward's lse feeds any backward:
// qkv [B,T,3,NH,hs] bf16, out [B,T,NH,hs] bf16, lse f32[B,NH,T] = natural log-sum-exp of the
// scaled scores (scale 1/sqrt(hs)) over the causal row, and dqkv in qkv's layout.
//  - naive (here): one block per (b, h, query row) builds the row's scores in shared memory.
//    O(T^2 hs) work, no tiling: the test oracle, not a training path.
//  - flash (attention_flash.cu): tiled online-softmax forward, two-kernel deterministic
//    backward, f32 accumulation.
//  - cudnn (attention_cudnn.cpp): cuDNN's fused SDPA through the frontend graph API.
// The backward kernels here and in flash are deterministic: dq by query rows, dk/dv by key
// rows, no atomics.
#include <spdlog/spdlog.h>

#include <cmath>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace cuda {

AttentionDims attention_dims(const Tensor& qkv, int n_head, const char* op) {
  if (qkv.ndim() != 3 || qkv.dim(2) % 3 != 0)
    throw std::invalid_argument(std::string("cuda ") + op + ": qkv " + qkv.str() +
                                " must be [B,T,3C]");
  AttentionDims d;
  d.B = static_cast<int>(qkv.dim(0));
  d.T = static_cast<int>(qkv.dim(1));
  d.C = static_cast<int>(qkv.dim(2) / 3);
  d.NH = n_head;
  if (n_head <= 0 || d.C % n_head != 0)
    throw std::invalid_argument(std::string("cuda ") + op + ": C=" + std::to_string(d.C) +
                                " is not divisible by n_head=" + std::to_string(n_head));
  d.hs = d.C / n_head;
  d.scale = 1.0f / std::sqrt(static_cast<float>(d.hs));
  return d;
}

namespace {
__global__ void attention_delta_kernel(float* delta, const bf16* dout, const bf16* out, int T,
                                       int NH, int hs) {
  // One warp per (b, h, t): delta = dot(dout, out) over the head's channels.
  const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t base = (static_cast<int64_t>(b) * T + t) * NH * hs + h * hs;
  float acc = 0.0f;
  for (int d = threadIdx.x; d < hs; d += 32) acc += to_float(dout[base + d]) * to_float(out[base + d]);
  acc = warp_sum(acc);
  if (threadIdx.x == 0) delta[(static_cast<int64_t>(b) * NH + h) * T + t] = acc;
}
}  // namespace

float* attention_delta(CudaBackend& backend, const AttentionDims& d, const Tensor& dout,
                       const Tensor& out) {
  float* delta = static_cast<float*>(
      backend.scratch(static_cast<size_t>(d.B) * d.NH * d.T * sizeof(float)));
  attention_delta_kernel<<<dim3(d.T, d.NH, d.B), 32, 0, backend.stream()>>>(
      delta, dout.ptr<bf16>(), out.ptr<bf16>(), d.T, d.NH, d.hs);
  KILN_CUDA_LAUNCH_CHECK();
  return delta;
}

}  // namespace cuda

namespace {

constexpr int kNaiveThreads = 128;

// Scores of query row t against keys 0..t, in shared memory; writes out row and lse.
__global__ void naive_forward_kernel(bf16* out, float* lse, const bf16* qkv, int T, int NH,
                                     int hs, float scale) {
  extern __shared__ float smem[];
  __shared__ float red[32];
  float* q = smem;        // [hs]
  float* p = smem + hs;   // [T]
  const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int C = NH * hs;
  const bf16* row0 = qkv + static_cast<int64_t>(b) * T * 3 * C;
  for (int d = threadIdx.x; d < hs; d += blockDim.x)
    q[d] = to_float(row0[static_cast<int64_t>(t) * 3 * C + h * hs + d]);
  __syncthreads();
  float m = -INFINITY;
  for (int k = threadIdx.x; k <= t; k += blockDim.x) {
    const bf16* key = row0 + static_cast<int64_t>(k) * 3 * C + C + h * hs;
    float s = 0.0f;
    for (int d = 0; d < hs; ++d) s += q[d] * to_float(key[d]);
    p[k] = s * scale;
    m = fmaxf(m, s * scale);
  }
  m = block_max(m, red);
  float sum = 0.0f;
  for (int k = threadIdx.x; k <= t; k += blockDim.x) {
    const float e = expf(p[k] - m);
    p[k] = e;
    sum += e;
  }
  sum = block_sum(sum, red);  // holds a barrier: p is complete below
  if (threadIdx.x == 0) lse[(static_cast<int64_t>(b) * NH + h) * T + t] = m + logf(sum);
  for (int d = threadIdx.x; d < hs; d += blockDim.x) {
    float acc = 0.0f;
    for (int k = 0; k <= t; ++k)
      acc += p[k] * to_float(row0[static_cast<int64_t>(k) * 3 * C + 2 * C + h * hs + d]);
    out[(static_cast<int64_t>(b) * T + t) * C + h * hs + d] = __float2bfloat16_rn(acc / sum);
  }
}

// dq for query row t: ds_k = p_k (dout.v_k - delta_t); dq = scale * sum_k ds_k k_k.
__global__ void naive_dq_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                const float* delta, int T, int NH, int hs, float scale) {
  extern __shared__ float smem[];
  float* q = smem;            // [hs]
  float* g = smem + hs;       // [hs] dout row
  float* ds = smem + 2 * hs;  // [T]
  const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int C = NH * hs;
  const bf16* row0 = qkv + static_cast<int64_t>(b) * T * 3 * C;
  const int64_t stat = (static_cast<int64_t>(b) * NH + h) * T + t;
  for (int d = threadIdx.x; d < hs; d += blockDim.x) {
    q[d] = to_float(row0[static_cast<int64_t>(t) * 3 * C + h * hs + d]);
    g[d] = to_float(dout[(static_cast<int64_t>(b) * T + t) * C + h * hs + d]);
  }
  __syncthreads();
  const float row_lse = lse[stat], row_delta = delta[stat];
  for (int k = threadIdx.x; k <= t; k += blockDim.x) {
    const bf16* key = row0 + static_cast<int64_t>(k) * 3 * C + C + h * hs;
    const bf16* val = key + C;
    float s = 0.0f, dp = 0.0f;
    for (int d = 0; d < hs; ++d) {
      s += q[d] * to_float(key[d]);
      dp += g[d] * to_float(val[d]);
    }
    const float p = expf(s * scale - row_lse);
    ds[k] = p * (dp - row_delta);
  }
  __syncthreads();
  for (int d = threadIdx.x; d < hs; d += blockDim.x) {
    float acc = 0.0f;
    for (int k = 0; k <= t; ++k)
      acc += ds[k] * to_float(row0[static_cast<int64_t>(k) * 3 * C + C + h * hs + d]);
    dqkv[(static_cast<int64_t>(b) * T + t) * 3 * C + h * hs + d] = __float2bfloat16_rn(acc * scale);
  }
}

// dk, dv for key row s: over queries t >= s, dv = sum_t p_ts dout_t, dk = scale sum_t ds_ts q_t.
__global__ void naive_dkv_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                 const float* delta, int T, int NH, int hs, float scale) {
  extern __shared__ float smem[];
  float* kk = smem;            // [hs]
  float* vv = smem + hs;       // [hs]
  float* p = smem + 2 * hs;    // [T]
  float* ds = p + T;           // [T]
  const int s_idx = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int C = NH * hs;
  const bf16* row0 = qkv + static_cast<int64_t>(b) * T * 3 * C;
  const bf16* dout0 = dout + static_cast<int64_t>(b) * T * C;
  for (int d = threadIdx.x; d < hs; d += blockDim.x) {
    kk[d] = to_float(row0[static_cast<int64_t>(s_idx) * 3 * C + C + h * hs + d]);
    vv[d] = to_float(row0[static_cast<int64_t>(s_idx) * 3 * C + 2 * C + h * hs + d]);
  }
  __syncthreads();
  for (int t = s_idx + threadIdx.x; t < T; t += blockDim.x) {
    const bf16* q = row0 + static_cast<int64_t>(t) * 3 * C + h * hs;
    const bf16* g = dout0 + static_cast<int64_t>(t) * C + h * hs;
    float sc = 0.0f, dp = 0.0f;
    for (int d = 0; d < hs; ++d) {
      sc += to_float(q[d]) * kk[d];
      dp += to_float(g[d]) * vv[d];
    }
    const int64_t stat = (static_cast<int64_t>(b) * NH + h) * T + t;
    const float pt = expf(sc * scale - lse[stat]);
    p[t] = pt;
    ds[t] = pt * (dp - delta[stat]);
  }
  __syncthreads();
  for (int d = threadIdx.x; d < hs; d += blockDim.x) {
    float dk = 0.0f, dv = 0.0f;
    for (int t = s_idx; t < T; ++t) {
      dv += p[t] * to_float(dout0[static_cast<int64_t>(t) * C + h * hs + d]);
      dk += ds[t] * to_float(row0[static_cast<int64_t>(t) * 3 * C + h * hs + d]);
    }
    bf16* dst = dqkv + (static_cast<int64_t>(b) * T + s_idx) * 3 * C + h * hs + d;
    dst[C] = __float2bfloat16_rn(dk * scale);
    dst[2 * C] = __float2bfloat16_rn(dv);
  }
}

void check_attention_io(const AttentionDims& d, const Tensor& out, const Tensor& lse,
                        const Tensor& qkv, const char* op) {
  expect_activation(qkv, op, "qkv");
  expect_activation(out, op, "out");
  expect_shape(out, Shape{d.B, d.T, d.C}, (std::string("cuda ") + op + ": out").c_str());
  expect_f32(lse, op, "lse");
  expect_numel(lse, static_cast<int64_t>(d.B) * d.NH * d.T, op, "lse");
}

size_t naive_shared_bytes(const AttentionDims& d, bool dkv) {
  return (2 * static_cast<size_t>(d.hs) + (dkv ? 2 : 1) * static_cast<size_t>(d.T)) *
         sizeof(float);
}

}  // namespace

std::string CudaBackend::attention_name() const { return attention_kind_name(attention_); }

void CudaBackend::set_attention(const std::string& kind) {
  attention_auto_ = kind == "auto";
  if (kind == "naive") {
    attention_ = AttentionKind::naive;
  } else if (kind == "flash") {
    attention_ = AttentionKind::flash;
  } else if (kind == "cudnn") {
    if (!cudnn_built())
      throw std::invalid_argument(
          "attention: cudnn requested but kiln was built without the cuDNN frontend "
          "(run scripts/install_deps.sh and reconfigure)");
    attention_ = AttentionKind::cudnn;
  } else if (kind == "auto") {
    attention_ = cudnn_built() ? AttentionKind::cudnn : AttentionKind::flash;
    spdlog::info("attention: auto -> {} ({})", attention_kind_name(attention_),
                 cudnn_built() ? "built with the cuDNN frontend"
                               : "built without the cuDNN frontend; hand-written flash kernels");
    return;
  } else {
    throw std::invalid_argument("attention: unknown kind '" + kind +
                                "' (auto | cudnn | flash | naive)");
  }
  spdlog::info("attention: {} (requested)", attention_kind_name(attention_));
}

void CudaBackend::attention_forward(Tensor out, Tensor lse, Tensor qkv, int n_head) {
  AttentionDims d = attention_dims(qkv, n_head, "attention_forward");
  check_attention_io(d, out, lse, qkv, "attention_forward");
  switch (attention_) {
    case AttentionKind::naive: attention_forward_naive(out, lse, qkv, n_head); break;
    case AttentionKind::flash: attention_forward_flash(out, lse, qkv, n_head); break;
    case AttentionKind::cudnn:
      if (!attention_auto_) {
        attention_forward_cudnn(out, lse, qkv, n_head);
        break;
      }
      try {
        attention_forward_cudnn(out, lse, qkv, n_head);
      } catch (const std::exception& e) {
        spdlog::warn("attention: auto -> flash: cuDNN SDPA failed for B={} T={} NH={} hs={}: {}",
                     d.B, d.T, d.NH, d.hs, e.what());
        attention_ = AttentionKind::flash;
        attention_forward_flash(out, lse, qkv, n_head);
      }
      break;
  }
}

void CudaBackend::attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                                     Tensor lse, int n_head) {
  AttentionDims d = attention_dims(qkv, n_head, "attention_backward");
  check_attention_io(d, out, lse, qkv, "attention_backward");
  expect_activation(dqkv, "attention_backward", "dqkv");
  expect_activation(dout, "attention_backward", "dout");
  expect_shape(dqkv, qkv.shape, "cuda attention_backward: dqkv");
  expect_shape(dout, out.shape, "cuda attention_backward: dout");
  switch (attention_) {
    case AttentionKind::naive: attention_backward_naive(dqkv, dout, qkv, out, lse, n_head); break;
    case AttentionKind::flash: attention_backward_flash(dqkv, dout, qkv, out, lse, n_head); break;
    case AttentionKind::cudnn: attention_backward_cudnn(dqkv, dout, qkv, out, lse, n_head); break;
  }
}

void CudaBackend::attention_forward_naive(Tensor out, Tensor lse, Tensor qkv, int n_head) {
  AttentionDims d = attention_dims(qkv, n_head, "attention_forward");
  const size_t shmem = naive_shared_bytes(d, false);
  if (shmem > 48 * 1024)
    throw std::invalid_argument("cuda attention (naive): T=" + std::to_string(d.T) +
                                " too long for the test kernel; use flash or cudnn");
  naive_forward_kernel<<<dim3(d.T, d.NH, d.B), kNaiveThreads, shmem, stream_>>>(
      out.ptr<bf16>(), lse.ptr<float>(), qkv.ptr<bf16>(), d.T, d.NH, d.hs, d.scale);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::attention_backward_naive(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                                           Tensor lse, int n_head) {
  AttentionDims d = attention_dims(qkv, n_head, "attention_backward");
  const size_t shmem = naive_shared_bytes(d, true);
  if (shmem > 48 * 1024)
    throw std::invalid_argument("cuda attention (naive): T=" + std::to_string(d.T) +
                                " too long for the test kernel; use flash or cudnn");
  const float* delta = attention_delta(*this, d, dout, out);
  dim3 grid(d.T, d.NH, d.B);
  naive_dq_kernel<<<grid, kNaiveThreads, naive_shared_bytes(d, false), stream_>>>(
      dqkv.ptr<bf16>(), dout.ptr<bf16>(), qkv.ptr<bf16>(), lse.ptr<float>(), delta, d.T, d.NH,
      d.hs, d.scale);
  KILN_CUDA_LAUNCH_CHECK();
  naive_dkv_kernel<<<grid, kNaiveThreads, shmem, stream_>>>(dqkv.ptr<bf16>(), dout.ptr<bf16>(),
                                                            qkv.ptr<bf16>(), lse.ptr<float>(),
                                                            delta, d.T, d.NH, d.hs, d.scale);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
