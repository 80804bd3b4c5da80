#include "train/optimizer.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace kiln {

void clip_and_adamw(Backend& k, const ParamShard& shard, const std::vector<AdamWPiece>& pieces,
                    Tensor sched, Tensor sumsq, Tensor decay_spans, const OptimizerStep& s) {
  // The 1/world rides on the clip factor AdamW multiplies g by: no pass over the gradients.
  k.grad_norm_clip(sched, sumsq, s.grad_clip, s.grad_scale);
  for (const AdamWPiece& p : pieces) {
    const Shape n{p.n};
    const Tensor working = shard.working.defined() ? shard.working.slice(p.local, n) : Tensor{};
    k.adamw_update(shard.master.slice(p.local, n), shard.grads.slice(p.local, n),
                   shard.m.slice(p.local, n), shard.v.slice(p.v_local, n), working, decay_spans,
                   p.begin, sched, s.hyper);
  }
}

OptimizerStep optimizer_step(const OptimSection& optim, int world) {
  OptimizerStep s;
  s.grad_clip = static_cast<float>(optim.grad_clip);
  s.hyper.beta1 = static_cast<float>(optim.beta1);
  s.hyper.beta2 = static_cast<float>(optim.beta2);
  s.hyper.eps = static_cast<float>(optim.eps);
  s.hyper.weight_decay = static_cast<float>(optim.weight_decay);
  s.grad_scale = 1.0f / static_cast<float>(world);
  return s;
}

void Optimizer::attach(const ParamLayout& local, Strategy& strategy, Communicator* data,
                       Communicator* tensor, bool log) {
  if (optim_.name != "muon") return;
  muon_ = std::make_unique<Muon>(optim_, local, strategy, data, tensor);
  strategy.keep_one_moment(muon_->ranges());
  if (!log) return;
  int64_t values = 0;
  for (const MuonMatrix& m : muon_->matrices()) values += m.rows * m.cols;
  const ShardPlan& plan = strategy.plan();
  spdlog::info(
      "optim.name=muon: {} matrices ({} of the rank's {} parameters) by Muon, {} Newton-Schulz "
      "steps, lr scaled {}, their iteration spread over {} rank{} ({}){}; AdamW for the rest",
      muon_->matrices().size(), values, local.total, optim_.muon_ns_steps, optim_.muon_lr_scale,
      plan.world, plan.world > 1 ? "s" : "",
      plan.world == 1         ? "alone"
      : strategy.replicated() ? "all-gathered"
      : muon_->rounds() > 1
          ? fmt::format("pieces to owners and back by all-to-all, in {} rounds of at most {} MiB",
                        muon_->rounds(), optim_.muon_exchange_mb)
          : std::string("pieces to owners and back by all-to-all"),
      tensor ? fmt::format(" x {} tensor ranks (each split matrix's parts joined on one by "
                           "all-to-all, iterated whole and sent back)",
                           tensor->world_size())
             : "");
}

void Optimizer::plan(Arena& arena, const ParamLayout& local) {
  if (muon_) muon_->plan(arena);
  arena.plan(&decay_spans_, "decay_spans", {static_cast<int64_t>(local.decay_spans.size()), 2},
             DType::i64);
  arena.plan(&sched_, "sched", {kSchedSize}, DType::f32);
  arena.plan(&sumsq_, "grad_sumsq", {1}, DType::f32);
}

void Optimizer::upload(Backend& k, const ParamLayout& local) {
  std::vector<int64_t> flat;
  for (const auto& [b, e] : local.decay_spans) {
    flat.push_back(b);
    flat.push_back(e);
  }
  k.copy_from_host(decay_spans_, flat.data());
}

void Optimizer::step(Backend& k, Strategy& strategy, const Nvtx& nvtx) {
  strategy.reduce_grads(sumsq_);
  Nvtx::Range range = nvtx.range("optimizer");
  clip_and_adamw(k, strategy.shard(), strategy.adamw_pieces(), sched_, sumsq_, decay_spans_, step_);
  if (muon_) muon_->step(k, strategy.shard(), sched_);
  range.end();
  strategy.after_update();
}

}  // namespace kiln
