#include "dist/device_mesh.h"

#include <cstdint>
#include <string>
#include <utility>

#include "base/error.h"

namespace kiln {

namespace {

[[noreturn]] void refuse(const char* key, int n, const std::string& why) {
  throw InputError(std::string("dist.") + key + "=" + std::to_string(n) + " " + why);
}

}  // namespace

DeviceMesh make_device_mesh(int rank, int world, const MeshShape& s) {
  const std::string ranks = " (" + std::to_string(world) + " ranks)";
  if (world < 1 || rank < 0 || rank >= world)
    throw InputError("rank " + std::to_string(rank) + " outside a world of " +
                     std::to_string(world));
  for (const auto& [key, n] : {std::pair<const char*, int>{"tensor_parallel", s.tensor},
                               {"context_parallel", s.context},
                               {"data_replicate", s.data_replicate},
                               {"expert_parallel", s.expert}})
    if (n < 1 || world % n != 0)
      refuse(key, n,
             "must divide the world size" + ranks + ": launch a multiple of it, e.g. "
             "--nproc-per-node=" + std::to_string(n));
  const int64_t outer = int64_t{s.tensor} * s.context * s.data_replicate;
  if (world % outer != 0)
    refuse("tensor_parallel", s.tensor,
           "x dist.context_parallel=" + std::to_string(s.context) + " x dist.data_replicate=" +
               std::to_string(s.data_replicate) + " must divide the world size" + ranks);
  DeviceMesh m;
  m.rank = rank;
  m.world = world;
  m.replicate = s.data_replicate;
  m.context = s.context;
  m.tensor = s.tensor;
  m.shard = static_cast<int>(world / outer);
  m.expert = s.expert;
  // Experts spread over the non-tensor ranks of one replica, whose tokens differ.
  if ((m.shard * m.context) % s.expert != 0)
    refuse("expert_parallel", s.expert,
           "must divide the ranks of a replica that hold one tensor shard (world / "
           "(dist.tensor_parallel x dist.data_replicate) = " +
               std::to_string(m.shard * m.context) + ")");
  return m;
}

CommGroup DeviceMesh::world_group() const {
  return {rank, world, "", data_group().size == world};
}

CommGroup DeviceMesh::tensor_group() const {
  return {tensor_rank(), tensor, "tp" + std::to_string(tensor_peer(0))};
}

CommGroup DeviceMesh::context_group() const {
  return {context_rank(), context, "cp" + std::to_string(context_peer(0))};
}

CommGroup DeviceMesh::expert_group() const {
  return {expert_rank(), expert, "ep" + std::to_string(expert_peer(0))};
}

CommGroup DeviceMesh::data_group() const {
  const int size = shard * context / expert;
  if (size == world) return {rank, world, "", true};
  return {replica_index() / expert, size, "dp" + std::to_string(data_peer(0)), true};
}

CommGroup DeviceMesh::replicate_group() const {
  return {replicate_rank(), replicate, "rep" + std::to_string(replicate_peer(0))};
}

}  // namespace kiln
