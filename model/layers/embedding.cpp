#include "model/layers/embedding.h"

#include <stdexcept>
#include <string>

namespace kiln {

void Embedding::declare(LayoutBuilder& b, int64_t padded_vocab, int64_t C, int64_t seq_len,
                        bool learned_positions) {
  wte = b.add("wte", {padded_vocab, C}, true, 0, TensorSplit{0, {}});
  wpe = learned_positions ? b.add("wpe", {seq_len, C}, false) : -1;
}

void Embedding::set_tensor_parallel(const TensorParallel& t, int64_t padded_vocab) {
  if (padded_vocab % t.ranks != 0)
    throw std::invalid_argument("the padded vocabulary of " + std::to_string(padded_vocab) +
                                " rows must split over " + std::to_string(t.ranks) +
                                " ranks (model.padded_vocab_size)");
  tp = t;
  first_row = t.rank * (padded_vocab / t.ranks);
}

void Embedding::forward(Backend& k, const Params& w, Tensor out, Tensor tokens, int64_t first,
                        Tensor every) const {
  Tensor pos = positions(w);
  if (pos.defined() && first > 0) {
    if (tp.on()) throw std::logic_error("Embedding: decoding under tensor parallelism");
    const int64_t C = pos.dim(1);
    pos = pos.slice(first * C, {pos.dim(0) - first, C});
  }
  if (!tp.on()) {
    k.encoder_forward(out, tokens, param(w, wte), pos, /*first_row=*/0);
    return;
  }
  k.encoder_forward(every, tokens, param(w, wte), pos, first_row);
  tp.scatter_tokens(out, every);
}

void Embedding::backward(Backend& k, const Params& g, Tensor dout, Tensor tokens,
                         Tensor every) const {
  if (!tp.on()) {
    k.encoder_backward(param(g, wte), param(g, wpe), dout, tokens, /*first_row=*/0);
    return;
  }
  tp.gather_tokens(every, dout);
  k.encoder_backward(param(g, wte), positions(g), every, tokens, first_row);
}

}  // namespace kiln
