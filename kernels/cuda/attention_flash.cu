// Hand-written causal flash attention: the fallback when cuDNN is absent.
// Design choice: tiles of 32 queries x 32 keys in shared memory (f32), FOUR threads per query
// (or key) row, each owning hs/4 channels in registers; dot products are finished with two
// shuffles. Forward keeps the online softmax (running max m, running sum l) so memory is O(T),
// and writes lse = m + log(l). Backward is deterministic: one kernel walks key tiles per query
// tile for dq, another walks, per key tile of a kv head, the query tiles of each query head of
// that head's group (GQA: the group's sum happens in registers, in head order; no atomics).
// Head sizes 32, 64, 128 (HS is a template parameter: the per-thread slices live in registers).
// This version uses CUDA cores (FFMA), not tensor cores: correct and O(T) in memory, several
// times slower than cuDNN's SDPA. A wgmma version is future work (see docs/cuda.md).
// Document masking (d.key_start): query t sees keys key_start[t]..t. Because key_start never
// decreases along t, a query tile's smallest first key is its first row's, so the forward and
// dq start at that key's tile, and dk/dv stop at the first query tile whose first row starts
// past the key tile: tiles no query of the block sees are never loaded, and a window of short
// documents costs about sum(len^2) instead of T^2.
// Context parallelism (attention_cp_forward/backward) runs these same kernels: its query rows sit
// at two chunks' positions in the sequence (d.half, d.pos0, d.pos1) and its keys in a gathered
// kv of their own (d.Tk rows); causality and the tile walks go by positions, which rise along
// the rows, so a query tile walks key tiles up to its last row's position, and a key tile starts
// at the first query row whose position reaches it.
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kTile = 32;     // queries per block (forward, dq) / keys per block (dk, dv)
constexpr int kGroup = 4;     // threads per row
constexpr int kThreads = kTile * kGroup;

__device__ inline float group_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// Loads rows [r0, r0+kTile) of one head's slice (at `col` within rows of `stride` elements) as
// f32 into tile[kTile][HS]; rows past T read as 0.
template <int HS>
__device__ inline void load_tile(float (*tile)[HS], const bf16* base, int64_t stride, int col,
                                 int r0, int T) {
  for (int i = threadIdx.x; i < kTile * HS; i += blockDim.x) {
    const int r = i / HS, d = i % HS;
    tile[r][d] = (r0 + r < T) ? to_float(base[static_cast<int64_t>(r0 + r) * stride + col + d]) : 0.0f;
  }
}

template <int HS>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(bf16* out, float* lse, const bf16* q_rows, const bf16* kv,
                         AttentionShape d) {
  constexpr int P = HS / kGroup;
  __shared__ float ks[kTile][HS];
  __shared__ float vs[kTile][HS];
  const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int T = d.T, S = d.qkv_stride, Tk = d.Tk, KS = d.kv_stride;
  const int kcol = d.k_offset + (h / d.group) * HS, vcol = d.v_offset + (h / d.group) * HS;
  const int row = threadIdx.x / kGroup, part = threadIdx.x % kGroup;
  const int t = qt * kTile + row;
  const bf16* base = q_rows + static_cast<int64_t>(b) * T * S;
  const bf16* kv_base = kv + static_cast<int64_t>(b) * Tk * KS;
  float q[P], o[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    q[i] = t < T ? to_float(base[static_cast<int64_t>(t) * S + h * HS + part * P + i]) * d.scale
                 : 0.0f;
    o[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const int k0 = t < T ? first_key(d, b, t) : 0;      // this row's first key
  const int pos = t < T ? query_position(d, t) : -1;  // and its last
  const int last_kt = query_position(d, min(qt * kTile + kTile, T) - 1) / kTile;
  for (int kt = first_key(d, b, qt * kTile) / kTile; kt <= last_kt; ++kt) {
    __syncthreads();
    load_tile<HS>(ks, kv_base, KS, kcol, kt * kTile, Tk);
    load_tile<HS>(vs, kv_base, KS, vcol, kt * kTile, Tk);
    __syncthreads();
    float s[kTile];
    float tile_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      float acc = 0.0f;
#pragma unroll
      for (int i = 0; i < P; ++i) acc += q[i] * ks[j][part * P + i];
      acc = group_sum(acc);
      const int key = kt * kTile + j;
      s[j] = (key >= k0 && key <= pos) ? acc : -INFINITY;
      tile_max = fmaxf(tile_max, s[j]);
    }
    const float m_new = fmaxf(m, tile_max);
    if (m_new == -INFINITY) continue;  // rows past T, or before their document's first tile
    const float corr = expf(m - m_new);
    l *= corr;
#pragma unroll
    for (int i = 0; i < P; ++i) o[i] *= corr;
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      const float p = expf(s[j] - m_new);
      l += p;
#pragma unroll
      for (int i = 0; i < P; ++i) o[i] += p * vs[j][part * P + i];
    }
    m = m_new;
  }
  if (t >= T) return;
  const float inv = 1.0f / l;
  bf16* dst = out + (static_cast<int64_t>(b) * T + t) * d.out_stride + h * HS + part * P;
#pragma unroll
  for (int i = 0; i < P; ++i) dst[i] = __float2bfloat16_rn(o[i] * inv);
  if (part == 0) lse[(static_cast<int64_t>(b) * d.NH + h) * T + t] = m + logf(l);
}

template <int HS>
__global__ void __launch_bounds__(kThreads)
    flash_dq_kernel(bf16* dq_rows, const bf16* dout, const bf16* q_rows, const bf16* kv,
                    const float* lse, const float* delta, AttentionShape d) {
  constexpr int P = HS / kGroup;
  __shared__ float ks[kTile][HS];
  __shared__ float vs[kTile][HS];
  const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int T = d.T, S = d.qkv_stride, Tk = d.Tk, KS = d.kv_stride;
  const int kcol = d.k_offset + (h / d.group) * HS, vcol = d.v_offset + (h / d.group) * HS;
  const int row = threadIdx.x / kGroup, part = threadIdx.x % kGroup;
  const int t = qt * kTile + row;
  const bf16* base = q_rows + static_cast<int64_t>(b) * T * S;
  const bf16* kv_base = kv + static_cast<int64_t>(b) * Tk * KS;
  float q[P], g[P], dq[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    q[i] = t < T ? to_float(base[static_cast<int64_t>(t) * S + h * HS + part * P + i]) : 0.0f;
    g[i] = t < T
               ? to_float(
                     dout[(static_cast<int64_t>(b) * T + t) * d.out_stride + h * HS + part * P + i])
               : 0.0f;
    dq[i] = 0.0f;
  }
  const int64_t stat = (static_cast<int64_t>(b) * d.NH + h) * T + t;
  const float row_lse = t < T ? lse[stat] : 0.0f;
  const float row_delta = t < T ? delta[stat] : 0.0f;
  const int k0 = t < T ? first_key(d, b, t) : 0;
  const int pos = t < T ? query_position(d, t) : -1;
  const int last_kt = query_position(d, min(qt * kTile + kTile, T) - 1) / kTile;
  for (int kt = first_key(d, b, qt * kTile) / kTile; kt <= last_kt; ++kt) {
    __syncthreads();
    load_tile<HS>(ks, kv_base, KS, kcol, kt * kTile, Tk);
    load_tile<HS>(vs, kv_base, KS, vcol, kt * kTile, Tk);
    __syncthreads();
#pragma unroll 4
    for (int j = 0; j < kTile; ++j) {
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int i = 0; i < P; ++i) {
        s += q[i] * ks[j][part * P + i];
        dp += g[i] * vs[j][part * P + i];
      }
      s = group_sum(s);
      dp = group_sum(dp);
      const int key = kt * kTile + j;
      const float p = (key >= k0 && key <= pos) ? expf(s * d.scale - row_lse) : 0.0f;
      const float ds = p * (dp - row_delta);
#pragma unroll
      for (int i = 0; i < P; ++i) dq[i] += ds * ks[j][part * P + i];
    }
  }
  if (t >= T) return;
  bf16* dst = dq_rows + (static_cast<int64_t>(b) * T + t) * S + h * HS + part * P;
#pragma unroll
  for (int i = 0; i < P; ++i) dst[i] = __float2bfloat16_rn(dq[i] * d.scale);
}

// One block per (key tile, kv head, batch): dk/dv of the tile's keys summed over the query
// heads of the kv head's group, in head order, then over query tiles. Every key tile is
// written, zero where no query sees it.
template <int HS>
__global__ void __launch_bounds__(kThreads)
    flash_dkv_kernel(bf16* dkv, const bf16* dout, const bf16* q_rows, const bf16* kv,
                     const float* lse, const float* delta, AttentionShape d) {
  constexpr int P = HS / kGroup;
  __shared__ float qs[kTile][HS];
  __shared__ float gs[kTile][HS];
  __shared__ float lse_s[kTile];
  __shared__ float delta_s[kTile];
  __shared__ int k0_s[kTile];   // the query rows' first keys
  __shared__ int pos_s[kTile];  // and their positions (-1 past T)
  const int st = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int T = d.T, S = d.qkv_stride, Tk = d.Tk, KS = d.kv_stride;
  const int kcol = d.k_offset + kvh * HS, vcol = d.v_offset + kvh * HS;
  const int row = threadIdx.x / kGroup, part = threadIdx.x % kGroup;
  const int s_idx = st * kTile + row;
  const bf16* base = q_rows + static_cast<int64_t>(b) * T * S;
  const bf16* kv_base = kv + static_cast<int64_t>(b) * Tk * KS;
  const bf16* dout0 = dout + static_cast<int64_t>(b) * T * d.out_stride;
  float k[P], v[P], dk[P], dv[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int64_t off = static_cast<int64_t>(s_idx) * KS + part * P + i;
    k[i] = s_idx < Tk ? to_float(kv_base[off + kcol]) : 0.0f;
    v[i] = s_idx < Tk ? to_float(kv_base[off + vcol]) : 0.0f;
    dk[i] = 0.0f;
    dv[i] = 0.0f;
  }
  const int qtiles = (T + kTile - 1) / kTile;
  const int first_qt = first_query_seeing(d, st * kTile) / kTile;
  const int last_key = st * kTile + kTile - 1;
  for (int h = kvh * d.group; h < (kvh + 1) * d.group; ++h) {
    for (int qt = first_qt; qt < qtiles; ++qt) {
      // Every thread reads the same first key, so the whole block leaves together: from this
      // query tile on, every query's document starts after this key tile.
      if (first_key(d, b, qt * kTile) > last_key) break;
      __syncthreads();
      load_tile<HS>(qs, base, S, h * HS, qt * kTile, T);
      load_tile<HS>(gs, dout0, d.out_stride, h * HS, qt * kTile, T);
      if (threadIdx.x < kTile) {
        const int t = qt * kTile + threadIdx.x;
        const int64_t stat = (static_cast<int64_t>(b) * d.NH + h) * T + t;
        lse_s[threadIdx.x] = t < T ? lse[stat] : 0.0f;
        delta_s[threadIdx.x] = t < T ? delta[stat] : 0.0f;
        k0_s[threadIdx.x] = t < T ? first_key(d, b, t) : 0;
        pos_s[threadIdx.x] = t < T ? query_position(d, t) : -1;
      }
      __syncthreads();
#pragma unroll 4
      for (int j = 0; j < kTile; ++j) {
        float s = 0.0f, dp = 0.0f;
#pragma unroll
        for (int i = 0; i < P; ++i) {
          s += qs[j][part * P + i] * k[i];
          dp += gs[j][part * P + i] * v[i];
        }
        s = group_sum(s);
        dp = group_sum(dp);
        const float p = (pos_s[j] >= s_idx && s_idx < Tk && k0_s[j] <= s_idx)
                            ? expf(s * d.scale - lse_s[j])
                            : 0.0f;
        const float ds = p * (dp - delta_s[j]);
#pragma unroll
        for (int i = 0; i < P; ++i) {
          dv[i] += p * gs[j][part * P + i];
          dk[i] += ds * qs[j][part * P + i];
        }
      }
    }
  }
  if (s_idx >= Tk) return;
  bf16* dst = dkv + (static_cast<int64_t>(b) * Tk + s_idx) * KS + part * P;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    dst[kcol + i] = __float2bfloat16_rn(dk[i] * d.scale);
    dst[vcol + i] = __float2bfloat16_rn(dv[i]);
  }
}

[[noreturn]] void unsupported_head_size(int hs) {
  throw std::invalid_argument("cuda attention (flash): head size " + std::to_string(hs) +
                              " not supported (32, 64, 128); use cudnn or naive");
}

}  // namespace

namespace cuda {

void flash_forward(cudaStream_t stream, const AttentionShape& d, bf16* out, float* lse,
                   const bf16* q, const bf16* kv) {
  const dim3 grid(ceil_div(d.T, kTile), d.NH, d.B);
#define KILN_FLASH_FWD(HS) \
  flash_forward_kernel<HS><<<grid, kThreads, 0, stream>>>(out, lse, q, kv, d)
  switch (d.hs) {
    case 32: KILN_FLASH_FWD(32); break;
    case 64: KILN_FLASH_FWD(64); break;
    case 128: KILN_FLASH_FWD(128); break;
    default: unsupported_head_size(d.hs);
  }
#undef KILN_FLASH_FWD
  KILN_CUDA_LAUNCH_CHECK();
}

void flash_backward(CudaBackend& backend, const AttentionShape& d, bf16* dq, bf16* dkv,
                    const Tensor& dout, const bf16* q, const bf16* kv, const Tensor& out,
                    const float* lse) {
  if (d.hs != 32 && d.hs != 64 && d.hs != 128) unsupported_head_size(d.hs);
  const float* delta = attention_delta(backend, d, dout, out);
  const dim3 q_grid(ceil_div(d.T, kTile), d.NH, d.B), kv_grid(ceil_div(d.Tk, kTile), d.KV, d.B);
  cudaStream_t stream = backend.stream();
  const bf16* g = dout.ptr<bf16>();
#define KILN_FLASH_BWD(HS)                                                           \
  flash_dq_kernel<HS><<<q_grid, kThreads, 0, stream>>>(dq, g, q, kv, lse, delta, d); \
  KILN_CUDA_LAUNCH_CHECK();                                                          \
  flash_dkv_kernel<HS><<<kv_grid, kThreads, 0, stream>>>(dkv, g, q, kv, lse, delta, d)
  switch (d.hs) {
    case 32: KILN_FLASH_BWD(32); break;
    case 64: KILN_FLASH_BWD(64); break;
    default: KILN_FLASH_BWD(128); break;
  }
#undef KILN_FLASH_BWD
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace cuda

void CudaBackend::attention_forward_flash(Tensor out, Tensor lse, Tensor qkv,
                                          const AttentionDims& a, Tensor key_start) {
  flash_forward(stream_, attention_shape(qkv, a, key_start), out.ptr<bf16>(), lse.ptr<float>(),
                qkv.ptr<bf16>(), qkv.ptr<bf16>());
}

void CudaBackend::attention_backward_flash(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                                           Tensor lse, const AttentionDims& a, Tensor key_start) {
  flash_backward(*this, attention_shape(qkv, a, key_start), dqkv.ptr<bf16>(), dqkv.ptr<bf16>(),
                 dout, qkv.ptr<bf16>(), qkv.ptr<bf16>(), out, lse.ptr<float>());
}

}  // namespace kiln
