// precision.fp8's per-layer state in one unit, owned by the model (Model::fp8()): which linear
// layers run in FP8, their delayed-scaling state (scales, amax histories and the step's amax
// windows, kernels/fp8.h) at a fixed address planned with the activations, the weights' FP8
// copies and the cast scratch. The FP8 linears read their operands from here (Linear::fp8);
// the trainer drives it at four moments:
//  - start: fresh scaling, or a checkpoint's state (refused where it does not fit the run);
//  - each step: the ranks' amax windows agreed by one MAX all-reduce so that every rank
//    quantizes alike, the new scales, and after AdamW the weights' FP8 copies;
//  - each checkpoint: the state saved (Fp8Checkpoint, which rank 0 writes), and the ranks
//    checked to agree;
//  - each step's metrics: the summary the update leaves (the tensor nearest saturation).
// The model knows nothing of ranks: the collectives come as hooks (Fp8Ranks) from where the
// model meets a strategy (train/parallelize.h). With FP8 off (no FP8 layers) every call does
// nothing.
#pragma once

#include <deque>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/arena.h"
#include "model/layers/layer.h"

namespace kiln {

struct Linear;

// The state as a checkpoint holds it (fp8_state.bin and the manifest's fp8 entry): the
// Fp8StateLayout over `names`, `history` amaxes each. Empty without FP8.
struct Fp8Checkpoint {
  std::vector<std::string> names;
  int history = 0;
  std::vector<float> state;
};

// The ranks that must quantize alike, as the trainer reaches them; the defaults are one process
// that says nothing.
struct Fp8Ranks {
  int world = 1;
  bool log = false;  // this rank says what the state found (rank 0)
  // MAX over every rank of `amax`, in place; done when it returns.
  std::function<void(Tensor amax)> all_reduce_max;
  // Every rank's `mine` into `all`, in rank order; done when it returns.
  std::function<void(Tensor all, Tensor mine)> all_gather;
};

class Fp8State {
 public:
  // `weights`: the model's bound working weights, which the FP8 copies are cast from.
  Fp8State(Backend& backend, const Fp8Options& options, const Params& weights);
  Fp8State(const Fp8State&) = delete;
  Fp8State& operator=(const Fp8State&) = delete;

  // While the model is built: `lin`, named `name` ("h.3.mlp.proj"), runs in FP8; its tensors are
  // name.x, name.w and name.g, after those of the linears added before it.
  void add(Linear& lin, const std::string& name);
  bool on() const { return layout_.n > 0; }
  const Fp8StateLayout& layout() const { return layout_; }
  // The names of the state's tensors, in state order ("h.3.mlp.proj.x").
  const std::vector<std::string>& names() const { return names_; }
  // The whole state, f32[layout().total()].
  Tensor state() const { return buffers_.state; }

  // Under a strategy that never holds the whole model (fsdp), before plan(): no FP8 weight
  // copies are kept (cast_weights does nothing); each FP8 linear casts its weight into scratch
  // shared by all of them before each forward and backward. The same bytes and amaxes as the
  // cast once per step, since weights and scales change only between steps.
  void cast_weights_on_use() { copies_ = Fp8WeightCopies::on_use; }
  // Or (fsdp with fp8.all_gather), before plan(): the weights' FP8 copies are gathered with their
  // units. cast_weights calls `cast_shard`, which casts this rank's part of each weight with the
  // state's current scales (recording the amaxes, which the ranks' MAX all-reduce makes whole);
  // point_gathered says where each copy lies while its unit is held. The bytes are the cast's.
  using CastShard = std::function<void(Tensor state, const Fp8StateLayout& layout)>;
  void gather_weights(CastShard cast_shard) {
    copies_ = Fp8WeightCopies::gathered;
    cast_shard_ = std::move(cast_shard);
  }
  // The FP8 linears' weights: (parameter index in the model's layout, state tensor index).
  std::vector<std::pair<int, int>> weights() const;
  // Gathered copies: each FP8 linear's weight8 is where(its weight's parameter index), an FP8
  // tensor of the weight's shape (undefined while its unit is not held); otherwise nothing.
  void point_gathered(const std::function<Tensor(int param)>& where);
  // The ranks the state is agreed over; before plan_agreement().
  void set_ranks(Fp8Ranks ranks) { ranks_ = std::move(ranks); }

  // The state, its window's copy, the weights' FP8 copies and the cast scratch for micro-batch
  // B x T, planned with the activations; planned_bytes() is what that plan holds.
  void plan(const Planner& planner, int B, int T);
  int64_t planned_bytes(int B, int T) const;
  // The buffers of the ranks' agreement check (more than one rank), in `arena`.
  void plan_agreement(Arena& arena);

  // Once the weights are in place: the state of the checkpoint in `dir` (`saved`), or fresh
  // (null: scales 1, empty histories); then the weights' FP8 copies are made. A saved window is
  // dropped: the casts of the weights make it again. InputError naming dir's manifest where the
  // saved state does not fit this run's FP8 layers.
  void start(const Fp8Checkpoint* saved, const std::string& dir);
  // In the step, after the last micro-batch: the windows' amaxes over every rank, new scales.
  void update_scales();
  // In the step, after AdamW has written the working weights: the weights' FP8 copies.
  void cast_weights();
  // A forward that trains nothing (evaluation, sampling) must not move the scales training
  // uses: its casts land in the window, which keep_window() copies aside and restore_window()
  // puts back.
  void keep_window();
  void restore_window();
  // The state for a checkpoint, after checking that every rank's agrees (a difference is a bug,
  // which stops the run: rank 0 alone writes the state). Empty when off.
  Fp8Checkpoint save(int step);

  // The part of the state a step's metrics read back (undefined when off).
  Tensor summary() const;

 private:
  struct Buffers {
    Tensor state, window, weights, scratch[3];
  };
  void plan_into(const Planner& planner, Buffers& into, int B, int T) const;
  // Points each linear's operands at the planned buffers (their addresses exist once the arena
  // is allocated).
  void make_views();
  void check_ranks_agree(const std::vector<float>& state, int step);

  Backend& backend_;
  Fp8Options options_;
  const Params& weights_;
  Fp8StateLayout layout_;
  std::vector<Linear*> linears_;
  std::vector<std::string> names_;  // per state tensor
  // Each FP8 linear's operands, in state order; a deque, so adding one never moves those the
  // linears already point at.
  std::deque<Fp8Linear> ops_;
  Fp8WeightCopies copies_ = Fp8WeightCopies::per_step;
  CastShard cast_shard_;
  Buffers buffers_;
  int B_ = 0, T_ = 0;
  Fp8Ranks ranks_;
  Tensor digest_, digests_;  // this rank's hash of its scaling state, and all ranks'
  bool agreement_logged_ = false;
};

}  // namespace kiln
