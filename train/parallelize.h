// Parallelism applied to a model from outside it: the model's parameters and gradients are
// pointed at the strategy's buffers (each tensor at its offset inside its unit's current place:
// the full flat buffers, or an FSDP gather slot, re-pointed whenever the strategy moves units),
// and the model's unit hooks call the strategy's. Neither side knows the other's type.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "dist/strategy.h"
#include "model/model.h"

namespace kiln {

// `hooks` must outlive the model's use of it (the model keeps a pointer). `local`: the
// strategy's buffers are laid out as this (an expert-parallel rank's, below), which names the
// same tensors as the model's layout; each is found by name.
void parallelize(Model& model, Strategy& strategy, UnitHooks& hooks,
                 const ParamLayout* local = nullptr);

// Expert parallelism over `ranks` ranks: the layout of rank `rank`'s flat buffer, the model's
// `global` one with each expert tensor (ParamInfo::experts) holding only the rank's run of
// experts (rank * E/ranks on). Units, decay spans and every other tensor follow in order, so
// the non-expert parameters have the same offsets on every rank of the group.
ParamLayout expert_local_layout(const ParamLayout& global, int ranks);

// The ranges of `layout` that hold no expert tensor, merged where they touch.
std::vector<std::pair<int64_t, int64_t>> dense_ranges(const ParamLayout& layout);

// Where rank `rank`'s local range [begin, end) lies in the global buffer: pieces, each (local
// offset, global offset, size) and whether it holds expert tensors, cut where the two buffers
// part (around each run of expert tensors).
struct LayoutPiece {
  int64_t local, global, size;
  bool expert;
};
std::vector<LayoutPiece> local_to_global(const ParamLayout& global, const ParamLayout& local,
                                         int rank, int64_t begin, int64_t end);
// The global parameters (host, global.total) -> rank `rank`'s local buffer (host, local.total).
std::vector<float> to_local(const ParamLayout& global, const ParamLayout& local, int rank,
                            const std::vector<float>& params);

}  // namespace kiln
