#include "state/rank_layout.h"

namespace kiln {

ShardCoords shard_coords(const DeviceMesh& mesh) {
  return {mesh.tensor, mesh.tensor_rank(), mesh.expert, mesh.expert_rank()};
}

RankLayout::RankLayout(const ParamLayout& global, const DeviceMesh& mesh)
    : global_(global), mesh_(mesh), coords_(shard_coords(mesh)) {
  if (!coords_.whole()) local_ = shard_layout(global, coords_);
}

std::vector<LayoutPiece> RankLayout::global_pieces(int64_t begin, int64_t end) const {
  if (!local_) return {{begin, begin, end - begin, 1, end - begin, false, false}};
  return local_to_global(global_, *local_, coords_, begin, end);
}

std::vector<float> RankLayout::to_local(const std::vector<float>& global) const {
  return local_ ? kiln::to_local(global_, *local_, coords_, global) : global;
}

}  // namespace kiln
