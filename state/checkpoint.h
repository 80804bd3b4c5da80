// Checkpoints: a directory per step, out_dir/checkpoints/step_NNNNNNNN/, holding one binary file
// per piece of each rank's owned ranges, and manifest.yaml (step, data position, RNG state,
// tensor table, resolved config, and each file's part and checksum). A piece is a range of the
// global flat fp32 master weights and AdamW moments or, for a tensor that tensor parallelism
// splits along dim 1, a strided set of equal runs of it (a run a row): one file per piece, not
// per run, so a tensor-parallel rank writes a few files a tensor, not one a row. Everything is
// written into step_NNNNNNNN.tmp/ (each file fsynced), and rank 0 renames the directory into
// place last: a crash mid-write leaves the previous checkpoint untouched and loadable. Because
// files carry their global place, a checkpoint can be read back by any world size, sharding
// strategy or tensor-parallel layout.
// The ranks publish through files, not collectives: each rank ends its part with a marker
// (rank_RRRRR.done, listing its files), and rank 0 writes the manifest once every rank's marker
// is there. So the writing can run on a thread of its own (state/async_checkpoint.h), which must
// never use the training communicator. Every rank writes into the same directory and rank 0
// renames it: across nodes, out_dir must be one shared filesystem.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "data/loader_state.h"
#include "model/fp8_state.h"
#include "model/param_layout.h"
#include "model/shard_layout.h"

namespace kiln {

struct TrainingState {
  int step = 0;  // optimizer steps completed
  uint64_t loader_epoch = 0;
  uint64_t loader_cursor = 0;
  std::vector<SourcePosition> loader_sources;  // data.sources: each source's position
  std::string rng_state;  // the trainer's sampling RNG, as text
  // precision.fp8: the delayed-scaling state (model/fp8_state.h), written by rank 0 to
  // fp8_state.bin; empty without FP8.
  Fp8Checkpoint fp8;
  // moe.balance=bias: every MoE block's balancing bias (Model::moe_bias), written by rank 0 to
  // moe_bias.bin; empty otherwise.
  std::vector<float> moe_bias;
};

// A file's part of the global buffer: `runs` runs of `run` elements, run k at begin + k * stride,
// held one after another in the file; `end` is the last run's end. A range is one run
// (run = stride = end - begin), and the manifest names run, runs and stride only where runs > 1.
struct CheckpointFile {
  std::string file;  // relative to the checkpoint directory
  int64_t begin = 0;
  int64_t end = 0;
  uint64_t checksum = 0;
  int64_t run = 0, runs = 1, stride = 0;
  int64_t size() const { return run * runs; }
};

struct CheckpointManifest {
  std::string dir;
  // The format (checkpoint.cpp): which checksum its shards carry (1: FNV-1a; 2 and 3: four
  // lanes) and which header (3: with run, runs and stride, so a file may be strided).
  uint32_t version = 3;
  TrainingState state;
  int world_size = 1;
  std::string strategy;
  int64_t param_count = 0;
  std::string config_yaml;
  std::vector<ParamInfo> tensors;
  std::vector<CheckpointFile> files;
};

// Host copies of one rank's piece of the optimizer state, written as one file: the range
// [begin, end) of the global buffer, or, where runs > 1, `runs` runs of `run` elements at begin +
// k * stride (end: the last run's end). master, m and v hold the runs one after another.
struct OptimizerShard {
  int64_t begin = 0;
  int64_t end = 0;
  const float* master = nullptr;
  const float* m = nullptr;
  const float* v = nullptr;
  int64_t run = 0, runs = 1, stride = 0;  // read only where runs > 1
};

// Where a load puts a piece of the global state: run k of `piece` (global offset piece.global +
// k * piece.stride) lands at master, m and v + k * piece.run, each skipped where null (weights
// alone). piece.local is not read.
struct StateDestination {
  LayoutPiece piece;
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
};

// Collective: every rank calls it with the pieces it writes, a file each (together they must
// tile [0, param_count) across ranks; under DDP only rank 0 passes any). `barrier` synchronizes all ranks
// (a no-op for one process). Returns the final directory. Keeps the newest `keep` checkpoints.
// Rank 0 waits up to `timeout_s` for the other ranks' files (dist.timeout_s). It runs the three
// steps below in order.
std::string save_checkpoint(const std::string& out_dir, const TrainingState& state,
                            const ParamLayout& layout, const std::string& config_yaml,
                            const std::string& strategy, const std::vector<OptimizerShard>& shards,
                            int rank, int world_size, int keep, double timeout_s,
                            const std::function<void()>& barrier);

// The three steps of a save, none of them collective. `abandoned`, where given, is asked between
// files and while waiting: true stops the step with an exception, publishing nothing.
// 1. Rank 0, before any rank writes (a barrier follows): removes every step_*.tmp directory a
//    crash or a second Ctrl-C left mid-write (this step's, stale markers included, and any
//    other step's), never a published checkpoint, and creates this step's.
void begin_checkpoint(const std::string& out_dir, int step);
// 2. Every rank: writes its pieces (each file fsynced), then its marker rank_RRRRR.done listing
//    them. On failure it removes the files it wrote, leaves rank_RRRRR.failed naming the cause
//    (where it can) so rank 0 stops waiting at once, and rethrows.
void write_rank_files(const std::string& out_dir, int step, int rank,
                      const std::vector<OptimizerShard>& shards,
                      const std::function<bool()>& abandoned = {});
// 3. Rank 0: waits for the markers of ranks 0 .. manifest.world_size - 1, for at most
//    `timeout_s` (a rank's .failed marker, or none in time, throws std::runtime_error naming the
//    rank: nothing is published, the previous checkpoint stays the newest). Then writes the FP8
//    and MoE state and manifest.yaml (its files are the markers'), renames the directory into
//    place, prunes to the newest `keep`, and returns the final directory.
//    `manifest.files` and `manifest.dir` are filled here.
std::string publish_checkpoint(const std::string& out_dir, CheckpointManifest manifest, int keep,
                               double timeout_s, const std::function<bool()>& abandoned = {});

// The manifest of a checkpoint of `layout` (its files are the ranks' markers').
CheckpointManifest checkpoint_manifest(const TrainingState& state, const ParamLayout& layout,
                                       const std::string& config_yaml, const std::string& strategy,
                                       int world_size);

// The newest complete checkpoint directory under out_dir/checkpoints, if any.
std::optional<std::string> find_latest_checkpoint(const std::string& out_dir);

// Reads and validates dir/manifest.yaml. Throws InputError naming the file on any problem; among
// them, files that do not tile [0, param_count) exactly once (a gap, an overlap) and a strided
// file that leaves its tensor.
CheckpointManifest read_manifest(const std::string& dir);

// Fills every destination (disjoint) from whichever files cover it: each such file is read once,
// whole, on a thread of its own, its checksum verified, and its runs scattered into the
// destinations' runs that they meet. Checks that the manifest's tensor table matches `layout`.
void load_optimizer_pieces(const CheckpointManifest& manifest, const ParamLayout& layout,
                           const std::vector<StateDestination>& destinations);

// load_optimizer_pieces for one range [begin, end) of the global buffer into master/m/v (host,
// sized end - begin; m or v null: not wanted, as for weights alone).
void load_optimizer_range(const CheckpointManifest& manifest, const ParamLayout& layout,
                          int64_t begin, int64_t end, float* master, float* m, float* v);

}  // namespace kiln
