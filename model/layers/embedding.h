// Token embedding wte[Vp,C], plus learned positions wpe[seq_len,C] when the model has them
// (GPT-2). Rotary positions (RoPE) are applied inside attention instead, so a RoPE model's
// embedding is the token lookup alone. Under tensor parallelism (model/tensor_parallel.h) the
// table is vocabulary-parallel: a rank holds rows [first_row, first_row + Vp/ranks), looks up
// every token of the micro-batch in them (a token outside reads zeros) and the ranks' lookups are
// summed into each rank's tokens (sequence parallelism); the first rank adds the positions, so
// that the sum holds them once.
#pragma once

#include "model/layers/layer.h"
#include "model/param_layout.h"
#include "model/tensor_parallel.h"

namespace kiln {

struct Embedding {
  int wte = -1, wpe = -1;
  TensorParallel tp;
  int64_t first_row = 0;

  void declare(LayoutBuilder& b, int64_t padded_vocab, int64_t C, int64_t seq_len,
               bool learned_positions);
  // This rank's slice of the `padded_vocab` rows; std::invalid_argument where they do not split.
  void set_tensor_parallel(const TensorParallel& t, int64_t padded_vocab);
  // Row t of each sequence at position first + t (decoding one token past a KV cache). Under tp,
  // `out` holds the rank's tokens and `every` (every token's [B,T,C], the residual dtype) the
  // rank's part of their sum.
  void forward(Backend& k, const Params& w, Tensor out, Tensor tokens, int64_t first = 0,
               Tensor every = {}) const;
  // dout: the gradient at out (the rank's tokens under tp, gathered into `every` first).
  void backward(Backend& k, const Params& g, Tensor dout, Tensor tokens, Tensor every = {}) const;

 private:
  // wpe on the rank that adds the positions (all of them without tp), else undefined.
  Tensor positions(const Params& p) const { return tp.rank == 0 ? param(p, wpe) : Tensor{}; }
};

}  // namespace kiln
