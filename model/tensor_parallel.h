// dist.tensor_parallel as the model sees it (docs/distributed.md, Tensor parallelism): the
// `ranks` ranks of a group split each block's matrices (Megatron's column- and row-parallel
// linears) and the vocabulary, and the activations between blocks by token (sequence
// parallelism): a rank holds 1/ranks of a micro-batch's tokens in the residual stream and the
// norms, gathers all of them before a column-parallel GEMM, and sums its partial outputs into
// its tokens after a row-parallel one. Which parameters split and how is the model's
// (ParamInfo::split); the model knows only the group's two exchanges (model/group_exchange.h).
#pragma once

#include "model/group_exchange.h"

namespace kiln {

struct TensorParallel : GroupExchange {};

}  // namespace kiln
