// What every layer shares. A layer is a small struct: the indices of its parameters in the
// model's ParamLayout (resolved once, when the layer declares them by name), the shapes it
// needs, and forward/backward functions over Backend ops. Weights and grads are passed in as
// the model's bound tensors (Params, indexed like layout.tensors), so a layer owns no memory.
// Backward follows the op convention: parameter grads accumulate (+=), or are written (=) where
// the caller passes accumulate = false (a unit whose gradients are stale, UnitHooks::grads_fresh);
// activation grads are overwritten, except where a layer says it accumulates into the residual
// stream's gradient.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kernels/backend.h"

namespace kiln {

using Params = std::vector<Tensor>;

// Where a layer's activation buffers go: Arena::plan for memory planned once, or anything
// else that wants to see the buffers (the decoder keeps some per block and shares others under
// activation recomputation, and counts bytes for the memory table).
using Planner =
    std::function<void(Tensor* slot, const std::string& name, Shape shape, DType dtype)>;

// Document masking's per-token inputs of a micro-batch (data.document_mask, docs/data.md):
// i32[B,T] each in backend memory, undefined where off. key_start[b,t]: the first key query t
// attends, its document's first row (attention_forward's key_start); positions[b,t]: its RoPE
// position, t - key_start[b,t] (rope_forward's positions; undefined: t, as without documents).
// documents: attention's count of them, AttentionDims::documents (the documents the B rows hold
// in all; under context parallelism, the runs of one document in each of a rank's two chunks);
// 0 where not counted.
struct DocumentMask {
  Tensor key_start;
  Tensor positions;
  int64_t documents = 0;
};

// The tensor at `index`, or an undefined one for an absent parameter (index < 0).
inline Tensor param(const Params& p, int index) {
  return index < 0 ? Tensor{} : p[static_cast<size_t>(index)];
}

}  // namespace kiln
