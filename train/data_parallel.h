// DataParallel: where parameters, gradients and AdamW state live under dist.strategy, and how
// they are synchronized across ranks. The trainer asks it to zero grads, runs micro-batches
// (the model calls its unit hooks), then calls optimizer_step(); it never touches a collective
// itself.
//  - ddp:   replicated state; gradients all-reduced in buckets of dist.bucket_mb as units finish
//           their backward on the last micro-batch, overlapping the rest of backward (NCCL runs
//           them on its own stream; optimizer_step() waits for them). dist.bucket_mb=0: one
//           bucket where NVLink joins every rank on one host, 25 MiB elsewhere.
//  - zero1: full working params and grads; gradients reduce-scattered, each rank updates its
//           chunk of master weights and moments, updated params all-gathered.
//  - fsdp:  only shards persist. Each unit's params are all-gathered into a gather buffer (two
//           rotating buffers for the blocks, one kept for the embeddings, which the tied head
//           reuses) one unit ahead, while the unit before it computes, and its grads
//           reduce-scattered into the shard right after its backward, every micro-batch.
// dist.reduce_dtype=bf16 sums gradients across ranks in bf16: each rank rounds its f32
// gradients to bf16 (a cast into a buffer of their own) just before the collective, and the
// summed result is widened back to f32 for the norm and AdamW. Half the bytes on the wire and in
// the collective's memory traffic; accumulation over micro-batches stays f32.
#pragma once

#include <vector>

#include "dist/communicator.h"
#include "dist/sharding.h"
#include "kernels/arena.h"
#include "model/model.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"

namespace kiln {

class DataParallel {
 public:
  // strategy: ddp | zero1 | fsdp; reduce_dtype: f32 or bf16 (see above).
  DataParallel(const std::string& strategy, double bucket_mb, DType reduce_dtype,
               Backend& backend, Model& model, Communicator* comm, int rank, int world);

  const ShardPlan& plan() const { return plan_; }
  // Plans every parameter/gradient/optimizer buffer into `arena`; call bind() after allocate.
  void plan_memory(Arena& arena);
  void bind();

  // Full fp32 parameters (host, layout.total) -> this rank's state; moments left at zero.
  void load_parameters(const std::vector<float>& host_params);
  // This rank's owned ranges from a checkpoint.
  void load_checkpoint(const CheckpointManifest& manifest);
  // Host copies of this rank's owned ranges (ddp: rank 0 only), for save_checkpoint.
  struct HostShards {
    std::vector<std::vector<float>> master, m, v;
    std::vector<OptimizerShard> shards;
  };
  HostShards checkpoint_shards();

  // Before the first micro-batch of a step.
  void zero_grads();
  // Before each micro-batch: the last one triggers DDP's bucketed all-reduce.
  void set_micro_batch(int micro, int grad_accum) {
    micro_ = micro;
    last_micro_ = micro + 1 == grad_accum;
  }
  // After all micro-batches: finish gradient sync, global-norm clip, AdamW, refresh params.
  // step.grad_scale is set here (1/world).
  void optimizer_step(Tensor sched, Tensor sumsq, Tensor decay_spans, const OptimizerStep& step);
  // Weights in the working dtype for sampling; undefined under fsdp (never held whole).
  Tensor full_working() const { return plan_.strategy == "fsdp" ? Tensor{} : working_; }

 private:
  bool fsdp() const { return plan_.strategy == "fsdp"; }
  bool sharded() const { return plan_.strategy != "ddp"; }
  // Gradients go through a bf16 copy for the collectives (never with one rank: nothing to sum).
  bool reduce_bf16() const { return reduce_dtype_ == DType::bf16 && plan_.world > 1; }
  void all_reduce(Tensor t);
  void all_gather(Tensor out, Tensor in, bool overlap = false);
  void reduce_scatter(Tensor out, Tensor in);
  // out (f32 shard) = sum over ranks of chunk `rank` of in (f32), in the reduce dtype;
  // `accumulate`: out += instead.
  void reduce_scatter_grads(Tensor out, Tensor in, bool accumulate);
  void gather_working();          // zero1: every chunk -> full working params
  void refresh_working();         // working copies from the master weights
  void gather_unit(int unit);     // fsdp: issue a unit's all-gather (not waited for)
  // fsdp: `unit`'s params gathered and bound, and the all-gather of `prefetch` (>= 0) issued.
  void use_unit(int unit, int prefetch);
  void scatter_unit_grads(int unit);
  void bind_units();              // fsdp: point the model at the current gather buffers
  void after_backward_ddp(int unit);
  void choose_buckets();          // ddp: resolves dist.bucket_mb=0 and says what it runs

  std::string strategy_;
  double bucket_mb_;
  DType reduce_dtype_;
  Backend& backend_;
  Model& model_;
  Communicator* comm_;
  ShardPlan plan_;
  UnitHooks hooks_;
  int micro_ = 0;
  bool last_micro_ = true;
  int64_t ddp_pending_end_ = 0;

  Tensor master_, m_, v_, grad_shard_, working_shard_;  // shard buffers (ddp: everything)
  Tensor working_, grads_;                              // full buffers (ddp, zero1)
  Tensor gather_src_;                                   // what all-gathers read: master or working shard
  // reduce_dtype bf16: ddp's whole gradient (zero1: padded) or fsdp's widest unit, and a shard.
  Tensor reduce_full_, reduce_shard_;
  // fsdp: slot 0 holds unit 0 (embeddings) for the whole step, slots 1-2 rotate the rest.
  Tensor unit_params_[3], unit_grads_[3], scatter_tmp_;
  int held_[3] = {-1, -1, -1};
  std::vector<int> unit_slot_;
};

}  // namespace kiln
