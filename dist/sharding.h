// Sharding plans: which elements of the flat parameter buffer each rank owns under each
// dist.strategy. dist sees parameters only as ranges: a plan is a list of global [begin, end)
// ranges, each stored at a local offset in the rank's shard buffers (master weights, AdamW
// moments, gradient shard).
//  - ddp:   every rank owns everything (replicated state; gradients all-reduced).
//  - zero1: the buffer is padded to a multiple of the world size and split in equal chunks;
//           rank r owns chunk r (gradients reduce-scattered, parameters all-gathered).
//  - fsdp:  every unit (embeddings, each block, the head) is padded and split the same way, so
//           a unit can be gathered and its gradients scattered on their own.
// Padding elements are owned too (they keep collectives equal-sized) but lie past the real
// parameters: `owned` lists only real elements, `chunks` the padded collective pieces.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kiln {

struct OwnedRange {
  int64_t begin;  // global element index (real parameters only)
  int64_t end;
  int64_t local;  // offset of `begin` in the rank's shard buffers
};

// One collective piece: the padded range [begin, begin + world * chunk) of the global buffer
// (a unit, or the whole buffer for zero1), of which this rank holds `chunk` elements at `local`.
struct ShardChunk {
  int unit;           // -1 for zero1's single piece
  int64_t begin;      // global start of the piece
  int64_t real_size;  // real parameters in the piece (its padded size is world * chunk)
  int64_t chunk;      // elements per rank
  int64_t local;      // offset of this rank's chunk in the shard buffers
};

struct ShardPlan {
  std::string strategy;
  int rank = 0;
  int world = 1;
  int64_t total = 0;       // real parameters
  int64_t shard_size = 0;  // elements in this rank's shard buffers (padding included)
  std::vector<OwnedRange> owned;
  std::vector<ShardChunk> chunks;  // empty for ddp
};

// units: [begin, end) of each unit in the flat buffer, contiguous and in order.
ShardPlan make_shard_plan(const std::string& strategy, int64_t total,
                          const std::vector<std::pair<int64_t, int64_t>>& units, int rank,
                          int world);

}  // namespace kiln
