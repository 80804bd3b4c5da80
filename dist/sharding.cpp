#include "dist/sharding.h"

#include <algorithm>
#include <stdexcept>

namespace kiln {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Splits the piece [begin, begin + real) into `world` equal chunks; appends this rank's.
void add_piece(ShardPlan& plan, int unit, int64_t begin, int64_t real) {
  const int64_t chunk = ceil_div(real, plan.world);
  const int64_t local = plan.shard_size;
  plan.chunks.push_back({unit, begin, real, chunk, local});
  const int64_t lo = std::min(real, plan.rank * chunk), hi = std::min(real, lo + chunk);
  if (hi > lo) plan.owned.push_back({begin + lo, begin + hi, local});
  plan.shard_size += chunk;
}
}  // namespace

ShardPlan make_shard_plan(const std::string& strategy, int64_t total,
                          const std::vector<std::pair<int64_t, int64_t>>& units, int rank,
                          int world) {
  if (world < 1 || rank < 0 || rank >= world)
    throw std::invalid_argument("make_shard_plan: rank " + std::to_string(rank) + " of " +
                                std::to_string(world));
  ShardPlan plan;
  plan.strategy = strategy;
  plan.rank = rank;
  plan.world = world;
  plan.total = total;
  if (strategy == "ddp") {
    plan.owned.push_back({0, total, 0});
    plan.shard_size = total;
  } else if (strategy == "zero1") {
    add_piece(plan, -1, 0, total);
  } else if (strategy == "fsdp") {
    for (size_t u = 0; u < units.size(); ++u)
      add_piece(plan, static_cast<int>(u), units[u].first, units[u].second - units[u].first);
  } else {
    throw std::invalid_argument("unknown dist.strategy '" + strategy + "'");
  }
  return plan;
}

}  // namespace kiln
