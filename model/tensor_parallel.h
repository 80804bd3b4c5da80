// dist.tensor_parallel as the model sees it (docs/distributed.md, Tensor parallelism): the
// `ranks` ranks of a group split each block's matrices (Megatron's column- and row-parallel
// linears) and the vocabulary, and the activations between blocks by token (sequence
// parallelism): a rank holds 1/ranks of a micro-batch's tokens in the residual stream and the
// norms, gathers all of them before a column-parallel GEMM, and sums its partial outputs into
// its tokens after a row-parallel one. Which parameters split and how is the model's
// (ParamInfo::split); the model knows only the group's two exchanges (model/group_exchange.h).
//
// Async TP (dist.tensor_parallel_chunks = K > 1): the tokens move in K pieces, each beside the
// GEMM on the piece before. So that a piece of the gathered tokens is a run of rows in their
// order (what the GEMM reads and writes), a rank's tokens are K runs: with N tokens, R ranks and
// m = N / (R K), rank r holds rows [(c R + r) m, (c R + r + 1) m) for c < K (K = 1: one run,
// [r N/R, (r + 1) N/R)). Everything a rank computes on its own tokens is per token, so the
// losses are the same for any K.
#pragma once

#include <cstdint>
#include <functional>

#include "model/group_exchange.h"

namespace kiln {

struct TensorParallel : GroupExchange {
  int chunks = 1;  // K above

  // The rows [first, first + n) of `all`'s rows (each of all.dim(-1) values).
  using Rows = std::function<void(int64_t first, int64_t n)>;
  // all = every rank's tokens `mine`, in their order; each(first, n), if set, runs as soon as
  // rows [first, first + n) of `all` are in, and covers all's rows once over the calls.
  void gather_tokens(Tensor all, Tensor mine, const Rows& each = {}) const;
  // each(first, n) writes rows [first, first + n) of `all` (this rank's partial sums for every
  // token), and mine = the sum over ranks of their partial sums for this rank's tokens; each
  // piece is sent as soon as it is written. Without `each`, all is written already.
  void scatter_tokens(Tensor mine, Tensor all, const Rows& each = {}) const;
  // gather_tokens started (beside the compute issued after it): `all` may be read once finish()
  // with the returned mark has returned.
  uint64_t start_gather_tokens(Tensor all, Tensor mine) const;
  void finish(uint64_t mark) const;
};

}  // namespace kiln
