// The parallel plan: how the world's ranks split into the groups each kind of parallelism
// communicates within. Rank r's coordinates are computed once here, and the communicators, the
// data-parallel strategy, expert parallelism and the checkpoint layout all read them from the
// plan, so no two places can disagree on who is grouped with whom.
//
//   expert group:  dist.expert_parallel consecutive ranks (on one host where nodes hold a
//                  multiple of it); rank r holds the experts of r mod P.
//   replica group: the ranks P, 2P, ... apart, which hold the same experts: the data-parallel
//                  group the strategy (ddp / zero1 / fsdp) spans. Without expert parallelism it
//                  is the whole world.
//
// Context and tensor parallelism would be further axes of the same split (each a group of
// consecutive ranks inside the expert group, the replica group keeping the outermost stride);
// none is built yet, so the plan has only these two.
#pragma once

#include <string>

namespace kiln {

// The ranks a communicator spans: this rank's place among them, their number, and a name
// unique among the run's groups ("" for the world; the plan's are "ep<g>" and "replica<q>").
struct CommGroup {
  int rank = 0, size = 1;
  std::string name;
};

struct ParallelPlan {
  int rank = 0, world = 1;
  int expert_parallel = 1;  // P: ranks one MoE block's experts are spread over

  bool has_experts_split() const { return expert_parallel > 1; }
  // This rank's place in its expert group: which run of the experts it holds.
  int expert_rank() const { return rank % expert_parallel; }
  int expert_group_index() const { return rank / expert_parallel; }
  int replicas() const { return world / expert_parallel; }

  CommGroup world_group() const { return {rank, world, ""}; }
  CommGroup expert_group() const;
  // The group the data-parallel strategy spans: the world, or the replica group.
  CommGroup data_group() const;
  // The world rank of member `member` of this rank's expert group / data group.
  int expert_peer(int member) const { return expert_group_index() * expert_parallel + member; }
  int data_peer(int member) const { return member * expert_parallel + expert_rank(); }
  // Checkpoints: a rank writes its experts; the dense parameters, the same on every rank of an
  // expert group, are written by the group's first rank alone.
  bool writes_dense() const { return expert_rank() == 0; }
};

// Throws InputError naming dist.expert_parallel where it does not divide the world.
ParallelPlan make_parallel_plan(int rank, int world, int expert_parallel);

}  // namespace kiln
