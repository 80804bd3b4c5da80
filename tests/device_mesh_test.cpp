// The device mesh's group arithmetic (dist/device_mesh.h): for every world size and every shape
// that divides it, each kind of group partitions the world into groups of its axis' size, each
// rank's place in its group leads back to it, a tensor group is consecutive ranks, the ranks
// that share a batch are exactly those of a tensor x context block, and the data, expert and
// replicate groups of a rank meet only in the rank itself.
#include "dist/device_mesh.h"

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "base/error.h"

namespace kiln {
namespace {

struct Kind {
  const char* name;
  std::function<CommGroup(const DeviceMesh&)> group;
  std::function<int(const DeviceMesh&, int)> peer;
};

const std::vector<Kind>& kinds() {
  static const std::vector<Kind> k = {
      {"tensor", &DeviceMesh::tensor_group, &DeviceMesh::tensor_peer},
      {"context", &DeviceMesh::context_group, &DeviceMesh::context_peer},
      {"expert", &DeviceMesh::expert_group, &DeviceMesh::expert_peer},
      {"data", &DeviceMesh::data_group, &DeviceMesh::data_peer},
      {"replicate", &DeviceMesh::replicate_group, &DeviceMesh::replicate_peer},
  };
  return k;
}

std::vector<MeshShape> shapes(int world) {
  std::vector<MeshShape> out;
  for (int R = 1; R <= world; ++R)
    for (int CP = 1; CP <= world; ++CP)
      for (int TP = 1; TP <= world; ++TP) {
        if (world % (R * CP * TP) != 0) continue;
        const int per_replica = world / (R * TP);  // data_shard x context
        for (int P = 1; P <= per_replica; ++P)
          if (per_replica % P == 0) out.push_back({R, CP, TP, P});
      }
  return out;
}

std::string str(const MeshShape& s, int world) {
  return std::to_string(world) + " ranks: R" + std::to_string(s.data_replicate) + " CP" +
         std::to_string(s.context) + " TP" + std::to_string(s.tensor) + " EP" +
         std::to_string(s.expert);
}

TEST(DeviceMesh, EveryKindOfGroupPartitionsTheWorld) {
  for (int world : {1, 2, 4, 6, 8, 12, 16})
    for (const MeshShape& s : shapes(world)) {
      const std::string at = str(s, world);
      for (const Kind& kind : kinds()) {
        std::map<std::string, std::set<int>> members;  // group name -> world ranks
        for (int r = 0; r < world; ++r) {
          const DeviceMesh m = make_device_mesh(r, world, s);
          const CommGroup g = kind.group(m);
          EXPECT_EQ(kind.peer(m, g.rank), r) << at << " " << kind.name;
          std::set<int> peers;
          for (int i = 0; i < g.size; ++i) peers.insert(kind.peer(m, i));
          EXPECT_EQ(peers.size(), static_cast<size_t>(g.size)) << at << " " << kind.name;
          // Every member names the group alike and sees the same members.
          for (int p : peers) {
            const DeviceMesh other = make_device_mesh(p, world, s);
            EXPECT_EQ(kind.group(other).name, g.name) << at << " " << kind.name;
            EXPECT_EQ(kind.group(other).size, g.size);
          }
          EXPECT_TRUE(members[g.name].insert(r).second);
        }
        size_t covered = 0;
        for (const auto& [name, ranks] : members) covered += ranks.size();
        EXPECT_EQ(covered, static_cast<size_t>(world)) << at << " " << kind.name;
      }
    }
}

TEST(DeviceMesh, AxesHaveTheirSizesAndTensorGroupsAreConsecutive) {
  for (int world : {2, 4, 8, 16})
    for (const MeshShape& s : shapes(world))
      for (int r = 0; r < world; ++r) {
        const DeviceMesh m = make_device_mesh(r, world, s);
        const std::string at = str(s, world) + " rank " + std::to_string(r);
        EXPECT_EQ(m.tensor_group().size, s.tensor) << at;
        EXPECT_EQ(m.context_group().size, s.context) << at;
        EXPECT_EQ(m.expert_group().size, s.expert) << at;
        EXPECT_EQ(m.replicate_group().size, s.data_replicate) << at;
        EXPECT_EQ(m.data_group().size * s.expert * s.tensor * s.data_replicate, world) << at;
        EXPECT_EQ(m.tensor_peer(0), r - r % s.tensor) << at;
        EXPECT_EQ(m.gradient_ranks() * s.tensor, world);
        // The strategy's group holds one tensor shard and one run of experts.
        for (int i = 0; i < m.data_group().size; ++i) {
          const DeviceMesh p = make_device_mesh(m.data_peer(i), world, s);
          EXPECT_EQ(p.tensor_rank(), m.tensor_rank()) << at;
          EXPECT_EQ(p.expert_rank(), m.expert_rank()) << at;
          EXPECT_EQ(p.replicate_rank(), m.replicate_rank()) << at;
        }
        // A rank's data, expert and replicate groups share it alone, and so do its tensor and
        // data groups.
        std::vector<std::set<int>> groups;
        for (const Kind& kind : kinds()) {
          std::set<int> g;
          for (int i = 0; i < kind.group(m).size; ++i) g.insert(kind.peer(m, i));
          groups.push_back(g);
        }
        for (size_t a : {0u, 2u, 3u, 4u})
          for (size_t b : {2u, 3u, 4u}) {
            if (a >= b) continue;
            std::set<int> both;
            for (int x : groups[a])
              if (groups[b].count(x)) both.insert(x);
            EXPECT_EQ(both, std::set<int>{r}) << at << " " << kinds()[a].name << " and "
                                              << kinds()[b].name;
          }
      }
}

// The ranks of a tensor x context block read one batch, and every batch is read by one block.
TEST(DeviceMesh, TensorAndContextRanksShareABatch) {
  for (int world : {2, 4, 8, 16})
    for (const MeshShape& s : shapes(world)) {
      std::map<int, std::set<int>> readers;  // batch rank -> world ranks
      for (int r = 0; r < world; ++r) {
        const DeviceMesh m = make_device_mesh(r, world, s);
        EXPECT_EQ(m.batch_ranks(), world / (s.tensor * s.context));
        readers[m.batch_rank()].insert(r);
        for (int i = 0; i < s.tensor; ++i)
          EXPECT_EQ(make_device_mesh(m.tensor_peer(i), world, s).batch_rank(), m.batch_rank());
        for (int i = 0; i < s.context; ++i)
          EXPECT_EQ(make_device_mesh(m.context_peer(i), world, s).batch_rank(), m.batch_rank());
      }
      EXPECT_EQ(readers.size(), static_cast<size_t>(world / (s.tensor * s.context)));
      for (const auto& [batch, ranks] : readers)
        EXPECT_EQ(ranks.size(), static_cast<size_t>(s.tensor * s.context)) << str(s, world);
    }
}

TEST(DeviceMesh, NamesTheGroupsOfSixteenRanks) {
  // R2 x S2 x CP2 x TP2, experts over 2: rank 13 = ((1 * 2 + 1) * 2 + 0) * 2 + 1.
  const DeviceMesh m = make_device_mesh(13, 16, {2, 2, 2, 2});
  EXPECT_EQ(m.tensor_rank(), 1);
  EXPECT_EQ(m.context_rank(), 0);
  EXPECT_EQ(m.shard_rank(), 1);
  EXPECT_EQ(m.replicate_rank(), 1);
  EXPECT_EQ(m.tensor_group().name, "tp12");
  EXPECT_EQ(m.context_group().name, "cp13");
  EXPECT_EQ(m.expert_group().name, "ep13");
  EXPECT_EQ(m.data_group().name, "dp9");
  EXPECT_EQ(m.replicate_group().name, "rep5");
  EXPECT_EQ(m.batch_rank(), 3);
  // Only the strategy's group carries its all-gathers.
  EXPECT_TRUE(m.data_group().data);
  EXPECT_FALSE(m.world_group().data);
  EXPECT_FALSE(m.tensor_group().data);
  const DeviceMesh plain = make_device_mesh(3, 4, {});
  EXPECT_EQ(plain.data_group().name, "");  // the world itself
  EXPECT_TRUE(plain.world_group().data);
  const DeviceMesh context = make_device_mesh(3, 4, {1, 2, 1, 1});
  EXPECT_EQ(context.data_group().size, 4);  // context ranks hold the same parameters
}

TEST(DeviceMesh, RefusesAxesThatDoNotDivideTheWorldNamingTheKey) {
  auto message = [](int world, const MeshShape& s) {
    try {
      make_device_mesh(0, world, s);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message(4, {1, 1, 3, 1}).find("dist.tensor_parallel=3"), std::string::npos);
  EXPECT_NE(message(4, {3, 1, 1, 1}).find("dist.data_replicate=3"), std::string::npos);
  EXPECT_NE(message(4, {1, 2, 4, 1}).find("must divide the world size"), std::string::npos);
  EXPECT_NE(message(8, {1, 1, 2, 4}).find("accepted"), std::string::npos);
  // Experts over 4 with 8 ranks of tensor parallelism 4: a replica holds 2 ranks a shard.
  EXPECT_NE(message(8, {1, 1, 4, 4}).find("dist.expert_parallel=4"), std::string::npos);
  EXPECT_THROW(make_device_mesh(4, 4, {}), InputError);
}

}  // namespace
}  // namespace kiln
