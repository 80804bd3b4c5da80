// RMSNorm forward (plain and fused with the residual add) and backward: LayerNorm without the
// mean and the bias (LLaMA, Qwen3). out = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps).
// The residual stream (input, the fused add's sum, backward's dinp) is f32 or bf16 (template R),
// and backward can write the updated dinp's bf16 copy (dinp_act), as in layernorm.cu. weight is
// f32 or bf16 (template W), as layernorm.cu's.
// Structure and speed tricks as in layernorm.cu: one warp per row, f32 math, 16-byte loads when
// C % 8 == 0; up to C = 2048 the forward holds the row in registers (read once, all of it in
// flight). The fused residual form normalizes the residual as it stores it (rounded to R), and
// sums its squares in the same pass.
// Backward design choice: deterministic without float atomics. dinp += per row (the residual
// stream's gradient accumulates). dweight's column sums: for C % 256 == 0 up to 4096 (LLaMA
// 1.36B's and Qwen3's 2048) ONE pass over dout/inp/dinp, a block per row walking a fixed range of
// rows with its columns' dweight sums in registers (rmsnorm_backward_rows_kernel), then a final
// kernel adding the blocks' partials in a fixed order (the grid depends only on the GPU's SM
// count, so results are bit-identical run to run on one GPU model). Other widths (8192 included)
// take two passes: row-chunk partials of dout * x * rstd, then the dinp kernel.
#include <algorithm>
#include <array>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kWarpsPerBlock = 4;

// With kResidual: residual = a + b (rounded to R) is written and normalized; else a is.
template <int kVec, bool kResidual, class R, class W>
__global__ void rmsnorm_forward_kernel(bf16* out, float* rstd_out, R* residual, const R* a,
                                       const bf16* b, const W* weight, int64_t N, int C,
                                       float eps) {
  const int lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  if (row >= N) return;
  const R* x = kResidual ? residual + row * C : a + row * C;
  float sumsq = 0.0f;
  if constexpr (kResidual) {
    const R* ra = a + row * C;
    const bf16* rb = b + row * C;
    R* rr = residual + row * C;
    for (int c = lane * kVec; c < C; c += 32 * kVec) {
      float va[kVec], vb[kVec];
      load_vec<kVec>(va, ra + c);
      load_vec<kVec>(vb, rb + c);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        // The statistics are those of the residual as stored.
        va[k] = round_to<R>(va[k] + vb[k]);
        sumsq += va[k] * va[k];
      }
      store_vec<kVec>(rr + c, va);
    }
    __syncwarp();  // each lane re-reads only what it wrote, but keep the warp in step
  } else {
    for (int c = lane * kVec; c < C; c += 32 * kVec) {
      float v[kVec];
      load_vec<kVec>(v, x + c);
#pragma unroll
      for (int k = 0; k < kVec; ++k) sumsq += v[k] * v[k];
    }
  }
  const float rstd = rsqrtf(warp_sum(sumsq) / C + eps);
  for (int c = lane * kVec; c < C; c += 32 * kVec) {
    float v[kVec], w[kVec];
    load_vec<kVec>(v, x + c);
    load_vec<kVec>(w, weight + c);
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = v[k] * rstd * w[k];
    store_vec<kVec>(out + row * C + c, v);
  }
  if (lane == 0) rstd_out[row] = rstd;
}

// The same for C % 8 == 0 and C <= kMaxIters * 256 (up to 2048: wider rows would cost more
// registers than occupancy allows), with the row held in registers: lane l owns the 16-byte
// chunks (i * 32 + l) * 8 (those below C), all loaded before any is used, so a warp has its whole
// row in flight and HBM is read once (the loop above waits on each load).
template <int kMaxIters, bool kResidual, class R, class W>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    rmsnorm_forward_rows_kernel(bf16* out, float* rstd_out, R* residual, const R* a, const bf16* b,
                                const W* weight, int64_t N, int C, float eps) {
  const int lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  if (row >= N) return;
  Vec8<R> x[kMaxIters];
  Packed128<bf16> y[kResidual ? kMaxIters : 1];
#pragma unroll
  for (int i = 0; i < kMaxIters; ++i) {
    const int c = (i * 32 + lane) * 8;
    if (c < C) {
      x[i] = load8cs(a + row * C + c);
      if constexpr (kResidual) y[i] = load128cs(b + row * C + c);
    }
  }
  float sumsq = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxIters; ++i) {
    const int c = (i * 32 + lane) * 8;
    if (c >= C) continue;
    if constexpr (kResidual) {
#pragma unroll
      for (int k = 0; k < 8; ++k) x[i][k] = from_float<R>(to_float(x[i][k]) + to_float(y[i][k]));
      store8(residual + row * C + c, x[i]);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) sumsq += to_float(x[i][k]) * to_float(x[i][k]);
  }
  const float rstd = rsqrtf(warp_sum(sumsq) / C + eps);
#pragma unroll
  for (int i = 0; i < kMaxIters; ++i) {
    const int c = (i * 32 + lane) * 8;
    if (c >= C) continue;
    const Vec8<W> w = load8(weight + c);
    Packed128<bf16> o;
#pragma unroll
    for (int k = 0; k < 8; ++k)
      o[k] = __float2bfloat16_rn(to_float(x[i][k]) * rstd * to_float(w[k]));
    store128(out + row * C + c, o);
  }
  if (lane == 0) rstd_out[row] = rstd;
}

// Both forward ops: residual undefined is the plain one (a normalized), else residual = a + b.
template <class R, class W>
void launch_rmsnorm_forward(cudaStream_t stream, Tensor out, Tensor rstd_t, Tensor residual_t,
                            Tensor a_t, Tensor b_t, Tensor weight_t, float eps) {
  const int C = static_cast<int>(a_t.dim(-1));
  const int64_t N = a_t.numel() / C;
  const bool vec8 =
      vec8_ok(C, {residual_t.data, out.data, a_t.data, b_t.data, weight_t.data});
  bf16* o = out.ptr<bf16>();
  float* rstd = rstd_t.ptr<float>();
  R* residual = residual_t.defined() ? residual_t.ptr<R>() : nullptr;
  const R* a = a_t.ptr<R>();
  const bf16* b = b_t.defined() ? b_t.ptr<bf16>() : nullptr;
  const W* weight = weight_t.ptr<W>();
  const int blocks = ceil_div(N, kWarpsPerBlock), threads = 32 * kWarpsPerBlock;
#define KILN_RMSNORM_FWD(kernel, first)                                                      \
  do {                                                                                       \
    if (residual)                                                                            \
      kernel<first, true, R, W>                                                              \
          <<<blocks, threads, 0, stream>>>(o, rstd, residual, a, b, weight, N, C, eps);      \
    else                                                                                     \
      kernel<first, false, R, W>                                                             \
          <<<blocks, threads, 0, stream>>>(o, rstd, nullptr, a, nullptr, weight, N, C, eps); \
  } while (0)
  if (vec8 && C <= 4 * 256)
    KILN_RMSNORM_FWD(rmsnorm_forward_rows_kernel, 4);
  else if (vec8 && C <= 8 * 256)
    KILN_RMSNORM_FWD(rmsnorm_forward_rows_kernel, 8);
  else if (vec8)
    KILN_RMSNORM_FWD(rmsnorm_forward_kernel, 8);
  else
    KILN_RMSNORM_FWD(rmsnorm_forward_kernel, 1);
#undef KILN_RMSNORM_FWD
  KILN_CUDA_LAUNCH_CHECK();
}

// dinp[row] += (dnorm - xhat * mean(dnorm * xhat)) * rstd, dnorm = dout * weight, xhat = x * rstd;
// dinp_act (when not null) = the updated dinp in bf16.
template <int kVec, class R, class W>
__global__ void rmsnorm_dinp_kernel(R* dinp, bf16* dinp_act, const bf16* dout, const R* inp,
                                    const W* weight, const float* rstd, int64_t N, int C) {
  const int lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  if (row >= N) return;
  const float rs = rstd[row];
  const bf16* dy = dout + row * C;
  const R* x = inp + row * C;
  float sum_dnorm_xhat = 0.0f;
  for (int c = lane * kVec; c < C; c += 32 * kVec) {
    float g[kVec], v[kVec], w[kVec];
    load_vec<kVec>(g, dy + c);
    load_vec<kVec>(v, x + c);
    load_vec<kVec>(w, weight + c);
#pragma unroll
    for (int k = 0; k < kVec; ++k) sum_dnorm_xhat += g[k] * w[k] * v[k] * rs;
  }
  const float mean_dnorm_xhat = warp_sum(sum_dnorm_xhat) / C;
  for (int c = lane * kVec; c < C; c += 32 * kVec) {
    float g[kVec], v[kVec], w[kVec], d[kVec];
    load_vec<kVec>(g, dy + c);
    load_vec<kVec>(v, x + c);
    load_vec<kVec>(w, weight + c);
    load_vec<kVec>(d, dinp + row * C + c);
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      d[k] = round_to<R>(d[k] + (g[k] * w[k] - v[k] * rs * mean_dnorm_xhat) * rs);
    store_vec<kVec>(dinp + row * C + c, d);
    if (dinp_act) store_vec<kVec>(dinp_act + row * C + c, d);
  }
}

// partials[chunk][c] = sum of dout * x * rstd over the chunk's rows (one thread per column).
template <class R>
__global__ void rmsnorm_dweight_partials_kernel(float* partials, const bf16* dout, const R* inp,
                                                const float* rstd, int64_t N, int C,
                                                int64_t rows_per_chunk) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = blockIdx.y * rows_per_chunk;
  const int64_t r1 = min(N, r0 + rows_per_chunk);
  float dw = 0.0f;
  for (int64_t r = r0; r < r1; ++r)
    dw += to_float(dout[r * C + c]) * to_float(inp[r * C + c]) * rstd[r];
  partials[blockIdx.y * static_cast<int64_t>(C) + c] = dw;
}

// dweight[c] += the partials' sum. A block of 32 columns x 8 row lanes: lane y adds chunks y,
// y + 8, ... of its column, then the 8 lane sums are added in lane order, a fixed order for a
// given chunk count (hundreds of chunks: one thread per column walking them all would be
// latency-bound, tens of microseconds a call).
constexpr int kFinalCols = 32, kFinalLanes = 8;
__global__ void __launch_bounds__(kFinalCols* kFinalLanes)
    rmsnorm_dweight_final_kernel(float* dweight, const float* partials, int chunks, int C) {
  __shared__ float lane_sums[kFinalLanes][kFinalCols + 1];
  const int x = threadIdx.x % kFinalCols, y = threadIdx.x / kFinalCols;
  const int c = blockIdx.x * kFinalCols + x;
  float dw = 0.0f;
  if (c < C)
    for (int k = y; k < chunks; k += kFinalLanes) dw += partials[k * static_cast<int64_t>(C) + c];
  lane_sums[y][x] = dw;
  __syncthreads();
  if (y != 0 || c >= C) return;
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kFinalLanes; ++i) total += lane_sums[i][x];
  dweight[c] += total;
}

void launch_dweight_final(cudaStream_t stream, float* dweight, const float* partials, int chunks,
                          int C) {
  rmsnorm_dweight_final_kernel<<<ceil_div(C, kFinalCols), kFinalCols * kFinalLanes, 0, stream>>>(
      dweight, partials, chunks, C);
  KILN_CUDA_LAUNCH_CHECK();
}

// One-pass backward for C % 256 == 0 up to 4096 (LLaMA 1.36B's and Qwen3's 2048): a block of
// C / 8 threads per row, thread t owning columns [8t, 8t + 8) of every row, so its dweight sums
// stay in 8 registers across the block's rows (no shared-memory traffic) and its weight is
// loaded once. Each block walks a contiguous range of rows with the next row's dout, inp, dinp
// and rstd loaded before the current row's reduction, so two rows' reads are in flight per
// thread (the warp-per-row kernel this replaced read dinp only after the row's reduction, one
// HBM round trip more per row: 2.7 TB/s). The row's sum crosses warps through a double-buffered
// shared array, one barrier a row. The grid is one wave sized by the GPU (occupancy x SMs), so the
// partials' order, and with it dweight, is bit-identical run to run on one GPU model.
// At most 64 registers, so that 1024 threads (two rows each in flight) fit on an SM; an f32 stream
// holds twice the bytes a row, and gets 128 (at 64 it spills).
template <int kThreads, class R, class W>
__global__ void __launch_bounds__(kThreads, (sizeof(R) == 2 ? 1024 : 512) / kThreads)
    rmsnorm_backward_rows_kernel(R* dinp, bf16* dinp_act, float* partials, const bf16* dout,
                                 const R* inp, const W* weight, const float* rstd, int64_t N,
                                 int64_t rows_per_block) {
  constexpr int C = kThreads * 8, kWarps = kThreads / 32;
  __shared__ float row_sums[2][kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, c = threadIdx.x * 8;
  float w[8], dw[8];
  {
    const Vec8<W> wp = load8(weight + c);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      w[k] = to_float(wp[k]);
      dw[k] = 0.0f;
    }
  }
  const int64_t r0 = blockIdx.x * rows_per_block;
  const int64_t r1 = min(N, r0 + rows_per_block);
  Packed128<bf16> g;
  Vec8<R> v, d;
  float rs = 0.0f;
  if (r0 < r1) {
    g = load128cs(dout + r0 * C + c);
    v = load8cs(inp + r0 * C + c);
    d = load8cs(dinp + r0 * C + c);
    rs = rstd[r0];
  }
  int parity = 0;
  for (int64_t row = r0; row < r1; ++row) {
    const Packed128<bf16> gi = g;
    const Vec8<R> vi = v;
    Vec8<R> di = d;
    const float rsi = rs;
    if (row + 1 < r1) {
      g = load128cs(dout + (row + 1) * C + c);
      v = load8cs(inp + (row + 1) * C + c);
      d = load8cs(dinp + (row + 1) * C + c);
      rs = rstd[row + 1];
    }
    float part = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float gk = to_float(gi[k]);
      const float xhat = to_float(vi[k]) * rsi;
      part += gk * w[k] * xhat;
      dw[k] += gk * xhat;
    }
    part = warp_sum(part);
    if (lane == 0) row_sums[parity][warp] = part;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) total += row_sums[parity][i];
    parity ^= 1;
    const float mean_dnorm_xhat = total / C;
    Packed128<bf16> copy;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float xhat = to_float(vi[k]) * rsi;
      di[k] = from_float<R>(to_float(di[k]) +
                            (to_float(gi[k]) * w[k] - xhat * mean_dnorm_xhat) * rsi);
      copy[k] = __float2bfloat16_rn(to_float(di[k]));
    }
    store8(dinp + row * C + c, di);
    if (dinp_act) store128(dinp_act + row * C + c, copy);
  }
  float* out = partials + blockIdx.x * static_cast<int64_t>(C) + c;
  *reinterpret_cast<float4*>(out) = make_float4(dw[0], dw[1], dw[2], dw[3]);
  *reinterpret_cast<float4*>(out + 4) = make_float4(dw[4], dw[5], dw[6], dw[7]);
}

template <int kThreads, class R, class W>
void rmsnorm_backward_rows(CudaBackend& backend, Tensor dinp, Tensor dinp_act, Tensor dweight,
                           Tensor dout, Tensor inp, Tensor weight, Tensor rstd, int64_t N) {
  constexpr int C = kThreads * 8;
  int per_sm = 0;
  KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, rmsnorm_backward_rows_kernel<kThreads, R, W>, kThreads, 0));
  // One full wave; the grid depends only on the GPU, so the partial sums' order is fixed on it.
  const int64_t want = static_cast<int64_t>(std::max(per_sm, 1)) * backend.sm_count();
  const int64_t rows_per_block = ceil_div(N, std::min<int64_t>(want, N));
  const int blocks = ceil_div(N, rows_per_block);
  float* partials =
      static_cast<float*>(backend.scratch(static_cast<size_t>(blocks) * C * sizeof(float)));
  rmsnorm_backward_rows_kernel<kThreads, R, W><<<blocks, kThreads, 0, backend.stream()>>>(
      dinp.ptr<R>(), dinp_act.defined() ? dinp_act.ptr<bf16>() : nullptr, partials,
      dout.ptr<bf16>(), inp.ptr<R>(), weight.ptr<W>(), rstd.ptr<float>(), N, rows_per_block);
  KILN_CUDA_LAUNCH_CHECK();
  launch_dweight_final(backend.stream(), dweight.ptr<float>(), partials, blocks, C);
}

// rmsnorm_backward_rows for C = 256, 512, ..., 4096 (index C / 256 - 1).
using BackwardRows = void (*)(CudaBackend&, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                              int64_t);
template <class R, class W, int... k>
constexpr std::array<BackwardRows, sizeof...(k)> backward_rows(std::integer_sequence<int, k...>) {
  return {&rmsnorm_backward_rows<(k + 1) * 32, R, W>...};
}
template <class R, class W>
constexpr auto kBackwardRows = backward_rows<R, W>(std::make_integer_sequence<int, 16>{});

template <class R, class W>
void launch_rmsnorm_backward(CudaBackend& backend, Tensor dinp, Tensor dinp_act, Tensor dweight,
                             Tensor dout, Tensor inp, Tensor weight, Tensor rstd) {
  const int C = static_cast<int>(inp.dim(-1));
  const int64_t N = inp.numel() / C;
  const bool vec8 = vec8_ok(C, {dinp.data, dinp_act.data, dout.data, inp.data, weight.data});
  if (C % 256 == 0 && C <= 4096 && vec8)
    return kBackwardRows<R, W>[C / 256 - 1](backend, dinp, dinp_act, dweight, dout, inp, weight,
                                            rstd, N);
  const cudaStream_t stream = backend.stream();
  const RowChunks chunks = row_chunks(N);
  float* partials =
      static_cast<float*>(backend.scratch(static_cast<size_t>(chunks.count) * C * sizeof(float)));
  const int threads = 128;
  rmsnorm_dweight_partials_kernel<R>
      <<<dim3(ceil_div(C, threads), chunks.count), threads, 0, stream>>>(
          partials, dout.ptr<bf16>(), inp.ptr<R>(), rstd.ptr<float>(), N, C, chunks.rows);
  KILN_CUDA_LAUNCH_CHECK();
  launch_dweight_final(stream, dweight.ptr<float>(), partials, chunks.count, C);

  const int blocks = ceil_div(N, kWarpsPerBlock);
  bf16* copy = dinp_act.defined() ? dinp_act.ptr<bf16>() : nullptr;
  if (vec8)
    rmsnorm_dinp_kernel<8, R, W><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(
        dinp.ptr<R>(), copy, dout.ptr<bf16>(), inp.ptr<R>(), weight.ptr<W>(), rstd.ptr<float>(), N,
        C);
  else
    rmsnorm_dinp_kernel<1, R, W><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(
        dinp.ptr<R>(), copy, dout.ptr<bf16>(), inp.ptr<R>(), weight.ptr<W>(), rstd.ptr<float>(), N,
        C);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace

void CudaBackend::run_rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight,
                                      float eps) {
  const int C = static_cast<int>(inp.dim(-1));
  const int64_t N = inp.numel() / C;
  if (N == 0) return;
  with_f32_or_bf16(inp.dtype, weight.dtype, [&](auto r, auto w) {
    launch_rmsnorm_forward<decltype(r), decltype(w)>(stream_, out, rstd, {}, inp, {}, weight, eps);
  });
}

void CudaBackend::run_residual_rmsnorm_forward(Tensor residual, Tensor out, Tensor rstd, Tensor a,
                                               Tensor b, Tensor weight, float eps) {
  const int C = static_cast<int>(a.dim(-1));
  const int64_t N = a.numel() / C;
  if (N == 0) return;
  with_f32_or_bf16(a.dtype, weight.dtype, [&](auto r, auto w) {
    launch_rmsnorm_forward<decltype(r), decltype(w)>(stream_, out, rstd, residual, a, b, weight,
                                                     eps);
  });
}

void CudaBackend::run_rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                                       Tensor weight, Tensor rstd, Tensor dinp_act) {
  const int C = static_cast<int>(inp.dim(-1));
  const int64_t N = inp.numel() / C;
  if (N == 0) return;
  with_f32_or_bf16(inp.dtype, weight.dtype, [&](auto r, auto w) {
    launch_rmsnorm_backward<decltype(r), decltype(w)>(*this, dinp, dinp_act, dweight, dout, inp,
                                                      weight, rstd);
  });
}

}  // namespace kiln
