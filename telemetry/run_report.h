// What a run reports, step by step and at its end. A step's numbers: what the step copies back
// to the host (loss, grad norm, the FP8 and MoE summaries), read one step later into StepMetrics
// with the step's time, tok/s, MFU, ETA and power; rank 0's step line (with the highest loss
// and grad norm since the previous line), metrics.jsonl and the TensorBoard events; and the
// rank's own report for the /metrics endpoint. At the end, summary.json: what ran where, the
// device memory's peak (watched at each step), and the stop that ended the run, if one did.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/config.h"
#include "data/loader_state.h"
#include "model/model.h"
#include "telemetry/metrics.h"
#include "telemetry/metrics_channel.h"
#include "telemetry/power.h"
#include "telemetry/run_dir.h"
#include "telemetry/step_timer.h"
#include "telemetry/tensorboard.h"

namespace kiln {

// A step whose work is enqueued and whose loss and grad norm are being read asynchronously.
struct PendingStep {
  using Clock = StepTimer::Clock;
  int step;
  double lr;
  Clock::time_point enqueued;           // when the host began enqueueing it
  Clock::time_point enqueue_end;        // when it was enqueued: a backend without a stream is done
  double data_wait_s;                   // waiting for the loader's batches while enqueueing it
  std::vector<SourcePosition> sources;  // data.sources: the positions after its batches
};

class RunReport {
 public:
  RunReport(const Config& cfg, int rank, int world_size, Backend& backend, const Model& model,
            RunPower& power, int64_t tokens_per_step);
  // At the run's start, `start_step` steps in (`resumed`: from a checkpoint), once the resume
  // is accepted: rank 0 writes config.yaml and opens metrics.jsonl and the TensorBoard events
  // (nothing of the run directory is written before), and the peaks MFU is against are set.
  // MFU is against the bf16 peak, as peers report it, FP8 or not; FP8 runs also report
  // mfu_fp8, against the FP8 peak.
  void start(int start_step, bool resumed);
  double flops_per_token() const { return flops_per_token_; }
  double peak_flops() const { return peak_; }
  double peak_fp8_flops() const { return peak_fp8_; }

  // What the step copies back once its work is enqueued, after its loss sum and grad norm.
  std::vector<Tensor> readback(Tensor loss_sum, Tensor grad_norm) const;
  // Step p's metrics, once its values are on the host.
  StepMetrics read(const PendingStep& p);
  // After host work (eval, checkpoint), which is not the next step's device time.
  void host_work_done() { timer_.host_work_done(); }
  // The device memory in use now, kept if it is the most yet (`planned`: the arenas' bytes,
  // which rank 0's first such line compares it with).
  int64_t watch_memory(int step, size_t planned);
  // Rank 0's step line, every train.log_every steps, at the last and at an evaluation; the
  // steps between lines count towards it.
  void log_line(StepMetrics& sm, size_t planned);
  // Rank 0: the step's line kept for a crash during its checkpoint (MetricsLog::write_pending),
  // then written to metrics.jsonl and TensorBoard.
  void write_pending(const StepMetrics& sm);
  void write(const StepMetrics& sm);
  // The rank's numbers for the /metrics endpoint: step_scalars' and its own ("step",
  // "memory_bytes" where `memory_in_use` is known, "data_wait_s", "gpu_power_w" and
  // "gpu_throttled" where its GPU is read).
  RankReport rank_report(const StepMetrics& sm, const PendingStep& p, int64_t memory_in_use) const;
  // Rank 0: summary.json, for a run that used `memory_bytes` in its arenas, whose CUDA graphs
  // did `cuda_graphs` (StepGraph::status) and which ended at `stop` (null: it finished). First
  // the logs' held lines are written (InputError naming the file if the disk still refuses).
  void write_summary(size_t memory_bytes, const std::string& cuda_graphs,
                     std::optional<double> tokens_per_joule,
                     const StoppedRun* stop = nullptr) const;

 private:
  bool is_main() const { return rank_ == 0; }

  const Config& cfg_;
  int rank_, world_size_;
  Backend& backend_;
  const Model& model_;
  RunPower& power_;
  int64_t tokens_per_step_;
  double peak_ = 0, peak_fp8_ = 0;
  double flops_per_token_ = 0;
  StepTimer timer_;
  int64_t device_peak_ = -1;     // the most memory_in_use() seen at a finished step
  StepMetrics::SinceLine line_;  // the steps since rank 0's previous step line
  std::unique_ptr<MetricsLog> metrics_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;  // rank 0, train.tensorboard
};

}  // namespace kiln
