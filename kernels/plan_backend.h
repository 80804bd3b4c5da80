// A backend that plans and never computes: it answers what the CUDA backend on an sm_90 GPU
// answers about dtypes and capabilities (bf16 activations, FP8, CUTLASS grouped GEMMs, graph
// capture), so a model, a strategy and the FP8 recipe lay out their buffers as they would on that
// GPU, on a machine without one. Allocating, moving data or running an op through it is a
// std::logic_error. `train --plan` (config/plan.h) uses it.
#pragma once

#include <memory>
#include <string>

#include "kernels/backend.h"

namespace kiln {

// `gpu` names the GPU planned for, in name() ("plan for 4 x NVIDIA H100 80GB").
std::unique_ptr<Backend> make_plan_backend(const std::string& gpu);

}  // namespace kiln
