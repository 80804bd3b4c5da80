// Token + position embedding, forward and backward. wpe may be undefined (RoPE models have no
// learned positions): the forward is then a plain gather of wte rows and dwpe is skipped. wte
// may hold a slice of the table's rows (tensor parallelism's vocabulary-parallel embedding):
// the forward gives a token outside it a zero row. The
// output and its gradient are the residual stream, f32 or bf16 (template R; the sum of the two
// bf16 embeddings is taken in f32 and rounded once).
// Design choice (backward): the scatter-add into dwte is made deterministic WITHOUT float
// atomics by sorting (token, position) pairs with CUB's stable radix sort (deterministic,
// scratch memory only, no host sync). The sorted positions are cut into chunks of kDwteChunk,
// a block each, so a frequent token (a byte vocabulary's space: thousands of positions a batch)
// is summed by many blocks rather than one: a run that starts and ends inside a chunk is added
// into dwte[token] there; a run that crosses chunks leaves a partial per chunk, and the chunk
// where it starts adds them in chunk order. dwte may hold a window of the table's rows (fsdp's
// shard of them): tokens outside it are skipped. dwpe needs no sort: one thread per (t, c) sums
// over the batch.
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace {

// Each thread writes kVec consecutive channels (kVec = 8: 16-byte loads and stores).
// kPositions: add wpe[t] (GPT-2); without, out is wte's row as it is. wte holds the table's
// rows [first_row, first_row + rows); a token outside them reads as a zero row.
template <int kVec, bool kPositions, class R>
__global__ void encoder_forward_kernel(R* out, const int* tokens, const bf16* wte, const bf16* wpe,
                                       int64_t BT, int T, int C, int64_t first_row, int64_t rows) {
  const int64_t idx = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * kVec;
  if (idx >= BT * C) return;
  const int64_t bt = idx / C;
  const int c = static_cast<int>(idx % C);
  const int64_t row = tokens[bt] - first_row;
  float v[kVec];
  if (row >= 0 && row < rows) {
    load_vec<kVec>(v, wte + row * C + c);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = 0.0f;
  }
  if constexpr (kPositions) {
    float p[kVec];
    load_vec<kVec>(p, wpe + static_cast<int64_t>(bt % T) * C + c);
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] += p[k];
  }
  store_vec<kVec>(out + idx, v);
}

template <class R>
__global__ void encoder_dwpe_kernel(float* dwpe, const R* dout, int B, int T, int C) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<int64_t>(T) * C) return;
  float acc = 0.0f;
  for (int b = 0; b < B; ++b) acc += to_float(dout[static_cast<int64_t>(b) * T * C + idx]);
  dwpe[idx] += acc;
}

__global__ void iota_kernel(int* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = i;
}

// blockIdx.x: a position in token-sorted order; only the first of each run of equal tokens works.
constexpr int kDwteChunk = 64;

__device__ inline bool run_starts_at(const int* tok, int i) {
  return i == 0 || tok[i - 1] != tok[i];
}
__device__ inline bool run_ends_at(const int* tok, int i, int n) {
  return i + 1 == n || tok[i + 1] != tok[i];
}

// dwte holds the table's rows [first_row, first_row + rows): a token's row there, or -1.
__device__ inline int64_t held_row(int token, int first_row, int rows) {
  const int r = token - first_row;
  return r >= 0 && r < rows ? r : -1;
}

// Chunk k = blockIdx.x of the sorted positions. Its segments (runs of one token within the
// chunk) that are whole runs go into dwte; the first segment, where it continues a run from an
// earlier chunk or goes on past this one, into head[k]; the last, where it goes on past this
// chunk, into tail[k]. Tokens dwte does not hold are skipped (their partials never written).
template <class R>
__global__ void encoder_dwte_chunks_kernel(float* dwte, float* head, float* tail, const R* dout,
                                           const int* tok, const int* pos, int BT, int C,
                                           int first_row, int rows) {
  const int k = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int begin = k * kDwteChunk, end = min(BT, begin + kDwteChunk);
  float acc = 0.0f;
  int seg = begin;
  for (int i = begin; i < end; ++i) {
    const int64_t row = held_row(tok[i], first_row, rows);
    if (row >= 0) acc += to_float(dout[static_cast<int64_t>(pos[i]) * C + c]);
    if (i + 1 < end && tok[i + 1] == tok[i]) continue;
    if (row >= 0) {
      if (run_starts_at(tok, seg) && run_ends_at(tok, i, BT))
        dwte[row * C + c] += acc;
      else if (seg == begin)
        head[static_cast<int64_t>(k) * C + c] = acc;
      else
        tail[static_cast<int64_t>(k) * C + c] = acc;
    }
    acc = 0.0f;
    seg = i + 1;
  }
}

// The runs that cross a chunk boundary, each added once, by the chunk it starts in: its part
// there (tail, or head when the run fills the chunk from its start), then each later chunk's
// head, in order, up to the chunk where it ends.
__global__ void encoder_dwte_crossing_kernel(float* dwte, const float* head, const float* tail,
                                             const int* tok, int BT, int chunks, int C,
                                             int first_row, int rows) {
  const int k = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int begin = k * kDwteChunk, end = min(BT, begin + kDwteChunk);
  const int t = tok[end - 1];
  const int64_t row = held_row(t, first_row, rows);
  if (row < 0 || run_ends_at(tok, end - 1, BT)) return;  // not held; or ends in this chunk
  const bool fills_chunk = tok[begin] == t;
  if (fills_chunk && !run_starts_at(tok, begin)) return;  // started in an earlier chunk
  float total = fills_chunk ? head[static_cast<int64_t>(k) * C + c]
                            : tail[static_cast<int64_t>(k) * C + c];
  for (int j = k + 1; j < chunks; ++j) {
    total += head[static_cast<int64_t>(j) * C + c];
    const int last = min(BT, (j + 1) * kDwteChunk) - 1;
    if (tok[last] != t || run_ends_at(tok, last, BT)) break;
  }
  dwte[row * C + c] += total;
}

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

template <class R>
void launch_encoder_forward(cudaStream_t stream, Tensor out, Tensor tokens, Tensor wte, Tensor wpe,
                            int64_t first_row, int64_t BT, int T, int C) {
  const int threads = 256;
  const bool has_wpe = wpe.defined();
  const bool vec8 = C % 8 == 0 && aligned(out.data, 16) && aligned(wte.data, 16) &&
                    (!has_wpe || aligned(wpe.data, 16));
  const int blocks = ceil_div(vec8 ? BT * C / 8 : BT * C, threads);
  const bf16* wpe_ptr = has_wpe ? wpe.ptr<bf16>() : nullptr;
#define KILN_ENCODER_FWD(vec, positions)                                     \
  encoder_forward_kernel<vec, positions, R><<<blocks, threads, 0, stream>>>( \
      out.ptr<R>(), tokens.ptr<int>(), wte.ptr<bf16>(), wpe_ptr, BT, T, C, first_row, wte.dim(0))
  if (vec8 && has_wpe)
    KILN_ENCODER_FWD(8, true);
  else if (vec8)
    KILN_ENCODER_FWD(8, false);
  else if (has_wpe)
    KILN_ENCODER_FWD(1, true);
  else
    KILN_ENCODER_FWD(1, false);
#undef KILN_ENCODER_FWD
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace

void CudaBackend::run_encoder_forward(Tensor out, Tensor tokens, Tensor wte, Tensor wpe,
                                      int64_t first_row) {
  const int B = static_cast<int>(tokens.dim(0)), T = static_cast<int>(tokens.dim(1));
  const int C = static_cast<int>(wte.dim(-1));
  const int64_t BT = static_cast<int64_t>(B) * T;
  if (BT == 0) return;
  if (out.dtype == DType::f32)
    launch_encoder_forward<float>(stream_, out, tokens, wte, wpe, first_row, BT, T, C);
  else
    launch_encoder_forward<bf16>(stream_, out, tokens, wte, wpe, first_row, BT, T, C);
}

void CudaBackend::run_encoder_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens,
                                       int64_t first_row) {
  const int B = static_cast<int>(tokens.dim(0)), T = static_cast<int>(tokens.dim(1));
  const int C = static_cast<int>(dwte.dim(-1));
  const int rows = static_cast<int>(dwte.dim(0)), first = static_cast<int>(first_row);
  const int BT = B * T;
  const int threads = 256;
  if (BT == 0) return;

  if (dwpe.defined()) {
    const int blocks = ceil_div(static_cast<int64_t>(T) * C, threads);
    if (dout.dtype == DType::f32)
      encoder_dwpe_kernel<<<blocks, threads, 0, stream_>>>(dwpe.ptr<float>(), dout.ptr<float>(), B,
                                                           T, C);
    else
      encoder_dwpe_kernel<<<blocks, threads, 0, stream_>>>(dwpe.ptr<float>(), dout.ptr<bf16>(), B,
                                                           T, C);
    KILN_CUDA_LAUNCH_CHECK();
  }

  // Token ids are any non-negative i32 (dwte may hold a window of the table's rows).
  const int end_bit = 31;
  size_t sort_bytes = 0;
  KILN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<int*>(nullptr),
                                                  static_cast<int*>(nullptr),
                                                  static_cast<int*>(nullptr),
                                                  static_cast<int*>(nullptr), BT, 0, end_bit,
                                                  stream_));
  const int chunks = ceil_div(BT, kDwteChunk);
  const size_t ints = align_up(static_cast<size_t>(BT) * sizeof(int));
  const size_t partials = align_up(static_cast<size_t>(chunks) * C * sizeof(float));
  char* base = static_cast<char*>(scratch(3 * ints + 2 * partials + align_up(sort_bytes)));
  int* sorted_tokens = reinterpret_cast<int*>(base);
  int* positions = reinterpret_cast<int*>(base + ints);
  int* sorted_pos = reinterpret_cast<int*>(base + 2 * ints);
  float* head = reinterpret_cast<float*>(base + 3 * ints);
  float* tail = reinterpret_cast<float*>(base + 3 * ints + partials);
  void* sort_temp = base + 3 * ints + 2 * partials;
  iota_kernel<<<ceil_div(BT, threads), threads, 0, stream_>>>(positions, BT);
  KILN_CUDA_LAUNCH_CHECK();
  KILN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_temp, sort_bytes, tokens.ptr<int>(),
                                                  sorted_tokens, positions, sorted_pos, BT, 0,
                                                  end_bit, stream_));
  const int cthreads = 128;
  const dim3 grid(chunks, ceil_div(C, cthreads));
  if (dout.dtype == DType::f32)
    encoder_dwte_chunks_kernel<<<grid, cthreads, 0, stream_>>>(dwte.ptr<float>(), head, tail,
                                                               dout.ptr<float>(), sorted_tokens,
                                                               sorted_pos, BT, C, first, rows);
  else
    encoder_dwte_chunks_kernel<<<grid, cthreads, 0, stream_>>>(dwte.ptr<float>(), head, tail,
                                                               dout.ptr<bf16>(), sorted_tokens,
                                                               sorted_pos, BT, C, first, rows);
  KILN_CUDA_LAUNCH_CHECK();
  encoder_dwte_crossing_kernel<<<grid, cthreads, 0, stream_>>>(
      dwte.ptr<float>(), head, tail, sorted_tokens, BT, chunks, C, first, rows);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln
