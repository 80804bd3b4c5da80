// Sharding plans: across ranks the owned ranges tile the real parameters exactly once, chunks
// are equal-sized per piece, and local offsets pack each rank's shard buffer without overlap.
#include <gtest/gtest.h>

#include "dist/sharding.h"

namespace kiln {
namespace {

const std::vector<std::pair<int64_t, int64_t>> kUnits = {{0, 10}, {10, 17}, {17, 40}, {40, 41}};

void expect_tiles(const std::string& strategy, int world) {
  std::vector<int> owners(41, 0);
  for (int r = 0; r < world; ++r) {
    const ShardPlan p = make_shard_plan(strategy, 41, kUnits, r, world);
    int64_t local_end = 0;
    for (const auto& o : p.owned) {
      EXPECT_GE(o.local, local_end);
      local_end = o.local + (o.end - o.begin);
      EXPECT_LE(local_end, p.shard_size);
      for (int64_t i = o.begin; i < o.end; ++i) ++owners[static_cast<size_t>(i)];
    }
    // The chunks, one after the other, fill the shard: what lets fsdp skip zeroing its grad
    // shard (the first micro-batch's reduce-scatters, one a chunk, overwrite all of it).
    int64_t chunk_end = 0;
    for (const auto& c : p.chunks) {
      EXPECT_GE(c.chunk * world, c.real_size);
      EXPECT_EQ(c.local, chunk_end);
      chunk_end = c.local + c.chunk;
    }
    if (!p.chunks.empty()) {
      EXPECT_EQ(chunk_end, p.shard_size) << strategy;
    }
  }
  for (int i = 0; i < 41; ++i) EXPECT_EQ(owners[static_cast<size_t>(i)], strategy == "ddp" ? world : 1) << strategy << " element " << i;
}

TEST(DistSharding, OwnedRangesTileTheParameters) {
  for (const char* s : {"ddp", "zero1", "fsdp"})
    for (int world : {1, 2, 3, 4}) expect_tiles(s, world);
}

TEST(DistSharding, Zero1SplitsOnePaddedPiece) {
  const ShardPlan p = make_shard_plan("zero1", 41, kUnits, 3, 4);
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].chunk, 11);
  EXPECT_EQ(p.shard_size, 11);
  ASSERT_EQ(p.owned.size(), 1u);
  EXPECT_EQ(p.owned[0].begin, 33);
  EXPECT_EQ(p.owned[0].end, 41);  // the last 3 elements of the chunk are padding
}

TEST(DistSharding, FsdpSplitsEveryUnit) {
  const ShardPlan p = make_shard_plan("fsdp", 41, kUnits, 1, 2);
  ASSERT_EQ(p.chunks.size(), 4u);
  EXPECT_EQ(p.shard_size, 5 + 4 + 12 + 1);
  // unit 3 has one element: rank 1 owns only padding there.
  EXPECT_EQ(p.owned.size(), 3u);
}

TEST(DistSharding, UnknownStrategyThrows) {
  EXPECT_THROW(make_shard_plan("tp", 41, kUnits, 0, 2), std::invalid_argument);
}

}  // namespace
}  // namespace kiln
