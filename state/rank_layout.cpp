#include "state/rank_layout.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kiln {

ParamLayout expert_local_layout(const ParamLayout& global, int ranks) {
  LayoutBuilder b;
  int unit = 0;
  for (const ParamInfo& t : global.tensors) {
    for (; unit < t.unit; ++unit) b.close_unit();
    Shape shape = t.shape;
    int64_t experts = 0;
    if (t.experts > 0) {
      if (t.experts % ranks != 0)
        throw std::invalid_argument(t.name + ": " + std::to_string(t.experts) +
                                    " experts do not split over " + std::to_string(ranks) +
                                    " ranks");
      experts = t.experts / ranks;
      shape.dims[0] = experts;
    }
    b.add(t.name, shape, t.decay, experts);
  }
  for (; unit < static_cast<int>(global.units.size()); ++unit) b.close_unit();
  ParamLayout local = b.finish();
  local.last_unit_reads_first = global.last_unit_reads_first;
  local.first_unit_rows = global.first_unit_rows;
  return local;
}

std::vector<std::pair<int64_t, int64_t>> dense_ranges(const ParamLayout& layout) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const ParamInfo& t : layout.tensors) {
    if (t.experts > 0) continue;
    if (!out.empty() && out.back().second == t.offset)
      out.back().second += t.numel();
    else
      out.emplace_back(t.offset, t.offset + t.numel());
  }
  return out;
}

std::vector<LayoutPiece> local_to_global(const ParamLayout& global, const ParamLayout& local,
                                         int rank, int64_t begin, int64_t end) {
  std::vector<LayoutPiece> out;
  for (size_t i = 0; i < local.tensors.size(); ++i) {
    const ParamInfo &l = local.tensors[i], &g = global.tensors[i];
    const int64_t b = std::max(begin, l.offset), e = std::min(end, l.offset + l.numel());
    if (b >= e) continue;
    // A rank's experts are the global tensor's rank-th run of numel() elements.
    const int64_t first = g.experts > 0 ? g.offset + rank * l.numel() : g.offset;
    const LayoutPiece piece{b, first + (b - l.offset), e - b, g.experts > 0};
    // Consecutive tensors of one kind that lie together in both buffers make one piece.
    LayoutPiece* last = out.empty() ? nullptr : &out.back();
    if (last && last->expert == piece.expert && last->local + last->size == piece.local &&
        last->global + last->size == piece.global)
      last->size += piece.size;
    else
      out.push_back(piece);
  }
  return out;
}

std::vector<float> to_local(const ParamLayout& global, const ParamLayout& local, int rank,
                            const std::vector<float>& params) {
  std::vector<float> out(static_cast<size_t>(local.total));
  for (const LayoutPiece& p : local_to_global(global, local, rank, 0, local.total))
    std::copy_n(params.begin() + p.global, p.size, out.begin() + p.local);
  return out;
}

RankLayout::RankLayout(const ParamLayout& global, const ParallelPlan& plan)
    : global_(global), plan_(plan) {
  if (plan.has_experts_split()) local_ = expert_local_layout(global, plan.expert_parallel);
}

std::vector<LayoutPiece> RankLayout::global_pieces(int64_t begin, int64_t end) const {
  if (!local_) return {{begin, begin, end - begin, false}};
  return local_to_global(global_, *local_, plan_.expert_rank(), begin, end);
}

std::vector<float> RankLayout::to_local(const std::vector<float>& global) const {
  return local_ ? kiln::to_local(global_, *local_, plan_.expert_rank(), global) : global;
}

}  // namespace kiln
