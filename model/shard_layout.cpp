#include "model/shard_layout.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kiln {

namespace {

[[noreturn]] void refuse(const ParamInfo& t, const std::string& what) {
  throw std::invalid_argument(t.name + " " + t.shape.str() + ": " + what);
}

// The segments of t's split dim at the global size.
std::vector<int64_t> segments_of(const ParamInfo& t) {
  return t.split.segments.empty() ? std::vector<int64_t>{t.shape[t.split.dim]}
                                  : t.split.segments;
}

// A tensor's part on this rank as blocks relative to the tensor's start: `runs` runs of `run`
// elements, contiguous here from `local`, at `global` + k * stride there.
struct Block {
  int64_t local, global, run, runs, stride;
};

std::vector<Block> blocks_of(const ParamInfo& g, const ParamInfo& l, const ShardCoords& c) {
  const bool experts = g.experts > 0 && c.expert_ranks > 1;
  const bool split = g.split.split() && c.tensor_ranks > 1;
  const int64_t n = l.numel();
  if (experts) return {{0, c.expert_rank * n, n, 1, n}};
  if (!split) return {{0, 0, n, 1, n}};
  const int T = c.tensor_ranks, t = c.tensor_rank;
  const int64_t rows = g.shape[0];
  if (g.split.dim == 0) {
    const int64_t width = g.numel() / rows;
    std::vector<Block> out;
    int64_t local_row = 0, global_row = 0;
    for (const int64_t s : segments_of(g)) {
      const int64_t part = s / T;
      out.push_back({local_row * width, (global_row + t * part) * width, part * width, 1,
                     part * width});
      local_row += part;
      global_row += s;
    }
    return out;
  }
  // Along dim 1, one segment: each row's t-th part (with whatever dims follow it).
  const int64_t global_cols = g.numel() / rows, local_cols = global_cols / T;
  return {{0, t * local_cols, local_cols, rows, global_cols}};
}

void add_piece(std::vector<LayoutPiece>& out, LayoutPiece p) {
  if (p.runs == 1) p.stride = p.run;
  LayoutPiece* last = out.empty() ? nullptr : &out.back();
  if (last && last->runs == 1 && p.runs == 1 && last->expert == p.expert &&
      last->split == p.split && last->local + last->run == p.local &&
      last->global + last->run == p.global) {
    last->run += p.run;
    last->stride = last->run;
    return;
  }
  out.push_back(p);
}

}  // namespace

ParamLayout shard_layout(const ParamLayout& global, const ShardCoords& c) {
  LayoutBuilder b;
  int unit = 0;
  for (const ParamInfo& t : global.tensors) {
    for (; unit < t.unit; ++unit) b.close_unit();
    Shape shape = t.shape;
    int64_t experts = t.experts;
    TensorSplit split = t.split;
    if (t.experts > 0 && c.expert_ranks > 1) {
      if (t.split.split() && c.tensor_ranks > 1)
        refuse(t, "an expert tensor is not split by tensor parallelism too");
      if (t.experts % c.expert_ranks != 0)
        refuse(t, std::to_string(t.experts) + " experts do not split over " +
                      std::to_string(c.expert_ranks) + " ranks");
      experts = t.experts / c.expert_ranks;
      shape.dims[0] = experts;
    }
    if (t.split.split() && c.tensor_ranks > 1) {
      int64_t along = 0;
      std::vector<int64_t> local_segments;
      for (const int64_t s : segments_of(t)) {
        if (s % c.tensor_ranks != 0)
          refuse(t, "a part of " + std::to_string(s) + " along dim " +
                        std::to_string(t.split.dim) + " does not split over " +
                        std::to_string(c.tensor_ranks) + " ranks");
        local_segments.push_back(s / c.tensor_ranks);
        along += s / c.tensor_ranks;
      }
      shape.dims[t.split.dim] = along;
      // The local tensor keeps its split, at the local size.
      if (!split.segments.empty()) split.segments = local_segments;
    }
    const int index = b.add(t.name, shape, t.decay, experts, split);
    if (t.f32_read) b.read_in_f32(index);
    if (t.hidden_matrix()) {
      // A row split divides each matrix's rows (a column split keeps them, with fewer columns).
      std::vector<int64_t> rows = t.matrix_rows;
      if (t.split.split() && t.split.dim == shape.ndim - 2 && c.tensor_ranks > 1)
        for (int64_t& r : rows) r /= c.tensor_ranks;
      b.hidden_matrix(index, rows);
    }
  }
  for (; unit < static_cast<int>(global.units.size()); ++unit) b.close_unit();
  ParamLayout local = b.finish();
  local.last_unit_reads_first = global.last_unit_reads_first;
  local.first_unit_rows = global.first_unit_rows;
  return local;
}

std::vector<LayoutPiece> local_to_global(const ParamLayout& global, const ParamLayout& local,
                                         const ShardCoords& c, int64_t begin, int64_t end) {
  std::vector<LayoutPiece> out;
  // Tensors lie in order: start at the first one that ends past `begin`.
  const auto first = std::upper_bound(
      local.tensors.begin(), local.tensors.end(), begin,
      [](int64_t at, const ParamInfo& t) { return at < t.offset + t.numel(); });
  for (auto it = first; it != local.tensors.end() && it->offset < end; ++it) {
    const size_t i = static_cast<size_t>(it - local.tensors.begin());
    const ParamInfo &l = *it, &g = global.tensors[i];
    const bool expert = g.experts > 0 && c.expert_ranks > 1;
    const bool split = g.split.split() && c.tensor_ranks > 1;
    for (const Block& bl : blocks_of(g, l, c)) {
      const int64_t start = l.offset + bl.local, size = bl.run * bl.runs;
      const int64_t lo = std::max(begin, start), hi = std::min(end, start + size);
      if (lo >= hi) continue;
      const int64_t G = g.offset + bl.global;
      // The runs [lo, hi) touches: a partial first run, whole runs, a partial last run.
      int64_t k0 = (lo - start) / bl.run, o0 = (lo - start) % bl.run;
      const int64_t k1 = (hi - start - 1) / bl.run, o1 = (hi - start - 1) % bl.run + 1;
      if (k0 == k1) {
        add_piece(out, {lo, G + k0 * bl.stride + o0, hi - lo, 1, 0, expert, split});
        continue;
      }
      if (o0 > 0) {
        add_piece(out, {lo, G + k0 * bl.stride + o0, bl.run - o0, 1, 0, expert, split});
        ++k0;
      }
      const int64_t whole_end = o1 == bl.run ? k1 + 1 : k1;
      if (whole_end > k0)
        add_piece(out, {start + k0 * bl.run, G + k0 * bl.stride, bl.run, whole_end - k0,
                        bl.stride, expert, split});
      if (o1 < bl.run) add_piece(out, {start + k1 * bl.run, G + k1 * bl.stride, o1, 1, 0, expert,
                                       split});
    }
  }
  return out;
}

std::vector<float> to_local(const ParamLayout& global, const ParamLayout& local,
                            const ShardCoords& c, const std::vector<float>& params) {
  std::vector<float> out(static_cast<size_t>(local.total));
  for (const LayoutPiece& p : local_to_global(global, local, c, 0, local.total))
    for_each_run(p, [&](int64_t l, int64_t g, int64_t n) {
      std::copy_n(params.begin() + g, n, out.begin() + l);
    });
  return out;
}

}  // namespace kiln
