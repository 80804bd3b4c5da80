// The optimizer step, once for every strategy and for the tests: global-norm gradient clipping
// and AdamW over a rank's flat shard of the parameters. Every scalar that changes per step (lr,
// step, the clip factor) goes through the backend's sched tensor, so the step reads them from
// device memory. The caller brings sumsq, the GLOBAL sum of squares of the gradient as it stands
// (a sharded strategy all-reduces its shards' sums first).
#pragma once

#include <memory>
#include <vector>

#include "config/config.h"
#include "dist/sharding.h"
#include "dist/strategy.h"
#include "kernels/arena.h"
#include "kernels/backend.h"
#include "model/param_layout.h"
#include "telemetry/nvtx.h"
#include "train/muon.h"

namespace kiln {

// What stays the same from step to step; lr and the step number are read from sched, which the
// caller fills first (Backend::set_schedule, or the trainer's staged upload), so that a captured
// step replays with fresh values.
struct OptimizerStep {
  float grad_clip = 0;  // max global norm (0: no clipping)
  // 1/world: each rank's loss is the mean over its own tokens, so the summed gradient becomes
  // the mean; applied with the clip factor, not as a pass over the gradients.
  float grad_scale = 1;
  AdamWHyper hyper;
};
// The optim section's clip and AdamW hyperparameters, the gradient averaged over `world` ranks.
OptimizerStep optimizer_step(const OptimSection& optim, int world);

// Clips by the global norm (sched[kSchedGradNorm] gets it) and applies AdamW to each piece of the
// shard (Strategy::adamw_pieces) with sched[kSchedLr] and sched[kSchedStep]; decay_spans:
// i64[S,2] of global offsets where weight decay applies.
void clip_and_adamw(Backend& k, const ParamShard& shard, const std::vector<AdamWPiece>& pieces,
                    Tensor sched, Tensor sumsq, Tensor decay_spans, const OptimizerStep& s);

// A run's optimizer: the state it keeps besides the strategy's shard (the schedule's scalars, the
// gradient's global sum of squares, the weight-decay spans of the rank's buffer, Muon's buffers),
// planned into the run's state arena, and its step over the strategy.
class Optimizer {
 public:
  // `gradient_ranks`: the ranks whose gradients are averaged (docs: OptimizerStep::grad_scale).
  Optimizer(const OptimSection& optim, int gradient_ranks)
      : optim_(optim), step_(optimizer_step(optim, gradient_ranks)) {}
  // Once the strategy exists, before plan(): optim.name=muon takes the hidden matrices of
  // `local` (the strategy's buffer) from AdamW, over the strategy's group (`data`, its
  // communicator) and the tensor group (`tensor`; each null for a group of one), and the
  // strategy keeps one moment for them. `log`: say so.
  void attach(const ParamLayout& local, Strategy& strategy, Communicator* data,
              Communicator* tensor, bool log);
  const Muon* muon() const { return muon_.get(); }
  // The state, for a rank whose buffer is laid out as `local`.
  void plan(Arena& arena, const ParamLayout& local);
  // Once the arena is allocated: the decay spans into device memory.
  void upload(Backend& k, const ParamLayout& local);
  // f32[kSchedSize]: lr and step in (staged each step), the grad norm out.
  Tensor sched() const { return sched_; }
  // After the last micro-batch's backward: the strategy's reduction, clipping, AdamW and Muon
  // (the NVTX range "optimizer"), and the updated parameters where the next forward reads them.
  void step(Backend& k, Strategy& strategy, const Nvtx& nvtx);

 private:
  OptimSection optim_;
  OptimizerStep step_;
  std::unique_ptr<Muon> muon_;
  Tensor decay_spans_, sched_, sumsq_;
};

}  // namespace kiln
