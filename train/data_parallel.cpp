#include "train/data_parallel.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <limits>

namespace kiln {

DataParallel::DataParallel(const std::string& strategy, double bucket_mb, DType reduce_dtype,
                           Backend& backend, Model& model, Communicator* comm, int rank, int world)
    : strategy_(strategy), bucket_mb_(bucket_mb), reduce_dtype_(reduce_dtype), backend_(backend),
      model_(model), comm_(comm),
      plan_(make_shard_plan(strategy, model.layout().total, model.layout().units, rank, world)),
      unit_slot_(model.layout().units.size(), -1) {
  if (!sharded() && comm_ && world > 1) choose_buckets();
}

// dist.bucket_mb=0 picks by the link between the ranks. On one host whose GPUs NVLink joins, one
// bucket (one all-reduce after backward) measured 0.4-1.7% faster than 25 MiB buckets overlapped
// with backward in every comparison made (2 and 4 H200s, three sessions): the overlapped
// all-reduces slowed the compute beside them by about what they hid (docs/PERF.md). Over slower
// links overlap is what hides the communication (two socket "nodes": 31.9% of one GPU with
// 25 MiB buckets, 26.5% with one).
void DataParallel::choose_buckets() {
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

void DataParallel::plan_memory(Arena& arena) {
  const int64_t P = model_.layout().total, S = plan_.shard_size;
  const DType act = backend_.activation_dtype(), f32 = DType::f32;
  if (!sharded()) {
    arena.plan(&master_, "params.master", {P}, f32);
    if (act != f32) arena.plan(&working_, "params.working", {P}, act);
    arena.plan(&grads_, "grads", {P}, f32);
  } else {
    arena.plan(&master_, "params.master (shard)", {S}, f32);
    arena.plan(&grad_shard_, "grads (shard)", {S}, f32);
    if (act != f32) arena.plan(&working_shard_, "params.working (shard)", {S}, act);
  }
  arena.plan(&m_, sharded() ? "adamw.m (shard)" : "adamw.m", {S}, f32);
  arena.plan(&v_, sharded() ? "adamw.v (shard)" : "adamw.v", {S}, f32);
  if (plan_.strategy == "zero1") {
    const int64_t padded = plan_.chunks[0].chunk * plan_.world;
    arena.plan(&working_, "params.working (full)", {padded}, act);
    arena.plan(&grads_, "grads (full)", {padded}, f32);
    if (reduce_bf16()) {
      arena.plan(&reduce_full_, "grads.bf16 (full, for the reduce)", {padded}, DType::bf16);
      arena.plan(&reduce_shard_, "grads.bf16 (shard, reduced)", {S}, DType::bf16);
    }
  } else if (fsdp()) {
    int64_t widest = 1, widest_chunk = 1;
    for (size_t u = 1; u < plan_.chunks.size(); ++u)
      widest = std::max(widest, plan_.chunks[u].chunk * plan_.world);
    for (const auto& c : plan_.chunks) widest_chunk = std::max(widest_chunk, c.chunk);
    const int64_t unit0 = plan_.chunks[0].chunk * plan_.world;
    const char* names[3] = {"fsdp.unit0", "fsdp.gather.a", "fsdp.gather.b"};
    for (int s = 0; s < 3; ++s) {
      const int64_t n = s == 0 ? unit0 : widest;
      arena.plan(&unit_params_[s], std::string(names[s]) + ".params", {n}, act);
      arena.plan(&unit_grads_[s], std::string(names[s]) + ".grads", {n}, f32);
    }
    arena.plan(&scatter_tmp_, "fsdp.scatter_tmp", {widest_chunk}, f32);
    if (reduce_bf16()) {  // every unit's grads pass through it, the embeddings' too
      arena.plan(&reduce_full_, "fsdp.grads.bf16 (for the reduce)", {std::max(widest, unit0)},
                 DType::bf16);
      arena.plan(&reduce_shard_, "fsdp.scatter_tmp.bf16", {widest_chunk}, DType::bf16);
    }
  } else if (reduce_bf16()) {
    arena.plan(&reduce_full_, "grads.bf16 (for the all-reduce)", {P}, DType::bf16);
  }
}

void DataParallel::bind() {
  if (!sharded()) {
    if (!working_.defined()) working_ = master_;
    grad_shard_ = grads_;
  }
  gather_src_ = working_shard_.defined() ? working_shard_ : master_;
  if (fsdp()) {
    // Forward runs units 0, 1, ..., last and backward last, ..., 1, 0: each hook prefetches the
    // unit after the one it readies, so that unit's all-gather runs beside this one's compute.
    const int last = static_cast<int>(plan_.chunks.size()) - 1;
    hooks_.before_forward = [this, last](int unit) { use_unit(unit, unit < last ? unit + 1 : -1); };
    hooks_.before_backward = [this, last](int unit) {
      use_unit(unit, unit > 1 ? unit - 1 : -1);  // unit 0 stays in its slot from the forward
      // Unit 0's grads also collect the tied head's, which runs first in backward.
      if (unit == last) backend_.fill_zero(unit_grads_[0]);
      if (unit != 0) backend_.fill_zero(unit_grads_[unit_slot_[static_cast<size_t>(unit)]]);
    };
    hooks_.after_backward = [this](int unit) { scatter_unit_grads(unit); };
    model_.set_hooks(&hooks_);
    return;
  }
  model_.bind_weights(flat_params(working_));
  model_.bind_grads(flat_params(grads_));
  if (!sharded()) {
    hooks_.after_backward = [this](int unit) { after_backward_ddp(unit); };
    model_.set_hooks(&hooks_);
  }
}

// Collectives whose results the next op consumes wait for them right away; DDP's bucket
// all-reduces (after_backward_ddp) do not, so they overlap the rest of backward until
// optimizer_step().
void DataParallel::all_reduce(Tensor t) {
  if (!comm_ || plan_.world == 1) return;
  comm_->all_reduce_sum(t);
  comm_->wait();
}

void DataParallel::all_gather(Tensor out, Tensor in, bool overlap) {
  if (!comm_ || plan_.world == 1) return backend_.copy(out, in);
  comm_->all_gather(out, in);
  if (!overlap) comm_->wait();
}

void DataParallel::reduce_scatter(Tensor out, Tensor in) {
  if (!comm_ || plan_.world == 1) return backend_.copy(out, in);
  comm_->reduce_scatter_sum(out, in);
  comm_->wait();
}

void DataParallel::reduce_scatter_grads(Tensor out, Tensor in, bool accumulate) {
  const int64_t n = out.numel();
  const Tensor sum = accumulate ? scatter_tmp_.slice(0, {n}) : out;  // f32
  if (reduce_bf16()) {
    const Tensor low_in = reduce_full_.slice(0, {in.numel()});
    const Tensor low_out = reduce_shard_.slice(0, {n});
    backend_.copy(low_in, in);
    reduce_scatter(low_out, low_in);
    backend_.copy(sum, low_out);
  } else {
    reduce_scatter(sum, in);
  }
  if (accumulate) backend_.add(out, sum);
}

void DataParallel::gather_working() { all_gather(working_, gather_src_); }

void DataParallel::bind_units() {
  const ParamLayout& layout = model_.layout();
  auto place = [&](const Tensor* slots) {
    return [&, slots](const ParamInfo& info) {
      const int slot = unit_slot_[static_cast<size_t>(info.unit)];
      if (slot < 0) return Tensor{};
      const int64_t unit_begin = layout.units[static_cast<size_t>(info.unit)].first;
      return slots[slot].slice(info.offset - unit_begin, info.shape);
    };
  };
  model_.bind_weights(place(unit_params_));
  model_.bind_grads(place(unit_grads_));
}

// Issues the all-gather of `unit` into its slot unless the slot holds it already. The unit that
// held the slot is done with: its ops are enqueued, and the gather runs after them.
void DataParallel::gather_unit(int unit) {
  const int slot = unit == 0 ? 0 : 1 + unit % 2;
  if (held_[slot] == unit) return;
  const ShardChunk& c = plan_.chunks[static_cast<size_t>(unit)];
  all_gather(unit_params_[slot].slice(0, {c.chunk * plan_.world}),
             gather_src_.slice(c.local, {c.chunk}), /*overlap=*/true);
  if (held_[slot] >= 0) unit_slot_[static_cast<size_t>(held_[slot])] = -1;
  held_[slot] = unit;
  unit_slot_[static_cast<size_t>(unit)] = slot;
}

void DataParallel::use_unit(int unit, int prefetch) {
  gather_unit(unit);
  if (comm_) comm_->wait();  // before the prefetch, which runs on beside this unit's compute
  if (prefetch >= 0) gather_unit(prefetch);
  bind_units();
}

void DataParallel::scatter_unit_grads(int unit) {
  const ShardChunk& c = plan_.chunks[static_cast<size_t>(unit)];
  const Tensor full = unit_grads_[unit_slot_[static_cast<size_t>(unit)]].slice(0, {c.chunk * plan_.world});
  reduce_scatter_grads(grad_shard_.slice(c.local, {c.chunk}), full, /*accumulate=*/micro_ > 0);
}

void DataParallel::after_backward_ddp(int unit) {
  if (!last_micro_ || !comm_ || plan_.world == 1) return;
  const int64_t begin = model_.layout().units[static_cast<size_t>(unit)].first;
  const double pending_mb = static_cast<double>(ddp_pending_end_ - begin) * 4.0 / (1 << 20);
  if (pending_mb >= bucket_mb_ || unit == 0) {
    const Shape n{ddp_pending_end_ - begin};
    Tensor bucket = grads_.slice(begin, n);
    if (reduce_bf16()) {
      // Rounded on the compute stream, where the bucket's gradients were just finished.
      backend_.copy(reduce_full_.slice(begin, n), bucket);
      bucket = reduce_full_.slice(begin, n);
    }
    // Not waited for here: optimizer_step() does. The last bucket (unit 0's) starts after
    // backward, with no compute beside it, so it may take all of NCCL's SMs.
    if (unit == 0)
      comm_->all_reduce_sum(bucket);
    else
      comm_->all_reduce_sum_overlapped(bucket);
    ddp_pending_end_ = begin;
  }
}

void DataParallel::zero_grads() {
  backend_.fill_zero(grads_.defined() ? grads_ : grad_shard_);
  ddp_pending_end_ = model_.layout().total;
}

// After the master weights change outside an optimizer step: the working copies follow.
void DataParallel::refresh_working() {
  if (working_shard_.defined()) backend_.copy(working_shard_, master_);
  if (!sharded() && working_.data != master_.data) backend_.copy(working_, master_);
  if (plan_.strategy == "zero1") gather_working();
  std::fill(std::begin(held_), std::end(held_), -1);
}

void DataParallel::load_parameters(const std::vector<float>& host_params) {
  std::vector<float> shard(static_cast<size_t>(plan_.shard_size), 0.0f);
  for (const auto& o : plan_.owned)
    std::copy(host_params.begin() + o.begin, host_params.begin() + o.end, shard.begin() + o.local);
  backend_.copy_from_host(master_, shard.data());
  backend_.fill_zero(m_);
  backend_.fill_zero(v_);
  refresh_working();
}

void DataParallel::load_checkpoint(const CheckpointManifest& manifest) {
  for (const auto& o : plan_.owned) {
    const int64_t n = o.end - o.begin;
    std::vector<float> master(static_cast<size_t>(n)), m(master.size()), v(master.size());
    load_optimizer_range(manifest, model_.layout(), o.begin, o.end, master.data(), m.data(), v.data());
    backend_.copy_from_host(master_.slice(o.local, {n}), master.data());
    backend_.copy_from_host(m_.slice(o.local, {n}), m.data());
    backend_.copy_from_host(v_.slice(o.local, {n}), v.data());
  }
  refresh_working();
}

DataParallel::HostShards DataParallel::checkpoint_shards() {
  HostShards h;
  if (!sharded() && plan_.rank != 0) return h;  // replicated: rank 0 writes it all
  for (const auto& o : plan_.owned) {
    const int64_t n = o.end - o.begin;
    h.master.emplace_back(static_cast<size_t>(n));
    h.m.emplace_back(static_cast<size_t>(n));
    h.v.emplace_back(static_cast<size_t>(n));
    backend_.copy_to_host(h.master.back().data(), master_.slice(o.local, {n}));
    backend_.copy_to_host(h.m.back().data(), m_.slice(o.local, {n}));
    backend_.copy_to_host(h.v.back().data(), v_.slice(o.local, {n}));
  }
  for (size_t i = 0; i < plan_.owned.size(); ++i)
    h.shards.push_back({plan_.owned[i].begin, plan_.owned[i].end, h.master[i].data(),
                        h.m[i].data(), h.v[i].data()});
  return h;
}

void DataParallel::optimizer_step(Tensor sched, Tensor sumsq, Tensor decay_spans,
                                  const OptimizerStep& step) {
  Backend& k = backend_;
  if (comm_) comm_->wait();  // DDP's bucket all-reduces
  if (!sharded() && reduce_bf16()) k.copy(grads_, reduce_full_);
  if (plan_.strategy == "zero1") reduce_scatter_grads(grad_shard_, grads_, /*accumulate=*/false);
  k.sum_squares(sumsq, grad_shard_, false);
  if (sharded()) all_reduce(sumsq);
  // Each rank's loss is the mean over its own tokens, so the gradient is the mean of the
  // summed ones.
  OptimizerStep s = step;
  s.grad_scale = 1.0f / static_cast<float>(plan_.world);
  const Tensor working = working_shard_.defined() ? working_shard_
                         : (!sharded() && working_.data != master_.data) ? working_
                                                                         : Tensor{};
  clip_and_adamw(k, {master_, grad_shard_, m_, v_, working}, plan_.owned, sched, sumsq,
                 decay_spans, s);
  if (plan_.strategy == "zero1") gather_working();
  std::fill(std::begin(held_), std::end(held_), -1);
}

}  // namespace kiln
