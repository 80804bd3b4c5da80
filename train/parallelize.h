// Parallelism applied to a model from outside it: the model's parameters and gradients are
// pointed at the strategy's buffers (each tensor at its offset inside its unit's current place:
// the full flat buffers, or an FSDP gather slot, re-pointed whenever the strategy moves units),
// and the model's unit hooks call the strategy's. Neither side knows the other's type.
#pragma once

#include "dist/strategy.h"
#include "model/model.h"

namespace kiln {

// `hooks` must outlive the model's use of it (the model keeps a pointer).
void parallelize(Model& model, Strategy& strategy, UnitHooks& hooks);

}  // namespace kiln
