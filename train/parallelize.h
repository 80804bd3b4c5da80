// The device mesh (dist/device_mesh.h) applied to a model from outside it: the model's
// parameters and gradients are pointed at the strategy's buffers (each tensor at its offset
// inside its unit's current place: the full flat buffers, or an FSDP gather slot, re-pointed
// whenever the strategy moves units), the model's unit hooks call the strategy's, and the model's
// layers exchange over the mesh's groups: experts' tokens over the expert group, keys and values
// over the context group, activations over the tensor group, while this rank's flat buffer holds
// only its part of the parameters (RankLayout). Neither side knows the other's type.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "config/config.h"
#include "state/rank_layout.h"
#include "dist/device_mesh.h"
#include "dist/strategy.h"
#include "model/model.h"
#include "telemetry/nvtx.h"

namespace kiln {

// The dist section's axes.
MeshShape mesh_shape(const DistSection& dist);

// Builds this rank's communicator over `group` once the backend exists (NCCL needs its device
// and stream). Every rank of the group calls it, in the same order as its other groups.
using CommunicatorFactory =
    std::function<std::unique_ptr<Communicator>(Backend&, const CommGroup& group)>;

// The run's communicators over the mesh's groups, each null for a group of one. Destroy them
// before the backend (NCCL works on its device).
struct RunCommunicators {
  Communicator* world = nullptr;      // every rank (null for one process)
  Communicator* data = nullptr;       // the strategy's group (the world's where it is the world)
  Communicator* tensor = nullptr;     // tensor parallelism's
  Communicator* context = nullptr;    // context parallelism's
  Communicator* expert = nullptr;     // expert parallelism's
  Communicator* replicate = nullptr;  // the replicas' (HSDP)
  std::unique_ptr<Communicator> owned_world, nvtx_world;
  std::vector<std::unique_ptr<Communicator>> owned;
};
// The world's from `make_comm` (none where it is empty: one process), in NVTX ranges where
// `nvtx` is on; then every rank makes its groups of more than one rank, in one order: tensor,
// context, expert, data, replicate.
RunCommunicators make_run_communicators(const DeviceMesh& mesh, Backend& backend,
                                        const CommunicatorFactory& make_comm, const Nvtx& nvtx);

// `hooks` must outlive the model's use of it (the model keeps a pointer). `local`: the
// strategy's buffers are laid out as this (an expert-parallel rank's, below), which names the
// same tensors as the model's layout; each is found by name.
void parallelize(Model& model, Strategy& strategy, UnitHooks& hooks,
                 const ParamLayout* local = nullptr);
// Where the forward reads each parameter now (`local` as parallelize's): its unit's working
// copy, or the strategy's f32 copy for a tensor read in f32 (ParamInfo::f32_read). What
// parallelize binds, and what sampling reads.
Locate weight_locator(const Strategy& strategy, const ParamLayout* local = nullptr);

// precision.fp8 on the strategy: under one that never holds the whole model (fsdp) the FP8
// linears' weights are gathered in FP8 with their units (`all_gather`, fp8.all_gather; `local`
// as parallelize's), or else each linear casts its weight where it is used; the ranks' amax
// windows and the checkpoints' agreement check go over `world` (the world's communicator, null
// for one process). `log`: this rank says what the FP8 state finds.
void parallelize_fp8(Model& model, Strategy& strategy, bool all_gather, const ParamLayout* local,
                     Communicator* world, int world_size, bool log);

// The dist section's strategy over the mesh's data group, holding `layout`'s buffer, and the
// sums beyond that group (Strategy::reduce_over): over the tensor group the tensors it does not
// split, over the expert group the dense parameters, over the replicas everything. What the
// strategy needs of the model comes from its layout (ParamLayout::last_unit_reads_first,
// first_unit_rows); `rows_per_micro_batch`: the tokens a rank's micro-batch holds.
std::unique_ptr<Strategy> make_run_strategy(const DistSection& dist, Backend& backend,
                                            const DeviceMesh& mesh, const RankLayout& layout,
                                            const RunCommunicators& comms,
                                            int64_t rows_per_micro_batch);

// Expert parallelism: the model's MoE layers exchange tokens over `ep`, the communicator of the
// mesh's expert group. `log`: say how the experts are spread.
void parallelize_experts(Model& model, const RankLayout& layout, const DeviceMesh& mesh,
                         Communicator& ep, bool log);

// Context parallelism: this rank's place in its context group (ranks and rank; no exchanges),
// what the step inputs split the windows by.
ContextParallel context_split(const DeviceMesh& mesh);
// The model's attention gathers keys and values over `cp`, the communicator of the mesh's
// context group; InputError naming dist.context_parallel for a model it cannot split. `log`:
// say how the sequence is split.
void parallelize_context(Model& model, const DeviceMesh& mesh, Communicator& cp, bool log);

// Tensor parallelism: the model's blocks split their matrices and the vocabulary over `tp`, the
// communicator of the mesh's tensor group; InputError naming dist.tensor_parallel for a model it
// cannot split, or whose micro-batch of `micro_batch_tokens` a rank does not split. The
// exchanges move a rank's tokens in up to `most_chunks` pieces (dist.tensor_parallel_chunks,
// async TP). `log`: say how.
void parallelize_tensor(Model& model, const DeviceMesh& mesh, Communicator& tp,
                        int64_t micro_batch_tokens, int most_chunks, bool log);

// All of the above for a run: the model's layers split over the mesh's tensor, expert and context
// groups, the dist section's strategy over its data group, FP8 on that strategy. Returns the
// strategy; `rows_per_micro_batch` as make_run_strategy's. InputError for a split or a dist key
// the run cannot take. `log`: this rank says how.
std::unique_ptr<Strategy> parallelize_run(const Config& cfg, Backend& backend, Model& model,
                                          const DeviceMesh& mesh, const RankLayout& layout,
                                          const RunCommunicators& comms,
                                          int64_t rows_per_micro_batch, bool log);

}  // namespace kiln
