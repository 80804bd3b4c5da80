// Muon (optim.name=muon, docs/optimizer.md): the blocks' hidden matrices (ParamInfo::matrix_rows:
// each logical matrix on its own, q, k and v apart, each expert's apart) take Nesterov momentum
// orthogonalized by the Newton-Schulz iteration; AdamW updates the rest (train/optimizer.h).
// The iteration needs each matrix whole, while a sharded strategy cuts the flat buffer across
// them and tensor parallelism splits them over the tensor group, so every matrix has an owner:
// a rank of the data group, and under tensor parallelism one of its tensor group too, chosen to
// spread the iteration's FLOPs evenly, and:
//  - replicated state (ddp, or a group of one): every rank updates every matrix's momentum, the
//    owner iterates it in its packed slot, and the slots are all-gathered; every rank then
//    applies every update to its whole copy.
//  - sharded state (zero1, fsdp): each rank updates the momentum of the pieces it holds, an
//    all-to-all brings every matrix's pieces to its owner, which iterates it, and a second one
//    takes the orthogonalized pieces back to their holders, which apply them to their shards.
//    The matrices go in rounds (optim.muon_exchange_mb) so that the exchange buffers hold a
//    round's pieces, not a rank's share of every matrix: planned from every rank's pieces and
//    the owners, the same on every rank.
//  - tensor parallelism: where the data owner would iterate its rank's part of a split matrix,
//    an all-to-all over the tensor group brings the group's parts to the matrix's tensor owner,
//    which joins them (a row split's parts are row blocks, a column split's column blocks),
//    iterates the whole, cuts it again and sends each part back by a second all-to-all. The
//    matrices the tensor group holds whole (MoE experts, shared experts) are iterated by each of
//    its ranks alike, as without tensor parallelism.
// A matrix's update is the same bits on any rank and beside any others (kernels/cpu/muon.cpp),
// so every layout follows the single-process run. Expert matrices are the expert rank's own (its
// local layout's). Every buffer is planned once; the step enqueues work and collectives with
// sizes fixed at plan time, nothing else (a CUDA graph captures it).
#pragma once

#include <cstdint>
#include <vector>

#include "config/config.h"
#include "dist/communicator.h"
#include "dist/strategy.h"
#include "kernels/arena.h"
#include "kernels/backend.h"
#include "model/param_layout.h"

namespace kiln {

// One logical matrix of the rank's flat buffer: rows x cols values from `offset`, the rank's
// part of a whole_rows x whole_cols matrix (the same, but under tensor parallelism).
struct MuonMatrix {
  int64_t offset = 0, rows = 0, cols = 0;
  bool decay = true;
  float lr_scale = 1;  // optim.muon_lr_scale's factor of lr for the whole matrix's shape
  int owner = 0;       // the data-group rank that iterates it
  // Under tensor parallelism: how the tensor group splits it (-1: whole on each of its ranks;
  // 0: by rows, 1: by columns, rank t holding the t-th block), and which of its ranks iterates
  // the whole.
  int split = -1;
  int tensor_owner = 0;
  int64_t whole_rows = 0, whole_cols = 0;
};

// The logical matrices of `layout`'s hidden tensors, in buffer order (owners 0): `layout` is a
// rank's part of the model under `tensor_ranks` (model/shard_layout.h), whose split tensors
// hold a part of each matrix.
std::vector<MuonMatrix> muon_matrices(const ParamLayout& layout, const std::string& lr_scale,
                                      int tensor_ranks = 1);

// optim.muon_lr_scale's factor for a matrix of `rows` (outputs) x `cols` (inputs).
float muon_lr_scale(const std::string& rule, int64_t rows, int64_t cols);

class Muon {
 public:
  // `data`: the communicator of the strategy's group, `tensor` the tensor group's (each null for
  // a group of one).
  Muon(const OptimSection& optim, const ParamLayout& local, const Strategy& strategy,
       Communicator* data, Communicator* tensor = nullptr);
  // The buffer's ranges Muon updates, sorted (Strategy::keep_one_moment's).
  Strategy::Units ranges() const;
  void plan(Arena& arena);
  // After clipping (sched's gradient scale and lr are set): the step over `shard`.
  void step(Backend& k, const ParamShard& shard, Tensor sched);
  const std::vector<MuonMatrix>& matrices() const { return matrices_; }
  // Sharded: the exchanges to owners and back a step (optim.muon_exchange_mb); else 0.
  int rounds() const { return static_cast<int>(rounds_.size()); }

 private:
  // A run of a matrix's values that one rank holds: global [begin, begin + n) of the buffer, at
  // `local` in its holder's shard, at `at` in the exchange buffer it travels in, and at `packed`
  // in its owner's packed batches.
  struct Piece {
    int64_t begin, n, local, at, packed;
    int matrix;
  };
  // The owner's matrices of one shape, packed [count, rows, cols] from `packed`, in the order
  // `members` lists them (indices of matrices_).
  struct Batch {
    int64_t rows, cols, count, packed;
    std::vector<int> members;
  };
  // How this rank packs and iterates a set of matrices (all of them, or a round's). Each rank
  // packs its split matrices first, by tensor owner (split_rows values for each), then the rest
  // in `batches` by shape; `size` is its packing, `slot` the largest rank's. As a tensor owner it
  // receives tensor_block values from each rank of the group (parts_rows), its own split
  // matrices' parts in matrix order, and iterates them whole (whole_size values), batched by
  // shape in whole_batches.
  struct Packing {
    std::vector<Batch> batches;
    int64_t size = 0, slot = 0;
    int64_t split_size = 0, tensor_block = 0, whole_size = 0;
    std::vector<int64_t> split_rows, parts_rows;
    std::vector<int> whole_members;
    std::vector<Batch> whole_batches;
  };
  // Sharded: one exchange of some matrices to their owners and back. held: the pieces this rank
  // sends (in its send order), received: those it receives as an owner.
  struct Round {
    Packing packing;
    std::vector<Piece> held, received;
    std::vector<int64_t> send_rows, recv_rows;
    int64_t send_size = 0, recv_size = 0;
  };
  void plan_owners();
  // Sets packed_at_, in_block_ and whole_at_ of `members` (indices of matrices_, ascending).
  Packing plan_packing(const std::vector<int>& members);
  void plan_replicated(const Strategy& strategy);
  // Every rank's pieces (`held`, by holder) into rounds: the same on every rank.
  std::vector<std::vector<int>> plan_rounds(const std::vector<std::vector<Piece>>& held) const;
  void plan_sharded(const Strategy& strategy);
  // Newton-Schulz over batch b's matrices [first, first + n), packed from `at` of `buf`.
  void iterate(Backend& k, Tensor buf, const Batch& b, int64_t at, int64_t n) const;
  // Every batch of `batches` in `buf`, in pieces of bounded scratch.
  void iterate_all(Backend& k, Tensor buf, const std::vector<Batch>& batches) const;
  // The owner's iteration of `p`'s matrices in `packed`: the split ones through their tensor
  // owners, the rest here.
  void orthogonalize(Backend& k, Tensor packed, const Packing& p);
  // Between the tensor exchange's buffer and the whole matrices: joins the parts (`join`), or
  // cuts the wholes into them.
  void join_parts(Backend& k, bool join, const Packing& p);
  int64_t local_of(const Strategy& strategy, int64_t begin, int64_t n) const;

  float momentum_, weight_decay_;
  int steps_;
  // optim.muon_exchange_mb in f32 values: a round's bound on each exchange buffer.
  int64_t exchange_values_;
  Communicator* comm_;
  Communicator* tensor_;
  int rank_ = 0, world_ = 1;
  int tensor_rank_ = 0, tensor_ranks_ = 1;
  bool sharded_ = false;
  std::vector<MuonMatrix> matrices_;
  // Per matrix: where its owner packs it, and as a tensor owner, where its parts arrive in the
  // tensor block and where it is joined whole (in its packing: all, or its round's).
  std::vector<int64_t> packed_at_, in_block_, whole_at_;
  std::vector<int64_t> local_at_;  // replicated: per matrix, its offset in the shard
  Packing packing_;                // replicated: every matrix's
  std::vector<Round> rounds_;      // sharded
  int64_t work_size_ = 0;
  // packed_: replicated state, the slots the all-gather reads (alone: one piece of a batch at a
  // time). Sharded, a round's packed batches live in send_, free between its two exchanges.
  // Each buffer is the largest round's (or packing's) need.
  Tensor packed_, gathered_, work_, send_, recv_, parts_, whole_;
};

}  // namespace kiln
