// The contracts of the reductions and the optimizer's ops (kernels/contracts.h says what a
// contract is), in kernels/ops.def's order: the sums, the global-norm clip and the schedule,
// AdamW, Muon (momentum, Newton-Schulz, update) and add.
#include <string>

#include "kernels/contracts.h"

namespace kiln::contract {

namespace {

void check_reduction(const OpCheck& c, const Tensor& out, const Tensor& x) {
  c.f32("out", out);
  c.numel("out", out, 1);
  c.f32_or_activation("x", x);
}

void check_sched(const OpCheck& c, const Tensor& sched) {
  c.f32("sched", sched);
  c.numel("sched", sched, kSchedSize);
}

}  // namespace

void reduce_sum(const OpCheck& c, Tensor out, Tensor x, bool accumulate) {
  check_reduction(c, out, x);
}

void sum_squares(const OpCheck& c, Tensor out, Tensor x, bool accumulate) {
  check_reduction(c, out, x);
}

void grad_norm_clip(const OpCheck& c, Tensor sched, Tensor sumsq, float max_norm,
                    float grad_scale) {
  check_sched(c, sched);
  c.f32("sumsq", sumsq);
  c.numel("sumsq", sumsq, 1);
}

void set_schedule(const OpCheck& c, Tensor sched, float lr, int step) {
  check_sched(c, sched);
  if (step < 1)
    c.fail("step", "must be >= 1 (1-based for bias correction), got " + std::to_string(step));
}

void adamw_update(const OpCheck& c, Tensor master, Tensor grads, Tensor m, Tensor v, Tensor working,
                  Tensor decay_spans, int64_t offset, Tensor sched, const AdamWHyper& hyper) {
  c.f32("master", master);
  const int64_t n = master.numel();
  c.f32("grads", grads);
  c.numel("grads", grads, n);
  c.f32("m", m);
  c.numel("m", m, n);
  c.f32("v", v);
  c.numel("v", v, n);
  check_sched(c, sched);
  if (working.defined()) {
    c.defined("working", working);
    if (working.dtype != DType::f32 && working.dtype != DType::bf16)
      c.fail("working", "expected dtype f32 or bf16, got " + working.str());
    c.numel("working", working, n);
  }
  if (decay_spans.defined()) {
    c.dtype("decay_spans", decay_spans, DType::i64);
    c.ndim("decay_spans", decay_spans, 2);
    c.dim("decay_spans", decay_spans, 1, 2);
  }
}

void muon_momentum(const OpCheck& c, Tensor momentum, Tensor nesterov, Tensor grads, Tensor sched,
                   float mu) {
  c.f32("momentum", momentum);
  const int64_t n = momentum.numel();
  c.f32("grads", grads);
  c.numel("grads", grads, n);
  if (nesterov.defined()) {
    c.f32("nesterov", nesterov);
    c.numel("nesterov", nesterov, n);
  }
  check_sched(c, sched);
  if (!(mu >= 0.0f && mu < 1.0f)) c.fail("mu", "must be in [0, 1), got " + std::to_string(mu));
}

void newton_schulz(const OpCheck& c, Tensor out, Tensor x, Tensor work, int steps) {
  c.f32("x", x);
  c.ndim("x", x, 3);
  c.f32("out", out);
  c.ndim("out", out, 3);
  for (int i = 0; i < 3; ++i) c.dim("out", out, i, x.dim(i));
  c.f32("work", work);
  const int64_t need = newton_schulz_workspace(x.dim(0), x.dim(1), x.dim(2));
  if (work.numel() < need)
    c.fail("work",
           work.str() + " is below the " + std::to_string(need) + " values " + x.str() + " needs");
  if (steps < 1) c.fail("steps", "must be >= 1, got " + std::to_string(steps));
}

void muon_update(const OpCheck& c, Tensor master, Tensor working, Tensor update, Tensor sched,
                 float lr_scale, float weight_decay) {
  c.f32("master", master);
  const int64_t n = master.numel();
  c.f32("update", update);
  c.numel("update", update, n);
  check_sched(c, sched);
  if (working.defined()) {
    if (working.dtype != DType::f32 && working.dtype != DType::bf16)
      c.fail("working", "expected dtype f32 or bf16, got " + working.str());
    c.numel("working", working, n);
  }
}

void add(const OpCheck& c, Tensor dst, Tensor src) {
  c.f32_or_activation("dst", dst);
  c.defined("src", src);
  c.same_dtype("src", src, dst);
  if (dst.numel() != src.numel())
    c.fail("src", dst.str() + " and " + src.str() + " differ in size");
}

}  // namespace kiln::contract
