// The flat parameter buffer as one rank holds it, and the way between it and the global (the
// model's, one process's) buffer that initialization, checkpoints and Hugging Face files speak
// of: under expert parallelism a rank holds only its run of each expert tensor, so its local
// layout differs from the model's, and a range of it is pieces of the global buffer.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "dist/parallel_plan.h"
#include "model/param_layout.h"

namespace kiln {

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

// The flat buffer as this rank holds it under `plan`: the model's layout, or under expert
// parallelism the rank's own (its run of each expert tensor), and the way between it and the
// global (the model's) buffer that initialization and checkpoints read and write.
class RankLayout {
 public:
  // Throws std::invalid_argument where the experts do not split over the expert group.
  RankLayout(const ParamLayout& global, const ParallelPlan& plan);
  const ParamLayout& local() const { return local_ ? *local_ : global_; }
  // The local layout where it differs from the model's (expert parallelism), else null.
  const ParamLayout* expert_local() const { return local_ ? &*local_ : nullptr; }
  // The local range [begin, end) as global pieces (one piece without expert parallelism).
  std::vector<LayoutPiece> global_pieces(int64_t begin, int64_t end) const;
  // The global parameters (host) in the local buffer's layout.
  std::vector<float> to_local(const std::vector<float>& global) const;
  // Whether this rank writes piece `p` to a checkpoint: its experts always; the dense
  // parameters, the same on every rank of an expert group, from the group's first rank alone.
  bool writes(const LayoutPiece& p) const { return p.expert || plan_.writes_dense(); }

 private:
  const ParamLayout& global_;
  ParallelPlan plan_;
  std::optional<ParamLayout> local_;
};

}  // namespace kiln
