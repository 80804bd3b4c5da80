// Internal to the attention files: the shape every implementation derives from qkv and the
// op's AttentionDims, the shared delta = rowsum(dout * out) pre-pass of the backward, and the
// flash kernels' launchers (attention_forward and attention_cp_forward both run them).
#pragma once

#include "kernels/cuda/cuda_backend.h"
#ifdef __CUDACC__
#include "kernels/cuda/common.cuh"
#endif

namespace kiln {
namespace cuda {

// qkv[B,T,qkv_stride]: per token NH query heads, then KV key heads, then KV value heads, each hs
// wide. Query head h reads kv head h / group. Offsets are in elements within a row.
// The keys and values are qkv's own rows (Tk = T) for attention_forward; context parallelism
// (attention_cp_forward) reads them from the gathered kv[B,Tk,2*KV*hs] instead, and its T query
// rows sit at two chunks' positions in the sequence (QueryChunks).
struct AttentionShape {
  int B = 0, T = 0, NH = 0, KV = 0, hs = 0;
  int group = 1;       // NH / KV: query heads per kv head
  int qkv_stride = 0;  // (NH + 2 KV) hs
  int out_stride = 0;  // NH hs
  int Tk = 0;          // key rows
  int kv_stride = 0;   // elements per key row: qkv_stride, or 2 KV hs for a gathered kv
  int k_offset = 0;    // the first key head in a key row: NH hs in qkv, 0 in kv
  int v_offset = 0;    // the first value head: (NH + KV) hs in qkv, KV hs in kv
  // Query row t's position in the sequence: t < half ? pos0 + t : pos1 + t - half. For
  // attention_forward half = T and pos0 = 0 (row t is at t); it never decreases along t.
  int half = 0, pos0 = 0, pos1 = 0;
  float scale = 1.0f;  // 1 / sqrt(hs)
  // Document masking: key_start[b*T + t] is query t's first key (a position: at most the
  // query's, never decreasing in t); nullptr: 0, plain causal.
  const int* key_start = nullptr;
};

// The shape of qkv as `a` splits it (the op's contract has checked that they agree), with
// key_start's device pointer when it is defined.
AttentionShape attention_shape(const Tensor& qkv, const AttentionDims& a,
                               const Tensor& key_start = Tensor{});
// attention_cp_forward's shape: query rows from qkv at chunks' positions, keys and values from
// the gathered kv (attention_cp.cu).
AttentionShape attention_cp_shape(const Tensor& qkv, const Tensor& kv, const AttentionDims& a,
                                  const QueryChunks& chunks, const Tensor& key_start);
// delta f32[B,NH,T] in the backend's scratch (valid until the next op that uses scratch).
float* attention_delta(CudaBackend& backend, const AttentionShape& d, const Tensor& dout,
                       const Tensor& out);

// Document masking through cuDNN's ragged SDPA (attention_cudnn.cpp): batch entry i is a run of
// query rows of one document within one chunk of d's query rows (attention_forward: all T rows;
// context parallelism: chunk 0 or 1 of d.half rows), in order of sequence then row, padded with
// empty entries to `entries`. Its queries attend keys from their document's first position to
// their own, causal at the bottom right. Built on the device from d.key_start
// (attention_documents.cu), so a call needs from the host only how many entries there are.
struct DocumentTable {
  int entries = 0;
  int rows = 0;               // the chunk's query rows a sequence: each entry's stats row count
  int* seq_len_q = nullptr;   // [entries] its query rows (0: padding)
  int* seq_len_kv = nullptr;  // [entries] its keys
  int* first = nullptr;       // [entries] its first query row among the B*T (b * T + t)
  int* q_offset = nullptr;    // [entries + 1] first * qkv_stride: Q's (and dQ's) ragged offsets
  int* kv_offset = nullptr;   // [entries + 1] its first key's, into K, V (qkv or kv) and dK, dV
  int* o_offset = nullptr;    // [entries + 1] first * out_stride: O's and dO's
  static size_t bytes(int entries) {
    return (3 * static_cast<size_t>(entries) + 3 * (static_cast<size_t>(entries) + 1)) *
           sizeof(int);
  }
};
// The table of chunk `chunk`'s documents in `memory` (DocumentTable::bytes(entries)), `entries`
// at least their number.
DocumentTable document_table(cudaStream_t stream, const AttentionShape& d, int chunk, int entries,
                             void* memory);
// The ragged batch a document-masked call of d counted as `documents` entries (AttentionDims::
// documents) runs on cuDNN: their number rounded up to a power of two; 0 where cuDNN cannot take
// it (i32 offsets overflow, or the entries' stats would pass 512 MiB) or kiln was built without
// the frontend.
int cudnn_document_entries(const AttentionShape& d, int64_t documents);
// cuDNN's packed stats [entries, NH, table.rows] (row j of entry i) to kiln's lse [B, NH, T]
// (row t of first[i] + j), or back with to_lse false.
void document_stats(cudaStream_t stream, const AttentionShape& d, const DocumentTable& table,
                    float* stats, float* lse, bool to_lse);

#ifdef __CUDACC__  // nvcc only: device helpers, and launchers that take device pointers
// Query t's first key in sequence b.
__device__ inline int first_key(const AttentionShape& d, int b, int t) {
  return d.key_start ? d.key_start[static_cast<int64_t>(b) * d.T + t] : 0;
}
// Query row t's position in the sequence (its last key).
__device__ inline int query_position(const AttentionShape& d, int t) {
  return t < d.half ? d.pos0 + t : d.pos1 + t - d.half;
}
// The first query row at position s or later (T where none is): the first that may see key s.
__device__ inline int first_query_seeing(const AttentionShape& d, int s) {
  if (s <= d.pos0) return 0;
  if (s < d.pos0 + d.half) return s - d.pos0;
  if (s <= d.pos1) return d.half;
  return min(d.half + s - d.pos1, d.T);
}

// The flash kernels (attention_flash.cu). q: the query rows (qkv's layout), kv: the key rows
// (d.Tk rows of d.kv_stride); for attention_forward both are qkv. The backward writes dq into
// dq's query columns (qkv's layout) and dk/dv for every one of the d.Tk keys into dkv (kv's
// layout), zero where no query attends. Head sizes 32, 64, 128; others throw.
void flash_forward(cudaStream_t stream, const AttentionShape& d, bf16* out, float* lse,
                   const bf16* q, const bf16* kv);
void flash_backward(CudaBackend& backend, const AttentionShape& d, bf16* dq, bf16* dkv,
                    const Tensor& dout, const bf16* q, const bf16* kv, const Tensor& out,
                    const float* lse);
#endif

}  // namespace cuda
}  // namespace kiln
