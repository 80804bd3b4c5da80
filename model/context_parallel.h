// dist.context_parallel as the model sees it (docs/distributed.md): the `ranks` ranks of a group
// share each sequence of T positions, each holding T/ranks of its rows, so every activation but
// attention's keys is 1/ranks of the sequence's. The sequence is cut into 2*ranks chunks and rank
// r holds chunks r and 2*ranks-1-r, an early and a late one, so that under the causal mask every
// rank has the same number of query-key pairs. Attention gathers the keys and values of the
// whole sequence from the group, attends its own queries over them, and in backward returns
// each rank the sum of the key and value gradients of its rows. The model knows only the group's
// two exchanges (model/group_exchange.h).
#pragma once

#include <cstdint>

#include "kernels/backend.h"
#include "model/group_exchange.h"

namespace kiln {

struct ContextParallel : GroupExchange {
  // Rows a rank holds of a sequence of T positions (T divisible by 2 * ranks).
  int64_t rows(int64_t T) const { return T / ranks; }
  // Where rank `r` of `ranks` holds its rows of a sequence of T positions.
  static QueryChunks split(int64_t T, int ranks, int r) {
    const int64_t C = T / (2 * ranks);
    QueryChunks c;
    c.offset[0] = r * C;
    c.offset[1] = (2 * static_cast<int64_t>(ranks) - 1 - r) * C;
    return c;
  }
  QueryChunks chunks(int64_t T, int r) const { return split(T, ranks, r); }
  QueryChunks chunks(int64_t T) const { return chunks(T, rank); }
};

}  // namespace kiln
