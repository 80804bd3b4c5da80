#include "model/layers/embedding.h"

namespace kiln {

void Embedding::declare(LayoutBuilder& b, int64_t padded_vocab, int64_t C, int64_t seq_len,
                        bool learned_positions) {
  wte = b.add("wte", {padded_vocab, C}, true);
  wpe = learned_positions ? b.add("wpe", {seq_len, C}, false) : -1;
}

}  // namespace kiln
