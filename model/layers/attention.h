// Causal self-attention: qkv projection -> [QK-norm] -> [RoPE] -> attention core -> output
// projection. The qkv projection writes q, k and v heads packed per token (AttentionDims), so
// grouped-query attention is a narrower qkv weight and nothing else. RoPE rotates q and k in
// place: attention's backward needs the rotated q and k, and the qkv GEMM's backward needs only
// its input, so the pre-rotation values are never kept (QK-norm keeps its input, which its
// backward reads). Under tensor parallelism (model/tensor_parallel.h) the qkv projection is
// column-parallel by heads (each rank its query heads and its key-value heads: `dims` is then
// the rank's), the core runs on the rank's heads over every token, and the output projection is
// row-parallel: the layer takes and returns the rank's tokens (sequence parallelism), gathering
// the input before qkv and summing the projection's partial outputs into its tokens after it.
#pragma once

#include <string>

#include "model/context_parallel.h"
#include "model/tensor_parallel.h"
#include "model/layers/layer.h"
#include "model/layers/linear.h"
#include "model/param_layout.h"

namespace kiln {

struct Attention {
  AttentionDims dims;
  bool rope = false;
  Rope rope_params;  // theta and scaling (kernels/rope_freq.h)
  bool qk_norm = false;
  float norm_eps = 1e-6f;
  Linear qkv, proj;
  int q_norm = -1, k_norm = -1;
  ContextParallel cp;  // set before planning: the buffers' shapes depend on it
  TensorParallel tp;   // likewise (set_tensor_parallel)

  struct Acts {
    Tensor qkv_raw, qk_rstd;  // QK-norm only: the projection's output and the heads' rstd
    Tensor qkv;               // what the core reads: normed and rotated q, k; v
    Tensor y, lse;            // core output [B,T,NH*hs] and its log-sum-exp
    Tensor out;               // after the output projection [B,T,C]; the rank's tokens under tp
  };
  // Backward buffers, one set shared by every block. Context parallelism's, forward and
  // backward: this rank's keys and values (and their gradient) kv_local [B,T/P,kvw], every
  // rank's as gathered kv_ranks [P,B,T/P,kvw], the sequence's in order kv [B,T,kvw] and their
  // gradient from this rank's queries dkv [B,T,kvw] (kvw = 2 * KV * hs).
  // Tensor parallelism's, shared with the MLP (the decoder's): every token's input or output
  // gradient `gathered` [B,T,C], and the partial sum of every token's output or input gradient
  // before the reduce-scatter, `partial` [B,T,C].
  struct Scratch {
    Tensor dy, dqkv, dqkv_raw;
    Tensor kv_local, kv_ranks, kv, dkv;
    Tensor gathered, partial;
  };

  void declare(LayoutBuilder& b, const std::string& name, int64_t C, bool qkv_bias, bool bias);
  // The rank's heads and projections; std::invalid_argument where the heads do not split.
  void set_tensor_parallel(const TensorParallel& t);
  void plan(const Planner& planner, const std::string& name, Acts& a, int64_t B, int64_t T,
            DType act) const;
  void plan_scratch(const Planner& planner, Scratch& s, int64_t B, int64_t T, DType act) const;
  // docs: the micro-batch's document mask (model/layers/layer.h; {}: plain causal). s: the
  // shared buffers context parallelism gathers into.
  void forward(Backend& k, const Params& w, const Acts& a, Tensor inp, const DocumentMask& docs,
               const Scratch& s) const;
  // The attention core: a.y and a.lse from a.qkv (the forward's step after RoPE, and again
  // under recomputation from the kept qkv); under context parallelism it gathers the keys.
  void core(Backend& k, const Acts& a, const DocumentMask& docs, const Scratch& s) const;
  // One token at position `pos` (a: one-token buffers, inp [1,1,C]) against the KV cache
  // `cache` (the forward's a.qkv [1,T,qkv_dim], rows 0..pos-1 filled): its q, k and v go to row
  // pos, rotated there for position pos, and its query attends over rows 0..pos.
  void decode(Backend& k, const Params& w, const Acts& a, Tensor inp, Tensor cache,
              int64_t pos) const;
  // dinp = gradient w.r.t. inp (overwritten); dout: gradient w.r.t. a.out. The grads are added
  // to, or overwritten where not `accumulate`.
  // kv_gathered (context parallelism): s.kv already holds this block's gathered keys and
  // values (recomputation just ran its forward), so backward need not gather them again.
  void backward(Backend& k, const Params& w, const Params& g, const Scratch& s, Tensor dinp,
                Tensor dout, Tensor inp, const Acts& a, const DocumentMask& docs, bool accumulate,
                bool kv_gathered = false) const;

 private:
  void gather_kv(Backend& k, const Acts& a, const Scratch& s) const;
  // dims with the micro-batch's document count (attention_forward's a.documents).
  AttentionDims counted(const DocumentMask& docs) const {
    AttentionDims d = dims;
    d.documents = docs.documents;
    return d;
  }
};

}  // namespace kiln
