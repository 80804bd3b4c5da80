// train.eval_every's validation loss: the mean loss of train.eval_steps batches of data.val or,
// with data.sources, of each source that has a val glob, and the sources' losses' mean weighted
// by their weights. Each rank evaluates its own windows in forward passes that train nothing
// (the FP8 scales stay as they were), and the losses are summed over the ranks. Ranks that
// share sequences (context parallelism) read the same windows, each its rows.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "data/loader.h"
#include "dist/device_mesh.h"
#include "model/model.h"
#include "telemetry/metrics.h"
#include "telemetry/nvtx.h"
#include "train/step_inputs.h"

namespace kiln {

class Evaluation {
 public:
  // Opens the val loaders the data section names for this rank (none when train.eval_every is
  // 0); a glob it cannot read is an InputError naming its key. A batch goes through `inputs`'
  // micro-batch 0, its losses are summed into `loss_sum` (planned later, read at each run),
  // and `sum_over_ranks` sums that over the ranks.
  Evaluation(const Config& cfg, const DeviceMesh& mesh, Backend& backend, Model& model,
             StepInputs& inputs, const Tensor& loss_sum, Nvtx& nvtx,
             std::function<void(Tensor)> sum_over_ranks);
  bool on() const { return !loaders_.empty(); }
  // Whether finishing `step` (1-based) evaluates: every train.eval_every steps, and the last.
  bool due(int step) const {
    return on() && (step % cfg_.train.eval_every == 0 || step == cfg_.train.max_steps);
  }
  // Evaluates into sm.val_loss (and, with data.sources, sm.source_val_loss).
  void run(StepMetrics& sm);

 private:
  double mean_loss(DataLoader& loader);

  // data.val's loader, or with data.sources one per source that has a val glob.
  struct ValLoader {
    std::string source;  // "" for data.val
    double weight = 1;
    std::unique_ptr<DataLoader> loader;
  };
  const Config& cfg_;
  // The ranks whose losses are of distinct tokens: every rank of a tensor group reports its slice
  // of their rows (Model::losses).
  int token_ranks_;
  int rows_;  // of each window, on this rank
  Backend& backend_;
  Model& model_;
  StepInputs& inputs_;
  const Tensor& loss_sum_;
  Nvtx& nvtx_;
  std::function<void(Tensor)> sum_over_ranks_;
  std::vector<ValLoader> loaders_;
};

}  // namespace kiln
