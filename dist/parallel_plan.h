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
//   context group: dist.context_parallel consecutive ranks, which share each sequence (rank r
//                  holds rows of it as model/context_parallel.h splits them). They hold the same
//                  parameters and see different tokens, so the strategy's group spans them too:
//                  only the loader and attention see the split. Not combined with expert
//                  parallelism.
//
// Tensor parallelism would be a further axis of the same split (a group of consecutive ranks
// inside the others, the replica group keeping the outermost stride); none is built yet.
#pragma once

#include <string>

namespace kiln {

// The ranks a communicator spans: this rank's place among them, their number, and a name
// unique among the run's groups ("" for the world; the plan's are "ep<g>" and "replica<q>").
struct CommGroup {
  int rank = 0, size = 1;
  std::string name;
  // The data-parallel strategy shards its state over this group (zero1/fsdp's all-gathers run
  // here): only its communicator needs dist.copy_engine_gathers' windows.
  bool data = false;
};

struct ParallelPlan {
  int rank = 0, world = 1;
  int expert_parallel = 1;  // P: ranks one MoE block's experts are spread over
  int context_parallel = 1;  // ranks that share each sequence

  bool has_experts_split() const { return expert_parallel > 1; }
  // This rank's place in its expert group: which run of the experts it holds.
  int expert_rank() const { return rank % expert_parallel; }
  int expert_group_index() const { return rank / expert_parallel; }
  int replicas() const { return world / expert_parallel; }

  bool has_context_split() const { return context_parallel > 1; }
  int context_rank() const { return rank % context_parallel; }
  CommGroup context_group() const;
  // The loader's view: which of the step's batches this rank reads, of how many (ranks of a
  // context group read the same batch and each keeps its rows).
  int batch_rank() const { return rank / context_parallel; }
  int batch_ranks() const { return world / context_parallel; }

  CommGroup world_group() const { return {rank, world, "", !has_experts_split()}; }
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

// Throws InputError naming dist.expert_parallel or dist.context_parallel where it does not
// divide the world, or where both are set.
ParallelPlan make_parallel_plan(int rank, int world, int expert_parallel,
                                int context_parallel = 1);

}  // namespace kiln
