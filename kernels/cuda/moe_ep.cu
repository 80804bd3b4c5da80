// MoE expert parallelism's data movement on the GPU (reference: kernels/cpu/moe_ep.cpp): four
// row permutations between a rank's routed rows, the per-rank chunks all-to-all moves, and the
// rows grouped by local expert. The sizes stay on the device, so each destination row finds its
// source itself: one block per row, whose first thread walks the group counts (E of them, a
// few hundred at most) and whose threads then copy the row, or zero it where no row lands.
// Simple before fast: CudaMoe.ExpertParallelOpsMatchTheCpu checks each map, and
// DistNccl.MoeExpertParallelFollowsTheSingleGpuCurve the layer over NCCL on 2 GPUs.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

constexpr int kThreads = 128;

enum class Map { split, join, group, ungroup };

struct MapArgs {
  const int* offsets = nullptr;  // split, join: the routed rows' i32[E+1]
  const int* counts = nullptr;   // group, ungroup: rows per (source rank, local expert)
  int P = 1, El = 1;             // ranks, experts a rank
  int64_t M = 0;                 // rows a chunk holds
};

// The source row of destination row `d`, or -1 where the destination is padding.
template <Map kMap>
__device__ int64_t source_row(const MapArgs& a, int64_t d) {
  const int* n = a.counts;
  if constexpr (kMap == Map::split) {  // d = (q, j) of the chunks
    const int64_t q = d / a.M, j = d % a.M;
    const int64_t begin = a.offsets[q * a.El], end = a.offsets[(q + 1) * a.El];
    return begin + j < end ? begin + j : -1;
  } else if constexpr (kMap == Map::join) {  // d: a routed row
    for (int q = 0; q < a.P; ++q)
      if (d < a.offsets[(q + 1) * a.El]) return q * a.M + (d - a.offsets[q * a.El]);
    return -1;
  } else if constexpr (kMap == Map::group) {  // d: a local row, grouped by expert then source
    int64_t row = 0;
    for (int e = 0; e < a.El; ++e)
      for (int s = 0; s < a.P; ++s) {
        const int64_t rows = n[s * a.El + e];
        if (d < row + rows) {
          int64_t start = 0;  // chunk s's rows before expert e's
          for (int f = 0; f < e; ++f) start += n[s * a.El + f];
          return s * a.M + start + (d - row);
        }
        row += rows;
      }
    return -1;
  } else {  // ungroup, d = (s, j) of the chunks
    const int64_t s = d / a.M, j = d % a.M;
    int64_t start = 0, local = 0;  // chunk s's rows before expert e; local rows before e's group
    for (int e = 0; e < a.El; ++e) {
      const int64_t rows = n[s * a.El + e];
      int64_t before = 0;  // expert e's rows from sources before s
      for (int t = 0; t < s; ++t) before += n[t * a.El + e];
      if (j < start + rows) return local + before + (j - start);
      start += rows;
      for (int t = 0; t < a.P; ++t) local += n[t * a.El + e];
    }
    return -1;
  }
}

template <Map kMap>
__global__ void __launch_bounds__(kThreads)
    map_rows_kernel(bf16* out, const bf16* in, MapArgs a, int64_t C) {
  __shared__ int64_t src;
  const int64_t d = blockIdx.x;
  if (threadIdx.x == 0) src = source_row<kMap>(a, d);
  __syncthreads();
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    out[d * C + c] = src < 0 ? from_float<bf16>(0.0f) : in[src * C + c];
}

__global__ void split_counts_kernel(int* counts, const int* offsets, int E) {
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

void expect_i32(const Tensor& t, const char* op, const char* what, int64_t numel) {
  expect_device(t, op, what);
  if (t.dtype != DType::i32)
    throw std::invalid_argument(std::string("cuda ") + op + ": " + what + " " + t.str() +
                                " must be i32");
  expect_numel(t, numel, op, what);
}

// The chunks [P,M,C] and rows: P, M, C checked; returns the args for `offsets` (E+1 values).
MapArgs routed_args(const char* op, const Tensor& chunks, const Tensor& rows,
                    const Tensor& offsets) {
  expect_activation(chunks, op, "chunks");
  expect_activation(rows, op, "rows");
  if (chunks.ndim() != 3 || rows.ndim() != 2 || chunks.dim(1) != rows.dim(0) ||
      chunks.dim(2) != rows.dim(1))
    throw std::invalid_argument(std::string("cuda ") + op + ": chunks " + chunks.str() +
                                " must be [P, M, C] for rows " + rows.str());
  MapArgs a;
  a.P = static_cast<int>(chunks.dim(0));
  a.M = chunks.dim(1);
  const int64_t E = offsets.numel() - 1;
  if (E < a.P || E % a.P != 0)
    throw std::invalid_argument(std::string("cuda ") + op + ": offsets " + offsets.str() +
                                " must hold E+1 values, E a multiple of the ranks");
  expect_i32(offsets, op, "offsets", E + 1);
  a.El = static_cast<int>(E / a.P);
  a.offsets = offsets.ptr<int>();
  return a;
}

MapArgs received_args(const char* op, const Tensor& chunks, const Tensor& local,
                      const Tensor& counts) {
  expect_activation(chunks, op, "chunks");
  expect_activation(local, op, "local");
  if (chunks.ndim() != 3 || local.ndim() != 2 || local.dim(0) != chunks.dim(0) * chunks.dim(1) ||
      local.dim(1) != chunks.dim(2))
    throw std::invalid_argument(std::string("cuda ") + op + ": local " + local.str() +
                                " must be [P*M, C] for chunks " + chunks.str());
  MapArgs a;
  a.P = static_cast<int>(chunks.dim(0));
  a.M = chunks.dim(1);
  if (counts.numel() % a.P != 0 || counts.numel() == 0)
    throw std::invalid_argument(std::string("cuda ") + op + ": counts " + counts.str() +
                                " must hold a count per local expert for each rank");
  a.El = static_cast<int>(counts.numel() / a.P);
  expect_i32(counts, op, "counts", counts.numel());
  a.counts = counts.ptr<int>();
  return a;
}

template <Map kMap>
void map_rows(cudaStream_t stream, Tensor out, Tensor in, const MapArgs& a) {
  const int64_t rows = out.dim(0) * (out.ndim() == 3 ? out.dim(1) : 1), C = out.dim(-1);
  if (rows == 0) return;
  map_rows_kernel<kMap><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      out.ptr<bf16>(), in.ptr<bf16>(), a, C);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace

void CudaBackend::moe_ep_split(Tensor chunks, Tensor counts, Tensor rows, Tensor offsets) {
  const MapArgs a = routed_args("moe_ep_split", chunks, rows, offsets);
  expect_i32(counts, "moe_ep_split", "counts", offsets.numel() - 1);
  split_counts_kernel<<<1, kThreads, 0, stream_>>>(counts.ptr<int>(), offsets.ptr<int>(),
                                                   static_cast<int>(offsets.numel() - 1));
  KILN_CUDA_LAUNCH_CHECK();
  map_rows<Map::split>(stream_, chunks, rows, a);
}

void CudaBackend::moe_ep_join(Tensor rows, Tensor chunks, Tensor offsets) {
  map_rows<Map::join>(stream_, rows, chunks, routed_args("moe_ep_join", chunks, rows, offsets));
}

void CudaBackend::moe_ep_group(Tensor local, Tensor local_offsets, Tensor chunks, Tensor counts) {
  const MapArgs a = received_args("moe_ep_group", chunks, local, counts);
  expect_i32(local_offsets, "moe_ep_group", "local_offsets", a.El + 1);
  local_offsets_kernel<<<1, 1, 0, stream_>>>(local_offsets.ptr<int>(), counts.ptr<int>(), a.P,
                                             a.El);
  KILN_CUDA_LAUNCH_CHECK();
  map_rows<Map::group>(stream_, local, chunks, a);
}

void CudaBackend::moe_ep_ungroup(Tensor chunks, Tensor local, Tensor counts) {
  map_rows<Map::ungroup>(stream_, chunks, local,
                         received_args("moe_ep_ungroup", chunks, local, counts));
}

}  // namespace kiln
