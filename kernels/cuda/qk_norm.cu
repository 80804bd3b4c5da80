// Qwen3's QK-norm: RMSNorm over each query and key head (hs wide) inside the packed
// qkv[N, (NH+2KV)*hs], one weight vector for all query heads and one for all key heads; the
// value heads are copied through. A head is a unit of hs/8 lanes (16 bytes each: hs = 128 is
// half a warp), so a warp covers 2-4 consecutive heads of the row with full 16-byte accesses and
// the head's sum of squares is a shuffle within the unit (its own lane mask: units of one warp
// may take different branches, q/k vs v). q_weight and k_weight are f32 or bf16 (template W; the
// trainer reads norm gains in f32, as autocast does): 8 weights are one 16-byte load, or two.
// Backward design choice: deterministic column sums without atomics. A persistent grid (one
// wave: a fixed number of blocks on a given GPU) walks the units in a fixed assignment; each lane
// keeps its 8 columns' dq_weight and dk_weight sums in registers across all the heads it visits,
// the block adds its units' sums in unit order into one partial, and a final kernel adds the
// partials in block order into the f32 grads.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kThreads = 256;

// Sum over the kLanes lanes of this thread's unit (aligned groups of kLanes within the warp).
template <int kLanes>
__device__ inline float unit_sum(float x, unsigned mask) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) x += __shfl_xor_sync(mask, x, o);
  return x;
}

template <int kLanes>
__device__ inline unsigned unit_mask() {
  if constexpr (kLanes == 32) {
    return 0xffffffffu;
  } else {
    const int first = (threadIdx.x % 32) / kLanes * kLanes;
    return ((1u << kLanes) - 1u) << first;
  }
}

struct QkShape {
  int64_t units = 0;  // N * (NH + 2 KV): every head of every token
  int heads = 0;      // NH + 2 KV per token
  int nh = 0, kv = 0;
  float eps = 0.0f;
};

// One unit (kLanes = hs/8 lanes) per head of a token; unit u starts at element u * hs.
template <int kLanes, class W>
__global__ void __launch_bounds__(kThreads)
    qk_norm_forward_kernel(bf16* out, float* rstd, const bf16* inp, const W* q_weight,
                           const W* k_weight, QkShape s) {
  constexpr int hs = kLanes * 8;
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t unit = tid / kLanes;
  const int part = static_cast<int>(tid % kLanes);
  if (unit >= s.units) return;  // whole units leave together
  const int64_t token = unit / s.heads;
  const int head = static_cast<int>(unit % s.heads);
  const int64_t off = unit * hs + part * 8;
  const Packed128<bf16> x = load128cs(inp + off);
  if (head >= s.nh + s.kv) {  // a value head
    store128(out + off, x);
    return;
  }
  float v[8], sumsq = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    v[k] = to_float(x[k]);
    sumsq += v[k] * v[k];
  }
  const float rs = rsqrtf(unit_sum<kLanes>(sumsq, unit_mask<kLanes>()) / hs + s.eps);
  const Vec8<W> w = load8((head < s.nh ? q_weight : k_weight) + part * 8);
  Packed128<bf16> o;
#pragma unroll
  for (int k = 0; k < 8; ++k) o[k] = __float2bfloat16_rn(v[k] * rs * to_float(w[k]));
  store128(out + off, o);
  if (part == 0) rstd[token * (s.nh + s.kv) + head] = rs;
}

// Block b walks units [b * units_per_block, ...), its unit-slot j (kThreads / kLanes of them)
// the units j, j + slots, ... of that range. partials[b][0][c] / [1][c]: the block's dq_weight /
// dk_weight sums.
template <int kLanes, class W>
__global__ void __launch_bounds__(kThreads)
    qk_norm_backward_kernel(bf16* dinp, float* partials, const bf16* dout, const bf16* inp,
                            const W* q_weight, const W* k_weight, const float* rstd, QkShape s,
                            int64_t units_per_block) {
  constexpr int hs = kLanes * 8;
  constexpr int kSlots = kThreads / kLanes;
  __shared__ float sums[kSlots][2][hs];
  const int slot = threadIdx.x / kLanes, part = threadIdx.x % kLanes;
  const unsigned mask = unit_mask<kLanes>();
  const Vec8<W> wq = load8(q_weight + part * 8), wk = load8(k_weight + part * 8);
  float dwq[8] = {}, dwk[8] = {};
  const int64_t u0 = blockIdx.x * units_per_block;
  const int64_t u1 = min(s.units, u0 + units_per_block);
  for (int64_t unit = u0 + slot; unit < u1; unit += kSlots) {
    const int64_t token = unit / s.heads;
    const int head = static_cast<int>(unit % s.heads);
    const int64_t off = unit * hs + part * 8;
    const bool is_v = head >= s.nh + s.kv, is_q = head < s.nh;
    // Every load of the unit is issued before any is used.
    const Packed128<bf16> g = load128cs(dout + off);
    Packed128<bf16> x;
    float rs = 0.0f;
    if (!is_v) {
      x = load128cs(inp + off);
      rs = rstd[token * (s.nh + s.kv) + head];
    }
    if (is_v) {
      store128(dinp + off, g);
      continue;
    }
    float xhat[8], dnorm[8], dot = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      xhat[k] = to_float(x[k]) * rs;
      dnorm[k] = to_float(g[k]) * to_float(is_q ? wq[k] : wk[k]);
      dot += dnorm[k] * xhat[k];
    }
    const float mean_dot = unit_sum<kLanes>(dot, mask) / hs;
    Packed128<bf16> d;
#pragma unroll
    for (int k = 0; k < 8; ++k) d[k] = __float2bfloat16_rn((dnorm[k] - xhat[k] * mean_dot) * rs);
    store128(dinp + off, d);
    // Both sums stay in registers (selecting an array by pointer would put them in memory).
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float gx = to_float(g[k]) * xhat[k];
      dwq[k] += is_q ? gx : 0.0f;
      dwk[k] += is_q ? 0.0f : gx;
    }
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    sums[slot][0][part * 8 + k] = dwq[k];
    sums[slot][1][part * 8 + k] = dwk[k];
  }
  __syncthreads();
  for (int c = threadIdx.x; c < 2 * hs; c += kThreads) {
    float t = 0.0f;
    for (int j = 0; j < kSlots; ++j) t += (&sums[j][0][0])[c];  // slot order
    partials[blockIdx.x * static_cast<int64_t>(2 * hs) + c] = t;
  }
}

// dq_weight[c] += sum_b partials[b][0][c]; dk_weight likewise from [b][1][c]; block order.
__global__ void qk_norm_dweight_final_kernel(float* dq_weight, float* dk_weight,
                                             const float* partials, int blocks, int hs) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= 2 * hs) return;
  float t = 0.0f;
  for (int b = 0; b < blocks; ++b) t += partials[b * static_cast<int64_t>(2 * hs) + c];
  if (c < hs)
    dq_weight[c] += t;
  else
    dk_weight[c - hs] += t;
}

// The kernels' shape of the packed layout, and N (tokens). Refuses the head widths and the
// alignment the kernels do not take (one warp lane per 8 channels of a head).
QkShape qk_shape(const OpCheck& c, const Tensor& inp, const AttentionDims& a, int64_t& N,
                 std::initializer_list<const void*> ptrs) {
  if (a.head_dim != 32 && a.head_dim != 64 && a.head_dim != 128 && a.head_dim != 256)
    c.fail("dims", "head_dim " + std::to_string(a.head_dim) + " not supported (32, 64, 128, 256)");
  if (!vec8_ok(a.head_dim, ptrs)) c.fail("inp", "tensors must be 16-byte aligned");
  N = inp.numel() / a.qkv_dim();
  QkShape s;
  s.heads = a.n_head + 2 * a.n_kv_head;
  s.units = N * s.heads;
  s.nh = a.n_head;
  s.kv = a.n_kv_head;
  return s;
}

template <class W>
void launch_qk_norm_forward(cudaStream_t stream, Tensor out, Tensor rstd, Tensor inp,
                            Tensor q_weight, Tensor k_weight, const QkShape& s, int lanes) {
  const int blocks = ceil_div(s.units * lanes, kThreads);
#define KILN_QK_FWD(L)                                                                       \
  qk_norm_forward_kernel<L, W>                                                               \
      <<<blocks, kThreads, 0, stream>>>(out.ptr<bf16>(), rstd.ptr<float>(), inp.ptr<bf16>(), \
                                        q_weight.ptr<W>(), k_weight.ptr<W>(), s)
  switch (lanes) {
    case 4:
      KILN_QK_FWD(4);
      break;
    case 8:
      KILN_QK_FWD(8);
      break;
    case 16:
      KILN_QK_FWD(16);
      break;
    default:
      KILN_QK_FWD(32);
      break;
  }
#undef KILN_QK_FWD
  KILN_CUDA_LAUNCH_CHECK();
}

template <class W>
void launch_qk_norm_backward(CudaBackend& backend, Tensor dinp, Tensor dq_weight, Tensor dk_weight,
                             Tensor dout, Tensor inp, Tensor q_weight, Tensor k_weight, Tensor rstd,
                             const QkShape& s, int hs) {
  const int lanes = hs / 8, slots = kThreads / lanes;
  const cudaStream_t stream = backend.stream();
  // One full wave: the grid depends only on the GPU (and the kernel), so does the sum order.
  int per_sm = 0;
#define KILN_QK_OCCUPANCY(L)                                     \
  KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor( \
      &per_sm, qk_norm_backward_kernel<L, W>, kThreads, 0))
  switch (lanes) {
    case 4:
      KILN_QK_OCCUPANCY(4);
      break;
    case 8:
      KILN_QK_OCCUPANCY(8);
      break;
    case 16:
      KILN_QK_OCCUPANCY(16);
      break;
    default:
      KILN_QK_OCCUPANCY(32);
      break;
  }
#undef KILN_QK_OCCUPANCY
  const int64_t want = static_cast<int64_t>(std::max(per_sm, 1)) * backend.sm_count();
  const int64_t units_per_block =
      std::max<int64_t>(ceil_div(s.units, std::min<int64_t>(want, ceil_div(s.units, slots))), 1);
  const int blocks = ceil_div(s.units, units_per_block);
  float* partials =
      static_cast<float*>(backend.scratch(static_cast<size_t>(blocks) * 2 * hs * sizeof(float)));
#define KILN_QK_BWD(L)                                                                  \
  qk_norm_backward_kernel<L, W><<<blocks, kThreads, 0, stream>>>(                       \
      dinp.ptr<bf16>(), partials, dout.ptr<bf16>(), inp.ptr<bf16>(), q_weight.ptr<W>(), \
      k_weight.ptr<W>(), rstd.ptr<float>(), s, units_per_block)
  switch (lanes) {
    case 4:
      KILN_QK_BWD(4);
      break;
    case 8:
      KILN_QK_BWD(8);
      break;
    case 16:
      KILN_QK_BWD(16);
      break;
    default:
      KILN_QK_BWD(32);
      break;
  }
#undef KILN_QK_BWD
  KILN_CUDA_LAUNCH_CHECK();
  qk_norm_dweight_final_kernel<<<ceil_div(2 * hs, 128), 128, 0, stream>>>(
      dq_weight.ptr<float>(), dk_weight.ptr<float>(), partials, blocks, hs);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace

void CudaBackend::run_qk_norm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor q_weight,
                                      Tensor k_weight, const AttentionDims& a, float eps) {
  int64_t N = 0;
  QkShape s = qk_shape(op_check("qk_norm_forward"), inp, a, N,
                       {out.data, inp.data, q_weight.data, k_weight.data});
  s.eps = eps;
  if (N == 0) return;
  with_f32_or_bf16(q_weight.dtype, [&](auto w) {
    launch_qk_norm_forward<decltype(w)>(stream_, out, rstd, inp, q_weight, k_weight, s,
                                        a.head_dim / 8);
  });
}

void CudaBackend::run_qk_norm_backward(Tensor dinp, Tensor dq_weight, Tensor dk_weight, Tensor dout,
                                       Tensor inp, Tensor q_weight, Tensor k_weight, Tensor rstd,
                                       const AttentionDims& a) {
  int64_t N = 0;
  const QkShape s = qk_shape(op_check("qk_norm_backward"), inp, a, N,
                             {dinp.data, dout.data, inp.data, q_weight.data, k_weight.data});
  if (N == 0) return;
  with_f32_or_bf16(q_weight.dtype, [&](auto w) {
    launch_qk_norm_backward<decltype(w)>(*this, dinp, dq_weight, dk_weight, dout, inp, q_weight,
                                         k_weight, rstd, s, a.head_dim);
  });
}

}  // namespace kiln
