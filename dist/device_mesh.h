// The device mesh: the world's ranks as a grid of named axes, and every group a run communicates
// within cut from it, here and nowhere else. Outermost to innermost:
//
//   data_replicate (R) x data_shard (S) x context (CP) x tensor (TP),
//   rank = ((r * S + s) * CP + c) * TP + t,        S = world / (R * CP * TP)
//
// so a tensor group is TP consecutive ranks (one host, where nodes hold a multiple of TP), the
// fastest links carrying the most traffic. The groups, each the ranks that share every
// coordinate but the ones named:
//   tensor    t varies:  they split each layer's matrices (model/tensor_parallel.h) and read the
//             same batch.
//   context   c varies:  they share each sequence (model/context_parallel.h), the same batch.
//   expert    dist.expert_parallel = P folds over the non-tensor ranks of a replica, q = s * CP + c:
//             consecutive runs of P of them (same r and t) spread each MoE block's experts.
//   data      what the strategy (ddp, zero1, fsdp) spans: the ranks of a replica that hold the same
//             tensor shard and the same experts (same r, t and q mod P). Without expert or tensor
//             parallelism and replicas, the world.
//   replicate r varies (HSDP): zero1/fsdp shard inside each replica, and the replicas' gradient
//             shards are summed over this group after the data group's reduction.
// Which gradients each group must still sum, and how the norm counts them, is the strategy's
// (dist/strategy.h, reduce_over); which tensors each rank holds, the model's layout
// (model/param_layout.h, ShardLayout).
#pragma once

#include <string>

namespace kiln {

// The ranks a communicator spans: this rank's place among them, their number, and a name
// unique among the run's groups ("" for the world).
struct CommGroup {
  int rank = 0, size = 1;
  std::string name;
  // The data-parallel strategy shards its state over this group (zero1/fsdp's all-gathers run
  // here): only its communicator needs dist.copy_engine_gathers' windows.
  bool data = false;
};

// The dist section's axes (train/config.h): what the user asks for. The data shard axis is what
// is left of the world.
struct MeshShape {
  int data_replicate = 1;
  int context = 1;
  int tensor = 1;
  int expert = 1;  // folds over data_shard x context
};

class DeviceMesh {
 public:
  int rank = 0, world = 1;
  int replicate = 1, shard = 1, context = 1, tensor = 1, expert = 1;

  // Coordinates.
  int tensor_rank() const { return rank % tensor; }
  int context_rank() const { return (rank / tensor) % context; }
  int shard_rank() const { return (rank / (tensor * context)) % shard; }
  int replicate_rank() const { return rank / (tensor * context * shard); }
  // The non-tensor ranks of a replica, in order: q = s * CP + c.
  int replica_index() const { return (rank / tensor) % (shard * context); }
  // This rank's place in its expert group: which run of the experts it holds.
  int expert_rank() const { return replica_index() % expert; }

  bool has_tensor_split() const { return tensor > 1; }
  bool has_context_split() const { return context > 1; }
  bool has_experts_split() const { return expert > 1; }
  bool has_replicas() const { return replicate > 1; }

  CommGroup world_group() const;
  CommGroup tensor_group() const;
  CommGroup context_group() const;
  CommGroup expert_group() const;
  CommGroup data_group() const;
  CommGroup replicate_group() const;
  // The world rank of member `m` of this rank's group of that kind (tests, and whoever must name
  // a peer).
  int tensor_peer(int m) const { return at(replicate_rank(), replica_index(), m); }
  int context_peer(int m) const {
    return at(replicate_rank(), shard_rank() * context + m, tensor_rank());
  }
  int expert_peer(int m) const {
    return at(replicate_rank(), replica_index() - expert_rank() + m, tensor_rank());
  }
  int data_peer(int m) const { return at(replicate_rank(), m * expert + expert_rank(), tensor_rank()); }
  int replicate_peer(int m) const { return at(m, replica_index(), tensor_rank()); }

  // The loader's view: which of the step's batches this rank reads, of how many (the ranks of a
  // context group and of a tensor group read the same one; each keeps its part of it).
  int batch_rank() const { return rank / (tensor * context); }
  int batch_ranks() const { return world / (tensor * context); }
  // The ranks whose gradients are averaged: all but the tensor axis, whose ranks compute one
  // gradient between them (each its shard of it).
  int gradient_ranks() const { return world / tensor; }

 private:
  int at(int r, int q, int t) const { return (r * shard * context + q) * tensor + t; }
};

// Throws InputError naming the dist key at fault: an axis that does not divide the world (or
// dist.expert_parallel the data_shard x context ranks of a replica), or a rank outside it.
DeviceMesh make_device_mesh(int rank, int world, const MeshShape& shape);

}  // namespace kiln
