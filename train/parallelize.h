// The parallel plan (dist/parallel_plan.h) applied to a model from outside it: the model's
// parameters and gradients are pointed at the strategy's buffers (each tensor at its offset
// inside its unit's current place: the full flat buffers, or an FSDP gather slot, re-pointed
// whenever the strategy moves units), the model's unit hooks call the strategy's, and under
// expert parallelism the MoE layers exchange tokens over the expert group while this rank's
// flat buffer holds only its experts (RankLayout). Neither side knows the other's type.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "config/config.h"
#include "state/rank_layout.h"
#include "dist/parallel_plan.h"
#include "dist/strategy.h"
#include "model/model.h"
#include "telemetry/nvtx.h"

namespace kiln {

// Builds this rank's communicator over `group` once the backend exists (NCCL needs its device
// and stream). Every rank of the group calls it, in the same order as its other groups.
using CommunicatorFactory =
    std::function<std::unique_ptr<Communicator>(Backend&, const CommGroup& group)>;

// The run's communicators over the plan's groups. Destroy them before the backend (NCCL works
// on its device).
struct RunCommunicators {
  Communicator* world = nullptr;    // every rank (null for one process)
  Communicator* data = nullptr;     // the data-parallel strategy's group (null for a group of one)
  Communicator* expert = nullptr;   // expert parallelism's group (null without it)
  Communicator* context = nullptr;  // context parallelism's group (null without it)
  std::unique_ptr<Communicator> owned_world, nvtx_world, owned_expert, owned_data, owned_context;
};
// The world's from `make_comm` (none where it is empty: one process), in NVTX ranges where
// `nvtx` is on; under expert parallelism every rank then makes its expert group's, then its
// replicas' (the data group's), in that order; under context parallelism its context group's.
RunCommunicators make_run_communicators(const ParallelPlan& plan, Backend& backend,
                                        const CommunicatorFactory& make_comm, const Nvtx& nvtx);

// `hooks` must outlive the model's use of it (the model keeps a pointer). `local`: the
// strategy's buffers are laid out as this (an expert-parallel rank's, below), which names the
// same tensors as the model's layout; each is found by name.
void parallelize(Model& model, Strategy& strategy, UnitHooks& hooks,
                 const ParamLayout* local = nullptr);

// precision.fp8 on the strategy: under one that never holds the whole model (fsdp) the FP8
// linears' weights are gathered in FP8 with their units (`all_gather`, fp8.all_gather; `local`
// as parallelize's), or else each linear casts its weight where it is used; the ranks' amax
// windows and the checkpoints' agreement check go over `world` (the world's communicator, null
// for one process). `log`: this rank says what the FP8 state finds.
void parallelize_fp8(Model& model, Strategy& strategy, bool all_gather, const ParamLayout* local,
                     Communicator* world, int world_size, bool log);

// The dist section's strategy over the plan's data group (communicator `data`, null for a group
// of one), holding `layout`'s buffer; under expert parallelism the dense parameters are summed
// over the expert group (`ep`) besides. What the strategy needs of the model comes from its
// layout (ParamLayout::last_unit_reads_first, first_unit_rows); `rows_per_micro_batch`: the
// tokens a rank's micro-batch holds.
std::unique_ptr<Strategy> make_run_strategy(const DistSection& dist, Backend& backend,
                                            const ParallelPlan& plan, const RankLayout& layout,
                                            Communicator* data, Communicator* ep,
                                            int64_t rows_per_micro_batch);

// Expert parallelism: the model's MoE layers exchange tokens over `ep`, the communicator of the
// plan's expert group. `log`: say how the experts are spread.
void parallelize_experts(Model& model, const RankLayout& layout, const ParallelPlan& plan,
                         Communicator& ep, bool log);

// Context parallelism: this rank's place in its context group (ranks and rank; no exchanges),
// what the step inputs split the windows by.
ContextParallel context_split(const ParallelPlan& plan);
// The model's attention gathers keys and values over `cp`, the communicator of the plan's
// context group; InputError naming dist.context_parallel for a model it cannot split. `log`:
// say how the sequence is split.
void parallelize_context(Model& model, const ParallelPlan& plan, Communicator& cp, bool log);

}  // namespace kiln
