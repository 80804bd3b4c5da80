// A data-parallel strategy (dist.strategy): where one rank's parameters, gradients and AdamW
// state live, and how they are kept in step across ranks. A strategy sees the parameters only as
// the flat buffer and its units (ranges); the trainer points the model at unit_params() and
// unit_grads(), wires the model's unit hooks to before_forward / before_backward /
// after_backward, and runs the step as the recipe reads:
//
//   zero_grads();  for each micro-batch { set_micro_batch(); forward; backward }
//   reduce_grads(sumsq);  clip_and_adamw(shard(), owned ranges);  after_update();
//
//  - ddp.cpp:   replicated state; gradients all-reduced in buckets as units finish backward.
//  - zero1.cpp: full working params and grads; gradients reduce-scattered, each rank updates
//               its chunk, updated params all-gathered.
//  - fsdp.cpp:  only shards persist; a unit's params are gathered just before use (one unit
//               ahead), its grads reduce-scattered right after its backward.
// dist.reduce_dtype=bf16 sums gradients across ranks in bf16: each rank rounds its f32
// gradients to bf16 (a cast into a buffer of their own) just before the collective, and the
// summed result is widened back to f32 for the norm and AdamW. Accumulation stays f32.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dist/communicator.h"
#include "dist/device_mesh.h"
#include "dist/sharding.h"
#include "kernels/arena.h"

namespace kiln {

// One rank's optimizer state over its shard: f32 master weights, gradients and moments, and
// the working copy (activation dtype) the optimizer writes, undefined where the master is the
// working copy (the CPU). m holds every owned element's first moment (Muon's momentum where
// Muon updates it); v the second moment of the elements AdamW updates alone
// (Strategy::adamw_pieces says where).
struct ParamShard {
  Tensor master, grads, m, v, working;
};

// An owned run of elements AdamW updates: global [begin, begin + n) of the buffer, at `local` in
// the shard's master, grads and m, and at `v_local` in its v.
struct AdamWPiece {
  int64_t begin, local, v_local, n;
};

struct StrategyOptions {
  std::string name = "ddp";  // ddp | zero1 | fsdp
  double bucket_mb = 0;      // ddp: 0 = by the link between the ranks
  DType reduce_dtype = DType::f32;
  // Facts of the buffer besides its units, which the model states in its layout
  // (ParamLayout::last_unit_reads_first, first_unit_rows) so that dist knows no tensor:
  // The last unit reads unit 0's parameters too (a head tied to the token table). fsdp keeps
  // unit 0 gathered for the whole step then; otherwise the last unit takes its slot in turn.
  bool last_unit_reads_first = true;
  // Unit 0 is one table of this many rows (0: it is not), and each micro-batch's backward
  // scatters this many rows of gradient into it on each rank: what decides fsdp's sparse
  // gradient of the table (scatter_first_unit).
  int64_t first_unit_rows = 0;
  int64_t rows_per_micro_batch = 0;
};

class Strategy {
 public:
  using Units = std::vector<std::pair<int64_t, int64_t>>;
  Strategy(const StrategyOptions& options, Backend& backend, Communicator* comm, int rank,
           int world, int64_t total, const Units& units);
  virtual ~Strategy() = default;
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  const ShardPlan& plan() const { return plan_; }
  const Units& units() const { return units_; }
  // optim.name=muon, before plan_memory: the buffer's ranges of one moment (Muon's momentum, in
  // m) and no second: v holds only the rest, what adamw_pieces() lists.
  void keep_one_moment(const Units& ranges);
  const std::vector<AdamWPiece>& adamw_pieces() const { return adamw_pieces_; }
  // Before plan_memory: the buffer's ranges (sorted, disjoint) that the forward reads in f32
  // rather than the working dtype (norm gains and biases, model/param_layout.h's f32_read).
  // Every rank holds them whole: views of the master where it is whole (ddp, a world of one),
  // else a copy that after_update fills from the ranks' shards.
  void read_in_f32(const Units& ranges);
  // The f32 parameters [begin, begin + numel(shape)) of the buffer, inside one of those ranges.
  Tensor f32_params(int64_t begin, const Shape& shape) const;
  // Plans every parameter/gradient/optimizer buffer into `arena`; bind() after it is allocated.
  virtual void plan_memory(Arena& arena) = 0;
  virtual void bind() {}

  // Where unit u's working parameters and f32 gradients are now: the unit's range of the full
  // buffers, or of an FSDP gather slot; undefined while the unit is not held.
  virtual Tensor unit_params(int unit) const = 0;
  virtual Tensor unit_grads(int unit) const = 0;

  // precision.fp8 with fp8.all_gather, before plan_memory, under a strategy that gathers units
  // (fsdp; the others throw std::logic_error): the flat buffer's ranges [begin, end) that FP8
  // linears' weights hold, each with its FP8 state tensor. Their units are then gathered as FP8
  // bytes (unit_fp8) cast from each rank's shard (cast_fp8_shard), and the rest of each such
  // unit in the working dtype into unit_params, where the FP8 ranges are left stale.
  struct Fp8Range {
    int64_t begin, end;
    int index;
  };
  virtual void gather_in_fp8(const std::vector<Fp8Range>& ranges);
  // Where unit u's FP8 bytes are now, laid out like the unit (undefined while it is not held, or
  // holds no FP8 range).
  virtual Tensor unit_fp8(int /*unit*/) const { return Tensor{}; }
  // This rank's shard of the FP8 ranges cast with `state`'s current scales, for the gathers to
  // read: once the working shard holds the step's weights (after_update) and the scales are set.
  virtual void cast_fp8_shard(Tensor /*state*/, const Fp8StateLayout& /*layout*/) {}
  // Called when the placement of units changes (FSDP), so the caller points the model again.
  std::function<void()> on_placement_changed;

  // Unit hooks: the model calls them at unit boundaries (model/model.h's UnitHooks).
  virtual void before_forward(int /*unit*/) {}
  virtual void before_backward(int /*unit*/) {}
  virtual void after_backward(int /*unit*/) {}
  // Unit 0's gradient, where it is a table of rows, in the strategy's hands: `grads` [N, width]
  // scattered into the rows `rows` (i32[N]) name (UnitHooks::embedding_backward). False leaves
  // it to the model.
  virtual bool scatter_first_unit(Tensor /*grads*/, Tensor /*rows*/) { return false; }
  // Whether the unit's gradients are stale when its backward starts (UnitHooks::grads_fresh):
  // the model then writes them instead of adding to them.
  virtual bool grads_fresh(int /*unit*/) const { return false; }

  virtual void zero_grads() = 0;
  void set_micro_batch(int micro, int grad_accum) {
    micro_ = micro;
    last_micro_ = micro + 1 == grad_accum;
  }
  // After the last micro-batch: the gradient summed over ranks lands in shard().grads, and
  // sumsq (f32[1]) holds the GLOBAL sum of its squares.
  virtual void reduce_grads(Tensor sumsq) = 0;
  // The shard AdamW updates (over plan().owned).
  ParamShard shard() const { return {master_, grad_shard_, m_, v_, working_out()}; }
  // After AdamW: the updated parameters where the next forward reads them.
  virtual void after_update() = 0;
  // Before a step is captured as a CUDA graph, after a capture is abandoned (none of its work
  // ran), and after one succeeds (its collectives' marks exist only inside the graph): forget
  // which units' parameters are held, so the next step gathers every unit itself.
  virtual void forget_placement() {}

  // A sum the gradient takes beyond the strategy's own group (dist/device_mesh.h), once that
  // group's reduction is done and before the norm. Before plan_memory, once per group:
  //  - `summed`: the buffer's ranges of which each rank of `group` holds a part of the gradient
  //    (a tensor group's replicated tensors, each rank's from its tokens; an expert group's dense
  //    parameters; a replica group's everything, HSDP), summed over it; each is then the same
  //    on every rank of the group and the norm counts it once;
  //  - the rest are distinct on each rank of `group` (a tensor group's shards, an expert group's
  //    experts), and the norm adds every rank's.
  // `group` is null for a group of one (nothing to sum).
  void reduce_over(Communicator* group, const Units& summed);

  // This rank's master weights from `fill`, called once per owned range [begin, end) of the
  // flat buffer with a zeroed host f32 buffer of end - begin values; moments zero. A rank never
  // needs the whole model on the host.
  using FillRange = std::function<void(int64_t begin, int64_t end, float* out)>;
  void load_parameters(const FillRange& fill);
  // State in and out: host f32 ranges of the global buffer, one owned range at a time (v read
  // as 0 where only m is kept).
  void load_range(const OwnedRange& o, const float* master, const float* m, const float* v);
  void read_range(const OwnedRange& o, float* master, float* m, float* v);
  // After the master weights change outside an optimizer step: the working copies follow.
  virtual void refresh_working() = 0;
  // Every rank holds the same whole state (ddp): one rank writes it to a checkpoint.
  virtual bool replicated() const { return false; }
  // Weights in the working dtype for sampling; undefined under fsdp (never held whole).
  virtual Tensor full_working() const { return Tensor{}; }
  // Whether a rank ever holds every unit's working parameters at once (fsdp never does: it
  // gathers a unit at a time), so whatever is kept per weight (FP8 copies) can be kept whole.
  virtual bool holds_whole_model() const { return true; }

 protected:
  bool reduce_bf16() const { return reduce_dtype_ == DType::bf16 && plan_.world > 1; }
  // What AdamW writes the updated weights into besides the master (undefined: nothing).
  virtual Tensor working_out() const = 0;
  void all_reduce(Tensor t);
  void all_gather(Tensor out, Tensor in, bool overlap = false);
  void reduce_scatter(Tensor out, Tensor in);
  // out (f32 shard) = sum over ranks of chunk `rank` of in (f32), in the reduce dtype;
  // `accumulate`: out += instead, through `scratch` (f32, at least out's size).
  void reduce_scatter_grads(Tensor out, Tensor in, bool accumulate, Tensor scratch) {
    issue_scatter_grads(out, in, accumulate, scratch);
    finish_scatter_grads();
  }
  // The same in two halves, so that the reduce-scatter runs on beside the compute enqueued
  // between them: issue_... enqueues it (in, scratch and the bf16 buffers stay in use); finish_...
  // orders the compute stream after it and enqueues what consumes its result (no-op when none
  // is pending). One may be pending at a time: issue_... finishes the one before first.
  // `clear` (optional, holding `in`) is zeroed once the reduce-scatter has read it, on the comm
  // stream, and finish_... orders the compute stream after that too.
  void issue_scatter_grads(Tensor out, Tensor in, bool accumulate, Tensor scratch,
                           Tensor clear = Tensor{});
  void finish_scatter_grads();
  // Unit `unit`'s range of a buffer laid out like the flat parameters.
  Tensor unit_range(Tensor flat, int unit) const {
    const auto& [begin, end] = units_[static_cast<size_t>(unit)];
    return flat.slice(begin, {end - begin});
  }
  // The shard buffers every strategy has: master, grad shard and moments (ddp: everything),
  // and the whole copy of read_in_f32's ranges where the master is not whole.
  void plan_shard(Arena& arena, bool sharded);
  // Sharded strategies, in after_update: that copy from the updated shards (one all-reduce of
  // the copy, each rank's owned pieces in place and zeros elsewhere: the sum is exact).
  void refresh_f32_reads();
  // sumsq (f32[1]) = the squared norm of the whole gradient, from the reduced grad shard, which
  // each rank holds a part of (`sharded`: summed over comm_) or all of; first the sums over the
  // groups reduce_over named.
  void finish_reduce(Tensor sumsq, bool sharded);

  Backend& backend_;
  Communicator* comm_;
  ShardPlan plan_;
  Units units_;
  DType reduce_dtype_;
  int micro_ = 0;
  bool last_micro_ = true;
  Tensor master_, grad_shard_, m_, v_;
  std::vector<AdamWPiece> adamw_pieces_;  // every owned element unless keep_one_moment
  // read_in_f32: each range with its offset in f32_copy_, and the owned pieces refresh_f32_reads
  // copies (offset in the copy, offset in the shard, size).
  struct F32Range {
    int64_t begin, end, at;
  };
  std::vector<F32Range> f32_ranges_;
  std::vector<std::array<int64_t, 3>> f32_pieces_;
  Tensor f32_copy_;
  int64_t v_size_ = 0;
  Tensor reduce_full_, reduce_shard_;  // reduce_dtype bf16: the rounded gradients and a shard
  struct PendingScatter {
    Tensor out, sum, low_out;  // low_out defined: reduced in bf16, copied into sum
    bool accumulate = false;
    uint64_t mark = 0;
  };
  std::optional<PendingScatter> pending_scatter_;
  // reduce_over's groups, each with this rank's shard pieces (offset, size) it sums; and the
  // norm's classes: class c holds the shard's pieces distinct over the groups of c's bits (bit
  // g: group g) and summed over the others, its sum of squares summed over each group of its
  // bits. Every class exists on every rank (maybe empty), so the ranks' collectives match.
  using Pieces = std::vector<std::pair<int64_t, int64_t>>;
  struct ExtraSum {
    Communicator* comm;
    Pieces summed;
  };
  std::vector<ExtraSum> extra_;
  std::vector<Pieces> norm_classes_;       // 2^groups, by class
  Tensor class_sumsq_, class_scratch_;      // f32[2^groups]
};

// The strategy over `group`, the device mesh's data group (dist/device_mesh.h), whose
// communicator is `comm` (null for a group of one). Throws std::invalid_argument for an unknown
// strategy name.
std::unique_ptr<Strategy> make_strategy(const StrategyOptions& options, Backend& backend,
                                        Communicator* comm, const CommGroup& group, int64_t total,
                                        const Strategy::Units& units);

}  // namespace kiln
