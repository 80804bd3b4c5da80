// `train CONFIG --plan`: each rank's memory for a run of N ranks, laid out by the same code that
// lays out a real run (a model, strategy and FP8 recipe on a backend that plans as CUDA does,
// kernels/plan_backend.h), printed without a GPU and without starting the run, with a verdict:
// fits in the GPU's memory (exit 0) or not (exit 2, naming the largest buffers and the keys that
// would shrink them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "config/config.h"
#include "kernels/arena.h"
#include "model/model.h"

namespace kiln {

struct PlanTarget {
  std::string gpu;   // what the plan is for: "NVIDIA H100 80GB HBM3", "80 GiB"
  size_t bytes = 0;  // its memory
  int gpus_per_node = 1;  // --nproc-per-node: how far a tensor group may reach on NVLink
};

// --plan-gpu-memory's value: a size with its unit ("80GiB", "141GB", "81559MiB") or a GPU name
// (h100, h200, a100, a100-40gb, l40s, b200). Empty: GPU 0's memory where one is visible, else an
// H100 80GB. InputError naming the flag for anything else.
PlanTarget plan_target(const std::string& text);

// What a CUDA rank holds beyond its two arenas: the CUDA context, cuBLASLt's workspace, the
// backend's scratch, cuDNN's and NCCL's buffers (docs/distributed.md), and under
// precision.deterministic cuDNN's attention workspace.
size_t plan_overhead_bytes(const Config& cfg, int world_size);

// precision.deterministic's attention workspace (cuDNN's dS), 0 when off.
size_t deterministic_attention_bytes(const Config& cfg);

// The verdict after the plan's table (telemetry/run_log.h) was printed: the total a rank needs
// against `target`; where it fits with memory to spare, the most train.recompute_kept_blocks
// that would still fit; where it does not fit, why on one line, with the fewer kept blocks or
// the fewest train.recompute_full_blocks that would fit where some would (`activation_bytes`:
// the model's activations under a recompute plan). Returns the exit status (0 / 2).
int report_plan(const Config& cfg, const Arena& state, const Arena& acts, int world_size,
                const PlanTarget& target,
                const std::function<int64_t(const RecomputePlan&)>& activation_bytes);

}  // namespace kiln
