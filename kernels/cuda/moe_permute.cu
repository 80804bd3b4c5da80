// Mixture-of-Experts dispatch and combine on the GPU (reference: kernels/cpu/moe_permute.cpp).
// Dispatch is a stable counting sort computed entirely on the device (the grouped GEMMs then
// read the sizes on the host: grouped_matmul.cu): a histogram of the N*k choices (integer
// atomics), an exclusive scan into the offsets (E is small: one thread), then one block per
// expert walks the choices in order and ranks its own with warp ballots, which keeps each
// expert's rows in token order exactly as the CPU does. The gather and the combine are plain
// row copies and weighted row sums in f32, a block per row, 16 bytes a thread.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kRankThreads = 1024;

__global__ void histogram_kernel(int* counts, const int* topk_idx, int64_t M) {
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < M;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x)
    atomicAdd(&counts[topk_idx[s]], 1);
}

__global__ void offsets_kernel(int* offsets, const int* counts, int E) {
  int sum = 0;
  offsets[0] = 0;
  for (int e = 0; e < E; ++e) offsets[e + 1] = (sum += counts[e]);
}

// Block e: slot_row and row_token for expert e's choices, in slot order.
__global__ void __launch_bounds__(kRankThreads)
    rank_kernel(int* slot_row, int* row_token, const int* topk_idx, const int* offsets, int64_t M,
                int K) {
  __shared__ int warp_counts[kRankThreads / 32];
  const int e = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int base = offsets[e];
  for (int64_t chunk = 0; chunk < M; chunk += kRankThreads) {
    const int64_t s = chunk + threadIdx.x;
    const bool mine = s < M && topk_idx[s] == e;
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kRankThreads / 32; ++w) {
      before += w < warp ? warp_counts[w] : 0;
      total += warp_counts[w];
    }
    if (mine) {
      const int row = base + before + __popc(ballot & ((1u << lane) - 1));
      slot_row[s] = row;
      row_token[row] = static_cast<int>(s / K);
    }
    base += total;
    __syncthreads();  // warp_counts is rewritten by the next chunk
  }
}

// The row kernels move kVec elements a thread: 8 (one 16-byte access) where C % 8 == 0 and the
// tensors are 16-byte aligned (every MoE layer of a real model), else 1. A block walks rows.
// Element by element with a 64-bit division each, they ran at ~0.8 TB/s on an H100.
template <int kVec>
__global__ void gather_rows_kernel(bf16* xp, const bf16* x, const int* row_token, int64_t M,
                                   int64_t C) {
  for (int64_t r = blockIdx.x; r < M; r += gridDim.x) {
    const bf16* src = x + static_cast<int64_t>(row_token[r]) * C;
    bf16* dst = xp + r * C;
    for (int64_t c = threadIdx.x * kVec; c < C; c += static_cast<int64_t>(blockDim.x) * kVec) {
      if constexpr (kVec == 8)
        store128(dst + c, load128(src + c));
      else
        dst[c] = src[c];
    }
  }
}

template <int kVec>
__global__ void combine_kernel(bf16* out, const bf16* yp, const int* slot_row, const float* w,
                               int64_t N, int64_t C, int K, bool accumulate) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    for (int64_t c = threadIdx.x * kVec; c < C; c += static_cast<int64_t>(blockDim.x) * kVec) {
      float sum[kVec] = {};
      for (int j = 0; j < K; ++j) {
        const float wj = w ? w[n * K + j] : 1.0f;
        float y[kVec];
        load_vec<kVec>(y, yp + static_cast<int64_t>(slot_row[n * K + j]) * C + c);
#pragma unroll
        for (int k = 0; k < kVec; ++k) sum[k] += wj * y[k];
      }
      if (accumulate) {
        float o[kVec];
        load_vec<kVec>(o, out + n * C + c);
#pragma unroll
        for (int k = 0; k < kVec; ++k) sum[k] = o[k] + sum[k];
      }
      store_vec<kVec>(out + n * C + c, sum);
    }
  }
}

// Block n: dyp rows of token n's choices, and dtopk_w as block dot products.
template <int kVec>
__global__ void combine_backward_kernel(bf16* dyp, float* dtopk_w, const bf16* dout, const bf16* yp,
                                        const int* slot_row, const float* w, int64_t C, int K) {
  __shared__ float shared[32];
  const int64_t n = blockIdx.x;
  for (int j = 0; j < K; ++j) {
    const int64_t row = slot_row[n * K + j];
    const float wj = w[n * K + j];
    float dot = 0;
    for (int64_t c = threadIdx.x * kVec; c < C; c += static_cast<int64_t>(blockDim.x) * kVec) {
      float g[kVec], y[kVec], d[kVec];
      load_vec<kVec>(g, dout + n * C + c);
      load_vec<kVec>(y, yp + row * C + c);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        d[k] = wj * g[k];
        dot += g[k] * y[k];
      }
      store_vec<kVec>(dyp + row * C + c, d);
    }
    dot = block_sum(dot, shared);
    if (threadIdx.x == 0) dtopk_w[n * K + j] = dot;
  }
}

bool rows_vectorize(int64_t C, std::initializer_list<const void*> ptrs) {
  if (C % 8 != 0) return false;
  for (const void* p : ptrs)
    if (!aligned(p, 16)) return false;
  return true;
}

int grid_for(int64_t n, int threads, int sm_count) {
  return static_cast<int>(std::min<int64_t>(ceil_div(n, threads), int64_t{sm_count} * 32));
}

}  // namespace

void CudaBackend::run_moe_permute(Tensor xp, Tensor row_token, Tensor slot_row, Tensor offsets,
                                  Tensor x, Tensor topk_idx) {
  const int64_t C = x.dim(-1), M = topk_idx.numel();
  const int E = static_cast<int>(offsets.numel() - 1);
  const int K = static_cast<int>(topk_idx.dim(1));
  int* counts = static_cast<int*>(scratch(E * sizeof(int)));
  KILN_CUDA_CHECK(cudaMemsetAsync(counts, 0, E * sizeof(int), stream_));
  if (M > 0) {
    histogram_kernel<<<grid_for(M, 256, sm_count_), 256, 0, stream_>>>(counts, topk_idx.ptr<int>(),
                                                                       M);
    KILN_CUDA_LAUNCH_CHECK();
  }
  offsets_kernel<<<1, 1, 0, stream_>>>(offsets.ptr<int>(), counts, E);
  KILN_CUDA_LAUNCH_CHECK();
  if (M == 0) return;
  rank_kernel<<<E, kRankThreads, 0, stream_>>>(slot_row.ptr<int>(), row_token.ptr<int>(),
                                               topk_idx.ptr<int>(), offsets.ptr<int>(), M, K);
  KILN_CUDA_LAUNCH_CHECK();
  const int rows = static_cast<int>(std::min<int64_t>(M, int64_t{sm_count_} * 8));
  if (rows_vectorize(C, {xp.data, x.data}))
    gather_rows_kernel<8><<<rows, 256, 0, stream_>>>(xp.ptr<bf16>(), x.ptr<bf16>(),
                                                     row_token.ptr<int>(), M, C);
  else
    gather_rows_kernel<1><<<rows, 256, 0, stream_>>>(xp.ptr<bf16>(), x.ptr<bf16>(),
                                                     row_token.ptr<int>(), M, C);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_moe_unpermute(Tensor out, Tensor yp, Tensor slot_row, Tensor topk_w,
                                    bool accumulate) {
  const int64_t C = out.dim(-1), N = out.numel() / C, M = yp.numel() / C;
  const int rows = static_cast<int>(std::min<int64_t>(N, int64_t{sm_count_} * 8));
  const float* w = topk_w.defined() ? topk_w.ptr<float>() : nullptr;
  const int K = static_cast<int>(M / N);
  if (rows_vectorize(C, {out.data, yp.data}))
    combine_kernel<8><<<rows, 256, 0, stream_>>>(out.ptr<bf16>(), yp.ptr<bf16>(),
                                                 slot_row.ptr<int>(), w, N, C, K, accumulate);
  else
    combine_kernel<1><<<rows, 256, 0, stream_>>>(out.ptr<bf16>(), yp.ptr<bf16>(),
                                                 slot_row.ptr<int>(), w, N, C, K, accumulate);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_moe_unpermute_backward(Tensor dyp, Tensor dtopk_w, Tensor dout, Tensor yp,
                                             Tensor slot_row, Tensor topk_w) {
  const int64_t C = dout.dim(-1), N = dout.numel() / C, M = yp.numel() / C;
  const int K = static_cast<int>(M / N);
  if (rows_vectorize(C, {dyp.data, dout.data, yp.data}))
    combine_backward_kernel<8><<<static_cast<unsigned>(N), 128, 0, stream_>>>(
        dyp.ptr<bf16>(), dtopk_w.ptr<float>(), dout.ptr<bf16>(), yp.ptr<bf16>(),
        slot_row.ptr<int>(), topk_w.ptr<float>(), C, K);
  else
    combine_backward_kernel<1><<<static_cast<unsigned>(N), 128, 0, stream_>>>(
        dyp.ptr<bf16>(), dtopk_w.ptr<float>(), dout.ptr<bf16>(), yp.ptr<bf16>(),
        slot_row.ptr<int>(), topk_w.ptr<float>(), C, K);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
