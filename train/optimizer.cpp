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

}  // namespace kiln
