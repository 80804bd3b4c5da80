// The run's model from its config, in one place: the model and moe sections are the model's own
// config (Config::model), and model_config() adds what the other sections derive on a backend
// (the residual stream's dtype from precision.residual, FP8 from precision.fp8 and the fp8
// section), and recompute_plan() train.recompute, the one model choice outside them.
#pragma once

#include <string>

#include "config/config.h"
#include "model/model.h"

namespace kiln {

// The run's model: the model section with the precision section applied on `backend`, the
// residual stream's dtype and FP8 where the backend can run it (Hopper and newer run the FP8
// GEMMs, the CPU emulates them, for tests; an older GPU says why and runs bf16). `log`: say so.
ModelConfig model_config(const Config& config, const Backend& backend, bool log);

// train.recompute, train.recompute_full_blocks and train.recompute_kept_blocks for a model of
// n_layer blocks: which activations backward computes again.
RecomputePlan recompute_plan(const TrainSection& train, int n_layer);

}  // namespace kiln
