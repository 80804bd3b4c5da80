// dist.tensor_parallel as the model sees it (docs/distributed.md, Tensor parallelism): the
// `ranks` ranks of a group split each block's matrices (Megatron's column- and row-parallel
// linears) and the vocabulary, and the activations between blocks by token (sequence
// parallelism): a rank holds 1/ranks of a micro-batch's tokens in the residual stream and the
// norms, gathers all of them before a column-parallel GEMM, and sums its partial outputs into
// its tokens after a row-parallel one. Which parameters split and how is the model's
// (ParamInfo::split); the model knows only these two exchanges, never the communicator or the
// ranks' mesh (dist/device_mesh.h).
#pragma once

#include <functional>

#include "kernels/backend.h"

namespace kiln {

struct TensorParallel {
  int ranks = 1, rank = 0;
  // all_gather(all, mine): all = every rank's `mine`, one after another in rank order;
  // reduce_scatter(mine, all): mine = the sum over ranks of their `all`'s rank-th part. Each
  // finished when it returns.
  std::function<void(Tensor all, Tensor mine)> all_gather;
  std::function<void(Tensor mine, Tensor all)> reduce_scatter;

  bool on() const { return ranks > 1; }
};

}  // namespace kiln
