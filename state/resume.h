// How a run starts: with fresh parameters (init.from's weights or the seed's draw), or from a
// checkpoint. And what a checkpoint holds of a run beyond the file format (state/checkpoint.h),
// written at a checkpoint and read back on resume, in one place so the two cannot drift apart:
// the strategy's owned ranges of master weights and AdamW moments at their global offsets
// (under expert parallelism, each rank its experts and each expert group's first rank the dense
// parameters), the FP8 scaling state, the MoE balancing bias, the loader's position and the
// sampling RNG. A resumed run goes on exactly as if it had not stopped.
#pragma once

#include <optional>
#include <random>
#include <string>

#include "config/config.h"
#include "data/loader.h"
#include "dist/strategy.h"
#include "model/model.h"
#include "state/rank_layout.h"

namespace kiln {

class AsyncCheckpointer;

// The parts of a running trainer a checkpoint reads and writes.
struct RunParts {
  const Config& config;
  int rank, world_size;
  Backend& backend;
  Model& model;
  Strategy& strategy;
  const RankLayout& layout;
  DataLoader& train_loader;
  std::mt19937_64& rng;
  Communicator* comm;  // the world's (null for one process): checkpoints' barriers, on the
                       // step loop's thread only
};

// Once the memory is allocated: the run restored from the checkpoint train.resume names (the
// newest in out_dir under auto, if any; none; or a path), returning its step; else the
// parameters initialized and the FP8 scaling fresh, returning nullopt. Under
// train.resume=auto an InputError about the checkpoint also says how to start afresh instead;
// a checkpoint past train.max_steps is an InputError saying to raise it or start afresh.
std::optional<int> start_run(const RunParts& run);

// The host memory train.checkpoint_async's snapshot takes on this rank (0 where it is off):
// 3 x fp32 per parameter of the ranges the strategy has this rank write.
size_t checkpoint_snapshot_bytes(const TrainSection& train, const Strategy& strategy);

// Has `async` allocate the snapshot's host buffers on its writer thread now, beside the steps
// before the first save (AsyncCheckpointer::reserve).
void reserve_checkpoint_snapshot(const RunParts& run, AsyncCheckpointer& async);

// train.checkpoint_async: waits for this rank's save in flight (`async`; null: none), and agrees
// with every rank on whether any save failed, summing `flag` (f32[1] in backend memory) over the
// world (collective: called at checkpoint steps and on the way out, where every rank is). A
// failure one rank alone saw would send it out of the loop while the others wait for it in their
// next collective. Throws on every rank where one failed: this rank's error, or one naming the
// others. Returns the milliseconds it waited for the writer.
double settle_async_checkpoints(const RunParts& run, AsyncCheckpointer* async, Tensor flag);

// Writes the checkpoint of step `step` (collective: every rank calls it): the whole save here,
// or, with `async` (train.checkpoint_async), a copy of the state into its host buffers that its
// thread writes and publishes; the caller has waited `waited_ms` for the previous save and
// checked it (Trainer::settle_checkpoints). Returns the milliseconds of the step loop's stall,
// that wait included, which rank 0 also logs.
double save_run(const RunParts& run, int step, AsyncCheckpointer* async, double waited_ms = 0);

}  // namespace kiln
