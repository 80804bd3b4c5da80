// What rank 0 says before step 0, beyond each part's own line: the memory plan as a table
// (docs/design.md invariant 3: every buffer planned once, printed before anything is allocated),
// the shape of the MoE blocks, with the active parameters MFU counts, and the FP8 layers; and
// what summary.json says of FP8.
#pragma once

#include <string>

#include "config/config.h"
#include "kernels/arena.h"
#include "model/model.h"

namespace kiln {

// `checkpoint_host_bytes`: the host memory train.checkpoint_async's snapshot takes (0: none).
void log_memory_plan(const Config& cfg, const Backend& backend, const Model& model,
                     const Arena& state, const Arena& acts, int world_size,
                     const RecomputePlan& recompute, size_t checkpoint_host_bytes);

// The run about to start: its steps, the tokens a step and how they are made, the FLOPs a token
// and the peak MFU is against (`peak_flops` 0: not known).
void log_run_start(const Config& cfg, const Backend& backend, int steps, int64_t tokens_per_step,
                   int world_size, double flops_per_token, double peak_flops);

void log_moe(const Config& cfg, const Model& model);

// precision.fp8: how many linear layers run in FP8 and how they scale, and the peak mfu_fp8 is
// against (`peak_fp8` 0: not known). Nothing without FP8 layers.
void log_fp8(const Config& cfg, const Model& model, double peak_fp8);
// What precision.fp8 did, for summary.json: off, on, emulated (the CPU) or the bf16 fallback
// and why.
std::string fp8_status(const Config& cfg, const Backend& backend, const Model& model);

}  // namespace kiln
