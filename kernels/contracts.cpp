// The ops' argument contracts, in kernels/ops.def's order: what every op requires of its
// arguments (shapes, dtypes by role, sizes, scalars), checked by Backend before any backend runs
// the op, so a contract is written once and both backends refuse the same calls with the same
// message. Dtypes are roles (OpCheck): the activation dtype is f32 on the CPU and bf16 on CUDA.
// What one backend needs beyond this stays with it: the CPU reads index and offset values
// (its tensors are host memory), CUDA its alignment and the sizes its kernels take.
#include <cmath>
#include <limits>
#include <string>

#include "kernels/backend.h"

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
// and the f32 row statistic rstd [N].
void check_norm_forward(const OpCheck& c, const Tensor& out, const Tensor& rstd, const Tensor& inp,
                        const Tensor& weight) {
  c.f32_or_activation("inp", inp);
  c.min_ndim("inp", inp, 1);
  c.activation_dtype("out", out, inp.shape);
  c.activation_dtype("weight", weight, {inp.dim(-1)});
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
// an activation like inp, weight and dweight [C], rstd f32[N], dinp_act optional. Returns N.
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
  c.activation_dtype("weight", weight, {C});
  c.f32("dweight", dweight, {C});
  c.f32("rstd", rstd);
  c.numel("rstd", rstd, N);
  if (dinp_act.defined()) c.activation_dtype("dinp_act", dinp_act, inp.shape);
  return N;
}

// A linear layer's backward but for its output gradient: weight [OC,C], inp [..., C], dweight
// like weight, and the optional dinp and inp_pre_gelu like inp.
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

// inp [..., 2F] (gate then up) of a SwiGLU; returns the shape of its output [..., F].
Shape check_swiglu_inp(const OpCheck& c, const char* name, const Tensor& inp) {
  c.activation_dtype(name, inp);
  if (inp.ndim() == 0 || inp.dim(-1) % 2 != 0)
    c.fail(name, "last dim must be 2*F (gate then up), got " + inp.str());
  Shape half = inp.shape;
  half.dims[static_cast<size_t>(half.ndim - 1)] /= 2;
  return half;
}

// QK-norm's packed inp, its weights [hs] and rstd f32[B*T*(NH+KV)], and `out` (out or dinp)
// shaped like inp and not in the memory of `other` (inp or dout).
void check_qk_norm(const OpCheck& c, const Tensor& inp, const Tensor& q_weight,
                   const Tensor& k_weight, const Tensor& rstd, const AttentionDims& a,
                   const char* out_name, const Tensor& out, const char* other_name,
                   const Tensor& other) {
  c.packed_qkv("inp", inp, a);
  c.activation_dtype(out_name, out, inp.shape);
  if (out.data == other.data) c.fail(out_name, std::string("must not alias ") + other_name);
  c.activation_dtype("q_weight", q_weight, {a.head_dim});
  c.activation_dtype("k_weight", k_weight, {a.head_dim});
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

// The FP8 state and the index of a tensor in it.
void check_fp8_state(const OpCheck& c, const Tensor& state, const Fp8StateLayout& l, int index) {
  c.f32("state", state);
  c.numel("state", state, l.total());
  if (index < 0 || index >= l.n)
    c.fail("index",
           std::to_string(index) + " is not one of the " + std::to_string(l.n) + " FP8 tensors");
}

// A cast's outputs, [R,C] and/or its transpose [C,R], in one FP8 format.
void check_cast_outputs(const OpCheck& c, const char* name, const Tensor& out, const char* t_name,
                        const Tensor& out_t, int64_t R, int64_t C) {
  if (!out.defined() && !out_t.defined())
    c.fail(name, std::string("neither ") + name + " nor " + t_name + " is given");
  if (out.defined()) c.fp8(name, out, {R, C});
  if (out_t.defined()) {
    c.fp8(t_name, out_t, {C, R});
    if (out.defined() && out.dtype != out_t.dtype)
      c.fail(t_name, std::string(name) + " and " + t_name + " differ in format");
  }
}

void check_reduction(const OpCheck& c, const Tensor& out, const Tensor& x) {
  c.f32("out", out);
  c.numel("out", out, 1);
  c.f32_or_activation("x", x);
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

void check_sched(const OpCheck& c, const Tensor& sched) {
  c.f32("sched", sched);
  c.numel("sched", sched, kSchedSize);
}

}  // namespace

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
  c.activation_dtype("bias", bias, weight.shape);
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
  if (key_start.defined()) c.dtype("key_start", key_start, DType::i32, {B, T});
  if (a.documents < 0 || a.documents > B * T || (a.documents > 0 && !key_start.defined()))
    c.fail("a.documents", std::to_string(a.documents) +
                              " documents: 0, or between 1 and B*T with a document mask's key_start");
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
  if (key_start.defined()) c.dtype("key_start", key_start, DType::i32, {B, Tq});
  if (a.documents < 0 || a.documents > B * Tq || (a.documents > 0 && !key_start.defined()))
    c.fail("a.documents", std::to_string(a.documents) +
                              " entries: 0, or between 1 and B*Tq with a document mask's key_start");
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

// ---- Mixture-of-Experts ---------------------------------------------------------------------

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

// ---- FP8 with delayed scaling ---------------------------------------------------------------

void fp8_cast(const OpCheck& c, Tensor out, Tensor out_t, Tensor inp, Tensor state,
              const Fp8StateLayout& layout, int index) {
  if (inp.defined() && inp.dtype == DType::f32 && c.activation != DType::f32) {
    if (matrix_rows(inp) != 1 || out_t.defined())
      c.fail("inp", "in f32 must be a vector (one row) cast without a transpose");
  } else {
    c.activation_dtype("inp", inp);
  }
  c.min_ndim("inp", inp, 1);
  check_fp8_state(c, state, layout, index);
  check_cast_outputs(c, "out", out, "out_t", out_t, matrix_rows(inp), inp.dim(-1));
}

void fp8_transpose(const OpCheck& c, Tensor out_t, Tensor inp) {
  c.ndim("inp", inp, 2);
  c.fp8("inp", inp);
  c.dtype("out_t", out_t, inp.dtype, {inp.dim(1), inp.dim(0)});
}

void swiglu_forward_fp8(const OpCheck& c, Tensor out, Tensor x8, Tensor inp, Tensor state,
                        const Fp8StateLayout& layout, int index) {
  swiglu_forward(c, out, inp);
  check_fp8_state(c, state, layout, index);
  c.fp8("x8", x8, {matrix_rows(out), out.dim(-1)});
}

void swiglu_backward_fp8(const OpCheck& c, Tensor g8, Tensor g8_t, Tensor dout, Tensor inp,
                         Tensor state, const Fp8StateLayout& layout, int index) {
  const Shape half = check_swiglu_inp(c, "inp", inp);
  c.activation_dtype("dout", dout, half);
  check_fp8_state(c, state, layout, index);
  check_cast_outputs(c, "g8", g8, "g8_t", g8_t, matrix_rows(inp), inp.dim(-1));
}

// matmul_forward's contract, and the casts it multiplies: x8 [N,C] and weight8 [OC,C] in E4M3.
void fp8_matmul_forward(const OpCheck& c, Tensor out, Tensor inp, Tensor weight, Tensor bias,
                        Tensor pre_gelu, const Fp8Linear& f) {
  matmul_forward(c, out, inp, weight, bias, pre_gelu);
  check_fp8_state(c, f.state, f.layout, f.index);
  c.dtype("x8", f.x8, DType::fp8_e4m3, {matrix_rows(inp), inp.dim(-1)});
  c.dtype("weight8", f.weight8, DType::fp8_e4m3, weight.shape);
}

// matmul_backward's contract, save that dout may be missing (then dbias must be too), and the
// casts of both layouts: weight8 [OC,C] and weight8_t [C,OC], x8_t [C,N] in E4M3, g8 [N,OC]
// and g8_t [OC,N] in the gradient format.
void fp8_matmul_backward(const OpCheck& c, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout,
                         Tensor inp, Tensor weight, Tensor inp_pre_gelu, const Fp8Linear& f,
                         bool accumulate) {
  if (dout.defined())
    matmul_backward(c, dinp, dweight, dbias, dout, inp, weight, inp_pre_gelu, accumulate);
  else if (dbias.defined())
    c.fail("dout", "is needed for dbias (the gradient exists only in FP8)");
  else
    check_linear_grads(c, dinp, dweight, inp, weight, inp_pre_gelu);
  const int64_t OC = weight.dim(0), C = weight.dim(1), N = matrix_rows(inp);
  check_fp8_state(c, f.state, f.layout, f.index);
  c.dtype("weight8", f.weight8, DType::fp8_e4m3, {OC, C});
  c.dtype("weight8_t", f.weight8_t, DType::fp8_e4m3, {C, OC});
  c.dtype("x8_t", f.x8_t, DType::fp8_e4m3, {C, N});
  c.fp8("g8", f.g8, {N, OC});
  c.fp8("g8_t", f.g8_t, {OC, N});
}

void fp8_update_scales(const OpCheck& c, Tensor state, const Fp8StateLayout& layout,
                       const Fp8Options& options) {
  c.f32("state", state);
  c.numel("state", state, layout.total());
}

// ---- reductions and the optimizer -----------------------------------------------------------

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
    c.fail("work", work.str() + " is below the " + std::to_string(need) + " values " + x.str() +
                       " needs");
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
