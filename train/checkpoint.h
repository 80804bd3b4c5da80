// Checkpoints: a directory per step, out_dir/checkpoints/step_NNNNNNNN/, holding one binary file
// per owned range of each rank (the [begin,end) range of the flat fp32 master weights and AdamW moments that rank
// owns) and manifest.yaml (step, data position, RNG state, tensor table, resolved config, and
// each file's range and checksum). Everything is written into step_NNNNNNNN.tmp/ (each file
// fsynced), and rank 0 renames the directory into place last: a crash mid-write leaves the
// previous checkpoint untouched and loadable. Because files carry ranges, a checkpoint can be
// read back by any world size or sharding strategy.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "model/param_layout.h"

namespace kiln {

// Writes `text` to path.tmp, fsyncs it and renames it over `path`, so `path` holds either its
// old contents or the new ones, never a partial write: on a full disk it is left as it was and
// std::runtime_error names the file and the cause.
void replace_file_synced(const std::string& path, const std::string& text);

struct TrainingState {
  int step = 0;  // optimizer steps completed
  uint64_t loader_epoch = 0;
  uint64_t loader_cursor = 0;
  std::string rng_state;  // the trainer's sampling RNG, as text
  // precision.fp8: the delayed-scaling state (kernels/fp8.h: Fp8StateLayout over fp8_names,
  // fp8_history amaxes each), written by rank 0 to fp8_state.bin; empty without FP8.
  std::vector<std::string> fp8_names;
  int fp8_history = 0;
  std::vector<float> fp8_state;
  // moe.balance=bias: every MoE block's balancing bias (Model::moe_bias), written by rank 0 to
  // moe_bias.bin; empty otherwise.
  std::vector<float> moe_bias;
};

struct CheckpointFile {
  std::string file;  // relative to the checkpoint directory
  int64_t begin = 0;
  int64_t end = 0;
  uint64_t checksum = 0;
};

struct CheckpointManifest {
  std::string dir;
  TrainingState state;
  int world_size = 1;
  std::string strategy;
  int64_t param_count = 0;
  std::string config_yaml;
  std::vector<ParamInfo> tensors;
  std::vector<CheckpointFile> files;
};

// FNV-1a over bytes, continuing from `hash` (the checkpoint files' checksum): cheap, and enough
// to catch truncation, bit rot, or two ranks whose state should be alike and is not.
uint64_t fnv1a_bytes(const void* data, size_t n, uint64_t hash = 14695981039346656037ull);

// Host copies of one rank's range [begin, end) of the optimizer state.
struct OptimizerShard {
  int64_t begin = 0;
  int64_t end = 0;
  const float* master = nullptr;
  const float* m = nullptr;
  const float* v = nullptr;
};

// Collective: every rank calls it with the ranges it owns (together they must tile
// [0, param_count) across ranks; under DDP only rank 0 passes any). `barrier` synchronizes all ranks
// (a no-op for one process). Returns the final directory. Keeps the newest `keep` checkpoints.
std::string save_checkpoint(const std::string& out_dir, const TrainingState& state,
                            const ParamLayout& layout, const std::string& config_yaml,
                            const std::string& strategy, const std::vector<OptimizerShard>& shards, int rank,
                            int world_size, int keep, const std::function<void()>& barrier);

// The newest complete checkpoint directory under out_dir/checkpoints, if any.
std::optional<std::string> find_latest_checkpoint(const std::string& out_dir);

// Reads and validates dir/manifest.yaml. Throws InputError naming the file on any problem.
CheckpointManifest read_manifest(const std::string& dir);

// Fills [begin, end) of master/m/v (host, sized end-begin) from whichever files cover it,
// verifying checksums. Checks that the manifest's tensor table matches `layout`.
void load_optimizer_range(const CheckpointManifest& manifest, const ParamLayout& layout,
                          int64_t begin, int64_t end, float* master, float* m, float* v);

}  // namespace kiln
