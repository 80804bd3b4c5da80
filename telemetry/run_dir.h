// The run directory (train.out_dir) as rank 0 keeps it: the resolved config.yaml, metrics.jsonl
// (one JSON object a step, reading as one run across resumes, and an event line for each
// supervised restart), and summary.json at the end (what ran where, for tools such as bench that
// read a finished run, and the restarts; a run stopped by a signal says so:
// "stopped":{"signal":"SIGTERM","step":S,"checkpoint":true}). Checkpoints live below it too
// (state/checkpoint.h).
//
// A restart's line has no "step" (readers of steps skip it) and survives the cut of a resume:
// {"event":"restart","restart":1,"cause":"node 0: rank 1 (pid 4242) was killed by signal 9
// (Killed)","resumed_from_step":4}. The launcher hands each generation its restarts
// (KILN_RESTARTS, dist/launcher.h); its rank 0 writes the lines the file does not hold yet.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/config.h"
#include "telemetry/metrics.h"

namespace kiln {

// InputError naming train.out_dir where it cannot be created (a path under a regular file, a
// folder not writable); creates nothing.
void check_run_dir(const Config& config);
// Creates out_dir and writes the resolved config into it (only if it changed). InputError where
// it cannot. Called once a resume is accepted (RunReport::start): a refused one leaves
// config.yaml saying what the checkpoint was trained with.
void create_run_dir(const Config& config);

// out_dir/metrics.jsonl opened for this run. A resumed run (`resumed_at`, the checkpoint's
// step) drops the step lines past that step; a fresh run in a used out_dir moves an earlier
// run's metrics, checkpoints and TensorBoard events aside (their checkpoints would otherwise
// look newer than ours to pruning and to resume), except in a restarted generation, which is
// the same run begun again at step 0. Then the restart lines of this process's generation are
// written.
std::unique_ptr<MetricsLog> open_metrics(const std::string& out_dir, std::optional<int> resumed_at);

// The restarts recorded in out_dir/metrics.jsonl, each as a JSON object ({"restart":1,...}).
std::vector<std::string> recorded_restarts(const std::string& out_dir);

// The git commit this binary was built from ("26cfa85", "26cfa85-dirty" with uncommitted
// changes; generated at build time by cmake/build_commit.cmake).
const char* build_commit();

// A run stopped by a signal before train.max_steps (train/stop.h): the signal's name and the
// step every rank saved and stopped at.
struct StoppedRun {
  std::string signal;
  int step = 0;
};

// summary.json's fields: what ran where, and which optimizations ran (fallbacks included).
struct RunSummary {
  std::string backend, attention;
  int64_t params = 0;
  size_t memory_bytes = 0;
  int64_t tokens_per_step = 0;
  int world_size = 1;
  std::string strategy, reduce_dtype;
  bool prefetch = true;
  std::string cuda_graphs, fp8;  // StepGraph::status, fp8_status (telemetry/run_log.h)
  double peak_flops = 0;         // 0: not known (no MFU), and absent from the file
  std::optional<double> tokens_per_joule;
  int64_t device_memory_bytes = -1;  // the most memory_in_use() seen; -1: not known (the CPU)
  // A run stopped by a signal before train.max_steps (train/stop.h): which, at which step, and
  // whether a checkpoint was saved there. Empty: the run finished.
  std::string stop_signal;
  int stopped_at_step = 0;
  bool stop_checkpoint = false;
};
void write_summary(const std::string& out_dir, const RunSummary& s);

}  // namespace kiln
