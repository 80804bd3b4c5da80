// The flat parameter buffer's table of named tensors (docs/design.md invariant 4): where each
// tensor lives (offset, shape), which FSDP unit it belongs to and whether AdamW decays it. Sharding
// strategies and checkpoints see parameters only through this table; layers add their tensors
// to it by name through a LayoutBuilder, in the order they run.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/tensor.h"

namespace kiln {

// How tensor parallelism (model/tensor_parallel.h) splits a tensor over the ranks of a tensor
// group: not at all (dim -1: every rank holds it whole, as norms' gains), or along dim 0 (rows: a
// column-parallel weight and bias, a vocabulary table) or dim 1 (columns: a row-parallel weight),
// each of `segments` (consecutive runs along that dim; empty: the whole dim) in equal parts, so
// that a packed tensor splits per part: qkv's q, k and v heads, SwiGLU's gate and up rows.
struct TensorSplit {
  int dim = -1;
  std::vector<int64_t> segments;
  bool split() const { return dim >= 0; }
};

// One named tensor of the flat parameter buffer.
struct ParamInfo {
  std::string name;  // "h.3.attn.qkv.weight"
  int64_t offset;    // elements from the start of the flat buffer
  Shape shape;
  int unit;    // FSDP unit: 0 = embeddings, 1..L = blocks, L+1 = final norm (+ head)
  bool decay;  // AdamW weight decay applies (matmul weights only)
  // A MoE layer's expert tensor: its first dimension, the experts (0 for any other tensor).
  // Expert parallelism splits it (train/parallelize.h).
  int64_t experts = 0;
  // Under tensor parallelism: how the tensor splits (a local layout's tensors keep their global
  // tensor's split, with the global segments).
  TensorSplit split;
  // optim.name=muon's fact (docs/optimizer.md): a hidden 2-D matrix, or a stack of them, that
  // Muon orthogonalizes. The tensor (each expert's slab of an expert tensor) is these runs of
  // rows, each a logical matrix of its own [rows, last dim] (a packed qkv: q, k and v); empty:
  // not one (embeddings, the head, norms, biases, a router), which AdamW updates.
  std::vector<int64_t> matrix_rows;
  // Read by the forward in f32, not the working dtype (norm gains and biases, as autocast reads
  // them): a gain sits near 1, where bf16's spacing (2^-7) is some 13 times AdamW's largest
  // step at lr 6e-4, so a bf16 copy would move once in many updates. Every rank holds such
  // tensors whole in f32 (Strategy::read_in_f32).
  bool f32_read = false;
  int64_t numel() const { return shape.numel(); }
  bool hidden_matrix() const { return !matrix_rows.empty(); }
};

struct ParamLayout {
  std::vector<ParamInfo> tensors;
  int64_t total = 0;                                     // elements
  std::vector<std::pair<int64_t, int64_t>> units;        // [begin, end) per unit
  std::vector<std::pair<int64_t, int64_t>> decay_spans;  // merged [begin, end) with decay
  // What a sharding strategy needs of the model besides ranges, stated here by the model so that
  // dist knows no tensor (dist/strategy.h, StrategyOptions): the last unit reads unit 0's
  // parameters too (a head tied to the token table), and unit 0 is one table of this many rows
  // whose gradient is a scatter of rows (0: it is not).
  bool last_unit_reads_first = false;
  int64_t first_unit_rows = 0;

  const ParamInfo& find(const std::string& name) const;
  // Index of `name` in tensors; throws std::out_of_range naming it when absent.
  int index(const std::string& name) const;

 private:
  friend class LayoutBuilder;
  std::unordered_map<std::string, int> by_name_;
};

// Builds a ParamLayout tensor by tensor and unit by unit.
class LayoutBuilder {
 public:
  // Adds `name` to the open unit; returns its index in tensors. `experts`, `split`: see
  // ParamInfo.
  int add(const std::string& name, Shape shape, bool decay, int64_t experts = 0,
          TensorSplit split = {});
  // Marks tensor `index` (2-D, or 3-D with its experts first) as hidden matrices for Muon, of
  // these runs of rows (ParamInfo::matrix_rows; empty: one matrix of all its rows).
  void hidden_matrix(int index, std::vector<int64_t> rows = {});
  // Marks tensor `index` as read in f32 (ParamInfo::f32_read).
  void read_in_f32(int index) { layout_.tensors.at(static_cast<size_t>(index)).f32_read = true; }
  // Closes the open unit (every tensor added since the last close) and opens the next.
  void close_unit();
  // The finished layout, with its decay spans merged.
  ParamLayout finish();

 private:
  ParamLayout layout_;
  int64_t unit_begin_ = 0;
};

// FNV-1a over bytes, continuing from `hash`: the checksum of checkpoint files (ranges of the
// flat buffer, state/checkpoint.h) and of the state ranks must hold alike (model/fp8_state.h):
// cheap, and enough to catch truncation, bit rot, or two ranks whose state should be alike and
// is not.
uint64_t fnv1a_bytes(const void* data, size_t n, uint64_t hash = 14695981039346656037ull);

}  // namespace kiln
