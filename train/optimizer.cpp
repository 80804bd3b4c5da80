#include "train/optimizer.h"

namespace kiln {

void clip_and_adamw(Backend& k, const ParamShard& shard, const std::vector<OwnedRange>& owned,
                    Tensor sched, Tensor sumsq, Tensor decay_spans, const OptimizerStep& s) {
  // The 1/world rides on the clip factor AdamW multiplies g by: no pass over the gradients.
  k.grad_norm_clip(sched, sumsq, s.grad_clip, s.grad_scale);
  for (const OwnedRange& o : owned) {
    const Shape n{o.end - o.begin};
    const Tensor working = shard.working.defined() ? shard.working.slice(o.local, n) : Tensor{};
    k.adamw_update(shard.master.slice(o.local, n), shard.grads.slice(o.local, n),
                   shard.m.slice(o.local, n), shard.v.slice(o.local, n), working, decay_spans,
                   o.begin, sched, s.hyper);
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

void Optimizer::plan(Arena& arena, const ParamLayout& local) {
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
  clip_and_adamw(k, strategy.shard(), strategy.plan().owned, sched_, sumsq_, decay_spans_, step_);
  range.end();
  strategy.after_update();
}

}  // namespace kiln
