#include "model/layers/moe.h"

namespace kiln {

void Moe::declare(LayoutBuilder& b, const std::string& name, int64_t C, int n_shared) {
  const int64_t E = n_experts(), F = expert_ffn_dim;
  router.declare(b, name + ".router", C, E, false);
  fc = b.add(name + ".experts.fc.weight", {E, kind == MlpKind::swiglu ? 2 * F : F, C}, true);
  proj = b.add(name + ".experts.proj.weight", {E, C, F}, true);
  has_shared = n_shared > 0;
  if (has_shared) {
    shared.kind = kind;
    shared.ffn_dim = n_shared * F;
    shared.declare(b, name + ".shared", C, false);
  }
}

void Moe::plan(const Planner& planner, const std::string& name, Acts& a, int64_t B, int64_t T,
               DType act) const {
  const int64_t N = B * T, E = n_experts(), K = routing.top_k, M = N * K, C = router.in;
  const int64_t F = expert_ffn_dim;
  planner(&a.logits, name + "router_logits", {N, E}, act);
  planner(&a.scores, name + "router_scores", {N, E}, DType::f32);
  planner(&a.topk_idx, name + "topk_idx", {N, K}, DType::i32);
  planner(&a.topk_w, name + "topk_w", {N, K}, DType::f32);
  planner(&a.counts, name + "expert_counts", {E}, DType::f32);
  planner(&a.offsets, name + "expert_offsets", {E + 1}, DType::i32);
  planner(&a.slot_row, name + "slot_row", {M}, DType::i32);
  planner(&a.row_token, name + "row_token", {M}, DType::i32);
  planner(&a.xp, name + "experts_in", {M, C}, act);
  planner(&a.pre, name + "experts_fch", {M, kind == MlpKind::swiglu ? 2 * F : F}, act);
  planner(&a.act, name + "experts_act", {M, F}, act);
  planner(&a.yp, name + "experts_out", {M, C}, act);
  if (has_shared) {
    planner(&a.shared.pre, name + "shared_fch", {B, T, shared.fc.out}, act);
    planner(&a.shared.act, name + "shared_act", {B, T, shared.ffn_dim}, act);
  }
  planner(&a.out, name + "moe_out", {B, T, C}, act);
}

void Moe::plan_scratch(const Planner& planner, Scratch& s, int64_t B, int64_t T, DType act) const {
  const int64_t N = B * T, E = n_experts(), K = routing.top_k, M = N * K, C = router.in;
  const int64_t F = expert_ffn_dim;
  planner(&s.dlogits, "d.router_logits", {N, E}, act);
  planner(&s.dtopk_w, "d.topk_w", {N, K}, DType::f32);
  planner(&s.dyp, "d.experts_out", {M, C}, act);
  planner(&s.dpre, "d.experts_fch", {M, kind == MlpKind::swiglu ? 2 * F : F}, act);
  if (kind == MlpKind::swiglu) planner(&s.dact, "d.experts_act", {M, F}, act);
  planner(&s.dxp, "d.experts_in", {M, C}, act);
  planner(&s.dx, "d.moe_branch", {B, T, C}, act);
  if (has_shared) shared.plan_scratch(planner, s.shared, B, T, act);
}

void Moe::forward(Backend& k, const Params& w, const Acts& a, Tensor inp, bool with_stats) const {
  const int64_t N = a.logits.dim(0), C = router.in;
  const Tensor x = inp.view({N, C});
  router.forward(k, w, a.logits, x);
  k.moe_router_forward(a.scores, a.topk_idx, a.topk_w, a.counts, with_stats ? a.stats : Tensor{},
                       a.logits, a.bias, routing);
  k.moe_permute(a.xp, a.row_token, a.slot_row, a.offsets, x, a.topk_idx);
  if (kind == MlpKind::gelu) {
    k.grouped_matmul_forward(a.act, a.xp, param(w, fc), a.offsets, a.pre);
  } else {
    k.grouped_matmul_forward(a.pre, a.xp, param(w, fc), a.offsets, Tensor{});
    k.swiglu_forward(a.act, a.pre);
  }
  k.grouped_matmul_forward(a.yp, a.act, param(w, proj), a.offsets, Tensor{});
  if (has_shared) {
    Mlp::Acts sa = a.shared;
    sa.out = a.out;
    shared.forward(k, w, sa, inp);
  }
  k.moe_unpermute(a.out.view({N, C}), a.yp, a.slot_row, a.topk_w, has_shared);
}

void Moe::backward(Backend& k, const Params& w, const Params& g, const Scratch& s, Tensor dinp,
                   Tensor dout, Tensor inp, const Acts& a, float loss_scale) const {
  const int64_t N = a.logits.dim(0), C = router.in;
  const Tensor x = inp.view({N, C}), dy = dout.view({N, C}), dx = dinp.view({N, C});
  k.moe_unpermute_backward(s.dyp, s.dtopk_w, dy, a.yp, a.slot_row, a.topk_w);
  if (kind == MlpKind::gelu) {
    k.grouped_matmul_backward(s.dpre, param(g, proj), s.dyp, a.act, param(w, proj), a.offsets,
                              a.pre);
  } else {
    k.grouped_matmul_backward(s.dact, param(g, proj), s.dyp, a.act, param(w, proj), a.offsets,
                              Tensor{});
    k.swiglu_backward(s.dpre, s.dact, a.pre);
  }
  k.grouped_matmul_backward(s.dxp, param(g, fc), s.dpre, a.xp, param(w, fc), a.offsets, Tensor{});
  // Three branches read x: the routed experts (through the permutation), the router and the
  // shared expert. The first writes dinp, the others are added to it.
  k.moe_unpermute(dx, s.dxp, a.slot_row, Tensor{}, false);
  k.moe_router_backward(s.dlogits, s.dtopk_w, a.logits, a.scores, a.topk_idx, a.counts, routing,
                        loss_scale);
  router.backward(k, w, g, s.dx.view({N, C}), s.dlogits, x);
  k.add(dinp, s.dx);
  if (has_shared) {
    Mlp::Acts sa = a.shared;
    sa.out = a.out;
    shared.backward(k, w, g, s.shared, s.dx, dout, inp, sa);
    k.add(dinp, s.dx);
  }
}

}  // namespace kiln
