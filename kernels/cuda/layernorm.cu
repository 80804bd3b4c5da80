// LayerNorm forward (plain and fused with the residual add) and backward.
// The residual stream (the norm's input, the fused add's sum, and backward's dinp) is f32 or bf16
// (precision.residual, template R); the branch added, the output and dout are bf16. Backward can
// also write a bf16 copy of the updated dinp (dinp_act), the gradient the GEMMs of the branch
// before the norm read, so an f32 stream costs no extra pass. weight and bias are f32 or bf16
// (template W): the trainer reads norm gains in f32, as autocast does; other callers pass bf16.
// Forward: one warp per row, f32 math, 16-byte loads when C % 8 == 0; mean and variance in two
// passes over the row (it stays in L1), so no catastrophic cancellation.
// Backward design choice: deterministic without float atomics. dinp is per row (one warp per
// row, accumulated into the residual-stream gradient). dweight/dbias are column sums over all
// rows: each block writes per-row-chunk partials to scratch, a second kernel adds the partials
// in fixed order into the f32 grads. Same input -> bit-identical grads, every run.
// For C = 256, 512, 768, 1024 (16-byte aligned) backward is ONE pass over dout/inp/dinp: a
// persistent grid, one warp per row, each warp keeping its running dweight/dbias column sums in
// shared memory across its rows; a block adds its warps' sums in warp order, writes one partial,
// and the final kernel adds the partials in block order. The two-pass path below (dinp kernel,
// then a partials kernel re-reading dout and inp) remains for other widths.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr float kLayerNormEps = 1e-5f;
constexpr int kWarpsPerBlock = 4;

// With kResidual: residual = a + b (rounded to R) is written and normalized; else a is.
template <int kVec, bool kResidual, class R, class W>
__global__ void layernorm_forward_kernel(bf16* out, float* mean_out, float* rstd_out, R* residual,
                                         const R* a, const bf16* b, const W* weight, const W* bias,
                                         int64_t N, int C) {
  const int lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  if (row >= N) return;
  const R* x = kResidual ? residual + row * C : a + row * C;
  if constexpr (kResidual) {
    const R* ra = a + row * C;
    const bf16* rb = b + row * C;
    R* rr = residual + row * C;
    for (int c = lane * kVec; c < C; c += 32 * kVec) {
      float va[kVec], vb[kVec];
      load_vec<kVec>(va, ra + c);
      load_vec<kVec>(vb, rb + c);
#pragma unroll
      for (int k = 0; k < kVec; ++k) va[k] += vb[k];
      store_vec<kVec>(rr + c, va);
    }
    __syncwarp();  // each lane re-reads only what it wrote, but keep the warp in step
  }
  float sum = 0.0f;
  for (int c = lane * kVec; c < C; c += 32 * kVec) {
    float v[kVec];
    load_vec<kVec>(v, x + c);
#pragma unroll
    for (int k = 0; k < kVec; ++k) sum += v[k];
  }
  const float mean = warp_sum(sum) / C;
  float var = 0.0f;
  for (int c = lane * kVec; c < C; c += 32 * kVec) {
    float v[kVec];
    load_vec<kVec>(v, x + c);
#pragma unroll
    for (int k = 0; k < kVec; ++k) var += (v[k] - mean) * (v[k] - mean);
  }
  const float rstd = rsqrtf(warp_sum(var) / C + kLayerNormEps);
  for (int c = lane * kVec; c < C; c += 32 * kVec) {
    float v[kVec], w[kVec], bb[kVec];
    load_vec<kVec>(v, x + c);
    load_vec<kVec>(w, weight + c);
    load_vec<kVec>(bb, bias + c);
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = (v[k] - mean) * rstd * w[k] + bb[k];
    store_vec<kVec>(out + row * C + c, v);
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// dinp[row] += (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat)) * rstd, dnorm = dout * weight;
// dinp_act (when not null) = the updated dinp in bf16.
template <int kVec, class R, class W>
__global__ void layernorm_dinp_kernel(R* dinp, bf16* dinp_act, const bf16* dout, const R* inp,
                                      const W* weight, const float* mean, const float* rstd,
                                      int64_t N, int C) {
  const int lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  if (row >= N) return;
  const float mu = mean[row], rs = rstd[row];
  const bf16* dy = dout + row * C;
  const R* x = inp + row * C;
  float sum_dnorm = 0.0f, sum_dnorm_xhat = 0.0f;
  for (int c = lane * kVec; c < C; c += 32 * kVec) {
    float g[kVec], v[kVec], w[kVec];
    load_vec<kVec>(g, dy + c);
    load_vec<kVec>(v, x + c);
    load_vec<kVec>(w, weight + c);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float dnorm = g[k] * w[k];
      sum_dnorm += dnorm;
      sum_dnorm_xhat += dnorm * (v[k] - mu) * rs;
    }
  }
  const float mean_dnorm = warp_sum(sum_dnorm) / C;
  const float mean_dnorm_xhat = warp_sum(sum_dnorm_xhat) / C;
  for (int c = lane * kVec; c < C; c += 32 * kVec) {
    float g[kVec], v[kVec], w[kVec], d[kVec];
    load_vec<kVec>(g, dy + c);
    load_vec<kVec>(v, x + c);
    load_vec<kVec>(w, weight + c);
    load_vec<kVec>(d, dinp + row * C + c);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float xhat = (v[k] - mu) * rs;
      d[k] = round_to<R>(d[k] + (g[k] * w[k] - mean_dnorm - xhat * mean_dnorm_xhat) * rs);
    }
    store_vec<kVec>(dinp + row * C + c, d);
    if (dinp_act) store_vec<kVec>(dinp_act + row * C + c, d);
  }
}

// partials[chunk][0][c] = sum dout*xhat, partials[chunk][1][c] = sum dout over the chunk's rows.
template <class R>
__global__ void layernorm_dparams_partials_kernel(float* partials, const bf16* dout,
                                                  const R* inp, const float* mean,
                                                  const float* rstd, int64_t N, int C,
                                                  int64_t rows_per_chunk) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = blockIdx.y * rows_per_chunk;
  const int64_t r1 = min(N, r0 + rows_per_chunk);
  float dw = 0.0f, db = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float g = to_float(dout[r * C + c]);
    dw += g * (to_float(inp[r * C + c]) - mean[r]) * rstd[r];
    db += g;
  }
  partials[(blockIdx.y * 2) * static_cast<int64_t>(C) + c] = dw;
  partials[(blockIdx.y * 2 + 1) * static_cast<int64_t>(C) + c] = db;
}

__global__ void layernorm_dparams_final_kernel(float* dweight, float* dbias,
                                               const float* partials, int chunks, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float dw = 0.0f, db = 0.0f;
  for (int k = 0; k < chunks; ++k) {
    dw += partials[(2 * k) * static_cast<int64_t>(C) + c];
    db += partials[(2 * k + 1) * static_cast<int64_t>(C) + c];
  }
  dweight[c] += dw;
  dbias[c] += db;
}

constexpr int kFusedBackwardWarps = 8;

// C == kIters * 256: lane `l` of a warp owns columns (i * 32 + l) * 8 + [0, 8) for i < kIters.
// Dynamic shared memory: f32 [kFusedBackwardWarps][2][C], each warp's running dweight/dbias
// sums (kept there, not in registers, so two blocks fit per SM).
template <int kIters, class R, class W>
__global__ void __launch_bounds__(32 * kFusedBackwardWarps, 2)
    layernorm_backward_fused_kernel(R* dinp, bf16* dinp_act, float* partials, const bf16* dout,
                                    const R* inp, const W* weight, const float* mean,
                                    const float* rstd, int64_t N, int64_t rows_per_block) {
  constexpr int C = kIters * 256;
  extern __shared__ float4 fused_smem[];
  float* sums = reinterpret_cast<float*>(fused_smem);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* my_dw = sums + warp * 2 * C;
  float* my_db = my_dw + C;
  for (int c = lane * 4; c < 2 * C; c += 32 * 4)
    *reinterpret_cast<float4*>(my_dw + c) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  __syncwarp();
  const int64_t r0 = blockIdx.x * rows_per_block;
  const int64_t r1 = min(N, r0 + rows_per_block);
  for (int64_t row = r0 + warp; row < r1; row += kFusedBackwardWarps) {
    const bf16* dy = dout + row * C;
    const R* x = inp + row * C;
    R* dx = dinp + row * C;
    Packed128<bf16> g[kIters];
    Vec8<R> v[kIters], d[kIters];
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int c = (i * 32 + lane) * 8;
      g[i] = load128cs(dy + c);
      v[i] = load8cs(x + c);
      d[i] = load8(dx + c);
    }
    const float mu = mean[row], rs = rstd[row];
    float sum_dnorm = 0.0f, sum_dnorm_xhat = 0.0f;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int c = (i * 32 + lane) * 8;
      const Vec8<W> w = load8(weight + c);
      float dw[8], db[8];
      *reinterpret_cast<float4*>(dw) = *reinterpret_cast<float4*>(my_dw + c);
      *reinterpret_cast<float4*>(dw + 4) = *reinterpret_cast<float4*>(my_dw + c + 4);
      *reinterpret_cast<float4*>(db) = *reinterpret_cast<float4*>(my_db + c);
      *reinterpret_cast<float4*>(db + 4) = *reinterpret_cast<float4*>(my_db + c + 4);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float gk = to_float(g[i][k]);
        const float xhat = (to_float(v[i][k]) - mu) * rs;
        const float dnorm = gk * to_float(w[k]);
        sum_dnorm += dnorm;
        sum_dnorm_xhat += dnorm * xhat;
        dw[k] += gk * xhat;
        db[k] += gk;
      }
      *reinterpret_cast<float4*>(my_dw + c) = *reinterpret_cast<float4*>(dw);
      *reinterpret_cast<float4*>(my_dw + c + 4) = *reinterpret_cast<float4*>(dw + 4);
      *reinterpret_cast<float4*>(my_db + c) = *reinterpret_cast<float4*>(db);
      *reinterpret_cast<float4*>(my_db + c + 4) = *reinterpret_cast<float4*>(db + 4);
    }
    const float mean_dnorm = warp_sum(sum_dnorm) / C;
    const float mean_dnorm_xhat = warp_sum(sum_dnorm_xhat) / C;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int c = (i * 32 + lane) * 8;
      const Vec8<W> w = load8(weight + c);
      Packed128<bf16> copy;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float xhat = (to_float(v[i][k]) - mu) * rs;
        const float dnorm = to_float(g[i][k]) * to_float(w[k]);
        d[i][k] = from_float<R>(to_float(d[i][k]) +
                                (dnorm - mean_dnorm - xhat * mean_dnorm_xhat) * rs);
        copy[k] = __float2bfloat16_rn(to_float(d[i][k]));
      }
      store8(dx + c, d[i]);
      if (dinp_act) store128(dinp_act + row * C + c, copy);
    }
  }
  __syncthreads();
  // The block's partial: the warps' sums added in warp order.
  float* out = partials + blockIdx.x * static_cast<int64_t>(2 * C);
  for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) {
    float t = sums[c];
#pragma unroll
    for (int w = 1; w < kFusedBackwardWarps; ++w) t += sums[w * 2 * C + c];
    out[c] = t;
  }
}

template <int kIters, class R, class W>
void layernorm_backward_fused(CudaBackend& backend, Tensor dinp, Tensor dinp_act, Tensor dweight,
                              Tensor dbias, Tensor dout, Tensor inp, Tensor weight, Tensor mean,
                              Tensor rstd, int64_t N) {
  constexpr int C = kIters * 256;
  const int threads = 32 * kFusedBackwardWarps;
  const size_t smem = static_cast<size_t>(kFusedBackwardWarps) * 2 * C * sizeof(float);
  KILN_CUDA_CHECK(cudaFuncSetAttribute(layernorm_backward_fused_kernel<kIters, R, W>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  int per_sm = 0;
  KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, layernorm_backward_fused_kernel<kIters, R, W>, threads, smem));
  // One full wave; the grid depends only on the GPU, so the partial sums' order is fixed on it.
  const int64_t want = static_cast<int64_t>(std::max(per_sm, 1)) * backend.sm_count();
  const int64_t rows_per_block = ceil_div(N, std::min<int64_t>(want, N));
  const int blocks = static_cast<int>(ceil_div(N, rows_per_block));
  float* partials =
      static_cast<float*>(backend.scratch(static_cast<size_t>(blocks) * 2 * C * sizeof(float)));
  layernorm_backward_fused_kernel<kIters, R, W><<<blocks, threads, smem, backend.stream()>>>(
      dinp.ptr<R>(), dinp_act.defined() ? dinp_act.ptr<bf16>() : nullptr, partials,
      dout.ptr<bf16>(), inp.ptr<R>(), weight.ptr<W>(), mean.ptr<float>(), rstd.ptr<float>(), N,
      rows_per_block);
  KILN_CUDA_LAUNCH_CHECK();
  layernorm_dparams_final_kernel<<<ceil_div(C, 128), 128, 0, backend.stream()>>>(
      dweight.ptr<float>(), dbias.ptr<float>(), partials, blocks, C);
  KILN_CUDA_LAUNCH_CHECK();
}

template <class R, class W>
void launch_layernorm_forward(cudaStream_t stream, Tensor out, Tensor mean, Tensor rstd,
                              Tensor residual, Tensor a, Tensor b, Tensor weight, Tensor bias) {
  const int C = static_cast<int>(a.dim(-1));
  const int64_t N = a.numel() / C;
  const int blocks = ceil_div(N, kWarpsPerBlock), threads = 32 * kWarpsPerBlock;
  const bool vec8 =
      vec8_ok(C, {residual.data, out.data, a.data, b.data, weight.data, bias.data});
  R* res = residual.defined() ? residual.ptr<R>() : nullptr;
  const bf16* bp = b.defined() ? b.ptr<bf16>() : nullptr;
#define KILN_LAYERNORM_FWD(vec, fused)                                                             \
  layernorm_forward_kernel<vec, fused, R, W>                                                       \
      <<<blocks, threads, 0, stream>>>(out.ptr<bf16>(), mean.ptr<float>(), rstd.ptr<float>(), res, \
                                       a.ptr<R>(), bp, weight.ptr<W>(), bias.ptr<W>(), N, C)
  if (res && vec8)
    KILN_LAYERNORM_FWD(8, true);
  else if (res)
    KILN_LAYERNORM_FWD(1, true);
  else if (vec8)
    KILN_LAYERNORM_FWD(8, false);
  else
    KILN_LAYERNORM_FWD(1, false);
#undef KILN_LAYERNORM_FWD
  KILN_CUDA_LAUNCH_CHECK();
}

template <class R, class W>
void launch_layernorm_backward(CudaBackend& backend, Tensor dinp, Tensor dinp_act, Tensor dweight,
                               Tensor dbias, Tensor dout, Tensor inp, Tensor weight, Tensor mean,
                               Tensor rstd) {
  const int C = static_cast<int>(inp.dim(-1));
  const int64_t N = inp.numel() / C;
  const bool vec8 = vec8_ok(C, {dinp.data, dinp_act.data, dout.data, inp.data, weight.data});
  if (C % 256 == 0 && C <= 1024 && vec8) {
    using Fused = void (*)(CudaBackend&, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                           Tensor, Tensor, int64_t);
    constexpr Fused kFused[] = {
        &layernorm_backward_fused<1, R, W>, &layernorm_backward_fused<2, R, W>,
        &layernorm_backward_fused<3, R, W>, &layernorm_backward_fused<4, R, W>};
    return kFused[C / 256 - 1](backend, dinp, dinp_act, dweight, dbias, dout, inp, weight, mean,
                               rstd, N);
  }
  const cudaStream_t stream = backend.stream();
  const RowChunks chunks = row_chunks(N);
  float* partials = static_cast<float*>(
      backend.scratch(static_cast<size_t>(chunks.count) * 2 * C * sizeof(float)));
  const int threads = 128;
  layernorm_dparams_partials_kernel<R>
      <<<dim3(ceil_div(C, threads), chunks.count), threads, 0, stream>>>(
          partials, dout.ptr<bf16>(), inp.ptr<R>(), mean.ptr<float>(), rstd.ptr<float>(), N, C,
          chunks.rows);
  KILN_CUDA_LAUNCH_CHECK();
  layernorm_dparams_final_kernel<<<ceil_div(C, threads), threads, 0, stream>>>(
      dweight.ptr<float>(), dbias.ptr<float>(), partials, chunks.count, C);
  KILN_CUDA_LAUNCH_CHECK();

  const int blocks = ceil_div(N, kWarpsPerBlock);
  bf16* copy = dinp_act.defined() ? dinp_act.ptr<bf16>() : nullptr;
  if (vec8)
    layernorm_dinp_kernel<8, R, W><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(
        dinp.ptr<R>(), copy, dout.ptr<bf16>(), inp.ptr<R>(), weight.ptr<W>(), mean.ptr<float>(),
        rstd.ptr<float>(), N, C);
  else
    layernorm_dinp_kernel<1, R, W><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(
        dinp.ptr<R>(), copy, dout.ptr<bf16>(), inp.ptr<R>(), weight.ptr<W>(), mean.ptr<float>(),
        rstd.ptr<float>(), N, C);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace

void CudaBackend::run_layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp,
                                        Tensor weight, Tensor bias) {
  const int C = static_cast<int>(inp.dim(-1));
  const int64_t N = inp.numel() / C;
  if (N == 0) return;
  with_f32_or_bf16(inp.dtype, weight.dtype, [&](auto r, auto w) {
    launch_layernorm_forward<decltype(r), decltype(w)>(stream_, out, mean, rstd, {}, inp, {},
                                                       weight, bias);
  });
}

void CudaBackend::run_residual_layernorm_forward(Tensor residual, Tensor out, Tensor mean,
                                                 Tensor rstd, Tensor a, Tensor b, Tensor weight,
                                                 Tensor bias) {
  const int C = static_cast<int>(a.dim(-1));
  const int64_t N = a.numel() / C;
  if (N == 0) return;
  with_f32_or_bf16(a.dtype, weight.dtype, [&](auto r, auto w) {
    launch_layernorm_forward<decltype(r), decltype(w)>(stream_, out, mean, rstd, residual, a, b,
                                                       weight, bias);
  });
}

void CudaBackend::run_layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                                         Tensor inp, Tensor weight, Tensor mean, Tensor rstd,
                                         Tensor dinp_act) {
  const int C = static_cast<int>(inp.dim(-1));
  const int64_t N = inp.numel() / C;
  if (N == 0) return;
  with_f32_or_bf16(inp.dtype, weight.dtype, [&](auto r, auto w) {
    launch_layernorm_backward<decltype(r), decltype(w)>(*this, dinp, dinp_act, dweight, dbias, dout,
                                                        inp, weight, mean, rstd);
  });
}

}  // namespace kiln
