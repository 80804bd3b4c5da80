// The flat parameter buffer as one rank holds it on the device mesh, and the way between it and
// the global (the model's, one process's) buffer that initialization, checkpoints and Hugging
// Face files speak of (model/shard_layout.h does the arithmetic): under expert parallelism a rank
// holds its run of each expert tensor, under tensor parallelism its part of each split tensor,
// so a range of its buffer is pieces of the global one. Any mesh reads and writes the global
// layout, so a run resumes under any other.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "dist/device_mesh.h"
#include "model/shard_layout.h"

namespace kiln {

// The rank's coordinates in the groups that split the parameters.
ShardCoords shard_coords(const DeviceMesh& mesh);

class RankLayout {
 public:
  // Throws std::invalid_argument naming the tensor where a split does not divide.
  RankLayout(const ParamLayout& global, const DeviceMesh& mesh);
  const ParamLayout& global() const { return global_; }
  const ParamLayout& local() const { return local_ ? *local_ : global_; }
  // The local layout where it differs from the model's (expert or tensor parallelism), else null.
  const ParamLayout* sharded() const { return local_ ? &*local_ : nullptr; }
  // The local range [begin, end) as global pieces (one piece where the layouts are one).
  std::vector<LayoutPiece> global_pieces(int64_t begin, int64_t end) const;
  // The global parameters (host) in the local buffer's layout.
  std::vector<float> to_local(const std::vector<float>& global) const;
  // Whether this rank writes piece `p` to a checkpoint: of the ranks that hold the same values,
  // the first alone (the first replica; of an expert group the first for dense parameters; of a
  // tensor group the first for tensors it does not split).
  bool writes(const LayoutPiece& p) const {
    return mesh_.replicate_rank() == 0 && (p.expert || mesh_.expert_rank() == 0) &&
           (p.split || mesh_.tensor_rank() == 0);
  }

 private:
  const ParamLayout& global_;
  DeviceMesh mesh_;
  ShardCoords coords_;
  std::optional<ParamLayout> local_;
};

}  // namespace kiln
