// The contracts of a dense transformer's ops (kernels/contracts.h says what a contract is), in
// kernels/ops.def's order: the embedding, LayerNorm and RMSNorm (with their fused residual sums),
// the linear layer, attention (context-parallel and decoding too), QK-norm, RoPE, SwiGLU and
// the cross-entropy (vocabulary-parallel too).
#include <limits>
#include <string>

#include "kernels/contracts.h"

namespace kiln::contract {

namespace {

// The embedding's tokens i32[B,T], its tables (wte [Vp,C] and the optional wpe [maxT,C], or
// their f32 gradients: `tables` is their dtype) and the residual stream [B,T,C] (out or dout).
void check_embedding(const OpCheck& c, const Tensor& tokens, DType tables, const char* wte_name,
                     const Tensor& wte, const char* wpe_name, const Tensor& wpe,
                     const char* stream_name, const Tensor& stream) {
  c.dtype("tokens", tokens, DType::i32);
  c.ndim("tokens", tokens, 2);
  c.dtype(wte_name, wte, tables);
  c.ndim(wte_name, wte, 2);
  const int64_t B = tokens.dim(0), T = tokens.dim(1), C = wte.dim(1);
  if (wpe.defined()) {
    c.dtype(wpe_name, wpe, tables);
    c.ndim(wpe_name, wpe, 2);
    c.dim(wpe_name, wpe, 1, C);
    if (wpe.dim(0) < T)
      c.fail(wpe_name, "has " + std::to_string(wpe.dim(0)) + " positions < T=" + std::to_string(T));
  }
  c.f32_or_activation(stream_name, stream, {B, T, C});
}

// The norms' forward: inp [..., C] (the residual stream), out like inp (activations), weight [C]
// (f32 or the activation dtype: the trainer reads norm gains in f32, as autocast does) and the
// f32 row statistic rstd [N].
void check_norm_forward(const OpCheck& c, const Tensor& out, const Tensor& rstd, const Tensor& inp,
                        const Tensor& weight) {
  c.f32_or_activation("inp", inp);
  c.min_ndim("inp", inp, 1);
  c.activation_dtype("out", out, inp.shape);
  c.f32_or_activation("weight", weight, {inp.dim(-1)});
  c.f32("rstd", rstd);
  c.numel("rstd", rstd, matrix_rows(inp));
}

// The fused forms' sum: residual = a + b, residual and a of one residual dtype, b an activation.
void check_residual_sum(const OpCheck& c, const Tensor& residual, const Tensor& a,
                        const Tensor& b) {
  c.f32_or_activation("a", a);
  c.activation_dtype("b", b, a.shape);
  c.f32_or_activation("residual", residual);
  c.same_dtype("residual", residual, a);
  c.shape("residual", residual, a.shape);
}

// The norms' backward: inp [..., C] and dinp (the residual stream's gradient) of one dtype, dout
// an activation like inp, weight [C] as the forward's, dweight f32[C], rstd f32[N], dinp_act
// optional. Returns N.
int64_t check_norm_backward(const OpCheck& c, const Tensor& dinp, const Tensor& dweight,
                            const Tensor& dout, const Tensor& inp, const Tensor& weight,
                            const Tensor& rstd, const Tensor& dinp_act) {
  c.f32_or_activation("inp", inp);
  c.min_ndim("inp", inp, 1);
  const int64_t N = matrix_rows(inp), C = inp.dim(-1);
  c.f32_or_activation("dinp", dinp);
  c.same_dtype("dinp", dinp, inp);
  c.shape("dinp", dinp, inp.shape);
  c.activation_dtype("dout", dout, inp.shape);
  c.f32_or_activation("weight", weight, {C});
  c.f32("dweight", dweight, {C});
  c.f32("rstd", rstd);
  c.numel("rstd", rstd, N);
  if (dinp_act.defined()) c.activation_dtype("dinp_act", dinp_act, inp.shape);
  return N;
}

// QK-norm's packed inp, its weights [hs] (f32 or the activation dtype, as the norms' weight; the
// two of one dtype) and rstd f32[B*T*(NH+KV)], and `out` (out or dinp) shaped like inp and not in
// the memory of `other` (inp or dout).
void check_qk_norm(const OpCheck& c, const Tensor& inp, const Tensor& q_weight,
                   const Tensor& k_weight, const Tensor& rstd, const AttentionDims& a,
                   const char* out_name, const Tensor& out, const char* other_name,
                   const Tensor& other) {
  c.packed_qkv("inp", inp, a);
  c.activation_dtype(out_name, out, inp.shape);
  if (out.data == other.data) c.fail(out_name, std::string("must not alias ") + other_name);
  c.f32_or_activation("q_weight", q_weight, {a.head_dim});
  c.f32_or_activation("k_weight", k_weight, {a.head_dim});
  c.same_dtype("k_weight", k_weight, q_weight);
  c.f32("rstd", rstd);
  c.numel("rstd", rstd, inp.dim(0) * inp.dim(1) * (a.n_head + a.n_kv_head));
}

// rope's input (packed qkv) and output, the head width, theta and the scaling.
void check_rope(const OpCheck& c, const char* out_name, const Tensor& out, const char* inp_name,
                const Tensor& inp, const AttentionDims& a, const Rope& rope) {
  c.packed_qkv(inp_name, inp, a);
  c.activation_dtype(out_name, out, inp.shape);
  if (a.head_dim % 2 != 0)
    c.fail("dims", "head_dim must be even, got " + std::to_string(a.head_dim));
  const std::string why = rope_error(rope);
  if (!why.empty()) c.fail("rope", why);
}

// A rank's slice of the vocabulary-parallel loss: logits [..., Vl] are the padded vocabulary's
// columns [first_col, first_col + Vl), numbered in i32 as the targets are; targets i32[N].
// Returns N.
int64_t check_vocab_slice(const OpCheck& c, const Tensor& logits, const Tensor& targets,
                          int64_t first_col, int vocab_size) {
  c.activation_dtype("logits", logits);
  c.min_ndim("logits", logits, 1);
  const int64_t N = matrix_rows(logits), Vl = logits.dim(-1);
  if (first_col < 0) c.fail("first_col", "is " + std::to_string(first_col) + " < 0");
  if (first_col + Vl > std::numeric_limits<int32_t>::max())
    c.fail("logits", "columns [" + std::to_string(first_col) + ", " +
                         std::to_string(first_col + Vl) + ") pass the i32 targets' range");
  if (vocab_size <= 0) c.fail("vocab_size", "is " + std::to_string(vocab_size) + " <= 0");
  c.dtype("targets", targets, DType::i32);
  c.numel("targets", targets, N);
  return N;
}

// A document mask's operands for B x T query rows: key_start [B,T] i32, and a.documents (the
// entries the kernels count) 0, or 1..B*T with key_start.
void check_documents(const OpCheck& c, const AttentionDims& a, const Tensor& key_start, int64_t B,
                     int64_t T) {
  if (key_start.defined()) c.dtype("key_start", key_start, DType::i32, {B, T});
  if (a.documents < 0 || a.documents > B * T || (a.documents > 0 && !key_start.defined()))
    c.fail("a.documents", std::to_string(a.documents) +
                              " entries: 0, or between 1 and B*T query rows with a document "
                              "mask's key_start");
}

}  // namespace

// ---- shared with the FP8 contracts (kernels/contracts.h) ----------------------------------

void check_linear_grads(const OpCheck& c, const Tensor& dinp, const Tensor& dweight,
                        const Tensor& inp, const Tensor& weight, const Tensor& inp_pre_gelu) {
  c.activation_dtype("weight", weight);
  c.ndim("weight", weight, 2);
  c.activation_dtype("inp", inp);
  c.dim("inp", inp, -1, weight.dim(1));
  c.f32("dweight", dweight, weight.shape);
  if (dinp.defined()) c.activation_dtype("dinp", dinp, inp.shape);
  if (inp_pre_gelu.defined()) c.activation_dtype("inp_pre_gelu", inp_pre_gelu, inp.shape);
}

Shape check_swiglu_inp(const OpCheck& c, const char* name, const Tensor& inp) {
  c.activation_dtype(name, inp);
  if (inp.ndim() == 0 || inp.dim(-1) % 2 != 0)
    c.fail(name, "last dim must be 2*F (gate then up), got " + inp.str());
  Shape half = inp.shape;
  half.dims[static_cast<size_t>(half.ndim - 1)] /= 2;
  return half;
}

// ---- embedding, norm, linear, attention, loss ---------------------------------------------

void encoder_forward(const OpCheck& c, Tensor out, Tensor tokens, Tensor wte, Tensor wpe,
                     int64_t first_row) {
  check_embedding(c, tokens, c.activation, "wte", wte, "wpe", wpe, "out", out);
  if (first_row < 0) c.fail("first_row", "is " + std::to_string(first_row) + " < 0");
}

void encoder_backward(const OpCheck& c, Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens,
                      int64_t first_row) {
  check_embedding(c, tokens, DType::f32, "dwte", dwte, "dwpe", dwpe, "dout", dout);
  if (first_row < 0) c.fail("first_row", "is " + std::to_string(first_row) + " < 0");
}

void layernorm_forward(const OpCheck& c, Tensor out, Tensor mean, Tensor rstd, Tensor inp,
                       Tensor weight, Tensor bias) {
  check_norm_forward(c, out, rstd, inp, weight);
  c.f32_or_activation("bias", bias, weight.shape);
  c.same_dtype("bias", bias, weight);
  c.f32("mean", mean);
  c.numel("mean", mean, matrix_rows(inp));
}

void residual_layernorm_forward(const OpCheck& c, Tensor residual, Tensor out, Tensor mean,
                                Tensor rstd, Tensor a, Tensor b, Tensor weight, Tensor bias) {
  check_residual_sum(c, residual, a, b);
  layernorm_forward(c, out, mean, rstd, residual, weight, bias);
}

void layernorm_backward(const OpCheck& c, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                        Tensor inp, Tensor weight, Tensor mean, Tensor rstd, Tensor dinp_act) {
  const int64_t N = check_norm_backward(c, dinp, dweight, dout, inp, weight, rstd, dinp_act);
  c.f32("dbias", dbias, weight.shape);
  c.f32("mean", mean);
  c.numel("mean", mean, N);
}

void matmul_forward(const OpCheck& c, Tensor out, Tensor inp, Tensor weight, Tensor bias,
                    Tensor pre_gelu) {
  c.activation_dtype("weight", weight);
  c.ndim("weight", weight, 2);
  const int64_t OC = weight.dim(0), C = weight.dim(1);
  c.activation_dtype("inp", inp);
  c.dim("inp", inp, -1, C);
  c.activation_dtype("out", out);
  c.dim("out", out, -1, OC);
  c.numel("out", out, matrix_rows(inp) * OC);
  if (bias.defined()) c.activation_dtype("bias", bias, {OC});
  if (pre_gelu.defined()) c.activation_dtype("pre_gelu", pre_gelu, out.shape);
}

void matmul_backward(const OpCheck& c, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                     Tensor inp, Tensor weight, Tensor inp_pre_gelu, bool /*accumulate*/) {
  check_linear_grads(c, dinp, dweight, inp, weight, inp_pre_gelu);
  const int64_t OC = weight.dim(0);
  c.activation_dtype("dout", dout);
  c.dim("dout", dout, -1, OC);
  c.numel("dout", dout, matrix_rows(inp) * OC);
  if (dbias.defined()) c.f32("dbias", dbias, {OC});
}

void attention_forward(const OpCheck& c, Tensor out, Tensor lse, Tensor qkv, const AttentionDims& a,
                       Tensor key_start) {
  c.packed_qkv("qkv", qkv, a);
  const int64_t B = qkv.dim(0), T = qkv.dim(1);
  c.activation_dtype("out", out, {B, T, a.q_dim()});
  c.f32("lse", lse, {B, a.n_head, T});
  check_documents(c, a, key_start, B, T);
}

void attention_backward(const OpCheck& c, Tensor dqkv, Tensor dout, Tensor qkv, Tensor out,
                        Tensor lse, const AttentionDims& a, Tensor key_start) {
  attention_forward(c, out, lse, qkv, a, key_start);
  c.activation_dtype("dqkv", dqkv, qkv.shape);
  c.activation_dtype("dout", dout, out.shape);
}

void attention_cp_forward(const OpCheck& c, Tensor out, Tensor lse, Tensor qkv, Tensor kv,
                          const AttentionDims& a, const QueryChunks& chunks, Tensor key_start) {
  c.packed_qkv("qkv", qkv, a);
  const int64_t B = qkv.dim(0), Tq = qkv.dim(1);
  c.activation_dtype("kv", kv);
  c.ndim("kv", kv, 3);
  c.dim("kv", kv, 0, B);
  c.dim("kv", kv, 2, 2 * a.kv_dim());
  const int64_t Tk = kv.dim(1), half = Tq / 2;
  if (Tq % 2 != 0) c.fail("qkv", "must hold two chunks of equal rows (" + std::to_string(Tq) + ")");
  if (chunks.offset[0] < 0 || chunks.offset[1] < chunks.offset[0] + half ||
      chunks.offset[1] + half > Tk)
    c.fail("chunks", "offsets " + std::to_string(chunks.offset[0]) + ", " +
                         std::to_string(chunks.offset[1]) + " of two chunks of " +
                         std::to_string(half) + " rows must be in order inside the " +
                         std::to_string(Tk) + " keys");
  c.activation_dtype("out", out, {B, Tq, a.q_dim()});
  c.f32("lse", lse, {B, a.n_head, Tq});
  check_documents(c, a, key_start, B, Tq);
}

void attention_cp_backward(const OpCheck& c, Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv,
                           Tensor kv, Tensor out, Tensor lse, const AttentionDims& a,
                           const QueryChunks& chunks, Tensor key_start) {
  attention_cp_forward(c, out, lse, qkv, kv, a, chunks, key_start);
  c.activation_dtype("dqkv", dqkv, qkv.shape);
  c.activation_dtype("dkv", dkv, kv.shape);
  c.activation_dtype("dout", dout, out.shape);
}

void copy_columns(const OpCheck& c, Tensor dst, int64_t dst_col, Tensor src, int64_t src_col,
                  int64_t width) {
  c.defined("dst", dst);
  c.same_dtype("src", src, dst);
  if (dst.ndim() < 1 || src.ndim() < 1) c.fail("dst", "needs a last dim of columns");
  const int64_t wd = dst.dim(dst.ndim() - 1), ws = src.dim(src.ndim() - 1);
  c.numel("src", src, dst.numel() / wd * ws);
  if (width < 0 || dst_col < 0 || src_col < 0 || dst_col + width > wd || src_col + width > ws)
    c.fail("width", "columns [" + std::to_string(dst_col) + ", +" + std::to_string(width) +
                        ") of " + std::to_string(wd) + " and [" + std::to_string(src_col) + ", +" +
                        std::to_string(width) + ") of " + std::to_string(ws) +
                        " are not inside the rows");
}

void attention_decode(const OpCheck& c, Tensor out, Tensor qkv, const AttentionDims& a, bool rotate,
                      const Rope& rope) {
  c.packed_qkv("qkv", qkv, a);
  if (qkv.dim(1) < 1) c.fail("qkv", "has no rows: the newest token is its last row");
  c.activation_dtype("out", out, {qkv.dim(0), a.q_dim()});
  if (rotate) check_rope(c, "qkv", qkv, "qkv", qkv, a, rope);
}

// ---- LLaMA / Qwen3 ops ----------------------------------------------------------------------

void rmsnorm_forward(const OpCheck& c, Tensor out, Tensor rstd, Tensor inp, Tensor weight,
                     float eps) {
  check_norm_forward(c, out, rstd, inp, weight);
  c.non_negative("eps", eps);
}

void residual_rmsnorm_forward(const OpCheck& c, Tensor residual, Tensor out, Tensor rstd, Tensor a,
                              Tensor b, Tensor weight, float eps) {
  check_residual_sum(c, residual, a, b);
  rmsnorm_forward(c, out, rstd, residual, weight, eps);
}

void rmsnorm_backward(const OpCheck& c, Tensor dinp, Tensor dweight, Tensor dout, Tensor inp,
                      Tensor weight, Tensor rstd, Tensor dinp_act) {
  check_norm_backward(c, dinp, dweight, dout, inp, weight, rstd, dinp_act);
}

void qk_norm_forward(const OpCheck& c, Tensor out, Tensor rstd, Tensor inp, Tensor q_weight,
                     Tensor k_weight, const AttentionDims& a, float eps) {
  check_qk_norm(c, inp, q_weight, k_weight, rstd, a, "out", out, "inp", inp);
  c.non_negative("eps", eps);
}

void qk_norm_backward(const OpCheck& c, Tensor dinp, Tensor dq_weight, Tensor dk_weight,
                      Tensor dout, Tensor inp, Tensor q_weight, Tensor k_weight, Tensor rstd,
                      const AttentionDims& a) {
  check_qk_norm(c, inp, q_weight, k_weight, rstd, a, "dinp", dinp, "dout", dout);
  c.activation_dtype("dout", dout, inp.shape);
  c.f32("dq_weight", dq_weight, {a.head_dim});
  c.f32("dk_weight", dk_weight, {a.head_dim});
}

void rope_forward(const OpCheck& c, Tensor out, Tensor inp, const AttentionDims& a,
                  const Rope& rope, Tensor positions) {
  check_rope(c, "out", out, "inp", inp, a, rope);
  if (positions.defined()) c.dtype("positions", positions, DType::i32, {inp.dim(0), inp.dim(1)});
}

void rope_backward(const OpCheck& c, Tensor dinp, Tensor dout, const AttentionDims& a,
                   const Rope& rope, Tensor positions) {
  check_rope(c, "dinp", dinp, "dout", dout, a, rope);
  if (positions.defined()) c.dtype("positions", positions, DType::i32, {dout.dim(0), dout.dim(1)});
}

void swiglu_forward(const OpCheck& c, Tensor out, Tensor inp) {
  const Shape half = check_swiglu_inp(c, "inp", inp);
  c.activation_dtype("out", out, half);
}

void swiglu_backward(const OpCheck& c, Tensor dinp, Tensor dout, Tensor inp) {
  const Shape half = check_swiglu_inp(c, "inp", inp);
  c.activation_dtype("dinp", dinp, inp.shape);
  c.activation_dtype("dout", dout, half);
}

// The weight gradient's GEMM as matmul_backward's, and act, dact [N,F] the halves of pre, dpre
// [N,2F].
void swiglu_matmul_backward(const OpCheck& c, Tensor dpre, Tensor dweight, Tensor dbias,
                            Tensor dout, Tensor act, Tensor weight, Tensor pre, Tensor dact,
                            bool accumulate) {
  matmul_backward(c, Tensor{}, dweight, dbias, dout, act, weight, Tensor{}, accumulate);
  const Shape half = check_swiglu_inp(c, "pre", pre);
  c.shape("act", act, half);
  c.activation_dtype("dpre", dpre, pre.shape);
  c.activation_dtype("dact", dact, half);
}

void softmax_cross_entropy(const OpCheck& c, Tensor losses, Tensor logits, Tensor targets,
                           int vocab_size, float dloss_scale, bool write_dlogits) {
  c.activation_dtype("logits", logits);
  c.min_ndim("logits", logits, 1);
  const int64_t N = matrix_rows(logits), Vp = logits.dim(-1);
  if (vocab_size <= 0 || vocab_size > Vp)
    c.fail("logits", "vocab_size=" + std::to_string(vocab_size) + " must be in [1, " +
                         std::to_string(Vp) + "] for " + logits.str());
  c.f32("losses", losses);
  c.numel("losses", losses, N);
  c.dtype("targets", targets, DType::i32);
  c.numel("targets", targets, N);
}

void softmax_cross_entropy_stats(const OpCheck& c, Tensor stats, Tensor logits, Tensor targets,
                                 int64_t first_col, int vocab_size) {
  const int64_t N = check_vocab_slice(c, logits, targets, first_col, vocab_size);
  c.f32("stats", stats);
  c.numel("stats", stats, N * kCrossEntropyStats);
}

void softmax_cross_entropy_combine(const OpCheck& c, Tensor losses, Tensor logits, Tensor stats_all,
                                   Tensor targets, int64_t first_col, int vocab_size,
                                   float dloss_scale, bool write_dlogits) {
  const int64_t N = check_vocab_slice(c, logits, targets, first_col, vocab_size);
  c.f32("losses", losses);
  c.numel("losses", losses, N);
  c.f32("stats_all", stats_all);
  const int64_t per_rank = N * kCrossEntropyStats;
  if (per_rank > 0 && (stats_all.numel() == 0 || stats_all.numel() % per_rank != 0))
    c.fail("stats_all", "must hold P >= 1 ranks' stats of " + std::to_string(N) + " rows, [P," +
                            std::to_string(N) + "," + std::to_string(kCrossEntropyStats) +
                            "], got " + stats_all.str());
}

}  // namespace kiln::contract
