// The parallel plan's group arithmetic (dist/parallel_plan.h): for every world size and
// expert-parallel size that divides it, the expert groups and the data (replica) groups
// partition the world, each rank sits once in one of each, and the two groups of a rank meet
// only in the rank itself. Context groups share a batch and leave the strategy the world.
#include "dist/parallel_plan.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "base/error.h"

namespace kiln {
namespace {

TEST(ParallelPlan, GroupsPartitionTheWorld) {
  for (int world : {1, 2, 4, 8}) {
    for (int P = 1; P <= world; ++P) {
      if (world % P != 0) continue;
      std::map<std::string, std::set<int>> members;  // group name -> world ranks
      for (int r = 0; r < world; ++r) {
        const ParallelPlan plan = make_parallel_plan(r, world, P);
        const CommGroup ep = plan.expert_group(), dp = plan.data_group();
        EXPECT_EQ(ep.size, P);
        EXPECT_EQ(dp.size, world / P);
        EXPECT_EQ(ep.size * dp.size, world);
        EXPECT_EQ(plan.expert_peer(ep.rank), r);
        EXPECT_EQ(plan.data_peer(dp.rank), r);
        // Expert groups are consecutive ranks; a replica group holds the same experts.
        EXPECT_EQ(plan.expert_peer(0), r - r % P);
        for (int m = 0; m < dp.size; ++m)
          EXPECT_EQ(make_parallel_plan(plan.data_peer(m), world, P).expert_rank(),
                    plan.expert_rank());
        EXPECT_EQ(plan.writes_dense(), r % P == 0);
        if (P == 1) {
          EXPECT_FALSE(plan.has_experts_split());
          EXPECT_EQ(dp.name, "");  // the world itself
          EXPECT_EQ(dp.rank, r);
        }
        EXPECT_TRUE(members["expert " + ep.name].insert(r).second);
        EXPECT_TRUE(members["data " + dp.name].insert(r).second);
        // A rank's expert group and data group share it alone.
        std::set<int> shared;
        for (int m = 0; m < P; ++m)
          for (int q = 0; q < dp.size; ++q)
            if (plan.expert_peer(m) == plan.data_peer(q)) shared.insert(plan.expert_peer(m));
        EXPECT_EQ(shared, std::set<int>{r});
      }
      // world / P expert groups of P ranks, P data groups of world / P ranks.
      int expert_groups = 0, data_groups = 0;
      for (const auto& [name, ranks] : members) {
        if (name.rfind("expert ", 0) == 0) {
          ++expert_groups;
          EXPECT_EQ(static_cast<int>(ranks.size()), P) << name;
        } else {
          ++data_groups;
          EXPECT_EQ(static_cast<int>(ranks.size()), world / P) << name;
        }
      }
      EXPECT_EQ(expert_groups, world / P) << world << " ranks, P=" << P;
      EXPECT_EQ(data_groups, P == 1 ? 1 : P) << world << " ranks, P=" << P;
    }
  }
}

TEST(ParallelPlan, NamesTheGroupsOfEightRanksByTwo) {
  const ParallelPlan plan = make_parallel_plan(5, 8, 2);
  EXPECT_EQ(plan.expert_group().name, "ep2");
  EXPECT_EQ(plan.expert_group().rank, 1);
  EXPECT_EQ(plan.data_group().name, "replica1");
  EXPECT_EQ(plan.data_group().rank, 2);
  EXPECT_EQ(plan.data_peer(3), 7);
  EXPECT_EQ(plan.expert_peer(0), 4);
  // Only the replica group's communicator carries the strategy's all-gathers.
  EXPECT_TRUE(plan.data_group().data);
  EXPECT_FALSE(plan.expert_group().data);
  EXPECT_FALSE(plan.world_group().data);
}

TEST(ParallelPlan, RefusesAnExpertParallelSizeThatDoesNotDivideTheWorld) {
  EXPECT_THROW(make_parallel_plan(0, 4, 3), InputError);
  EXPECT_THROW(make_parallel_plan(0, 1, 2), InputError);
  EXPECT_THROW(make_parallel_plan(4, 4, 2), InputError);
}

// Context groups are consecutive ranks; the ranks of one read the same batch (batch_rank), and
// the batches of the world's groups are distinct; the strategy spans the whole world.
TEST(ParallelPlan, ContextGroupsShareABatchAndTheStrategySpansTheWorld) {
  for (int world : {2, 4, 8})
    for (int N : {2, 4}) {
      if (world % N != 0) continue;
      std::map<std::string, std::set<int>> members;
      std::map<int, std::set<int>> batches;  // batch rank -> context group names
      for (int r = 0; r < world; ++r) {
        const ParallelPlan plan = make_parallel_plan(r, world, 1, N);
        const CommGroup cp = plan.context_group();
        EXPECT_TRUE(plan.has_context_split());
        EXPECT_EQ(cp.size, N);
        EXPECT_EQ(cp.rank, r % N);
        EXPECT_EQ(plan.batch_ranks(), world / N);
        EXPECT_EQ(plan.data_group().size, world);
        EXPECT_TRUE(plan.world_group().data);
        EXPECT_FALSE(cp.data);
        members[cp.name].insert(r);
        batches[plan.batch_rank()].insert(r / N);
      }
      EXPECT_EQ(members.size(), static_cast<size_t>(world / N));
      for (const auto& [name, ranks] : members) EXPECT_EQ(ranks.size(), static_cast<size_t>(N));
      EXPECT_EQ(batches.size(), static_cast<size_t>(world / N));
      for (const auto& [batch, groups] : batches) EXPECT_EQ(groups.size(), 1u);
    }
  EXPECT_THROW(make_parallel_plan(0, 6, 1, 4), InputError);
  EXPECT_THROW(make_parallel_plan(0, 4, 2, 2), InputError);
}

}  // namespace
}  // namespace kiln
