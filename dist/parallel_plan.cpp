#include "dist/parallel_plan.h"

#include <string>

#include "base/error.h"

namespace kiln {

ParallelPlan make_parallel_plan(int rank, int world, int expert_parallel,
                                int context_parallel) {
  if (expert_parallel < 1 || world % expert_parallel != 0)
    throw InputError("dist.expert_parallel=" + std::to_string(expert_parallel) +
                     " must divide the world size (" + std::to_string(world) +
                     " ranks): launch a multiple of it, e.g. --nproc-per-node=" +
                     std::to_string(expert_parallel));
  if (context_parallel < 1 || world % context_parallel != 0)
    throw InputError("dist.context_parallel=" + std::to_string(context_parallel) +
                     " must divide the world size (" + std::to_string(world) +
                     " ranks): launch a multiple of it, e.g. --nproc-per-node=" +
                     std::to_string(context_parallel));
  if (context_parallel > 1 && expert_parallel > 1)
    throw InputError("dist.context_parallel=" + std::to_string(context_parallel) +
                     " with dist.expert_parallel=" + std::to_string(expert_parallel) +
                     ": the two do not combine yet; set one of them to 1");
  if (rank < 0 || rank >= world)
    throw InputError("rank " + std::to_string(rank) + " outside a world of " +
                     std::to_string(world));
  ParallelPlan plan;
  plan.rank = rank;
  plan.world = world;
  plan.expert_parallel = expert_parallel;
  plan.context_parallel = context_parallel;
  return plan;
}

CommGroup ParallelPlan::context_group() const {
  return {context_rank(), context_parallel, "cp" + std::to_string(rank / context_parallel)};
}

CommGroup ParallelPlan::expert_group() const {
  return {expert_rank(), expert_parallel, "ep" + std::to_string(expert_group_index())};
}

CommGroup ParallelPlan::data_group() const {
  if (!has_experts_split()) return world_group();
  return {expert_group_index(), replicas(), "replica" + std::to_string(expert_rank()), true};
}

}  // namespace kiln
