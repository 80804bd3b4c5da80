#include "model/param_layout.h"

#include <stdexcept>

namespace kiln {

int ParamLayout::index(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) throw std::out_of_range("no parameter named " + name);
  return it->second;
}

const ParamInfo& ParamLayout::find(const std::string& name) const {
  return tensors[static_cast<size_t>(index(name))];
}

int LayoutBuilder::add(const std::string& name, Shape shape, bool decay, int64_t experts,
                       TensorSplit split) {
  const int unit = static_cast<int>(layout_.units.size());
  const int index = static_cast<int>(layout_.tensors.size());
  if (!layout_.by_name_.emplace(name, index).second)
    throw std::logic_error("parameter " + name + " added twice");
  if (experts > 0 && (shape.ndim < 1 || shape[0] != experts))
    throw std::logic_error("parameter " + name + ": an expert tensor's first dimension is its experts");
  if (split.split() && (split.dim >= shape.ndim || (split.dim == 1 && split.segments.size() > 1)))
    throw std::logic_error("parameter " + name + ": a split along dim " +
                           std::to_string(split.dim) + " of " + shape.str() +
                           " (columns split as one segment)");
  int64_t along = 0;
  for (int64_t s : split.segments) along += s;
  if (split.split() && !split.segments.empty() && along != shape[split.dim])
    throw std::logic_error("parameter " + name + ": segments of " + std::to_string(along) +
                           " along dim " + std::to_string(split.dim) + " of " + shape.str());
  layout_.tensors.push_back(
      {name, layout_.total, shape, unit, decay, experts, std::move(split), {}});
  layout_.total += shape.numel();
  return index;
}

void LayoutBuilder::hidden_matrix(int index, std::vector<int64_t> rows) {
  ParamInfo& t = layout_.tensors.at(static_cast<size_t>(index));
  const int matrix_dims = t.experts > 0 ? 3 : 2;
  if (t.shape.ndim != matrix_dims)
    throw std::logic_error("parameter " + t.name + " " + t.shape.str() +
                           " is no stack of 2-D matrices");
  const int64_t all = t.shape[t.shape.ndim - 2];
  if (rows.empty()) rows = {all};
  int64_t sum = 0;
  for (int64_t r : rows) sum += r;
  if (sum != all)
    throw std::logic_error("parameter " + t.name + ": matrices of " + std::to_string(sum) +
                           " rows in " + t.shape.str());
  t.matrix_rows = std::move(rows);
}

void LayoutBuilder::close_unit() {
  layout_.units.emplace_back(unit_begin_, layout_.total);
  unit_begin_ = layout_.total;
}

ParamLayout LayoutBuilder::finish() {
  for (const auto& t : layout_.tensors) {
    if (!t.decay) continue;
    auto& spans = layout_.decay_spans;
    if (!spans.empty() && spans.back().second == t.offset)
      spans.back().second = t.offset + t.numel();
    else
      spans.emplace_back(t.offset, t.offset + t.numel());
  }
  return std::move(layout_);
}

uint64_t fnv1a_bytes(const void* data, size_t n, uint64_t hash) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) hash = (hash ^ p[i]) * 1099511628211ull;
  return hash;
}

}  // namespace kiln
