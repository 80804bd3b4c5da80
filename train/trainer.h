// Trainer: the recipe. Build the backend and model, plan all memory once (printing the table),
// initialize or resume, then loop: grad_accum micro-steps of forward+backward, gradient sync
// (the dist strategy), global-norm clipping, AdamW; log every step, evaluate, checkpoint.
// Everything device-side lives in two arenas allocated before step 0; a step allocates nothing.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "model/model.h"
#include "train/config.h"

namespace kiln {

class Backend;
class Communicator;
// The ranks a communicator spans: this rank's place among them, their number, and a name
// unique among the run's groups ("" for the world; dist.expert_parallel's are "ep<g>").
struct CommGroup {
  int rank = 0, size = 1;
  std::string name;
};
// Builds this rank's communicator over `group` once the backend exists (NCCL needs its device
// and stream). Every rank of the group calls it, in the same order as its other groups.
using CommunicatorFactory =
    std::function<std::unique_ptr<Communicator>(Backend&, const CommGroup& group)>;

// Rank identity of this process; the defaults are a single-process run.
struct RankInfo {
  int rank = 0;
  int local_rank = 0;
  int world_size = 1;
};

ModelConfig model_config(const ModelSection& model);
// With the moe section's MoE blocks (the one-argument form builds a dense model).
ModelConfig model_config(const ModelSection& model, const MoeSection& moe);

// Instrumentation for tools (bench --profile-ops): wrap_backend returns the backend the trainer
// runs on in place of the one it built (which outlives every use of the wrapper); on_step is
// called after each optimizer step, once the step's work is done, with the number of steps done.
struct TrainObserver {
  std::function<Backend&(Backend& built)> wrap_backend;
  std::function<void(int steps_done)> on_step;
};

// Runs the whole training job described by `config` on this rank. `make_comm` is empty for a
// single process. Returns the process exit status.
int run_training(const Config& config, const RankInfo& rank, const CommunicatorFactory& make_comm,
                 const TrainObserver* observer = nullptr);

}  // namespace kiln
