// fsdp: only shards persist. Each unit's parameters are all-gathered into a gather buffer (two
// rotating buffers for the blocks, one for the embeddings, which the tied head reuses and an
// untied head takes in turn) one unit ahead, while the unit before it computes, and its gradients
// are reduce-scattered into the shard right after its backward, every micro-batch, beside the next
// unit's backward: the compute stream waits for a unit's gather alone (a mark on the comm stream),
// and for its reduce-scatter only at the next unit's end. The model calls the unit hooks inside
// each unit, so a unit is gathered just before its first op and scattered just after its last.
#include <algorithm>

#include "dist/strategy.h"

namespace kiln {

namespace {

class Fsdp final : public Strategy {
 public:
  Fsdp(const StrategyOptions& o, Backend& backend, Communicator* comm, int rank, int world,
       int64_t total, const Units& units)
      : Strategy(o, backend, comm, rank, world, total, units),
        head_reads_embeddings_(o.head_reads_embeddings),
        unit_slot_(units.size(), -1) {}

  void plan_memory(Arena& arena) override;
  void bind() override { gather_src_ = working_shard_.defined() ? working_shard_ : master_; }
  Tensor unit_params(int unit) const override { return in_slot(unit_params_, unit); }
  Tensor unit_grads(int unit) const override { return in_slot(unit_grads_, unit); }

  // Forward runs units 0, 1, ..., last and backward last, ..., 1, 0: each hook prefetches the
  // unit after the one it readies, so that unit's all-gather runs beside this one's compute.
  void before_forward(int unit) override { use_unit(unit, unit < last() ? unit + 1 : -1); }
  void before_backward(int unit) override {
    // Unit 0 stays in its slot from the forward, unless the untied head took the slot since.
    use_unit(unit, unit > 1 || (unit == 1 && !head_reads_embeddings_) ? unit - 1 : -1);
    // Unit 0's grads also collect the tied head's, which runs first in backward.
    if (unit == last() && head_reads_embeddings_) backend_.fill_zero(unit_grads_[0]);
    if (unit != 0 || !head_reads_embeddings_)
      backend_.fill_zero(unit_grads_[unit_slot_[static_cast<size_t>(unit)]]);
  }
  void after_backward(int unit) override;

  void zero_grads() override { backend_.fill_zero(grad_shard_); }
  void reduce_grads(Tensor sumsq) override {
    finish_scatter_grads();
    if (comm_) comm_->wait();
    finish_reduce(sumsq, /*sharded=*/true);
  }
  void after_update() override { forget_placement(); }
  void forget_placement() override { std::fill(std::begin(held_), std::end(held_), -1); }
  bool holds_whole_model() const override { return false; }
  void refresh_working() override {
    if (working_shard_.defined()) backend_.copy(working_shard_, master_);
    after_update();
  }

 protected:
  Tensor working_out() const override { return working_shard_; }

 private:
  int last() const { return static_cast<int>(plan_.chunks.size()) - 1; }
  // Slot 0 holds the embeddings (unit 0). A tied head reads them, so they stay for the whole
  // step; an untied head, as wide as they are, takes slot 0 after their forward and gives it back
  // before their backward, so slots 1-2 need only be as wide as a block.
  int slot_of(int unit) const {
    return unit == 0 || (unit == last() && !head_reads_embeddings_) ? 0 : 1 + unit % 2;
  }
  Tensor in_slot(const Tensor* slots, int unit) const {
    const int slot = unit_slot_[static_cast<size_t>(unit)];
    if (slot < 0) return Tensor{};
    const auto& [begin, end] = units_[static_cast<size_t>(unit)];
    return slots[slot].slice(0, {end - begin});
  }
  void gather_unit(int unit);
  void use_unit(int unit, int prefetch);

  const bool head_reads_embeddings_;
  Tensor working_shard_;
  Tensor gather_src_;  // what all-gathers read: the working shard, or the master (CPU)
  // Slot 0 holds unit 0 (and an untied head in turn), slots 1-2 rotate the rest.
  Tensor unit_params_[3], unit_grads_[3], scatter_tmp_;
  int held_[3] = {-1, -1, -1};
  uint64_t gathered_[3] = {0, 0, 0};  // the comm stream's mark after each slot's gather
  std::vector<int> unit_slot_;
};

void Fsdp::plan_memory(Arena& arena) {
  plan_shard(arena, /*sharded=*/true);
  const DType act = backend_.activation_dtype();
  if (act != DType::f32)
    arena.plan(&working_shard_, "params.working (shard)", {plan_.shard_size}, act);
  int64_t widest = 1, widest_chunk = 1, unit0 = 1;
  for (size_t u = 0; u < plan_.chunks.size(); ++u) {
    const int64_t n = plan_.chunks[u].chunk * plan_.world;
    int64_t& in = slot_of(static_cast<int>(u)) == 0 ? unit0 : widest;
    in = std::max(in, n);
    widest_chunk = std::max(widest_chunk, plan_.chunks[u].chunk);
  }
  const char* names[3] = {"fsdp.unit0", "fsdp.gather.a", "fsdp.gather.b"};
  for (int s = 0; s < 3; ++s) {
    const int64_t n = s == 0 ? unit0 : widest;
    arena.plan(&unit_params_[s], std::string(names[s]) + ".params", {n}, act);
    arena.plan(&unit_grads_[s], std::string(names[s]) + ".grads", {n}, DType::f32);
  }
  arena.plan(&scatter_tmp_, "fsdp.scatter_tmp", {widest_chunk}, DType::f32);
  if (reduce_bf16()) {  // every unit's grads pass through it, the embeddings' too
    arena.plan(&reduce_full_, "fsdp.grads.bf16 (for the reduce)", {std::max(widest, unit0)},
               DType::bf16);
    arena.plan(&reduce_shard_, "fsdp.scatter_tmp.bf16", {widest_chunk}, DType::bf16);
  }
}

// Issues the all-gather of `unit` into its slot unless the slot holds it already. The unit that
// held the slot is done with: its ops are enqueued, and the gather runs after them.
void Fsdp::gather_unit(int unit) {
  const int slot = slot_of(unit);
  if (held_[slot] == unit) return;
  const ShardChunk& c = plan_.chunks[static_cast<size_t>(unit)];
  all_gather(unit_params_[slot].slice(0, {c.chunk * plan_.world}),
             gather_src_.slice(c.local, {c.chunk}), /*overlap=*/true);
  if (comm_) gathered_[slot] = comm_->mark();
  if (held_[slot] >= 0) unit_slot_[static_cast<size_t>(held_[slot])] = -1;
  held_[slot] = unit;
  unit_slot_[static_cast<size_t>(unit)] = slot;
}

// `unit`'s params gathered and placed, and the all-gather of `prefetch` (>= 0) issued.
void Fsdp::use_unit(int unit, int prefetch) {
  gather_unit(unit);
  // This unit's gather only: a reduce-scatter issued after it runs on beside this unit's compute,
  // and so does the prefetch, issued after the wait.
  if (comm_) comm_->wait_until(gathered_[slot_of(unit)]);
  if (prefetch >= 0) gather_unit(prefetch);
  if (on_placement_changed) on_placement_changed();
}

void Fsdp::after_backward(int unit) {
  const ShardChunk& c = plan_.chunks[static_cast<size_t>(unit)];
  const Tensor full =
      unit_grads_[unit_slot_[static_cast<size_t>(unit)]].slice(0, {c.chunk * plan_.world});
  // Finished at the next unit's end (issue_scatter_grads finishes the one before), or here for
  // unit 0, the last: the next micro-batch's backward zeroes its grads first.
  issue_scatter_grads(grad_shard_.slice(c.local, {c.chunk}), full, /*accumulate=*/micro_ > 0,
                      scatter_tmp_);
  if (unit == 0) finish_scatter_grads();
}

}  // namespace

std::unique_ptr<Strategy> make_fsdp(const StrategyOptions& o, Backend& backend, Communicator* comm,
                                    int rank, int world, int64_t total,
                                    const Strategy::Units& units) {
  return std::make_unique<Fsdp>(o, backend, comm, rank, world, total, units);
}

}  // namespace kiln
