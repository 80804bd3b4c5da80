// Document masking on cuDNN: the table of a micro-batch's documents as ragged batch entries,
// and the move of their softmax statistics between cuDNN's packed layout and kiln's lse.
// The host knows only how many documents there are (counted as the batch is staged); where each
// starts is read here from key_start, a document's first token being the query whose first key
// is itself.
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/check.h"

namespace kiln {
namespace cuda {

namespace {

constexpr int kTableThreads = 1024;

// One block: a scan over the B*T rows for document starts (key_start[i] == i % T), in order.
__global__ void document_table_kernel(const int* key_start, int rows, int T, int entries,
                                      int qkv_stride, int out_stride, int* seq_len, int* start,
                                      int* qkv_offset, int* out_offset) {
  __shared__ int warp_count[kTableThreads / 32];
  __shared__ int carry;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < rows; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const bool first = i < rows && key_start[i] == i % T;
    const unsigned mask = __ballot_sync(0xffffffffu, first);
    if (lane == 0) warp_count[warp] = __popc(mask);
    __syncthreads();
    int index = carry + __popc(mask & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) index += warp_count[w];
    if (first && index < entries) start[index] = i;
    __syncthreads();
    if (threadIdx.x == 0)
      for (int w = 0; w < warps; ++w) carry += warp_count[w];
    __syncthreads();
  }
  const int count = min(carry, entries);
  for (int j = threadIdx.x; j < entries; j += blockDim.x) {
    const int s = j < count ? start[j] : rows;
    // A document ends where the next starts; the last of a row at the row's end. (The clamp
    // keeps an entry inside its row even if the host counted too few.)
    const int e = j < count ? min(j + 1 < count ? start[j + 1] : rows, (s / T + 1) * T) : rows;
    if (j >= count) start[j] = rows;
    seq_len[j] = e - s;
    qkv_offset[j] = s * qkv_stride;
    out_offset[j] = s * out_stride;
  }
  if (threadIdx.x == 0) {
    qkv_offset[entries] = rows * qkv_stride;
    out_offset[entries] = rows * out_stride;
  }
}

__global__ void document_stats_kernel(const int* seq_len, const int* start, int T, int NH,
                                      float* stats, float* lse, bool to_lse) {
  const int i = blockIdx.z, h = blockIdx.y;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= seq_len[i]) return;
  const int s = start[i], b = s / T, t = s % T + j;
  float* packed = stats + (static_cast<int64_t>(i) * NH + h) * T + j;
  float* row = lse + (static_cast<int64_t>(b) * NH + h) * T + t;
  if (to_lse)
    *row = *packed;
  else
    *packed = *row;
}

}  // namespace

DocumentTable document_table(cudaStream_t stream, const AttentionShape& d, int entries,
                             void* memory) {
  DocumentTable table;
  table.entries = entries;
  table.seq_len = static_cast<int*>(memory);
  table.start = table.seq_len + entries;
  table.qkv_offset = table.start + entries;
  table.out_offset = table.qkv_offset + entries + 1;
  document_table_kernel<<<1, kTableThreads, 0, stream>>>(
      d.key_start, d.B * d.T, d.T, entries, d.qkv_stride, d.out_stride, table.seq_len,
      table.start, table.qkv_offset, table.out_offset);
  KILN_CUDA_LAUNCH_CHECK();
  return table;
}

void document_stats(cudaStream_t stream, const AttentionShape& d, const DocumentTable& table,
                    float* stats, float* lse, bool to_lse) {
  constexpr int kThreads = 256;
  document_stats_kernel<<<dim3((d.T + kThreads - 1) / kThreads, d.NH, table.entries), kThreads, 0,
                          stream>>>(table.seq_len, table.start, d.T, d.NH, stats, lse, to_lse);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace kiln
