// precision.fp8's delayed scaling as a run drives it. The model's FP8 linears own the state
// (scales, amax histories and the step's amax windows, kernels/fp8.h) at a fixed address; this
// unit is the one place the trainer reaches it, at four moments:
//  - start: fresh scaling, or a checkpoint's state (refused where it does not fit the run);
//  - each step: the ranks' amax windows agreed by one MAX all-reduce so that every rank
//    quantizes alike, the new scales, and after AdamW the weights' FP8 copies;
//  - each checkpoint: the state saved (rank 0 writes it), and the ranks checked to agree;
//  - each step's metrics: the tensor nearest saturation, and MFU against the FP8 peak.
// With FP8 off (or fallen back to bf16) every call does nothing.
#pragma once

#include <optional>
#include <string>

#include "dist/communicator.h"
#include "model/model.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/metrics.h"

namespace kiln {

class Fp8Recipe {
 public:
  // `comm` spans the world (null for one process). `whole_model_held`: the strategy keeps every
  // weight's working copy (Strategy::holds_whole_model), so the FP8 copies are kept too; else
  // each FP8 linear casts its weight where it is used.
  Fp8Recipe(Model& model, Backend& backend, Communicator* comm, int world, bool is_main,
            bool whole_model_held);
  bool on() const { return model_.fp8_layout().n > 0; }

  // The buffers of the ranks' agreement check, in the state arena.
  void plan(Arena& arena);
  // Once the weights are in place: the state of the checkpoint in `dir` (`saved`), or fresh.
  void start(const TrainingState* saved, const std::string& dir);
  // In the step, after the last micro-batch: the windows' amaxes over every rank, new scales.
  void update_scales();
  // In the step, after AdamW has written the working weights.
  void cast_weights() { model_.fp8_cast_weights(); }
  // The state into a checkpoint's `state`, after checking that every rank's agrees.
  void save(TrainingState& state, int step);

  // The part of the state a step's metrics read back (undefined when off).
  Tensor summary() const;
  // The step's FP8 metrics from the read-back summary.
  StepMetrics::Fp8 metrics(const float* summary, double tok_s, double flops_per_token,
                           double peak_fp8, int step) const;
  // What the run says about FP8 before step 0, and what summary.json records.
  void log_plan(const Config& cfg, bool moe, double peak_fp8) const;
  std::string status(const Config& cfg) const;

 private:
  // Rank 0 alone writes the state: a difference between the ranks is a bug, which stops the run.
  void check_ranks_agree(const std::vector<float>& state, int step);

  Model& model_;
  Backend& backend_;
  Communicator* comm_;
  int world_;
  bool is_main_;
  Tensor digest_, digests_;  // this rank's hash of its scaling state, and all ranks'
  bool agreement_logged_ = false;
};

}  // namespace kiln
