// The backend a run computes on (train.device): CUDA where asked or, under auto, where a GPU is
// visible, else the CPU reference. What a device cannot do with the config is refused here,
// before any memory is touched: the CPU computes in fp32 whatever precision.dtype says (and
// says so), CUDA in bf16 only.
#pragma once

#include <memory>

#include "config/config.h"
#include "kernels/backend.h"

namespace kiln {

// `local_rank` picks this process's GPU on its node. InputError naming the key it refuses.
std::unique_ptr<Backend> make_run_backend(const Config& cfg, int local_rank);

// What CUDA refuses in a config, before any GPU is touched (train --plan checks it too):
// InputError naming the key.
void check_cuda_config(const Config& cfg);

}  // namespace kiln
