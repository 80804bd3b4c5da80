#include "train/step_graph.h"

#include <spdlog/spdlog.h>

#include <exception>
#include <utility>

#include "base/test_faults.h"

namespace kiln {

StepGraph::StepGraph(Backend& backend, std::function<void()> step_work,
                     std::function<void()> forget_placement)
    : backend_(backend),
      step_work_(std::move(step_work)),
      forget_placement_(std::move(forget_placement)) {}

StepGraph::~StepGraph() {
  if (mode_ == Mode::off) return;
  try {
    backend_.graph_release();
  } catch (const std::exception& e) {
    spdlog::warn("train.cuda_graphs: releasing the graph failed: {}", e.what());
  }
}

void StepGraph::start(const Config& cfg, const std::string& model_why_not, int start_step,
                      bool log) {
  if (!cfg.train.cuda_graphs) return;
  const int accum = cfg.train.grad_accum, max_steps = cfg.train.max_steps;
  what_ = std::to_string(accum) + " micro-batch" + (accum > 1 ? "es, " : ", ") + cfg.dist.strategy;
  log_ = log;
  // cuDNN's document-masked attention takes each step's count of documents from the host.
  const bool counted_documents = cfg.data.document_mask && backend_.attention_name() == "cudnn";
  std::string why_not = backend_.graph_unavailable();
  if (why_not.empty())
    why_not = counted_documents
                  ? "data.document_mask on cuDNN: each step's documents are its attention's batch"
                  : model_why_not;
  if (!why_not.empty()) {
    if (log) spdlog::info("train.cuda_graphs: does not apply here ({}); running eagerly", why_not);
    status_ = "n/a: " + why_not;
    return;
  }
  mode_ = Mode::warming;
  capture_at_ = start_step + kWarmupSteps;
  status_ = "not captured: the run ended within the eager warm-up";
  if (!log) return;
  if (capture_at_ >= max_steps)
    spdlog::info(
        "train.cuda_graphs: this run of {} steps ends within the {} eager warm-up "
        "steps; nothing will be captured",
        max_steps - start_step, kWarmupSteps);
  else
    spdlog::info(
        "train.cuda_graphs: {} eager warm-up steps, then step {} is captured as one "
        "CUDA graph and replayed",
        kWarmupSteps, capture_at_ + 1);
}

void StepGraph::run(int step) {
  if (mode_ == Mode::off || step < capture_at_) {
    step_work_();
    return;
  }
  if (mode_ == Mode::replaying) {
    const std::string moved = backend_.graph_replay();
    if (moved.empty()) return;
    if (log_) spdlog::info("train.cuda_graphs: capturing again at step {}: {}", step + 1, moved);
  }
  capture(step);
}

void StepGraph::capture(int step) {
  // The capture records every unit's gather (fsdp), whatever an eval left in place.
  forget_placement_();
  std::string why;
  backend_.capture_begin();
  try {
    step_work_();
    if (test_faults::break_capture()) backend_.synchronize();
  } catch (const std::exception& e) {
    why = e.what();
  }
  const std::string ended = backend_.capture_end();
  if (why.empty()) why = ended;
  if (why.empty()) why = backend_.graph_replay();  // the capture recorded the step; run it
  if (why.empty()) {
    if (mode_ == Mode::warming && log_)
      spdlog::info("train.cuda_graphs: step {} captured ({}); replaying it every step", step + 1,
                   what_);
    mode_ = Mode::replaying;
    status_ = "replayed";
    // What the capture left held (fsdp's prefetch of the next step's first unit) carries marks
    // recorded inside it, which nothing outside the graph may wait on: eager work after it
    // (evaluations) gathers again.
    forget_placement_();
    return;
  }
  // Nothing the capture recorded ran: the step runs now, eagerly, from the same state.
  mode_ = Mode::off;
  status_ = "eager: capture failed: " + why;
  forget_placement_();
  if (log_)
    spdlog::warn(
        "train.cuda_graphs: step {} could not be captured ({}); running eagerly from "
        "here on",
        step + 1, why);
  step_work_();
}

}  // namespace kiln
