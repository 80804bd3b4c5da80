// Reductions and the small optimizer-side ops: reduce_sum / sum_squares, column sums for bias
// gradients, grad_norm_clip, set_schedule, add.
// Design choice: no float atomics anywhere. Sums run in two passes with a FIXED grid (partials
// per block, then one block combines them in tree order), so a result depends only on the
// input, never on scheduling: bit-reproducible run to run.
#include <stdexcept>
#include <spdlog/spdlog.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kReduceBlocks = 512;  // fixed: the partials and their order never change
constexpr int kReduceThreads = 512;

template <class T, bool kSquares>
__global__ void reduce_partials_kernel(float* partials, const T* x, int64_t n) {
  __shared__ float shared[32];
  float acc = 0.0f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = to_float(x[i]);
    acc += kSquares ? v * v : v;
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

__global__ void reduce_final_kernel(float* out, const float* partials, int n, bool accumulate) {
  __shared__ float shared[32];
  float acc = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc += partials[i];
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) out[0] = accumulate ? out[0] + acc : acc;
}

// partials[chunk][c] = sum over the chunk's rows of x[r][c]; one thread per column, coalesced.
__global__ void column_partials_kernel(float* partials, const bf16* x, int64_t N, int64_t C,
                                       int64_t rows_per_chunk) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = blockIdx.y * rows_per_chunk;
  const int64_t r1 = min(N, r0 + rows_per_chunk);
  float acc = 0.0f;
  for (int64_t r = r0; r < r1; ++r) acc += __bfloat162float(x[r * C + c]);
  partials[blockIdx.y * C + c] = acc;
}

// The same partials, 8 columns per thread from one 16-byte load (a warp reads 512 contiguous
// bytes of a row) and 4 rows in flight per thread: the bias gradients' read of dout runs at
// memory speed (the one-column form above reaches ~2 TB/s). A block is kColRows row-threads
// by kColLanes column-threads; its row-threads' sums meet in shared memory in a fixed order.
constexpr int kColVec = 8, kColLanes = 32, kColRows = 8, kColUnroll = 4;
constexpr int kColumnBlocks = 512;  // fixed, so the summation order never depends on the GPU

__global__ void __launch_bounds__(kColLanes* kColRows)
    column_partials_vec_kernel(float* partials, const bf16* x, int64_t N, int64_t C,
                               int64_t rows_per_chunk) {
  __shared__ float sums[kColRows][kColLanes * kColVec];
  const int64_t c0 = (blockIdx.x * static_cast<int64_t>(kColLanes) + threadIdx.x) * kColVec;
  const int64_t r0 = blockIdx.y * rows_per_chunk;
  const int64_t r1 = min(N, r0 + rows_per_chunk);
  float acc[kColVec] = {};
  if (c0 < C) {
    int64_t r = r0 + threadIdx.y;
    for (; r + (kColUnroll - 1) * kColRows < r1; r += kColUnroll * kColRows) {
      Packed128<bf16> p[kColUnroll];
#pragma unroll
      for (int u = 0; u < kColUnroll; ++u) p[u] = load128cs(x + (r + u * kColRows) * C + c0);
#pragma unroll
      for (int u = 0; u < kColUnroll; ++u)
#pragma unroll
        for (int k = 0; k < kColVec; ++k) acc[k] += to_float(p[u][k]);
    }
    for (; r < r1; r += kColRows) {
      const Packed128<bf16> p = load128cs(x + r * C + c0);
#pragma unroll
      for (int k = 0; k < kColVec; ++k) acc[k] += to_float(p[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kColVec; ++k) sums[threadIdx.y][threadIdx.x * kColVec + k] = acc[k];
  __syncthreads();
  // Each of the block's 256 threads finishes one of its 256 columns.
  const int col = threadIdx.y * kColLanes + threadIdx.x;
  const int64_t c = blockIdx.x * static_cast<int64_t>(kColLanes) * kColVec + col;
  if (c >= C) return;
  float total = 0.0f;
#pragma unroll
  for (int y = 0; y < kColRows; ++y) total += sums[y][col];
  partials[blockIdx.y * C + c] = total;
}

__global__ void column_final_kernel(float* out, const float* partials, int chunks, int64_t C,
                                    bool accumulate) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  float acc = 0.0f;
  for (int k = 0; k < chunks; ++k) acc += partials[k * C + c];
  out[c] = (accumulate ? out[c] : 0.0f) + acc;
}

__global__ void grad_norm_clip_kernel(float* sched, const float* sumsq, float max_norm,
                                      float grad_scale) {
  const float norm = grad_scale * sqrtf(sumsq[0]);
  sched[kSchedGradNorm] = norm;
  sched[kSchedGradScale] =
      grad_scale * (max_norm > 0.0f ? fminf(1.0f, max_norm / (norm + 1e-6f)) : 1.0f);
}

// The values travel as kernel arguments, so the host calls this every step. Under CUDA-graph
// replay the arguments would be frozen: the trainer then writes lr/step into a pinned host
// buffer that a captured copy moves into `sched` instead.
__global__ void set_schedule_kernel(float* sched, float lr, float step) {
  sched[kSchedLr] = lr;
  sched[kSchedStep] = step;
}

template <class T>
__global__ void add_kernel(T* __restrict__ dst, const T* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = from_float<T>(to_float(dst[i]) + to_float(src[i]));
}

}  // namespace

void CudaBackend::reduce(Tensor out, Tensor x, bool squares, bool accumulate) {
  float* partials = static_cast<float*>(scratch(kReduceBlocks * sizeof(float)));
  const int64_t n = x.numel();
  if (x.dtype == DType::f32) {
    if (squares)
      reduce_partials_kernel<float, true>
          <<<kReduceBlocks, kReduceThreads, 0, stream_>>>(partials, x.ptr<float>(), n);
    else
      reduce_partials_kernel<float, false>
          <<<kReduceBlocks, kReduceThreads, 0, stream_>>>(partials, x.ptr<float>(), n);
  } else {
    if (squares)
      reduce_partials_kernel<bf16, true>
          <<<kReduceBlocks, kReduceThreads, 0, stream_>>>(partials, x.ptr<bf16>(), n);
    else
      reduce_partials_kernel<bf16, false>
          <<<kReduceBlocks, kReduceThreads, 0, stream_>>>(partials, x.ptr<bf16>(), n);
  }
  KILN_CUDA_LAUNCH_CHECK();
  reduce_final_kernel<<<1, kReduceThreads, 0, stream_>>>(out.ptr<float>(), partials,
                                                         kReduceBlocks, accumulate);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_reduce_sum(Tensor out, Tensor x, bool accumulate) {
  reduce(out, x, false, accumulate);
}

void CudaBackend::run_sum_squares(Tensor out, Tensor x, bool accumulate) {
  reduce(out, x, true, accumulate);
}

void CudaBackend::column_sum(float* out, const void* x_bf16, int64_t N, int64_t C,
                             bool accumulate) {
  if (C <= 0) return;
  if (N <= 0) {
    if (!accumulate) KILN_CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<size_t>(C) * 4, stream_));
    return;
  }
  const bf16* x = static_cast<const bf16*>(x_bf16);
  const int threads = 128;
  const bool vectorized = C % kColVec == 0 && aligned(x_bf16, 16);
  const int64_t col_blocks =
      vectorized ? ceil_div(C, static_cast<int64_t>(kColLanes) * kColVec) : ceil_div(C, threads);
  const int64_t chunks =
      vectorized ? std::max<int64_t>(1, std::min(ceil_div(kColumnBlocks, col_blocks),
                                                 ceil_div(N, kColRows * kColUnroll)))
                 : std::min<int64_t>(ceil_div(N, 32), 256);
  const int64_t rows_per_chunk = ceil_div(N, chunks);
  const int used_chunks = ceil_div(N, rows_per_chunk);
  float* partials = static_cast<float*>(scratch(static_cast<size_t>(used_chunks * C) * 4));
  if (vectorized)
    column_partials_vec_kernel<<<dim3(col_blocks, used_chunks), dim3(kColLanes, kColRows), 0,
                                 stream_>>>(partials, x, N, C, rows_per_chunk);
  else
    column_partials_kernel<<<dim3(col_blocks, used_chunks), threads, 0, stream_>>>(
        partials, x, N, C, rows_per_chunk);
  KILN_CUDA_LAUNCH_CHECK();
  column_final_kernel<<<ceil_div(C, threads), threads, 0, stream_>>>(out, partials, used_chunks,
                                                                     C, accumulate);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_grad_norm_clip(Tensor sched, Tensor sumsq, float max_norm, float grad_scale) {
  grad_norm_clip_kernel<<<1, 1, 0, stream_>>>(sched.ptr<float>(), sumsq.ptr<float>(), max_norm,
                                              grad_scale);
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_set_schedule(Tensor sched, float lr, int step) {
  set_schedule_kernel<<<1, 1, 0, stream_>>>(sched.ptr<float>(), lr, static_cast<float>(step));
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_add(Tensor dst, Tensor src) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(n, threads), sm_count_ * 32));
  if (dst.dtype == DType::f32)
    add_kernel<<<blocks, threads, 0, stream_>>>(dst.ptr<float>(), src.ptr<float>(), n);
  else
    add_kernel<<<blocks, threads, 0, stream_>>>(dst.ptr<bf16>(), src.ptr<bf16>(), n);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
