// One rank's shard of the model's parameters, and the way between its flat buffer and the global
// one (the model's, one process's) that initialization, checkpoints and Hugging Face files speak
// of. Under expert parallelism a rank holds its run of each expert tensor's experts; under tensor
// parallelism its part of each split tensor (ParamInfo::split). The local layout keeps the
// global one's tensors, order and units, each at its local size, so a range of the local buffer
// is pieces of the global buffer, some of them strided (a column split is a run a row).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "model/param_layout.h"

namespace kiln {

// Where this rank sits in the groups that split the parameters.
struct ShardCoords {
  int tensor_ranks = 1, tensor_rank = 0;
  int expert_ranks = 1, expert_rank = 0;
  bool whole() const { return tensor_ranks == 1 && expert_ranks == 1; }
};

// The local layout: every tensor of `global` in its order and unit, holding this rank's part (an
// expert tensor its expert_rank-th run of E/expert_ranks experts; a split tensor its
// tensor_rank-th part of each segment along its dim), with its decay spans and the global
// layout's facts for strategies. std::invalid_argument naming the tensor where a size does not
// divide.
ParamLayout shard_layout(const ParamLayout& global, const ShardCoords& c);

// A piece of a local range and where it lies in the global buffer: `runs` runs of `run`
// elements, run k at local + k * run here and at global + k * stride there (one run: a range).
struct LayoutPiece {
  int64_t local = 0, global = 0, run = 0, runs = 1, stride = 0;
  bool expert = false;  // expert tensors: distinct on every rank of the expert group
  bool split = false;   // tensors split by tensor parallelism: distinct on every rank of it
  int64_t size() const { return run * runs; }
};

// The local range [begin, end) as pieces of the global buffer, in local order; pieces that
// continue each other on both sides are merged.
std::vector<LayoutPiece> local_to_global(const ParamLayout& global, const ParamLayout& local,
                                         const ShardCoords& c, int64_t begin, int64_t end);

// Calls `f(local_offset, global_offset, n)` for every run of `p`, in local order.
template <class F>
void for_each_run(const LayoutPiece& p, F&& f) {
  for (int64_t k = 0; k < p.runs; ++k) f(p.local + k * p.run, p.global + k * p.stride, p.run);
}

// The global parameters (host, global.total values) in the local buffer's layout.
std::vector<float> to_local(const ParamLayout& global, const ParamLayout& local,
                            const ShardCoords& c, const std::vector<float>& params);

// The ranges of `layout` whose tensors satisfy `keep`, merged where they touch.
template <class Keep>
std::vector<std::pair<int64_t, int64_t>> ranges_where(const ParamLayout& layout, Keep&& keep) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const ParamInfo& t : layout.tensors) {
    if (!keep(t)) continue;
    if (!out.empty() && out.back().second == t.offset)
      out.back().second += t.numel();
    else
      out.emplace_back(t.offset, t.offset + t.numel());
  }
  return out;
}

}  // namespace kiln
