// train.cuda_graphs: the step's device work captured once as a CUDA graph after an eager
// warm-up, then replayed every step. The step reads everything that changes per step (batches,
// lr, step number) from device memory, so one capture serves every later step. A capture that
// fails runs that step eagerly from the same state and the run goes on eagerly
// (docs/design.md invariant 6); a replay the backend refuses (its scratch moved) is captured again.
#pragma once

#include <functional>
#include <string>

#include "config/config.h"
#include "kernels/backend.h"

namespace kiln {

class StepGraph {
 public:
  // `step_work` enqueues one step's device work; `forget_placement` makes the next step gather
  // every FSDP unit itself (Strategy::forget_placement), as a capture must record and as eager
  // work after a capture must too.
  StepGraph(Backend& backend, std::function<void()> step_work,
            std::function<void()> forget_placement);
  // Releases the graph (Backend::graph_release): its owner destroys it before the
  // communicators, which otherwise wait for it forever.
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // At the run's start, `start_step` steps in: whether train.cuda_graphs applies (not where the
  // backend says it cannot, nor the model (`model_why_not`: Model::graph_unavailable), nor under
  // data.document_mask on cuDNN), and which step is captured; `log`: this rank speaks.
  void start(const Config& cfg, const std::string& model_why_not, int start_step, bool log);
  // Step `step`'s device work: eager, captured, or replayed.
  void run(int step);
  // What train.cuda_graphs did, for summary.json: off, n/a (why), warm-up only, replayed, or
  // eager after a failed capture (why).
  const std::string& status() const { return status_; }

 private:
  void capture(int step);

  // This many steps run eagerly first (cuDNN plans, GEMM algorithms, the FP8 GEMM trial and the
  // backend's scratch size are settled in them), then one step is captured.
  static constexpr int kWarmupSteps = 2;
  enum class Mode { off, warming, replaying };

  Backend& backend_;
  std::function<void()> step_work_;
  std::function<void()> forget_placement_;
  Mode mode_ = Mode::off;
  int capture_at_ = 0;
  std::string what_;
  bool log_ = false;
  std::string status_ = "off";
};

}  // namespace kiln
