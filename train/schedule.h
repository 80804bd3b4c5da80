// Learning-rate schedule: linear warmup to optim.lr over warmup_steps, then cosine (or linear)
// decay to optim.min_lr at max_steps, or constant. Steps are 0-based here: step s is the
// (s+1)-th optimizer update, so warmup reaches the full lr on step warmup_steps - 1.
#pragma once

#include "config/config.h"

namespace kiln {

double learning_rate(const OptimSection& optim, int step, int max_steps);

}  // namespace kiln
