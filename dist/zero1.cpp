// zero1 (ZeRO stage 1): every rank holds the full working parameters and gradients, but the
// master weights and AdamW moments only of its chunk of the padded flat buffer. Gradients are
// reduce-scattered after the last micro-batch, each rank updates its chunk, and the updated
// working parameters are all-gathered for the next forward.
#include "dist/strategy.h"

namespace kiln {

namespace {

class Zero1 final : public Strategy {
 public:
  using Strategy::Strategy;

  void plan_memory(Arena& arena) override {
    plan_shard(arena, /*sharded=*/true);
    const DType act = backend_.activation_dtype();
    if (act != DType::f32)
      arena.plan(&working_shard_, "params.working (shard)", {plan_.shard_size}, act);
    const int64_t padded = plan_.chunks[0].chunk * plan_.world;
    arena.plan(&working_, "params.working (full)", {padded}, act);
    arena.plan(&grads_, "grads (full)", {padded}, DType::f32);
    if (reduce_bf16()) {
      arena.plan(&reduce_full_, "grads.bf16 (full, for the reduce)", {padded}, DType::bf16);
      arena.plan(&reduce_shard_, "grads.bf16 (shard, reduced)", {plan_.shard_size}, DType::bf16);
    }
  }
  void bind() override { gather_src_ = working_shard_.defined() ? working_shard_ : master_; }
  Tensor unit_params(int unit) const override { return unit_range(working_, unit); }
  Tensor unit_grads(int unit) const override { return unit_range(grads_, unit); }

  void zero_grads() override { backend_.fill_zero(grads_); }
  void reduce_grads(Tensor sumsq) override {
    if (comm_) comm_->wait();
    reduce_scatter_grads(grad_shard_, grads_, /*accumulate=*/false, Tensor{});
    finish_reduce(sumsq, /*sharded=*/true);
  }
  void after_update() override {
    all_gather(working_, gather_src_);
    refresh_f32_reads();
  }
  void refresh_working() override {
    if (working_shard_.defined()) backend_.copy(working_shard_, master_);
    after_update();
  }
  Tensor full_working() const override { return working_; }

 protected:
  Tensor working_out() const override { return working_shard_; }

 private:
  Tensor working_shard_, working_, grads_;
  Tensor gather_src_;  // what the all-gather reads: the working shard, or the master (CPU)
};

}  // namespace

std::unique_ptr<Strategy> make_zero1(const StrategyOptions& o, Backend& backend, Communicator* comm,
                                     int rank, int world, int64_t total,
                                     const Strategy::Units& units) {
  return std::make_unique<Zero1>(o, backend, comm, rank, world, total, units);
}

}  // namespace kiln
