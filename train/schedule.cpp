#include "train/schedule.h"

#include <algorithm>
#include <cmath>

namespace kiln {

double learning_rate(const OptimSection& optim, int step, int max_steps) {
  if (step < optim.warmup_steps)
    return optim.lr * static_cast<double>(step + 1) / static_cast<double>(optim.warmup_steps);
  if (optim.schedule == "constant" || max_steps <= optim.warmup_steps) return optim.lr;
  const double progress = std::min(
      1.0, static_cast<double>(step - optim.warmup_steps) / (max_steps - optim.warmup_steps));
  const double coeff =
      optim.schedule == "linear" ? 1.0 - progress : 0.5 * (1.0 + std::cos(M_PI * progress));
  return optim.min_lr + coeff * (optim.lr - optim.min_lr);
}

}  // namespace kiln
