// Trainer: the recipe. Build the backend (train/device.h) and the model (config/model_config.h),
// split the world by the parallel plan and apply it (train/parallelize.h), plan all memory once
// (telemetry/run_log.h prints the table), initialize or resume (state/resume.h), then loop:
// stage the step's inputs (train/step_inputs.h), run its device work eagerly or as a CUDA graph
// (train/step_graph.h): grad_accum micro-steps of forward+backward, gradient sync (the dist
// strategy), FP8 scaling (model/fp8_state.h), global-norm clipping, AdamW; then report the step
// (telemetry/run_report.h), evaluate (train/evaluation.h), sample and checkpoint, keeping the run
// directory (telemetry/run_dir.h); on a stop signal, agree on a step with the other ranks,
// checkpoint there and stop (train/stop.h).
// Everything device-side lives in two arenas allocated before step 0; a step allocates nothing.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "config/config.h"
#include "dist/device_mesh.h"
#include "model/model.h"
#include "telemetry/metrics_channel.h"
#include "train/parallelize.h"

namespace kiln {

// Rank identity of this process; the defaults are a single-process run.
struct RankInfo {
  int rank = 0;
  int local_rank = 0;
  int world_size = 1;
};

// Instrumentation for tools (bench --profile-ops): wrap_backend returns the backend the trainer
// runs on in place of the one it built (which outlives every use of the wrapper); on_step is
// called after each optimizer step, once the step's work is done, with the number of steps done.
// on_progress (the collective watchdog, dist/watchdog.h) is told each finished step without
// making it a host step, and host_work true while the trainer writes a checkpoint after it.
// on_report (train.metrics_port, telemetry/prometheus.h) gets the rank's numbers after each step, once
// they are on the host, without making it a host step: telemetry/metrics.h step_scalars' and the
// rank's own ("step", "memory_bytes" where the backend counts it, "data_wait_s", and where its
// GPU is read "gpu_power_w" and "gpu_throttled"). A non-finite loss is reported before the run
// stops on it.
struct TrainObserver {
  std::function<Backend&(Backend& built)> wrap_backend;
  std::function<void(int steps_done)> on_step;
  std::function<void(int steps_done, bool host_work)> on_progress;
  std::function<void(const RankReport& report)> on_report;
};

class StopAgreement;
// Runs the whole training job described by `config` on this rank. `make_comm` is empty for a
// single process. `stop` (train/stop.h), where given, is polled at each step boundary: on an
// agreed stop every rank saves a checkpoint at the agreed step and returns 128 + the signal.
// Returns the process exit status.
int run_training(const Config& config, const RankInfo& rank, const CommunicatorFactory& make_comm,
                 const TrainObserver* observer = nullptr, StopAgreement* stop = nullptr);

struct PlanTarget;
// `train CONFIG --plan`: rank 0's memory plan for a run of `world_size` ranks, made without a GPU
// (config/plan.h), and whether it fits `target`. Returns the exit status (0 fits, 2 not).
int plan_training(const Config& config, int world_size, const PlanTarget& target);

}  // namespace kiln
