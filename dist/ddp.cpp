// ddp: every rank holds all parameters, gradients and AdamW state. Gradients are all-reduced in
// buckets of dist.bucket_mb as units finish their backward on the last micro-batch, overlapping
// the rest of backward (NCCL runs them on its own stream; reduce_grads() waits for them).
// dist.bucket_mb=0 picks by the link between the ranks: one bucket (one all-reduce after
// backward) where NVLink joins every rank on one host, 25 MiB buckets elsewhere.
#include <spdlog/spdlog.h>

#include <limits>

#include "dist/strategy.h"

namespace kiln {

namespace {

class Ddp final : public Strategy {
 public:
  Ddp(const StrategyOptions& o, Backend& backend, Communicator* comm, int rank, int world,
      int64_t total, const Units& units)
      : Strategy(o, backend, comm, rank, world, total, units), bucket_mb_(o.bucket_mb) {
    if (comm_ && world > 1) choose_buckets();
  }

  void plan_memory(Arena& arena) override {
    plan_shard(arena, /*sharded=*/false);
    const DType act = backend_.activation_dtype();
    if (act != DType::f32) arena.plan(&working_, "params.working", {plan_.total}, act);
    if (reduce_bf16())
      arena.plan(&reduce_full_, "grads.bf16 (for the all-reduce)", {plan_.total}, DType::bf16);
  }
  void bind() override {
    if (!working_.defined()) working_ = master_;
  }
  Tensor unit_params(int unit) const override { return unit_range(working_, unit); }
  Tensor unit_grads(int unit) const override { return unit_range(grad_shard_, unit); }

  void after_backward(int unit) override;
  void zero_grads() override {
    backend_.fill_zero(grad_shard_);
    pending_end_ = plan_.total;
  }
  void reduce_grads(Tensor sumsq) override {
    if (comm_) comm_->wait();  // the bucket all-reduces
    if (reduce_bf16()) backend_.copy(grad_shard_, reduce_full_);
    finish_reduce(sumsq, /*sharded=*/false);
  }
  void after_update() override {}
  void refresh_working() override {
    if (working_.data != master_.data) backend_.copy(working_, master_);
  }
  Tensor full_working() const override { return working_; }
  bool replicated() const override { return true; }

 protected:
  Tensor working_out() const override {
    return working_.data != master_.data ? working_ : Tensor{};
  }

 private:
  void choose_buckets();

  double bucket_mb_;
  int64_t pending_end_ = 0;  // gradients [bucket start, pending_end_) wait for their all-reduce
  Tensor working_;
};

// dist.bucket_mb=0 picks by the link between the ranks. On one host whose GPUs NVLink joins, one
// bucket (one all-reduce after backward) measured 0.4-1.7% faster than 25 MiB buckets overlapped
// with backward in every comparison made (2 and 4 H200s, 2026-11-21: docs/perf-history.md,
// 233c71a, 115316e..cf4a327, d7bc358..4ec664e): the overlapped all-reduces slowed the compute
// beside them by about what they hid. Over slower links overlap is what hides the communication
// (two socket "nodes": 31.9% of one GPU with 25 MiB buckets, 26.5% with one).
void Ddp::choose_buckets() {
  std::string why = "dist.bucket_mb=" + fmt::format("{:g}", bucket_mb_);
  if (bucket_mb_ == 0) {
    std::string link;
    const bool one_bucket = comm_->nvlink_joined(&link);
    bucket_mb_ = one_bucket ? std::numeric_limits<double>::infinity() : 25.0;
    why = "dist.bucket_mb=0: " + link;
  }
  if (plan_.rank != 0) return;
  if (bucket_mb_ == std::numeric_limits<double>::infinity())
    spdlog::info("ddp: gradients all-reduced in one bucket after backward ({})", why);
  else
    spdlog::info("ddp: gradients all-reduced in {:g} MiB buckets while backward runs ({})",
                 bucket_mb_, why);
}

void Ddp::after_backward(int unit) {
  if (!last_micro_ || !comm_ || plan_.world == 1) return;
  const int64_t begin = units_[static_cast<size_t>(unit)].first;
  const double pending_mb = static_cast<double>(pending_end_ - begin) * 4.0 / (1 << 20);
  if (pending_mb >= bucket_mb_ || unit == 0) {
    const Shape n{pending_end_ - begin};
    Tensor bucket = grad_shard_.slice(begin, n);
    if (reduce_bf16()) {
      // Rounded on the compute stream, where the bucket's gradients were just finished.
      backend_.copy(reduce_full_.slice(begin, n), bucket);
      bucket = reduce_full_.slice(begin, n);
    }
    // Not waited for here: reduce_grads() does. The last bucket (unit 0's) starts after
    // backward, with no compute beside it, so it may take all of NCCL's SMs.
    if (unit == 0)
      comm_->all_reduce_sum(bucket);
    else
      comm_->all_reduce_sum_overlapped(bucket);
    pending_end_ = begin;
  }
}

}  // namespace

std::unique_ptr<Strategy> make_ddp(const StrategyOptions& o, Backend& backend, Communicator* comm,
                                   int rank, int world, int64_t total,
                                   const Strategy::Units& units) {
  return std::make_unique<Ddp>(o, backend, comm, rank, world, total, units);
}

}  // namespace kiln
