// Document masking on cuDNN: the table of a chunk's documents as ragged batch entries, and the
// move of their softmax statistics between cuDNN's packed layout and kiln's lse. The host knows
// only how many entries there are (counted as the batch is staged); where each starts is read
// here from key_start: an entry begins at the chunk's first row and wherever the key start
// changes (a document's first token, whose first key is itself).
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/check.h"

namespace kiln {
namespace cuda {

namespace {

constexpr int kTableThreads = 1024;

// One block: a scan over the chunk's rows [r0, r0 + n) of each sequence (positions p0 on) for
// the entries' first rows, in order; then each entry's lengths and offsets. Keys are rows of a
// [B, Tk, kv_stride] tensor indexed by position.
__global__ void document_table_kernel(const int* key_start, int B, int T, int r0, int n, int p0,
                                      int Tk, int qkv_stride, int out_stride, int kv_stride,
                                      int entries, int* seq_len_q, int* seq_len_kv, int* first,
                                      int* q_offset, int* kv_offset, int* o_offset) {
  __shared__ int warp_count[kTableThreads / 32];
  __shared__ int carry;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int rows = B * n;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < rows; base += blockDim.x) {
    const int i = base + threadIdx.x;
    bool begins = false;
    int row = 0;
    if (i < rows) {
      const int b = i / n, t = r0 + i % n;
      row = b * T + t;
      begins = t == r0 || key_start[row] != key_start[row - 1];
    }
    const unsigned mask = __ballot_sync(0xffffffffu, begins);
    if (lane == 0) warp_count[warp] = __popc(mask);
    __syncthreads();
    int index = carry + __popc(mask & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) index += warp_count[w];
    if (begins && index < entries) first[index] = row;
    __syncthreads();
    if (threadIdx.x == 0)
      for (int w = 0; w < warps; ++w) carry += warp_count[w];
    __syncthreads();
  }
  const int count = min(carry, entries);
  for (int j = threadIdx.x; j < entries; j += blockDim.x) {
    if (j >= count) {  // padding: empty, at the end
      seq_len_q[j] = seq_len_kv[j] = 0;
      first[j] = B * T;
      q_offset[j] = B * T * qkv_stride;
      o_offset[j] = B * T * out_stride;
      kv_offset[j] = B * Tk * kv_stride;
      continue;
    }
    const int f = first[j], b = f / T, t = f % T;
    // The entry ends where the next begins in the same sequence, else at the chunk's end.
    const int next = j + 1 < count ? first[j + 1] : B * T;
    const int end = next / T == b ? min(next % T, r0 + n) : r0 + n;
    const int s = key_start[f];                   // the document's first position
    const int last = p0 + (end - 1 - r0);         // the entry's last query's position
    seq_len_q[j] = end - t;
    seq_len_kv[j] = last + 1 - s;
    q_offset[j] = f * qkv_stride;
    o_offset[j] = f * out_stride;
    kv_offset[j] = (b * Tk + s) * kv_stride;
  }
  if (threadIdx.x == 0) {
    q_offset[entries] = B * T * qkv_stride;
    o_offset[entries] = B * T * out_stride;
    kv_offset[entries] = B * Tk * kv_stride;
  }
}

__global__ void document_stats_kernel(const int* seq_len_q, const int* first, int T, int NH,
                                      int rows, float* stats, float* lse, bool to_lse) {
  const int i = blockIdx.z, h = blockIdx.y;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= seq_len_q[i]) return;
  const int f = first[i], b = f / T, t = f % T + j;
  float* packed = stats + (static_cast<int64_t>(i) * NH + h) * rows + j;
  float* row = lse + (static_cast<int64_t>(b) * NH + h) * T + t;
  if (to_lse)
    *row = *packed;
  else
    *packed = *row;
}

}  // namespace

DocumentTable document_table(cudaStream_t stream, const AttentionShape& d, int chunk, int entries,
                             void* memory) {
  DocumentTable table;
  table.entries = entries;
  table.rows = d.half;
  table.seq_len_q = static_cast<int*>(memory);
  table.seq_len_kv = table.seq_len_q + entries;
  table.first = table.seq_len_kv + entries;
  table.q_offset = table.first + entries;
  table.kv_offset = table.q_offset + entries + 1;
  table.o_offset = table.kv_offset + entries + 1;
  document_table_kernel<<<1, kTableThreads, 0, stream>>>(
      d.key_start, d.B, d.T, chunk * d.half, d.half, chunk == 0 ? d.pos0 : d.pos1, d.Tk,
      d.qkv_stride, d.out_stride, d.kv_stride, entries, table.seq_len_q, table.seq_len_kv,
      table.first, table.q_offset, table.kv_offset, table.o_offset);
  KILN_CUDA_LAUNCH_CHECK();
  return table;
}

void document_stats(cudaStream_t stream, const AttentionShape& d, const DocumentTable& table,
                    float* stats, float* lse, bool to_lse) {
  constexpr int kThreads = 256;
  document_stats_kernel<<<dim3((table.rows + kThreads - 1) / kThreads, d.NH, table.entries),
                          kThreads, 0, stream>>>(table.seq_len_q, table.first, d.T, d.NH,
                                                 table.rows, stats, lse, to_lse);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace kiln
