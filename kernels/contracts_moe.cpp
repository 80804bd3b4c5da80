// The contracts of the Mixture-of-Experts ops (kernels/contracts.h says what a contract is), in
// kernels/ops.def's order: routing, the dropless dispatch and combine, the grouped GEMMs,
// expert parallelism's regrouping and the balancing bias.
#include <string>

#include "kernels/contracts.h"

namespace kiln::contract {

namespace {

// The routing both router ops take: logits [N,E] (activations), scores f32[N,E], topk_idx
// i32[N,k].
void check_routing(const OpCheck& c, const MoeRouting& r, const Tensor& logits,
                   const Tensor& scores, const Tensor& topk_idx) {
  if (r.n_experts <= 0 || r.top_k <= 0 || r.top_k > r.n_experts)
    c.fail("r", "needs 0 < top_k <= n_experts, got top_k " + std::to_string(r.top_k) + " of " +
                    std::to_string(r.n_experts));
  c.activation_dtype("logits", logits);
  if (logits.ndim() != 2 || logits.dim(1) != r.n_experts)
    c.fail("logits", "expected [N, " + std::to_string(r.n_experts) + "], got " + logits.str());
  c.f32("scores", scores, logits.shape);
  c.dtype("topk_idx", topk_idx, DType::i32, {logits.dim(0), r.top_k});
}

// The combine's shared arguments: tokens [N,C] (out or dout), rows yp [N*k,C] and slot_row
// i32[N*k].
void check_combine(const OpCheck& c, const char* tokens_name, const Tensor& tokens,
                   const Tensor& yp, const Tensor& slot_row) {
  c.activation_dtype(tokens_name, tokens);
  c.min_ndim(tokens_name, tokens, 1);
  c.activation_dtype("yp", yp);
  c.ndim("yp", yp, 2);
  const int64_t N = matrix_rows(tokens), M = yp.dim(0);
  c.dim("yp", yp, 1, tokens.dim(-1));
  if (N == 0 || M % N != 0) c.fail("yp", "rows must be a multiple of " + std::to_string(N));
  c.dtype("slot_row", slot_row, DType::i32);
  c.numel("slot_row", slot_row, M);
}

// The grouped GEMMs' inp [M,C], weight [E,OC,C] and offsets i32[E+1] (device or host memory).
void check_groups(const OpCheck& c, const Tensor& inp, const Tensor& weight,
                  const Tensor& offsets) {
  c.activation_dtype("inp", inp);
  c.ndim("inp", inp, 2);
  c.activation_dtype("weight", weight);
  c.ndim("weight", weight, 3);
  c.dim("weight", weight, 2, inp.dim(1));
  c.dtype_device_or_host("offsets", offsets, DType::i32);
  c.numel("offsets", offsets, weight.dim(0) + 1);
}

// The received layout: rows [R,C] packed by source, local [R,C], counts i32[P,El].
void check_received(const OpCheck& c, const Tensor& received, const Tensor& local,
                    const Tensor& counts) {
  c.activation_dtype("received", received);
  c.ndim("received", received, 2);
  c.activation_dtype("local", local, received.shape);
  c.dtype("counts", counts, DType::i32);
  c.ndim("counts", counts, 2);
}

}  // namespace

void moe_router_forward(const OpCheck& c, Tensor scores, Tensor topk_idx, Tensor topk_w,
                        Tensor counts, Tensor stats, Tensor logits, Tensor bias,
                        const MoeRouting& r) {
  check_routing(c, r, logits, scores, topk_idx);
  c.f32("topk_w", topk_w, topk_idx.shape);
  c.f32("counts", counts);
  c.numel("counts", counts, r.n_experts);
  if (bias.defined()) {
    c.f32("bias", bias);
    c.numel("bias", bias, r.n_experts);
  }
  if (stats.defined()) {
    c.f32("stats", stats);
    c.numel("stats", stats, r.n_experts + kMoeStats);
  }
}

void moe_router_backward(const OpCheck& c, Tensor dlogits, Tensor dtopk_w, Tensor logits,
                         Tensor scores, Tensor topk_idx, Tensor counts, const MoeRouting& r,
                         float loss_scale) {
  check_routing(c, r, logits, scores, topk_idx);
  c.activation_dtype("dlogits", dlogits, logits.shape);
  c.f32("dtopk_w", dtopk_w, topk_idx.shape);
  c.f32("counts", counts);
  c.numel("counts", counts, r.n_experts);
}

void moe_permute(const OpCheck& c, Tensor xp, Tensor row_token, Tensor slot_row, Tensor offsets,
                 Tensor x, Tensor topk_idx) {
  c.activation_dtype("x", x);
  c.min_ndim("x", x, 1);
  c.dtype("topk_idx", topk_idx, DType::i32);
  c.ndim("topk_idx", topk_idx, 2);
  c.dtype("offsets", offsets, DType::i32);
  const int64_t N = matrix_rows(x), C = x.dim(-1), M = N * topk_idx.dim(1);
  c.dim("topk_idx", topk_idx, 0, N);
  c.activation_dtype("xp", xp, {M, C});
  c.dtype("row_token", row_token, DType::i32);
  c.numel("row_token", row_token, M);
  c.dtype("slot_row", slot_row, DType::i32);
  c.numel("slot_row", slot_row, M);
}

void moe_unpermute(const OpCheck& c, Tensor out, Tensor yp, Tensor slot_row, Tensor topk_w,
                   bool accumulate) {
  check_combine(c, "out", out, yp, slot_row);
  if (topk_w.defined()) {
    c.f32("topk_w", topk_w);
    c.numel("topk_w", topk_w, yp.dim(0));
  }
}

void moe_unpermute_backward(const OpCheck& c, Tensor dyp, Tensor dtopk_w, Tensor dout, Tensor yp,
                            Tensor slot_row, Tensor topk_w) {
  check_combine(c, "dout", dout, yp, slot_row);
  const int64_t M = yp.dim(0);
  c.activation_dtype("dyp", dyp, yp.shape);
  c.f32("dtopk_w", dtopk_w);
  c.numel("dtopk_w", dtopk_w, M);
  c.f32("topk_w", topk_w);
  c.numel("topk_w", topk_w, M);
}

void grouped_matmul_forward(const OpCheck& c, Tensor out, Tensor inp, Tensor weight, Tensor offsets,
                            Tensor pre_gelu) {
  check_groups(c, inp, weight, offsets);
  const Shape out_shape{inp.dim(0), weight.dim(1)};
  c.activation_dtype("out", out, out_shape);
  if (pre_gelu.defined()) c.activation_dtype("pre_gelu", pre_gelu, out_shape);
}

void grouped_matmul_backward(const OpCheck& c, Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                             Tensor weight, Tensor offsets, Tensor inp_pre_gelu) {
  check_groups(c, inp, weight, offsets);
  c.f32("dweight", dweight, weight.shape);
  c.activation_dtype("dout", dout, {inp.dim(0), weight.dim(1)});
  if (dinp.defined()) c.activation_dtype("dinp", dinp, inp.shape);
  if (inp_pre_gelu.defined()) c.activation_dtype("inp_pre_gelu", inp_pre_gelu, inp.shape);
}

void moe_ep_counts(const OpCheck& c, Tensor counts, Tensor offsets) {
  c.dtype("counts", counts, DType::i32);
  c.dtype("offsets", offsets, DType::i32);
  c.numel("offsets", offsets, counts.numel() + 1);
}

void moe_ep_group(const OpCheck& c, Tensor local, Tensor local_offsets, Tensor received,
                  Tensor counts) {
  check_received(c, received, local, counts);
  c.dtype("local_offsets", local_offsets, DType::i32);
  c.numel("local_offsets", local_offsets, counts.dim(1) + 1);
}

void moe_ep_ungroup(const OpCheck& c, Tensor received, Tensor local, Tensor counts) {
  check_received(c, received, local, counts);
}

void moe_bias_update(const OpCheck& c, Tensor bias, Tensor counts, float rate) {
  c.f32("bias", bias);
  c.f32("counts", counts);
  c.numel("counts", counts, bias.numel());
}

}  // namespace kiln::contract
