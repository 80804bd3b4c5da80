// Causal self-attention: backend selection, argument checks, and the NAIVE kernels.
// Three implementations share one contract so any forward's lse feeds any backward:
// qkv [B,T,(NH+2KV)*hs] bf16 (NH query heads, KV key heads, KV value heads; query head h reads
// kv head h/(NH/KV)), out [B,T,NH*hs] bf16, lse f32[B,NH,T] = natural log-sum-exp of the scaled
// scores (scale 1/sqrt(hs)) over the causal row, and dqkv in qkv's layout. Grouped-query
// attention costs no copies anywhere: every implementation reads the shared kv head in place,
// and the backward sums dk/dv over the query heads of a group inside the program that owns the
// kv head (no atomics), so with NH == KV (GPT-2) it is the plain MHA computation.
//  - naive (here): one block per (b, h, query row) builds the row's scores in shared memory.
//    O(T^2 hs) work, no tiling: the test oracle, not a training path.
//  - flash (attention_flash.cu): tiled online-softmax forward, two-kernel deterministic
//    backward, f32 accumulation.
//  - cudnn (attention_cudnn.cpp): cuDNN's fused SDPA through the frontend graph API.
// The backward kernels here and in flash are deterministic: dq by query rows, dk/dv by key
// rows of a kv head, no atomics.
// Document masking (key_start): naive and flash take a per-query first key. cuDNN runs each
// document as a ragged batch entry, which needs the documents counted (AttentionDims::
// documents, the trainer's calls); an uncounted masked call runs flash where cudnn is selected,
// said once in the log.
#include <spdlog/spdlog.h>

#include <cmath>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace cuda {

AttentionShape attention_shape(const Tensor& qkv, const AttentionDims& a, const Tensor& key_start) {
  AttentionShape d;
  if (key_start.defined()) d.key_start = key_start.ptr<int>();
  d.B = static_cast<int>(qkv.dim(0));
  d.T = static_cast<int>(qkv.dim(1));
  d.NH = a.n_head;
  d.KV = a.n_kv_head;
  d.hs = a.head_dim;
  d.group = a.n_head / a.n_kv_head;
  d.qkv_stride = static_cast<int>(a.qkv_dim());
  d.out_stride = static_cast<int>(a.q_dim());
  d.Tk = d.T;
  d.kv_stride = d.qkv_stride;
  d.k_offset = static_cast<int>(a.q_dim());
  d.v_offset = static_cast<int>(a.q_dim() + a.kv_dim());
  d.half = d.T;
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

float* attention_delta(CudaBackend& backend, const AttentionShape& d, const Tensor& dout,
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
__global__ void naive_forward_kernel(bf16* out, float* lse, const bf16* qkv, AttentionShape d) {
  extern __shared__ float smem[];
  __shared__ float red[32];
  const int T = d.T, hs = d.hs, S = d.qkv_stride;
  float* q = smem;        // [hs]
  float* p = smem + hs;   // [T]
  const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kcol = d.k_offset + (h / d.group) * hs, vcol = d.v_offset + (h / d.group) * hs;
  const bf16* row0 = qkv + static_cast<int64_t>(b) * T * S;
  const int k0 = first_key(d, b, t);
  for (int i = threadIdx.x; i < hs; i += blockDim.x)
    q[i] = to_float(row0[static_cast<int64_t>(t) * S + h * hs + i]);
  __syncthreads();
  float m = -INFINITY;
  for (int k = k0 + threadIdx.x; k <= t; k += blockDim.x) {
    const bf16* key = row0 + static_cast<int64_t>(k) * S + kcol;
    float s = 0.0f;
    for (int i = 0; i < hs; ++i) s += q[i] * to_float(key[i]);
    p[k] = s * d.scale;
    m = fmaxf(m, s * d.scale);
  }
  m = block_max(m, red);
  float sum = 0.0f;
  for (int k = k0 + threadIdx.x; k <= t; k += blockDim.x) {
    const float e = expf(p[k] - m);
    p[k] = e;
    sum += e;
  }
  sum = block_sum(sum, red);  // holds a barrier: p is complete below
  if (threadIdx.x == 0) lse[(static_cast<int64_t>(b) * d.NH + h) * T + t] = m + logf(sum);
  for (int i = threadIdx.x; i < hs; i += blockDim.x) {
    float acc = 0.0f;
    for (int k = k0; k <= t; ++k)
      acc += p[k] * to_float(row0[static_cast<int64_t>(k) * S + vcol + i]);
    out[(static_cast<int64_t>(b) * T + t) * d.out_stride + h * hs + i] =
        __float2bfloat16_rn(acc / sum);
  }
}

// dq for query row t: ds_k = p_k (dout.v_k - delta_t); dq = scale * sum_k ds_k k_k.
__global__ void naive_dq_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                const float* delta, AttentionShape d) {
  extern __shared__ float smem[];
  const int T = d.T, hs = d.hs, S = d.qkv_stride;
  float* q = smem;            // [hs]
  float* g = smem + hs;       // [hs] dout row
  float* ds = smem + 2 * hs;  // [T]
  const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kcol = d.k_offset + (h / d.group) * hs, vcol = d.v_offset + (h / d.group) * hs;
  const bf16* row0 = qkv + static_cast<int64_t>(b) * T * S;
  const int64_t stat = (static_cast<int64_t>(b) * d.NH + h) * T + t;
  for (int i = threadIdx.x; i < hs; i += blockDim.x) {
    q[i] = to_float(row0[static_cast<int64_t>(t) * S + h * hs + i]);
    g[i] = to_float(dout[(static_cast<int64_t>(b) * T + t) * d.out_stride + h * hs + i]);
  }
  __syncthreads();
  const float row_lse = lse[stat], row_delta = delta[stat];
  const int k0 = first_key(d, b, t);
  for (int k = k0 + threadIdx.x; k <= t; k += blockDim.x) {
    const bf16* key = row0 + static_cast<int64_t>(k) * S + kcol;
    const bf16* val = row0 + static_cast<int64_t>(k) * S + vcol;
    float s = 0.0f, dp = 0.0f;
    for (int i = 0; i < hs; ++i) {
      s += q[i] * to_float(key[i]);
      dp += g[i] * to_float(val[i]);
    }
    const float p = expf(s * d.scale - row_lse);
    ds[k] = p * (dp - row_delta);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < hs; i += blockDim.x) {
    float acc = 0.0f;
    for (int k = k0; k <= t; ++k)
      acc += ds[k] * to_float(row0[static_cast<int64_t>(k) * S + kcol + i]);
    dqkv[(static_cast<int64_t>(b) * T + t) * S + h * hs + i] = __float2bfloat16_rn(acc * d.scale);
  }
}

// dk, dv for key row s of kv head g: over the group's query heads h (in order) and queries
// t >= s, dv = sum p_ts dout_t, dk = scale sum ds_ts q_t. The sums live in shared memory
// (each thread owns its channels), so any head_dim fits.
__global__ void naive_dkv_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                 const float* delta, AttentionShape d) {
  extern __shared__ float smem[];
  const int T = d.T, hs = d.hs, S = d.qkv_stride;
  float* kk = smem;            // [hs]
  float* vv = smem + hs;       // [hs]
  float* dk = smem + 2 * hs;   // [hs]
  float* dv = smem + 3 * hs;   // [hs]
  float* p = smem + 4 * hs;    // [T]
  float* ds = p + T;           // [T]
  const int s_idx = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int kcol = d.k_offset + g * hs, vcol = d.v_offset + g * hs;
  const bf16* row0 = qkv + static_cast<int64_t>(b) * T * S;
  const bf16* dout0 = dout + static_cast<int64_t>(b) * T * d.out_stride;
  for (int i = threadIdx.x; i < hs; i += blockDim.x) {
    kk[i] = to_float(row0[static_cast<int64_t>(s_idx) * S + kcol + i]);
    vv[i] = to_float(row0[static_cast<int64_t>(s_idx) * S + vcol + i]);
    dk[i] = 0.0f;
    dv[i] = 0.0f;
  }
  for (int h = g * d.group; h < (g + 1) * d.group; ++h) {
    __syncthreads();  // kk/vv loaded; p/ds of the previous head consumed
    for (int t = s_idx + threadIdx.x; t < T; t += blockDim.x) {
      const bf16* q = row0 + static_cast<int64_t>(t) * S + h * hs;
      const bf16* go = dout0 + static_cast<int64_t>(t) * d.out_stride + h * hs;
      float sc = 0.0f, dp = 0.0f;
      for (int i = 0; i < hs; ++i) {
        sc += to_float(q[i]) * kk[i];
        dp += to_float(go[i]) * vv[i];
      }
      const int64_t stat = (static_cast<int64_t>(b) * d.NH + h) * T + t;
      // A query of a later document does not see this key.
      const float pt = first_key(d, b, t) <= s_idx ? expf(sc * d.scale - lse[stat]) : 0.0f;
      p[t] = pt;
      ds[t] = pt * (dp - delta[stat]);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < hs; i += blockDim.x) {
      float acc_k = 0.0f, acc_v = 0.0f;
      for (int t = s_idx; t < T; ++t) {
        acc_v += p[t] * to_float(dout0[static_cast<int64_t>(t) * d.out_stride + h * hs + i]);
        acc_k += ds[t] * to_float(row0[static_cast<int64_t>(t) * S + h * hs + i]);
      }
      dk[i] += acc_k;
      dv[i] += acc_v;
    }
  }
  for (int i = threadIdx.x; i < hs; i += blockDim.x) {
    bf16* dst = dqkv + (static_cast<int64_t>(b) * T + s_idx) * S;
    dst[kcol + i] = __float2bfloat16_rn(dk[i] * d.scale);
    dst[vcol + i] = __float2bfloat16_rn(dv[i]);
  }
}

// Shared memory of the naive kernels: floats of [hs] vectors and of [T] rows.
size_t naive_shared_bytes(const AttentionShape& d, int hs_vectors, int t_rows) {
  return (static_cast<size_t>(hs_vectors) * d.hs + static_cast<size_t>(t_rows) * d.T) *
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

AttentionKind CudaBackend::masked_attention_kind(const AttentionDims& a) {
  if (attention_ != AttentionKind::cudnn || a.documents > 0) return attention_;
  if (!masked_fallback_logged_) {
    spdlog::info(
        "attention: document-masked calls with no document count (tests) "
        "-> flash; the rest stay on cudnn");
    masked_fallback_logged_ = true;
  }
  return AttentionKind::flash;
}

void CudaBackend::run_attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionDims& a,
                                        Tensor key_start) {
  const AttentionShape d = attention_shape(qkv, a);
  switch (key_start.defined() ? masked_attention_kind(a) : attention_) {
    case AttentionKind::naive:
      attention_forward_naive(out, lse, qkv, a, key_start);
      break;
    case AttentionKind::flash:
      attention_forward_flash(out, lse, qkv, a, key_start);
      break;
    case AttentionKind::cudnn:
      if (key_start.defined() && cudnn_document_entries(d, a.documents) == 0) {
        attention_forward_flash(out, lse, qkv, a, key_start);
        break;
      }
      cudnn_or_flash(
          fmt::format("B={} T={} NH={} KV={} hs={}{}", d.B, d.T, d.NH, d.KV, d.hs,
                      key_start.defined() ? fmt::format(" documents={}", a.documents) : ""),
          [&] { attention_forward_cudnn(out, lse, qkv, a, key_start); },
          [&] { attention_forward_flash(out, lse, qkv, a, key_start); });
      break;
  }
}

void CudaBackend::cudnn_or_flash(const std::string& call, const std::function<void()>& cudnn,
                                 const std::function<void()>& flash) {
  if (!attention_auto_) return cudnn();
  try {
    cudnn();
  } catch (const std::exception& e) {
    spdlog::warn("attention: auto -> flash: cuDNN SDPA failed for {}: {}", call, e.what());
    attention_ = AttentionKind::flash;
    flash();
  }
}

void CudaBackend::run_attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                                         Tensor lse, const AttentionDims& a, Tensor key_start) {
  switch (key_start.defined() ? masked_attention_kind(a) : attention_) {
    case AttentionKind::naive:
      attention_backward_naive(dqkv, dout, qkv, out, lse, a, key_start);
      break;
    case AttentionKind::flash:
      attention_backward_flash(dqkv, dout, qkv, out, lse, a, key_start);
      break;
    case AttentionKind::cudnn:
      // As the forward chose: the same shapes and count give the same answer.
      if (key_start.defined() && cudnn_document_entries(attention_shape(qkv, a), a.documents) == 0)
        attention_backward_flash(dqkv, dout, qkv, out, lse, a, key_start);
      else
        attention_backward_cudnn(dqkv, dout, qkv, out, lse, a, key_start);
      break;
  }
}

void CudaBackend::attention_forward_naive(Tensor out, Tensor lse, Tensor qkv,
                                          const AttentionDims& a, Tensor key_start) {
  const AttentionShape d = attention_shape(qkv, a, key_start);
  const size_t shmem = naive_shared_bytes(d, 1, 1);
  if (shmem > 48 * 1024)
    throw std::invalid_argument("cuda attention (naive): T=" + std::to_string(d.T) +
                                " too long for the test kernel; use flash or cudnn");
  naive_forward_kernel<<<dim3(d.T, d.NH, d.B), kNaiveThreads, shmem, stream_>>>(
      out.ptr<bf16>(), lse.ptr<float>(), qkv.ptr<bf16>(), d);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::attention_backward_naive(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                                           Tensor lse, const AttentionDims& a, Tensor key_start) {
  const AttentionShape d = attention_shape(qkv, a, key_start);
  const size_t shmem = naive_shared_bytes(d, 4, 2);
  if (shmem > 48 * 1024)
    throw std::invalid_argument("cuda attention (naive): T=" + std::to_string(d.T) +
                                " too long for the test kernel; use flash or cudnn");
  const float* delta = attention_delta(*this, d, dout, out);
  naive_dq_kernel<<<dim3(d.T, d.NH, d.B), kNaiveThreads, naive_shared_bytes(d, 2, 1), stream_>>>(
      dqkv.ptr<bf16>(), dout.ptr<bf16>(), qkv.ptr<bf16>(), lse.ptr<float>(), delta, d);
  KILN_CUDA_LAUNCH_CHECK();
  naive_dkv_kernel<<<dim3(d.T, d.KV, d.B), kNaiveThreads, shmem, stream_>>>(
      dqkv.ptr<bf16>(), dout.ptr<bf16>(), qkv.ptr<bf16>(), lse.ptr<float>(), delta, d);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
