// MoE expert parallelism's data movement on the GPU (reference: kernels/cpu/moe_ep.cpp): the
// rows per expert that the ranks exchange first, and the two row permutations between what a
// rank receives (packed by source rank, then local expert) and the rows grouped by local expert
// (by expert, then source) that the grouped GEMM takes. The counts stay on the device, so each
// destination row finds its source itself: one block per row, whose first thread walks the
// counts (P*El of them, a few hundred at most) and whose threads then copy the row; rows past
// the counts' total are left alone. CudaMoe.ExpertParallelOpsMatchTheCpu checks each op, and
// DistNccl.MoeExpertParallelFollowsTheSingleGpuCurve the layer over NCCL on 2 GPUs.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kThreads = 128;

// Row d of the grouped layout (local expert e, then source s) <-> its row in the packed layout
// (source s, then local expert e); -1 past the counts' total. counts: i32[P*El].
__device__ int64_t packed_row(const int* n, int P, int El, int64_t d) {
  int64_t row = 0;
  for (int e = 0; e < El; ++e)
    for (int s = 0; s < P; ++s) {
      const int64_t rows = n[s * El + e];
      if (d < row + rows) {
        int64_t start = 0;  // the packed rows before source s's rows of expert e
        for (int t = 0; t < s; ++t)
          for (int f = 0; f < El; ++f) start += n[t * El + f];
        for (int f = 0; f < e; ++f) start += n[s * El + f];
        return start + (d - row);
      }
      row += rows;
    }
  return -1;
}

// grouped = true: out is the grouped layout and in the packed one (moe_ep_group); false: the
// other way (moe_ep_ungroup). Block d handles grouped row d either way.
__global__ void __launch_bounds__(kThreads)
    regroup_kernel(bf16* out, const bf16* in, const int* counts, int P, int El, int64_t C,
                   bool grouped) {
  __shared__ int64_t other;
  const int64_t d = blockIdx.x;
  if (threadIdx.x == 0) other = packed_row(counts, P, El, d);
  __syncthreads();
  if (other < 0) return;
  const int64_t to = grouped ? d : other, from = grouped ? other : d;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) out[to * C + c] = in[from * C + c];
}

__global__ void counts_kernel(int* counts, const int* offsets, int E) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = offsets[e + 1] - offsets[e];
}

__global__ void local_offsets_kernel(int* local_offsets, const int* counts, int P, int El) {
  int sum = 0;
  for (int e = 0; e < El; ++e) {
    local_offsets[e] = sum;
    for (int s = 0; s < P; ++s) sum += counts[s * El + e];
  }
  local_offsets[El] = sum;
}

void regroup(cudaStream_t stream, Tensor out, Tensor in, Tensor counts, bool grouped) {
  const int64_t rows = out.dim(0), C = out.dim(1);
  if (rows == 0) return;
  regroup_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      out.ptr<bf16>(), in.ptr<bf16>(), counts.ptr<int>(), static_cast<int>(counts.dim(0)),
      static_cast<int>(counts.dim(1)), C, grouped);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace

void CudaBackend::run_moe_ep_counts(Tensor counts, Tensor offsets) {
  counts_kernel<<<1, kThreads, 0, stream_>>>(counts.ptr<int>(), offsets.ptr<int>(),
                                             static_cast<int>(counts.numel()));
  KILN_CUDA_LAUNCH_CHECK();
}

void CudaBackend::run_moe_ep_group(Tensor local, Tensor local_offsets, Tensor received,
                                   Tensor counts) {
  local_offsets_kernel<<<1, 1, 0, stream_>>>(local_offsets.ptr<int>(), counts.ptr<int>(),
                                             static_cast<int>(counts.dim(0)),
                                             static_cast<int>(counts.dim(1)));
  KILN_CUDA_LAUNCH_CHECK();
  regroup(stream_, local, received, counts, true);
}

void CudaBackend::run_moe_ep_ungroup(Tensor received, Tensor local, Tensor counts) {
  regroup(stream_, received, local, counts, false);
}

}  // namespace kiln
