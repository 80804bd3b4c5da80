// Context-parallel attention on CUDA (attention_cp_forward/backward): this rank's two chunks of
// query rows against the keys and values of the whole sequence, gathered into kv. Two paths, as
// attention_forward's:
//  - cudnn (attention_cudnn.cpp): one SDPA per chunk, causal at the bottom right of the chunk's
//    key prefix, or with key_start and the entries counted (AttentionDims::documents) each
//    chunk's documents as ragged batch entries; the calls of a backend whose attention is cudnn.
//  - flash (attention_flash.cu): the same kernels as attention_forward's, told the rows'
//    positions and reading keys from kv; document-masked calls not counted, and the flash and
//    naive kinds (naive has no kernel of its own here: it is the single-sequence test oracle).
// The backward writes only the query columns of dqkv, and all of dkv.
#include <string>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace kiln {

using namespace cuda;

namespace cuda {

AttentionShape attention_cp_shape(const Tensor& qkv, const Tensor& kv, const AttentionDims& a,
                                  const QueryChunks& chunks, const Tensor& key_start) {
  AttentionShape d = attention_shape(qkv, a, key_start);
  d.Tk = static_cast<int>(kv.dim(1));
  d.kv_stride = static_cast<int>(2 * a.kv_dim());
  d.k_offset = 0;
  d.v_offset = static_cast<int>(a.kv_dim());
  d.half = d.T / 2;
  d.pos0 = static_cast<int>(chunks.offset[0]);
  d.pos1 = static_cast<int>(chunks.offset[1]);
  return d;
}

}  // namespace cuda

namespace {

std::string cp_call(const AttentionShape& d) {
  return "context-parallel chunks of " + std::to_string(d.half) + " rows at " +
         std::to_string(d.pos0) + " and " + std::to_string(d.pos1) + " of " + std::to_string(d.Tk) +
         " keys, B=" + std::to_string(d.B) + " NH=" + std::to_string(d.NH) +
         " KV=" + std::to_string(d.KV) + " hs=" + std::to_string(d.hs);
}

// Whether the call runs cudnn: a backend on cudnn, and a masked call's entries counted and
// within cuDNN's reach.
bool cudnn_cp(CudaBackend& backend, const AttentionShape& d, const AttentionDims& a) {
  if (!d.key_start) return backend.attention() == AttentionKind::cudnn;
  return backend.masked_attention_kind(a) == AttentionKind::cudnn &&
         cudnn_document_entries(d, a.documents) > 0;
}

}  // namespace

void CudaBackend::run_attention_cp_forward(Tensor out, Tensor lse, Tensor qkv, Tensor kv,
                                           const AttentionDims& a, const QueryChunks& chunks,
                                           Tensor key_start) {
  const AttentionShape d = attention_cp_shape(qkv, kv, a, chunks, key_start);
  auto flash = [&] {
    flash_forward(stream_, d, out.ptr<bf16>(), lse.ptr<float>(), qkv.ptr<bf16>(), kv.ptr<bf16>());
  };
  if (cudnn_cp(*this, d, a))
    cudnn_or_flash(
        cp_call(d), [&] { attention_cp_forward_cudnn(out, lse, qkv, kv, a, chunks, key_start); },
        flash);
  else
    flash();
}

void CudaBackend::run_attention_cp_backward(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv,
                                            Tensor kv, Tensor out, Tensor lse,
                                            const AttentionDims& a, const QueryChunks& chunks,
                                            Tensor key_start) {
  const AttentionShape d = attention_cp_shape(qkv, kv, a, chunks, key_start);
  // The flash backward overwrites every dq row and every key's dk/dv, so it may also follow a
  // cuDNN backward that failed part way.
  auto flash = [&] {
    flash_backward(*this, d, dqkv.ptr<bf16>(), dkv.ptr<bf16>(), dout, qkv.ptr<bf16>(),
                   kv.ptr<bf16>(), out, lse.ptr<float>());
  };
  if (cudnn_cp(*this, d, a))
    cudnn_or_flash(
        cp_call(d),
        [&] {
          attention_cp_backward_cudnn(dqkv, dkv, dout, qkv, kv, out, lse, a, chunks, key_start);
        },
        flash);
  else
    flash();
}

}  // namespace kiln
