#include "model/layers/moe.h"

#include <algorithm>
#include <stdexcept>

namespace kiln {

void Moe::declare(LayoutBuilder& b, const std::string& name, int64_t C, int n_shared) {
  const int64_t E = n_experts(), F = expert_ffn_dim;
  router.declare(b, name + ".router", C, E, false);
  fc = b.add(name + ".experts.fc.weight", {E, kind == MlpKind::swiglu ? 2 * F : F, C}, true, E);
  proj = b.add(name + ".experts.proj.weight", {E, C, F}, true, E);
  // Each expert's matrices are Muon's (gate and up apart); the router's [E, C] is not: its rows
  // are the experts' logits, which AdamW keeps free to differ in scale.
  b.hidden_matrix(fc,
                  kind == MlpKind::swiglu ? std::vector<int64_t>{F, F} : std::vector<int64_t>{});
  b.hidden_matrix(proj);
  has_shared = n_shared > 0;
  if (has_shared) {
    shared.kind = kind;
    shared.ffn_dim = n_shared * F;
    shared.declare(b, name + ".shared", C, false, /*split=*/false);
  }
}

void Moe::plan(const Planner& planner, const std::string& name, Acts& a, int64_t B, int64_t T,
               DType act) const {
  const int64_t N = B * T, E = n_experts(), K = routing.top_k, M = N * K, C = router.in;
  const int64_t F = expert_ffn_dim, P = ep.ranks, R = P * M;
  planner(&a.logits, name + "router_logits", {N, E}, act);
  planner(&a.scores, name + "router_scores", {N, E}, DType::f32);
  planner(&a.topk_idx, name + "topk_idx", {N, K}, DType::i32);
  planner(&a.topk_w, name + "topk_w", {N, K}, DType::f32);
  planner(&a.counts, name + "expert_counts", {E}, DType::f32);
  planner(&a.offsets, name + "expert_offsets", {E + 1}, DType::i32);
  planner(&a.slot_row, name + "slot_row", {M}, DType::i32);
  planner(&a.row_token, name + "row_token", {M}, DType::i32);
  planner(&a.xp, name + "experts_in", {M, C}, act);
  if (P > 1) {
    planner(&a.xl, name + "ep_experts_in", {R, C}, act);
    planner(&a.ep_offsets, name + "ep_offsets", {local_experts() + 1}, DType::i32);
    planner(&a.ep_counts, name + "ep_counts", {2, E}, DType::i32);
  }
  planner(&a.pre, name + "experts_fch", {R, kind == MlpKind::swiglu ? 2 * F : F}, act);
  planner(&a.act, name + "experts_act", {R, F}, act);
  planner(&a.yp, name + "experts_out", {M, C}, act);
  if (has_shared) {
    planner(&a.shared.pre, name + "shared_fch", {B, T, shared.fc.out}, act);
    planner(&a.shared.act, name + "shared_act", {B, T, shared.ffn_dim}, act);
  }
  planner(&a.out, name + "moe_out", {B, T, C}, act);
}

void Moe::plan_scratch(const Planner& planner, Scratch& s, int64_t B, int64_t T, DType act) const {
  const int64_t N = B * T, E = n_experts(), K = routing.top_k, M = N * K, C = router.in;
  const int64_t F = expert_ffn_dim, P = ep.ranks, R = P * M;
  planner(&s.dlogits, "d.router_logits", {N, E}, act);
  planner(&s.dtopk_w, "d.topk_w", {N, K}, DType::f32);
  planner(&s.dyp, "d.experts_out", {M, C}, act);
  planner(&s.dpre, "d.experts_fch", {R, kind == MlpKind::swiglu ? 2 * F : F}, act);
  if (kind == MlpKind::swiglu) planner(&s.dact, "d.experts_act", {R, F}, act);
  if (P > 1) {
    planner(&s.ep_recv, "ep.recv", {R, C}, act);
    planner(&s.ep_rows, "ep.rows", {R, C}, act);
    planner(&s.ep_offsets, "ep.offsets", {local_experts() + 1}, DType::i32);
  }
  planner(&s.dxp, "d.experts_in", {M, C}, act);
  planner(&s.dx, "d.moe_branch", {B, T, C}, act);
  if (has_shared) shared.plan_scratch(planner, s.shared, B, T, act);
}

Tensor Moe::local(const Params& p, int index) const {
  const Tensor t = param(p, index);
  // Bound to this rank's experts alone (the trainer's expert-parallel buffers), or to all.
  if (ep.ranks == 1 || t.dim(0) == local_experts()) return t;
  const int64_t El = local_experts(), per = t.numel() / n_experts();
  return t.slice(ep.rank * El * per, {El, t.dim(1), t.dim(2)});
}

Tensor Moe::on_host(Backend& k, Tensor offsets) const {
  if (offsets.device == Device::cpu) return offsets;
  host_offsets_.resize(static_cast<size_t>(offsets.numel()));
  k.copy_to_host(host_offsets_.data(), offsets);
  return Tensor{host_offsets_.data(), offsets.shape, DType::i32, Device::cpu};
}

Tensor Moe::received_counts(const Acts& a) const {
  return a.ep_counts.slice(n_experts(), {ep.ranks, local_experts()});
}

void Moe::exchange_counts(Backend& k, const Acts& a) const {
  const int64_t P = ep.ranks, El = local_experts(), E = P * El;
  k.moe_ep_counts(a.ep_counts.slice(0, {E}), a.offsets);
  ep.all_to_all(received_counts(a), a.ep_counts.slice(0, {E}));
  ep_host_counts_.resize(static_cast<size_t>(2 * E));  // sent, then received
  k.copy_to_host(ep_host_counts_.data(), a.ep_counts);
  const int32_t *sent = ep_host_counts_.data(), *received = sent + E;
  ep_send_rows_.assign(static_cast<size_t>(P), 0);
  ep_recv_rows_.assign(static_cast<size_t>(P), 0);
  ep_local_offsets_.assign(static_cast<size_t>(El + 1), 0);
  for (int64_t q = 0; q < P; ++q)
    for (int64_t e = 0; e < El; ++e) {
      const size_t i = static_cast<size_t>(q * El + e);
      ep_send_rows_[static_cast<size_t>(q)] += sent[i];
      ep_recv_rows_[static_cast<size_t>(q)] += received[i];
      ep_local_offsets_[static_cast<size_t>(e + 1)] += received[i];
    }
  for (int64_t e = 0; e < El; ++e)
    ep_local_offsets_[static_cast<size_t>(e + 1)] += ep_local_offsets_[static_cast<size_t>(e)];
}

void Moe::experts_forward(Backend& k, const Params& w, const Acts& a, Tensor rows,
                          Tensor device_offsets, Tensor out) const {
  // Where the backend's grouped GEMMs read the sizes on the device, the offsets stay there: no
  // sync. Otherwise (expert parallelism, whose exchange reads its counts on the host anyway; a
  // CUDA build without CUTLASS) one copy to the host serves this pass's grouped calls and the
  // backward's.
  const Tensor offsets = forward_offsets_ =
      moe_sizes_on_device(k, ep.ranks) ? device_offsets : on_host(k, device_offsets);
  if (kind == MlpKind::gelu) {
    k.grouped_matmul_forward(a.act, rows, local(w, fc), offsets, a.pre);
  } else {
    k.grouped_matmul_forward(a.pre, rows, local(w, fc), offsets, Tensor{});
    k.swiglu_forward(a.act, a.pre);
  }
  k.grouped_matmul_forward(out, a.act, local(w, proj), offsets, Tensor{});
}

void Moe::experts_backward(Backend& k, const Params& w, const Params& g, const Scratch& s,
                           const Acts& a, Tensor rows, Tensor device_offsets, Tensor dout,
                           Tensor drows) const {
  const Tensor offsets = forward_offsets_;
  if (!offsets.defined() || offsets.numel() != device_offsets.numel())
    throw std::logic_error("Moe::experts_backward: no forward offsets for this micro-batch");
  // Where the offsets are host memory (the CPU) the reuse is checked: the same values.
  if (device_offsets.device == Device::cpu &&
      !std::equal(offsets.ptr<int32_t>(), offsets.ptr<int32_t>() + offsets.numel(),
                  device_offsets.ptr<int32_t>()))
    throw std::logic_error("Moe::experts_backward: the offsets differ from the forward's");
  if (kind == MlpKind::gelu) {
    k.grouped_matmul_backward(s.dpre, local(g, proj), dout, a.act, local(w, proj), offsets, a.pre);
  } else {
    k.grouped_matmul_backward(s.dact, local(g, proj), dout, a.act, local(w, proj), offsets,
                              Tensor{});
    k.swiglu_backward(s.dpre, s.dact, a.pre);
  }
  k.grouped_matmul_backward(drows, local(g, fc), s.dpre, rows, local(w, fc), offsets, Tensor{});
}

void Moe::forward(Backend& k, const Params& w, const Acts& a, const Scratch& s, Tensor inp,
                  bool with_stats) const {
  const int64_t N = a.logits.dim(0), C = router.in;
  const Tensor x = inp.view({N, C});
  router.forward(k, w, a.logits, x);
  k.moe_router_forward(a.scores, a.topk_idx, a.topk_w, a.counts, with_stats ? a.stats : Tensor{},
                       a.logits, a.bias, routing);
  k.moe_permute(a.xp, a.row_token, a.slot_row, a.offsets, x, a.topk_idx);
  if (ep.ranks == 1) {
    experts_forward(k, w, a, a.xp, a.offsets, a.yp);
  } else {
    // Dispatch: the rows per expert first, then each rank's run of rows (xp holds rank q's
    // experts' rows as one run) to it; the combine sends the outputs back the same way, straight
    // into yp's rows.
    exchange_counts(k, a);
    const Tensor counts = received_counts(a);
    ep.all_to_all_v(s.ep_recv, ep_recv_rows_, a.xp, ep_send_rows_);
    k.moe_ep_group(a.xl, a.ep_offsets, s.ep_recv, counts);
    const Tensor local_offsets{ep_local_offsets_.data(), a.ep_offsets.shape, DType::i32,
                               Device::cpu};
    experts_forward(k, w, a, a.xl, local_offsets, s.ep_rows);
    k.moe_ep_ungroup(s.ep_recv, s.ep_rows, counts);
    ep.all_to_all_v(a.yp, ep_send_rows_, s.ep_recv, ep_recv_rows_);
  }
  if (has_shared) {
    Mlp::Acts sa = a.shared;
    sa.out = a.out;
    shared.forward(k, w, sa, s.shared, inp);
  }
  k.moe_unpermute(a.out.view({N, C}), a.yp, a.slot_row, a.topk_w, has_shared);
}

void Moe::backward(Backend& k, const Params& w, const Params& g, const Scratch& s, Tensor dinp,
                   Tensor dout, Tensor inp, const Acts& a, float loss_scale) const {
  const int64_t N = a.logits.dim(0), C = router.in;
  const Tensor x = inp.view({N, C}), dy = dout.view({N, C}), dx = dinp.view({N, C});
  k.moe_unpermute_backward(s.dyp, s.dtopk_w, dy, a.yp, a.slot_row, a.topk_w);
  if (ep.ranks == 1) {
    experts_backward(k, w, g, s, a, a.xp, a.offsets, s.dyp, s.dxp);
  } else {
    // The output rows' gradients travel to the experts as the rows did, and the input rows'
    // come back as the outputs did; forward's counts and sizes still hold.
    const Tensor counts = received_counts(a);
    ep.all_to_all_v(s.ep_recv, ep_recv_rows_, s.dyp, ep_send_rows_);
    k.moe_ep_group(s.ep_rows, s.ep_offsets, s.ep_recv, counts);
    experts_backward(k, w, g, s, a, a.xl, s.ep_offsets, s.ep_rows, s.ep_rows);
    k.moe_ep_ungroup(s.ep_recv, s.ep_rows, counts);
    ep.all_to_all_v(s.dxp, ep_send_rows_, s.ep_recv, ep_recv_rows_);
  }
  // Three branches read x: the routed experts (through the permutation), the router and the
  // shared expert. The first writes dinp, the others are added to it.
  k.moe_unpermute(dx, s.dxp, a.slot_row, Tensor{}, false);
  k.moe_router_backward(s.dlogits, s.dtopk_w, a.logits, a.scores, a.topk_idx, a.counts, routing,
                        loss_scale);
  router.backward(k, w, g, s.dx.view({N, C}), s.dlogits, x, /*accumulate=*/true);
  k.add(dinp, s.dx);
  if (has_shared) {
    Mlp::Acts sa = a.shared;
    sa.out = a.out;
    shared.backward(k, w, g, s.shared, s.dx, dout, inp, sa, /*accumulate=*/true);
    k.add(dinp, s.dx);
  }
}

}  // namespace kiln
