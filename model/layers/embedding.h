// Token embedding wte[Vp,C], plus learned positions wpe[seq_len,C] when the model has them
// (GPT-2). Rotary positions (RoPE) are applied inside attention instead, so a RoPE model's
// embedding is the token lookup alone.
#pragma once

#include "model/layers/layer.h"
#include "model/param_layout.h"

namespace kiln {

struct Embedding {
  int wte = -1, wpe = -1;

  void declare(LayoutBuilder& b, int64_t padded_vocab, int64_t C, int64_t seq_len,
               bool learned_positions);
  // Row t of each sequence at position first + t (decoding one token past a KV cache).
  void forward(Backend& k, const Params& w, Tensor out, Tensor tokens, int64_t first = 0) const {
    Tensor positions = param(w, wpe);
    if (positions.defined() && first > 0) {
      const int64_t C = positions.dim(1);
      positions = positions.slice(first * C, {positions.dim(0) - first, C});
    }
    k.encoder_forward(out, tokens, param(w, wte), positions, /*first_row=*/0);
  }
  void backward(Backend& k, const Params& g, Tensor dout, Tensor tokens) const {
    k.encoder_backward(param(g, wte), param(g, wpe), dout, tokens, /*first_row=*/0);
  }
};

}  // namespace kiln
